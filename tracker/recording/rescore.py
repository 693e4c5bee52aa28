"""Re-score a recorded run: feed its exact tokens through another model (or precision) and record that model's
distributions at the same steps, as a run of its own.

>>> other = run.rescore(model_bf16)                 # or tracker.recording.rescore.rescore(run, model, ...)
>>> tracker.compare_runs(run, other).summary()      # KL, top-1 agreement, perplexities

Every generation of the run is rebuilt as the model saw it: each row's
prompt (as recorded, without its padding), left-padded to the generation's
longest, then its chosen tokens. The new run has the same generations,
sequences, prompts, sampling metadata and chosen tokens; its one stage,
``natural``, holds the other model's logits at every recorded step (the
steps a row was fed after it finished included), and each generation's
``prompt_logprobs`` are the other model's when the first run has them.

Two ways to compute, ``method``:

- ``"forward"`` (the default): teacher forcing, one forward pass per batch
  of sequences over the whole sequence (split into windows of positions,
  carried over by the KV cache, only where the logits of one pass would pass
  ``window_bytes``). Its logits equal a step-by-step decode's up to the
  rounding of the longer matrix products (measured on the demo model in
  float32: about 1e-5), not bit for bit.
- ``"stepwise"``: the prompt, then one forward pass per step with a KV
  cache, as a decode loop runs. With the model and dtype that recorded the
  run, on the same device, with ``batch_size`` at least the generation's
  batch (the same batch shape), it gives the recorded natural logits bit for
  bit (a KL of exactly 0) for runs recorded by logitscope's ``Generator`` or
  ``model.generate`` (left padding, attention mask, positions counted from
  each row's first real token). Rows are fed their recorded tokens after
  they finish, where a host may have masked them: those rows (hidden by
  default, ``include_finished=False``) may then differ.

Memory: the rows go through the project's :class:`~tracker.recording.recorder.Recorder`
(``storage`` as the first run's unless given), which spills complete chunks
to disk past ``memory_limit``; the model's logits are held for one window of
positions of one generation at a time. The returned run keeps the recorder
alive; write it with :meth:`~tracker.Run.to_parquet` or
:meth:`~tracker.Run.to_dataset`.
"""

from __future__ import annotations

import copy
import inspect
import sys
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from processors.vocab import Vocabulary, vocab_for
from tracker.format.provenance import library_version, model_name, new_run_id, now
from tracker.reading.compare import _as_run
from tracker.reading.prompt import prompt_logprobs
from tracker.reading.selection import count_arg
from tracker.recording.recorder import Recorder, Storage

__all__ = ["rescore", "check_vocabulary", "context_limit", "METHODS"]

METHODS = ("forward", "stepwise")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def context_limit(model: Any) -> int | None:
    """The model's context window from its config (``max_position_embeddings``, ``n_positions`` or ``n_ctx``)."""
    config = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _output_width(model: Any) -> int | None:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if weight is not None and weight.ndim == 2:
        return int(weight.shape[0])
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return int(size) if isinstance(size, int) else None


def _is_placeholder(vocab: Vocabulary) -> bool:
    """Whether a run's vocabulary is the ``<id>`` placeholder of a run recorded without a tokenizer."""
    return bool(vocab.special.all()) and vocab.display[:2] == tuple(f"<{i}>" for i in range(min(2, vocab.size)))


def check_vocabulary(run: Any, model: Any, tokenizer: Any = None) -> None:
    """Refuse a model (or tokenizer) whose vocabulary is not the run's: a ValueError naming both sizes, or the
    first token id whose bytes differ. The run's stored vocabulary is compared with the tokenizer's when both
    are known (a run recorded without a tokenizer is checked by size only)."""
    size = run.metadata.vocab_size
    width = _output_width(model)
    if width is not None and width != size:
        raise ValueError(
            f"model: its logits have {width} entries per step but the run's vocabulary has {size} tokens; "
            "rescoring needs the same vocabulary (the same tokenizer)"
        )
    if tokenizer is None or _is_placeholder(run.vocab):
        return
    theirs = vocab_for(tokenizer, size)
    ours = run.vocab
    if theirs.pieces != ours.pieces:
        first = next(i for i, (a, b) in enumerate(zip(ours.pieces, theirs.pieces)) if a != b)
        raise ValueError(
            f"tokenizer: token {first} is {theirs.pieces[first]!r} but the run's token {first} is "
            f"{ours.pieces[first]!r} (both {size} tokens wide); rescoring needs the tokenizer that recorded the run"
        )


