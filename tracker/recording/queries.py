"""The questions a tracker answers about what it recorded: each one the same method of its :class:`~tracker.Run`.

:class:`RunQueries` gives the tracker ``get_top_tokens``, ``to_dataframe``,
``stats``, ``why`` and the rest with the run's own signatures and
docstrings, each forwarding to ``self.run`` (the run recorded so far, rebuilt
only when something new was recorded).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tracker.reading.analysis import Analysis
from tracker.reading.insight import Insight
from tracker.reading.run import Run

__all__ = ["RunQueries"]


def _on_run(method: Callable[..., Any]) -> Callable[..., Any]:
    """A tracker method answering like the same :class:`~tracker.Run` method on the recorded run."""

    @functools.wraps(method)
    def call(self: RunQueries, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.run, method.__name__)(*args, **kwargs)

    return call


class RunQueries:
    """Queries and exports of the recorded run (a mixin: the class gives ``run``)."""

    run: Run

    @property
    def stages(self) -> list[str]:
        """The recorded stages, in pipeline order (see :attr:`tracker.Run.stages`)."""
        return self.run.stages

    def to_arrow(self):
        """The recorded run as an Arrow table (zero-copy; see :meth:`tracker.Run.to_arrow`)."""
        return self.run.to_arrow()

    def to_parquet(self, path: Any, **kwargs: Any) -> Path:
        """Write the recorded run to one Parquet file, atomically (see :meth:`tracker.Run.to_parquet`)."""
        return self.run.to_parquet(path, **kwargs)

    def to_dataset(self, root: Any, **kwargs: Any) -> Path:
        """Write the recorded run under ``root/run_id=<id>/`` (see :meth:`tracker.Run.to_dataset`)."""
        return self.run.to_dataset(root, **kwargs)

    def stream_to(self, root: Any, **kwargs: Any) -> Any:
        """A :class:`tracker.format.dataset.RunStream` writing this run into ``root`` part by part (``flush()`` after
        each generation, ``close()`` at the end; also a context manager)."""
        from tracker.format.dataset import RunStream

        return RunStream(self, root, **kwargs)

    get_top_tokens = _on_run(Analysis.get_top_tokens)
    to_dataframe = _on_run(Analysis.to_dataframe)
    sequence = _on_run(Analysis.sequence)
    get_logits = _on_run(Analysis.get_logits)
    get_probabilities = _on_run(Analysis.get_probabilities)
    stats = _on_run(Analysis.stats)
    continuation_probability = _on_run(Analysis.continuation_probability)
    generations = _on_run(Analysis.generations)
    sequences = _on_run(Analysis.sequences)
    prompt_logprobs = _on_run(Insight.prompt_logprobs)
    why = _on_run(Insight.why)
    diff = _on_run(Insight.diff)
    perplexity = _on_run(Insight.perplexity)
    view = _on_run(Insight.view)
    step = _on_run(Insight.step)
    show = _on_run(Insight.show)
    _repr_html_ = _on_run(Insight._repr_html_)
