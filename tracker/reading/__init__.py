"""Reading: a recorded run as :class:`~tracker.Run`, and every question asked of it.

Queries, row maths, metrics, comparison, prompt scores and notebook display; imports the format only.
numpy, pandas and pyarrow: no torch.
"""