def _prepared(model: Any, dtype: Any, device: Any) -> tuple[Any, torch.device, torch.dtype]:
    """The model on ``device`` in ``dtype`` (a copy when either differs from the model's own), in eval mode."""
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or a torch.dtype, got {dtype!r}")
        dtype = _DTYPES[dtype]
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating torch.dtype or one of {sorted(_DTYPES)}, got {dtype!r}")
    try:
        first = next(model.parameters())
    except (AttributeError, StopIteration):
        raise TypeError(f"model must be a torch causal LM with parameters, got {type(model).__name__}") from None
    target_device = first.device if device is None else torch.device(device)
    target_dtype = first.dtype if dtype is None else dtype
    if target_device != first.device or target_dtype != first.dtype:
        model = copy.deepcopy(model).to(device=target_device, dtype=target_dtype)
    return model.eval(), target_device, target_dtype


class _Inputs:
    """One generation's teacher-forcing inputs: ids, mask and positions ``[B, P + T - 1]``, chosen ``[B, T]``."""

    def __init__(self, run: Any, generation: int, record: dict[str, Any], limit: int | None) -> None:
        sequences = run.sequences(generation)
        prompts = record.get("prompt_ids") or []
        if len(prompts) != len(sequences) or any(len(p) == 0 for p in prompts):
            raise ValueError(
                f"generation {generation} has {len(sequences)} sequences but its metadata holds prompts for "
                f"{sum(bool(p) for p in prompts)}; rescoring needs every row's prompt ids"
            )
        chosen_rows = []
        for s in sequences:
            sel = run._select(generation, s, include_finished=True)
            if not np.array_equal(sel.steps, np.arange(sel.length)):
                raise ValueError(f"generation {generation}, sequence {s}: its steps are not 0, 1, 2, ... in order")
            chosen_rows.append(sel.chosen)
        steps = max(len(c) for c in chosen_rows)
        if any(len(c) != steps for c in chosen_rows):
            raise ValueError(f"generation {generation}: its sequences recorded different numbers of steps")
        chosen = np.stack(chosen_rows) if chosen_rows else np.zeros((0, 0), np.int64)
        unknown = np.argwhere(chosen[:, :-1] < 0)
        if unknown.size:
            s, t = unknown[0]
            raise ValueError(
                f"generation {generation}, sequence {sequences[s]}: the token chosen at step {t} is not recorded, "
                "so the steps after it cannot be fed"
            )
        width = max(len(p) for p in prompts)
        longest = max(len(p) for p in prompts) + steps - 1
        if limit is not None and longest > limit:
            raise ValueError(
                f"generation {generation}: a row needs {longest} positions (its prompt and {steps - 1} fed tokens) "
                f"but the model's context window holds {limit}; rescore with a model whose window is at least "
                f"{longest}"
            )
        length = width + steps - 1
        ids = np.zeros((len(prompts), length), dtype=np.int64)
        mask = np.zeros_like(ids)
        for b, prompt in enumerate(prompts):
            ids[b, width - len(prompt) : width] = prompt
            mask[b, width - len(prompt) :] = 1
        ids[:, width:] = np.maximum(chosen[:, :-1], 0)
        self.generation, self.prompt_width, self.steps = generation, width, steps
        self.ids, self.mask = torch.from_numpy(ids), torch.from_numpy(mask)
        self.positions = (self.mask.cumsum(-1) - 1).clamp(min=0)
        self.chosen = torch.from_numpy(chosen.astype(np.int64))
        self.known = chosen >= 0

    def to(self, device: torch.device) -> _Inputs:
        for name in ("ids", "mask", "positions", "chosen"):
            setattr(self, name, getattr(self, name).to(device))
        return self


