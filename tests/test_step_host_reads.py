"""The decode step reads the device at most once: counted on the CPU, enforced on CUDA.

On the CPU every read of a tensor's values goes through a few Python entry
points (``item``, ``tolist``, ``bool()``, ``int()``, ``float()``, ``nonzero``,
use as an index); counting them over a steady-state decode loop finds each
place that would make a GPU host wait. ``.cpu()`` and ``.numpy()`` of a CPU
tensor are views and are not counted. On CUDA the same loops run under
``torch.cuda.set_sync_debug_mode("error")`` from the second step on, so any
synchronisation fails the test at its source.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from test_tracker_support import byte_tokenizer, random_gpt2

from processors import BadWordsLogitsProcessor, LogitsProcessor, PenaltiesLogitsProcessor
from sampling import Generator, SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH_DIR = os.path.dirname(torch.__file__)
READS = ("item", "tolist", "__bool__", "nonzero", "__int__", "__float__", "__index__")
STEPS = 12
PROMPTS = ["the cat sat on", "héllo"]  # different lengths: the batch is padded


class StepMarker(LogitsProcessor):
    """Calls ``on_step(step)`` at the start of each step's processing (changes no logit)."""

    def __init__(self, on_step: Any) -> None:
        self.on_step = on_step
        self.step = 0

    def reset(self) -> None:
        self.step = 0

    def process(self, logits: torch.Tensor, ctx: Any) -> torch.Tensor:
        self.on_step(self.step)
        self.step += 1
        return logits


class ReadCounter:
    """Counts reads of tensor values per step, with the project or library line that made each."""

    def __init__(self) -> None:
        self.step = -1
        self.sites: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)

    def on_step(self, step: int) -> None:
        self.step = step

    def _site(self) -> str:
        frame = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename.startswith(TORCH_DIR):
            frame = frame.f_back  # torch's own Python wrappers: report their caller
        if frame is None:
            return "?"
        path = frame.f_code.co_filename
        if path.startswith(ROOT):
            path = os.path.relpath(path, ROOT)
        return f"{path}:{frame.f_lineno}"

    @contextlib.contextmanager
    def counting(self) -> Iterator[ReadCounter]:
        originals = {name: getattr(torch.Tensor, name) for name in READS}

        def wrap(name: str, original: Any) -> Any:
            def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                self.sites[self.step][f"{self._site()} ({name})"] += 1
                return original(tensor, *args, **kwargs)

            return counted

        for name, original in originals.items():
            setattr(torch.Tensor, name, wrap(name, original))
        try:
            yield self
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)

    def steady(self, first: int, last: int) -> tuple[float, collections.Counter[str]]:
        """Reads per step over steps ``first .. last - 1``, and where they were made."""
        total: collections.Counter[str] = collections.Counter()
        for step in range(first, last):
            total.update(self.sites.get(step, {}))
        return sum(total.values()) / (last - first), total


def _loop(device: str, *, grammar: str | None, tracked: bool, sampled: bool = True):
    """A Generator with bad words, penalties, optionally a grammar and a tracker, and its parameters."""
    tok = byte_tokenizer()
    model = random_gpt2(len(tok), seed=3).to(device)
    processors: list[Any] = [
        BadWordsLogitsProcessor(["cat"], tok),
        PenaltiesLogitsProcessor(repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.2),
    ]
    if grammar == "regex":
        from processors import RegexLogitsProcessor

        processors.append(RegexLogitsProcessor(r"[a-z ]{1,200}", tok))
    elif grammar == "json":
        from processors import JSONLogitsProcessor

        processors.append(JSONLogitsProcessor({"type": "array", "items": {"type": "integer"}}, tok))
    generator = Generator(model, tok, logits_processor=processors)
    generator.sampling_algorithm = "sort"  # the accelerator's algorithm, whatever the device
    if tracked:
        from tracker import add_tracking

        add_tracking(generator, storage="topk", top_k=8)
    params = (
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7, max_new_tokens=STEPS, ignore_eos=True)
        if sampled
        else SamplingParams(max_new_tokens=STEPS, ignore_eos=True)
    )
    return generator, params


def _mark(generator: Generator, on_step: Any) -> None:
    """Put a step marker first among the processors the Generator calls."""
    target = generator.logits_processor
    inner = getattr(target, "processor", None)  # the tracker wraps the list
    (inner if inner is not None else target).processors.insert(0, StepMarker(on_step))


@pytest.mark.parametrize(
    "prompts, pad_token_id",
    [(PROMPTS, None), (["a cat sat", "a cat sat"], None), (["a cat sat", "a cat sat"], 0)],
    ids=["padded", "unpadded", "unpadded-model-with-pad-id"],  # transformers checks unmasked input for its pad id
)
def test_steady_state_decode_step_reads_the_device_at_most_once(prompts, pad_token_id):
    pytest.importorskip("llguidance")
    generator, params = _loop("cpu", grammar="regex", tracked=True)
    generator.model.config.pad_token_id = pad_token_id
    counter = ReadCounter()
    _mark(generator, counter.on_step)
    with counter.counting():
        outputs = generator.generate(prompts, params)
    assert all(len(c.token_ids) == STEPS for out in outputs for c in out.outputs)
    per_step, sites = counter.steady(2, STEPS - 1)
    listing = "\n".join(f"  {count / (STEPS - 3):.2f} per step  {site}" for site, count in sites.most_common())
    assert per_step <= 1.0, (
        f"{per_step:.2f} reads of tensor values per decode step (at most 1: the step's planned copy, "
        f"sampling/step_copy.py), at:\n{listing}"
    )


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@CUDA
@pytest.mark.parametrize(
    "grammar, tracked, sampled",
    [(None, False, True), (None, False, False), (None, True, True), ("regex", False, True), ("json", True, True)],
)
def test_cuda_decode_steps_do_not_synchronise_after_the_first(grammar, tracked, sampled):
    if grammar is not None:
        pytest.importorskip("llguidance")
    generator, params = _loop("cuda", grammar=grammar, tracked=tracked, sampled=sampled)

    def strict_from_second_step(step: int) -> None:
        if step == 1:
            torch.cuda.set_sync_debug_mode("error")

    _mark(generator, strict_from_second_step)
    try:
        outputs = generator.generate(PROMPTS, params)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(len(c.token_ids) == STEPS for out in outputs for c in out.outputs)
