"""tracker: record what happens to the next-token distribution, query it, keep it on disk.

>>> from tracker import LogitTrackingProcessor, add_tracking, Run
>>> generator = add_tracking(generator)           # logitscope or Outlines generator
>>> generator("Call ", max_new_tokens=20)
>>> generator.logits_processor.get_top_tokens(k=5)
>>> generator.logits_processor.to_parquet("run.parquet")
>>> Run.load("run.parquet").stats()

Which module holds what, and what each may import: ``docs/architecture.md``.

The names below are imported on first use: reading runs (``tracker.format.schema``,
``tracker.format.layout``, ``Run.load``, the dashboard) needs pyarrow and numpy, not
the recorder's torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from processors.exports import lazy_exports

if TYPE_CHECKING:
    from processors.vocab import Vocabulary
    from tracker.format.layout import PartialRunWarning
    from tracker.format.schema import SCHEMA_VERSION, RunMetadata
    from tracker.reading.analysis import Continuation
    from tracker.reading.compare import Comparison, compare
    from tracker.reading.divergence import RunComparison, compare_runs
    from tracker.reading.query import Dataset, open_dataset
    from tracker.reading.run import Run
    from tracker.recording.integrate import add_tracking
    from tracker.recording.processor import LogitTrackingProcessor
    from tracker.recording.recorder import Recorder, Storage

__all__ = [
    "LogitTrackingProcessor",
    "add_tracking",
    "Run",
    "RunMetadata",
    "Continuation",
    "compare",
    "Comparison",
    "compare_runs",
    "RunComparison",
    "Vocabulary",
    "Storage",
    "Recorder",
    "SCHEMA_VERSION",
    "PartialRunWarning",
    "open_dataset",
    "Dataset",
]

#: Where each public name lives. Imported on first use (PEP 562), so that reading a run
#: (``tracker.format.schema``, ``tracker.format.layout``, the dashboard) does not load the recorder and torch.
_HOMES = {
    "LogitTrackingProcessor": "tracker.recording.processor",
    "add_tracking": "tracker.recording.integrate",
    "Run": "tracker.reading.run",
    "RunMetadata": "tracker.format.schema",
    "Continuation": "tracker.reading.analysis",
    "compare": "tracker.reading.compare",
    "Comparison": "tracker.reading.compare",
    "compare_runs": "tracker.reading.divergence",
    "RunComparison": "tracker.reading.divergence",
    "Vocabulary": "processors.vocab",
    "Storage": "tracker.recording.recorder",
    "Recorder": "tracker.recording.recorder",
    "SCHEMA_VERSION": "tracker.format.schema",
    "PartialRunWarning": "tracker.format.layout",
    "open_dataset": "tracker.reading.query",
    "Dataset": "tracker.reading.query",
}

__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
