"""tracker: record what happens to the next-token distribution, query it, keep it on disk.

>>> from tracker import LogitTrackingProcessor, add_tracking, Run
>>> generator = add_tracking(generator)           # logitscope or Outlines generator
>>> generator("Call ", max_new_tokens=20)
>>> generator.logits_processor.get_top_tokens(k=5)
>>> generator.logits_processor.to_parquet("run.parquet")
>>> Run.load("run.parquet").stats()

Modules: :mod:`~tracker.processor` (the tracker), :mod:`~tracker.integrate`
(``add_tracking``), :mod:`~tracker.recorder` (device to host, chunks, spill),
:mod:`~tracker.buffers` (reused host and pinned memory), :mod:`~tracker.schema`
(the Arrow schema and run metadata), :class:`Vocabulary` (token texts, from :mod:`processors.vocab`),
:mod:`~tracker.compute` (the maths), :mod:`~tracker.analysis` (the query API),
:mod:`~tracker.run` (``Run`` and Parquet), :mod:`~tracker.spill` (IPC files),
:mod:`~tracker.stages` (a stage per processor), :mod:`~tracker.prompt` (prompt
log-probabilities), :mod:`~tracker.compare` (two runs), :mod:`~tracker.display`
(notebook HTML).
"""

from tracker.analysis import Continuation
from tracker.compare import Comparison, compare
from tracker.integrate import add_tracking
from tracker.processor import LogitTrackingProcessor
from tracker.recorder import Recorder, Storage
from tracker.run import Run
from tracker.schema import SCHEMA_VERSION, RunMetadata
from processors.vocab import Vocabulary

__all__ = [
    "LogitTrackingProcessor",
    "add_tracking",
    "Run",
    "RunMetadata",
    "Continuation",
    "compare",
    "Comparison",
    "Vocabulary",
    "Storage",
    "Recorder",
    "SCHEMA_VERSION",
]
