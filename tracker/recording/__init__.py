"""Recording: the tracker that wraps a processor, its hosts, the recorder, chunks, spilling to disk.

Imports the reading side (a tracker answers queries through its run) and the format; needs torch.
"""