class _Scorer:
    """Runs the model over a generation's inputs and hands each step's ``[B, V]`` logits to the recorder."""

    def __init__(self, model: Any, recorder: Recorder, batch_size: int, window_bytes: int, bar: Any) -> None:
        self.model, self.recorder, self.batch_size, self.bar = model, recorder, batch_size, bar
        forward = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in forward else "past_key_values"
        self.keeps_last = "logits_to_keep" in forward
        self.window_bytes = window_bytes

    def _call(self, inp: _Inputs, rows: slice, a: int, b: int, cache: Any, keep: int | None) -> tuple[Any, Any]:
        kwargs: dict[str, Any] = {self.cache_arg: cache, "use_cache": True}
        if keep is not None and self.keeps_last:
            kwargs["logits_to_keep"] = keep
        out = self.model(
            input_ids=inp.ids[rows, a:b],
            attention_mask=inp.mask[rows, :b],
            position_ids=inp.positions[rows, a:b],
            **kwargs,
        )
        return out.logits, getattr(out, self.cache_arg)

    def _groups(self, batch: int) -> list[slice]:
        return [slice(a, min(batch, a + self.batch_size)) for a in range(0, batch, self.batch_size)]

    def forward(self, inp: _Inputs, vocab: int, want_prompt: bool) -> list[list[float | None]] | None:
        """Teacher forcing: one pass per group of rows and window of positions. Returns the prompt scores."""
        batch, width, length = inp.ids.shape[0], inp.prompt_width, inp.ids.shape[1]
        groups = self._groups(batch)
        caches: list[Any] = [None] * len(groups)
        per_column = max(1, batch * vocab * 4)
        span = max(1, self.window_bytes // per_column)
        scores = None
        start = 0
        while start < length:
            end = min(length, max(start + span, width if start == 0 else 0))  # the first window holds the prompt
            first_step_col = max(start, width - 1)
            keep = None if (start == 0 and want_prompt) else end - first_step_col
            parts = []
            for g, rows in enumerate(groups):
                logits, caches[g] = self._call(inp, rows, start, end, caches[g], keep)
                parts.append(logits)
            logits = torch.cat(parts) if len(parts) > 1 else parts[0]
            if start == 0 and want_prompt:
                scores = prompt_logprobs(logits[:, :width], inp.ids[:, :width], inp.mask[:, :width])
            logits = logits[:, logits.shape[1] - (end - first_step_col) :]
            for j in range(logits.shape[1]):
                self._record(inp, first_step_col + j - (width - 1), logits[:, j], vocab)
            start = end
        return scores

    def stepwise(self, inp: _Inputs, vocab: int, want_prompt: bool) -> list[list[float | None]] | None:
        """The prompt, then one pass per step with the KV cache (a decode loop's shapes). Returns the prompt scores."""
        width, scores = inp.prompt_width, None
        groups = self._groups(inp.ids.shape[0])
        caches: list[Any] = [None] * len(groups)
        for step in range(inp.steps):
            a, b = (0, width) if step == 0 else (width + step - 1, width + step)
            parts = []
            for g, rows in enumerate(groups):
                logits, caches[g] = self._call(inp, rows, a, b, caches[g], 0 if step == 0 and want_prompt else 1)
                parts.append(logits)
            logits = torch.cat(parts) if len(parts) > 1 else parts[0]
            if step == 0 and want_prompt:
                scores = prompt_logprobs(logits, inp.ids[:, :width], inp.mask[:, :width])
            self._record(inp, step, logits[:, -1], vocab)
        return scores

    def _record(self, inp: _Inputs, step: int, logits: torch.Tensor, vocab: int) -> None:
        """One step's rows: the logits as float32 and the recorded chosen tokens (no host read)."""
        rows = self.recorder.begin_step(inp.generation, step, logits.shape[0], vocab, logits.device)
        self.recorder.write(rows, "natural", logits.float(), owned=logits.dtype != torch.float32)
        known = inp.known[:, step]
        if known.all():
            self.recorder.set_chosen(rows, inp.chosen[:, step])
        self.bar.update(1)


def _progress(total: int, progress: bool | None) -> Any:
    from tqdm import tqdm

    show = (total >= 256 and sys.stderr.isatty()) if progress is None else bool(progress)
    return tqdm(total=total, desc="rescoring", unit="step", disable=not show, file=sys.stderr)


def rescore(
    run: Any,
    model: Any,
    tokenizer: Any = None,
    *,
    dtype: Any = None,
    device: Any = None,
    batch_size: int = 8,
    storage: str | None = None,
    top_k: int | None = None,
    method: str = "forward",
    progress: bool | None = None,
    memory_limit: int | None = 2 << 30,
    spill_dir: Any = None,
    window_bytes: int = 256 << 20,
    name: str | None = None,
) -> Any:
    """A new run with ``run``'s generations, prompts and chosen tokens, and ``model``'s distributions at every
    recorded step (see the module docstring).

    Args:
        run: the run to re-score (a :class:`~tracker.Run`, or a tracker: the run it recorded).
        model: a causal LM (``model(input_ids=, attention_mask=, position_ids=)`` giving ``.logits``).
        tokenizer: its tokenizer; when given, its vocabulary must be the run's token for token.
        dtype: run the model in this dtype (``"bfloat16"``, ``torch.float16``, ...; a copy of the model
            when it is not the model's own). Default: the model's.
        device: run on this device (a copy of the model when it is elsewhere). Default: the model's.
        batch_size: sequences per forward pass (a generation's rows are split into groups of this many).
        storage, top_k: how the new run keeps its rows (default: as ``run`` does).
        method: ``"forward"`` or ``"stepwise"`` (see the module docstring).
        progress: show a tqdm bar (default: on a terminal, for 256 steps or more).
        memory_limit, spill_dir: the recorder's bound on host memory and its spill folder.
        window_bytes: the most bytes of float32 logits one pass over a generation produces.
        name: the rescoring model's name in the new run's metadata (default: its config's name or path).

    ValueError naming the argument when the vocabularies differ, a row does not fit the model's context
    window, or a token the following steps need was not recorded.
    """
    run = _as_run(run, "run")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    batch_size = count_arg("batch_size", batch_size)
    window_bytes = count_arg("window_bytes", window_bytes)
    meta = run.metadata
    if not meta.vocab_size or not run.num_rows:
        raise ValueError("run: nothing recorded; there is nothing to rescore")
    check_vocabulary(run, model, tokenizer)
    model, device, dtype = _prepared(model, dtype, device)
    kind = storage or meta.storage
    parsed = Storage.parse(kind, top_k or meta.top_k or 20) if kind == "topk" else Storage.parse(kind)
    run_id = new_run_id()
    recorder = Recorder(parsed, ["natural"], memory_limit=memory_limit, spill_dir=spill_dir, run_id=run_id)
    recorder.eos_token_ids = list(meta.eos_token_ids)
    records = {g.get("generation"): g for g in meta.generations}
    limit = context_limit(model)
    inputs = [_Inputs(run, g, records.get(g, {}), limit) for g in run.generations()]  # every check before any pass
    generations = []
    with _progress(sum(i.steps for i in inputs), progress) as bar, torch.inference_mode():
        scorer = _Scorer(model, recorder, batch_size, window_bytes, bar)
        for inp in inputs:
            record = dict(records.get(inp.generation, {"generation": inp.generation}))
            want_prompt = record.get("prompt_logprobs") is not None
            inp.to(device)
            score = scorer.forward if method == "forward" else scorer.stepwise
            scores = score(inp, meta.vocab_size, want_prompt)
            recorder.end_generation(inp.generation)
            if want_prompt:
                record["prompt_logprobs"] = scores
            generations.append(record)
    name = name or model_name(model)
    extra = {k: v for k, v in meta.extra.items() if k not in ("title", "rescored_from", "rescore")}
    extra["title"] = f"{meta.extra.get('title') or meta.run_id} rescored by {name} ({str(dtype).replace('torch.', '')})"
    extra["rescored_from"] = {"run_id": meta.run_id, "title": meta.extra.get("title"), "model": meta.model}
    extra["rescore"] = {"model": name, "dtype": str(dtype).replace("torch.", ""), "device": str(device)}
    extra["rescore"]["method"] = method
    metadata = replace(
        meta,
        run_id=run_id,
        storage=recorder.storage_kind,
        top_k=recorder.storage.k_for(meta.vocab_size),
        stages=["natural"],
        model=name,
        processors=None,
        generations=generations,
        created_at=now(),
        library_version=library_version(),
        extra=extra,
        stage_aliases={},
    )
    result = type(run)(recorder.batches(), metadata, run.vocab)
    result._recorder = recorder  # the rows live in the recorder's buffers (and spill files): keep it alive
    return result
