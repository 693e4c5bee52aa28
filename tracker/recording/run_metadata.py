"""What a tracker and its copies share: the recorder, the generations so far and the run's description.

:class:`SharedRecording` builds the run's :class:`~tracker.format.schema.RunMetadata`
(model name, vocabulary, prompts, sampling parameters, the processors'
description, library version and time), opens a record for each new
generation (its prompts without left padding, its per-row sampling and prompt
log-probabilities), and turns the recorder's rows into a
:class:`~tracker.Run`, rebuilt only when something new was recorded.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from processors import BatchContext
from processors.vocab import Vocabulary, vocab_for
from tracker.format.provenance import library_version as _library_version
from tracker.format.provenance import model_name, new_run_id, now
from tracker.format.schema import RunMetadata
from tracker.reading.prompt import leading_pad_mask, prompt_rows
from tracker.reading.run import Run
from tracker.recording.chunks import StepRows
from tracker.recording.modes import Storage
from tracker.recording.recorder import Recorder

__all__ = ["Generation", "SharedRecording", "model_name", "new_run_id", "now"]


@dataclass
class Generation:
    """Book-keeping for the generation in progress (one per thread)."""

    id: int
    batch: int
    prompt_length: int
    epoch: int
    last_step: int = -1
    last_rows: StepRows | None = None
    chosen_known: bool = True


ScoredPrompts = tuple[list[list[int]], list[list[float | None]]]
"""Prompts (each row's ids without its padding) and their log-probabilities, one list per row."""


def _scores_for(prompts: list[list[int]], scored: ScoredPrompts) -> list[list[float | None]] | None:
    """The log-probabilities of ``prompts`` from ``scored``: its rows in order, or each repeated ``k`` times in a
    row (``num_return_sequences``, ``n`` samples per prompt); None when they are other prompts."""
    rows, scores = scored
    if rows == prompts:
        return scores
    if rows and prompts and len(prompts) % len(rows) == 0:
        k = len(prompts) // len(rows)
        if [r for r in rows for _ in range(k)] == prompts:
            return [s for s in scores for _ in range(k)]
    return None


def _prompt_ids(ctx: BatchContext, pad_token_id: int | None) -> list[list[int]]:
    """Each row's prompt: without the columns the attention mask marks 0, else without leading pad ids."""
    prompts = ctx.input_ids[:, : ctx.prompt_length].cpu()
    if ctx.attention_mask is not None:
        return prompt_rows(prompts, ctx.attention_mask[:, : ctx.prompt_length])
    return prompt_rows(prompts, leading_pad_mask(prompts, pad_token_id))


def _summarise_sampling(rows: list[dict[str, Any]]) -> Any:
    """One dict when every request was sampled alike (``seed`` then lists each request's
    seed if they differ), else one dict per request, in request order."""
    per_request: dict[Any, dict[str, Any]] = {}
    for row in rows:
        params = {k: v for k, v in row.items() if k not in ("request", "sample")}
        per_request.setdefault(row.get("request", len(per_request)), params)
    unique = list(per_request.values())
    bare = [{k: v for k, v in p.items() if k != "seed"} for p in unique]
    if any(b != bare[0] for b in bare):
        return unique
    seeds = [p.get("seed") for p in unique]
    return {**bare[0], "seed": seeds[0] if len(set(seeds)) == 1 else seeds}


def _check_recorded_chosen(batches: list[Any], vocab_size: int) -> None:
    """Refuse recorded chosen ids at or past ``vocab_size`` (those that came on an accelerator, unchecked)."""
    import pyarrow.compute as pc

    for batch in batches:
        chosen = batch.column("chosen")
        if vocab_size <= 0 or chosen.null_count == len(chosen):
            continue
        bad = pc.greater_equal(chosen, vocab_size)
        if pc.any(bad).as_py():
            i = pc.index(bad, True).as_py()
            row = {name: batch.column(name)[i].as_py() for name in ("generation", "sequence", "step", "chosen")}
            raise ValueError(
                f"chosen token of generation {row['generation']}, row {row['sequence']}, step {row['step']} is "
                f"{row['chosen']}, outside the vocabulary [0, {vocab_size})"
            )


@dataclass
class SharedRecording:
    """What a tracker and its copies share: the recorder and the run's description."""

    recorder: Recorder
    storage: Storage
    tokenizer: Any
    eos_token_ids: list[int]
    model: str | None
    processors: str | None
    run_id: str
    created_at: str
    sampling: Any = None
    sampling_from_user: bool = False
    pending_sampling: list[dict[str, Any]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    stage_aliases: dict[str, str] = field(default_factory=dict)
    pending_prompt: ScoredPrompts | None = None
    generations: list[dict[str, Any]] = field(default_factory=list)
    next_generation: int = 0
    epoch: int = 0
    vocab: Vocabulary | None = None
    run_cache: tuple[Any, Run] | None = None
    lock: threading.RLock = field(default_factory=threading.RLock)

    def __post_init__(self) -> None:
        self.recorder.describe = _describer(self)
        self.recorder.eos_token_ids = list(self.eos_token_ids)

    # ---------------------------------------------------------------- the description

    def vocabulary(self) -> Vocabulary:
        """The tokenizer's vocabulary as wide as the recorded rows (``<id>`` placeholders without a tokenizer)."""
        size = self.recorder.vocab_size or 0
        if self.vocab is None or self.vocab.size != size:
            if self.tokenizer is None:
                self.vocab = Vocabulary.placeholder(size)
            else:
                self.vocab = vocab_for(self.tokenizer, size)
        return self.vocab

    def metadata(self) -> RunMetadata:
        size = self.recorder.vocab_size or 0
        return RunMetadata(
            run_id=self.run_id,
            storage=self.recorder.storage_kind,
            top_k=self.recorder.storage.k_for(size) if size else self.recorder.storage.top_k,
            stages=list(self.recorder.stages),
            vocab_size=size,
            eos_token_ids=list(self.eos_token_ids),
            model=self.model,
            processors=self.processors,
            sampling=self.sampling,
            generations=[dict(g) for g in self.generations],
            library_version=_library_version(),
            created_at=self.created_at,
            extra=dict(self.extra),
            stage_aliases=dict(self.stage_aliases),
        )

    def annotate(self, model: Any = None, sampling: Any = None, extra: dict[str, Any] | None = None) -> None:
        """Facts the user adds: the model's name, sampling parameters (then kept over the host's), anything else."""
        if model is not None:
            self.model = model_name(model)
        if sampling is not None:
            self.sampling = sampling.to_dict() if hasattr(sampling, "to_dict") else sampling
            self.sampling_from_user = True
        self.extra.update(extra or {})

    def expect_sampling(self, rows: list[dict[str, Any]]) -> None:
        """How each row of the coming generation is sampled (the host tells before it starts)."""
        with self.lock:
            self.pending_sampling = rows
            if not self.sampling_from_user:
                self.sampling = _summarise_sampling(rows)

    def note_lengths(self, lengths: list[int]) -> None:
        """The tokens each row of the latest generation produced (the host tells when it ends)."""
        with self.lock:
            if self.generations and self.generations[-1].get("batch_size") == len(lengths):
                self.generations[-1]["lengths"] = lengths
                self.run_cache = None

    # ---------------------------------------------------------------- generations

    def open_generation(self, ctx: BatchContext, batch: int, pad_token_id: int | None) -> Generation:
        """Number a new generation and record its prompts, sampling and prompt log-probabilities.

        Reads the prompt ids to the host once per generation (never per step).
        """
        gid = self.next_generation
        self.next_generation += 1
        record: dict[str, Any] = {
            "generation": gid,
            "batch_size": batch,
            "prompt_ids": _prompt_ids(ctx, pad_token_id),
            "started_at": now(),
        }
        if self.pending_sampling is not None and len(self.pending_sampling) == batch:
            record["sampling"] = self.pending_sampling
        self.pending_sampling = None
        if self.pending_prompt is not None:
            scores = _scores_for(record["prompt_ids"], self.pending_prompt)
            if scores is None:
                warnings.warn(
                    f"generation {gid}: the prompts scored before it (score_prompt) are not its prompts; "
                    "their log-probabilities are not kept (score the input_ids and attention_mask given to generate)",
                    stacklevel=4,
                )
            else:
                record["prompt_logprobs"] = scores
        self.pending_prompt = None
        self.generations.append(record)
        return Generation(gid, batch, ctx.prompt_length, self.epoch)

    def attach_prompt_logprobs(self, generation: int, scored: ScoredPrompts) -> None:
        """Give a recorded generation its prompts' log-probabilities (ValueError if its prompts differ)."""
        with self.lock:
            record = next(r for r in self.generations if r["generation"] == generation)
            scores = _scores_for(record.get("prompt_ids") or [], scored)
            if scores is None:
                raise ValueError(
                    f"generation={generation} has prompts of {[len(p) for p in record.get('prompt_ids') or []]} "
                    f"tokens; the scored input_ids, without left padding, are not its prompts "
                    f"({[len(r) for r in scored[0]]} tokens)"
                )
            record["prompt_logprobs"] = scores
            self.run_cache = None

    def restart(self) -> None:
        """Forget everything recorded; what follows is a new run (a new id and time)."""
        with self.lock:
            self.recorder.clear()
            self.generations.clear()
            self.next_generation = 0
            self.epoch += 1
            self.run_cache = None
            self.run_id = new_run_id()
            self.created_at = now()
            self.recorder.run_id = self.run_id

    # ---------------------------------------------------------------- the run

    def run(self) -> Run:
        """The recorded run so far (rebuilt only when something new was recorded; drains CUDA staging)."""
        with self.lock:
            key = (
                self.epoch,
                self.recorder.version,
                len(self.generations),
                self.model,
                str(self.sampling),
                tuple(self.extra.items()).__repr__(),
            )
            if self.run_cache is not None and self.run_cache[0] == key:
                return self.run_cache[1]
            batches = self.recorder.batches()
            _check_recorded_chosen(batches, self.recorder.vocab_size or 0)
            run = Run(batches, self.metadata(), _vocabulary_source(self))
            self.run_cache = (key, run)
            return run


def _weak_call(shared: SharedRecording, method: Callable[[SharedRecording], Any]) -> Callable[[], Any]:
    """``method(shared)`` later, holding the recording weakly.

    The recorder and the runs a tracker hands out call back into the
    recording; holding it weakly keeps them from forming reference cycles, so
    a dropped tracker's buffers return to the pool at once.
    """
    ref = weakref.ref(shared)

    def call() -> Any:
        recording = ref()
        if recording is None:
            raise RuntimeError("the tracker that recorded this run is gone; keep it or save the run first")
        return method(recording)

    return call


def _vocabulary_source(shared: SharedRecording) -> Callable[[], Vocabulary]:
    """Builds a run's vocabulary on first use: the recording's cached one while it lives, else from the tokenizer."""
    ref = weakref.ref(shared)
    tokenizer, size = shared.tokenizer, shared.recorder.vocab_size or 0

    def load() -> Vocabulary:
        recording = ref()
        if recording is not None and recording.recorder.vocab_size == size:
            return recording.vocabulary()
        return Vocabulary.placeholder(size) if tokenizer is None else vocab_for(tokenizer, size)

    return load


def _describer(shared: SharedRecording) -> Callable[[], tuple[bytes, bytes | None]]:
    """What the recorder writes beside spilled chunks: the run's metadata, and its vocabulary when a
    tokenizer gave one (placeholders carry nothing a reader cannot make from the vocabulary size)."""

    def describe(r: SharedRecording) -> tuple[bytes, bytes | None]:
        return r.metadata().to_json(), None if r.tokenizer is None else r.vocabulary().serialize()

    return _weak_call(shared, describe)


def check_pad_token_id(pad_token_id: Any) -> int | None:
    """``pad_token_id`` as an int >= 0, or None; TypeError or ValueError naming it otherwise."""
    if pad_token_id is None:
        return None
    if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, (int, np.integer)):
        raise TypeError(f"pad_token_id must be a token id (an int >= 0) or None, got {pad_token_id!r}")
    if pad_token_id < 0:
        raise ValueError(f"pad_token_id must be a token id (an int >= 0) or None, got {pad_token_id}")
    return int(pad_token_id)
