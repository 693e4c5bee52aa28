"""Batch inference with tracking spread over a cluster: the class a Ray Data ``map_batches`` actor runs.

>>> import ray
>>> prompts = ray.data.from_items([{"prompt": p} for p in prompts])
>>> texts = prompts.map_batches(TrackedGeneration, fn_constructor_kwargs={"root": "s3://bucket/runs"},
...                             batch_size=16, concurrency=4)
>>> texts.take_all()                            # run_id, prompt, text per prompt
>>> tracker.open_dataset("s3://bucket/runs")    # then SQL across every run

Each actor loads its model once (the shipped demo model by default, or a
function that returns ``(model, tokenizer)``), wraps logitscope's
:class:`~sampling.Generator` with :func:`tracker.add_tracking`, and for each
batch of prompts generates, writes the batch as one run into the shared
table (:meth:`tracker.Run.to_dataset`: one commit per run, run ids unique,
visible to every reader once committed) and returns a small table of run ids,
prompts and generated texts. Nothing here depends on Ray: any engine that
calls a class per batch of rows (Spark's ``mapInPandas``, Daft's UDF
classes) can use it the same way.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

__all__ = ["TrackedGeneration"]


class TrackedGeneration:
    """Generate for batches of prompts with tracking; each batch becomes one run in the dataset at ``root``.

    Args:
        root: the dataset: a folder, or any location :meth:`tracker.Run.to_dataset` writes to.
        load_model: a function returning ``(model, tokenizer)``, called once per actor (default: the
            shipped demo model).
        processor: a function of the tokenizer returning the logits processor to wrap (a grammar, a
            bias ...); None: record the model's distribution only.
        params: the :class:`~sampling.SamplingParams` (or a dict of its arguments) for every prompt.
        prompt_column: the column of the batch holding the prompts.
        storage, top_k: how the tracker keeps each step (see :class:`tracker.LogitTrackingProcessor`).
        title: stored in each run's metadata (the dashboard shows it).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        load_model: Callable[[], tuple[Any, Any]] | None = None,
        processor: Callable[[Any], Any] | None = None,
        params: Any = None,
        *,
        prompt_column: str = "prompt",
        storage: str = "topk",
        top_k: int = 20,
        title: str | None = None,
    ) -> None:
        from sampling import Generator, SamplingParams
        from tracker import add_tracking

        if load_model is None:
            from logitscope.demo_model import load_demo_model

            load_model = load_demo_model
        model, tokenizer = load_model()
        self.root = str(root)
        self.prompt_column = prompt_column
        self.params = SamplingParams(**params) if isinstance(params, Mapping) else params
        inner = None if processor is None else processor(tokenizer)
        self.generator = add_tracking(Generator(model, tokenizer, inner), storage=storage, top_k=top_k)
        self.title = title

    def __call__(self, batch: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Generate for ``batch[prompt_column]``, write the run, return ``{"run_id", "prompt", "text"}``."""
        if self.prompt_column not in batch:
            raise KeyError(f"batch has no column {self.prompt_column!r} (prompt_column); it has {list(batch)}")
        prompts = [str(p) for p in batch[self.prompt_column]]
        tracker = self.generator.logits_processor
        tracker.clear()  # a new run for this batch
        if self.title is not None:
            tracker.annotate(title=self.title)
        outputs = self.generator.generate(prompts, self.params)
        run = tracker.run
        run.to_dataset(self.root)
        return {
            "run_id": np.array([run.run_id] * len(prompts), dtype=object),
            "prompt": np.array(prompts, dtype=object),
            "text": np.array([o.outputs[0].text for o in outputs], dtype=object),
        }
