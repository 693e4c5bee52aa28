"""One torch thread for the dashboard's own computations, when torch is there.

The dashboard and its sample recordings run small computations (a window of
statistics, a 1.35 M-parameter model) on machines it shares with other work.
On the 2-core machine this was built on, with other jobs running, torch's
default two intra-op threads made them 4x (window statistics: 0.5-0.7 s
against 0.13-0.23 s) to 100x (the demo model's decode loop) slower than one
thread; on an idle machine one thread costs little at these sizes.

The viewer itself needs no torch: when no module has imported it, nothing in
the block computes with it, and there is nothing to set.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

__all__ = ["one_torch_thread"]


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Run torch on one intra-op thread inside the block, then restore the previous count.

    Does nothing when torch is not imported (it is never imported here).
    """
    torch = sys.modules.get("torch")
    if torch is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
