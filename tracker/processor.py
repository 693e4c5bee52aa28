"""``LogitTrackingProcessor``: wrap any processor, record what goes in and what comes out.

>>> tracker = LogitTrackingProcessor(my_processor, tokenizer=tok)
>>> out = model.generate(**enc, logits_processor=LogitsProcessorList([tracker]),
...                      stopping_criteria=StoppingCriteriaList([tracker.stopping_criteria()]))
>>> tracker.get_top_tokens(k=5)

Per step and batch row the tracker records the logits *before* the wrapped
processor ("natural": the copy is taken before an in-place processor can
touch them), the logits it returned ("constrained"), optionally further stages
such as the distribution actually sampled from ("sampled", from logitscope's
sampling taps), and the token chosen.

Where the chosen tokens come from:

- logitscope's ``Generator`` calls :meth:`on_sampled` after every step, the
  last one included;
- transformers-style hosts (``model.generate``, Outlines) do not: the tracker
  reads each step's token from the next call's ``input_ids``, and the last
  step's from :meth:`stopping_criteria` (pass it to ``generate``) or from
  :meth:`finish` (give it the ``generate`` output).

A new generation starts after :meth:`reset` (which is passed on to the
wrapped processor), after :meth:`finish`, or when the host's input is not the
next step of the last one: a changed batch size, an input that is not exactly
one token longer than the last call's, or (for inputs on the CPU) one whose
first columns differ from the last call's input. Calling :meth:`finish` or not
gives the same generations. A row's recorded prompt leaves out its left
padding: the columns the attention mask marks 0 when the host gives one, else
the leading run of the pad id (``pad_token_id``, by default the tokenizer's).
:meth:`clear` forgets everything.

Threads: the generation in progress and the prompt boundary are kept per
thread, so two threads sharing a tracker record two separate generations
into one run (rows and metadata are guarded by a lock). The wrapped
processor is shared: one that keeps per-generation state (a grammar) must not
serve two threads at once; give each thread ``copy.deepcopy(tracker)``, which
shares the recording and copies the wrapped processor. The tracker is itself a logitscope
processor, so it works in every convention: transformers as it is, and
``processors.to_vllm/to_dynamo/to_trtllm(tracker)`` for the others.
TensorRT-LLM's adapter copies the processor per request: copies made with
``copy.deepcopy`` share this tracker's recording (each records its own
generations) and deep-copy the wrapped processor.
"""

from __future__ import annotations

import copy
import datetime as _dt
import functools
import threading
import uuid
import weakref
from dataclasses import dataclass, field
from importlib import metadata as _importlib_metadata
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

import numpy as np
import torch

from processors import BatchContext, LogitsProcessor, ProcessorError, as_processor
from processors.protocol import check_logits
from tracker.analysis import Analysis
from tracker.insight import Insight
from tracker.recorder import Recorder, StepRows, Storage
from tracker.run import Run
from tracker.prompt import prompt_logprobs, score_prompt
from tracker.schema import RunMetadata
from processors.vocab import Vocabulary, eos_token_ids, hf_tokenizer, vocab_for
from tracker.stages import apply_recording, per_processor

__all__ = ["LogitTrackingProcessor", "find_tokenizer"]

StageKind = Literal["logits", "logprobs", "probs"]


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _library_version() -> str:
    try:
        return _importlib_metadata.version("logitscope")
    except _importlib_metadata.PackageNotFoundError:
        return "unknown"


def find_tokenizer(*candidates: Any) -> Any:
    """The first tokenizer found on the candidates (or their ``.tokenizer`` chains).

    A host's wrapper (Outlines' ``TransformerTokenizer``) is unwrapped to the
    Hugging Face tokenizer inside it: token texts come from the vocabulary's
    bytes, never from a wrapper's ``decode``.
    """
    for candidate in candidates:
        seen = 0
        obj = candidate
        while obj is not None and seen < 4:
            if hasattr(obj, "convert_ids_to_tokens") or (hasattr(obj, "decode") and hasattr(obj, "eos_token_id")):
                return hf_tokenizer(obj)
            obj = getattr(obj, "tokenizer", None)
            seen += 1
    return None


@dataclass
class _Generation:
    """Book-keeping for the generation in progress."""

    id: int
    batch: int
    prompt_length: int
    epoch: int
    last_step: int = -1
    last_rows: StepRows | None = None
    chosen_known: bool = True


@dataclass
class _HostState:
    """What a transformers-style host showed this thread last: where its prompt ends, its last input."""

    prompt_length: int = 0
    last_ids: torch.Tensor | None = None


def _continues(input_ids: torch.Tensor, last: torch.Tensor) -> bool:
    """Whether ``input_ids`` is the step after ``last``: same rows, one token longer, same first columns.

    The columns are compared only for tensors on the CPU (free there); on an
    accelerator that would read the device every step, so batch and length decide.
    """
    if input_ids.shape[0] != last.shape[0] or input_ids.shape[1] != last.shape[1] + 1:
        return False
    if input_ids.device.type != "cpu" or last.device.type != "cpu":
        return True
    return bool(torch.equal(input_ids[:, :-1], last))


def _strip_left_padding(prompts: torch.Tensor, pad_token_id: int | None) -> list[list[int]]:
    """Each row of ``prompts [B, P]`` without its leading run of ``pad_token_id``."""
    rows = prompts.cpu()
    if pad_token_id is None or rows.shape[1] == 0:
        return rows.tolist()
    leading = torch.cumprod((rows == pad_token_id).to(torch.int64), dim=1).sum(dim=1).tolist()
    return [row[int(n):].tolist() for row, n in zip(rows, leading)]


def _check_chosen(tokens: Any, vocab_size: int, where: str) -> None:
    """Refuse chosen ids outside ``[0, vocab_size)``, naming the row, the id and the range.

    Checks host values (a CPU tensor, a list); a tensor on an accelerator is
    not read here (that would synchronise every step) and is checked when the
    run is built (see ``LogitTrackingProcessor.run``).
    """
    if isinstance(tokens, torch.Tensor):
        if tokens.device.type != "cpu":
            return
        values = tokens.detach().reshape(-1).to(torch.int64).numpy()
    else:
        values = np.asarray(list(tokens), dtype=np.int64).reshape(-1)
    if vocab_size <= 0 or values.size == 0:
        return
    bad = np.flatnonzero((values < 0) | (values >= vocab_size))
    if bad.size:
        row = int(bad[0])
        raise ValueError(
            f"{where}: chosen token of row {row} is {int(values[row])}, outside the vocabulary [0, {vocab_size})"
            + (f" ({bad.size} rows out of range)" if bad.size > 1 else "")
        )


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
class _Recording:
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
    pending_prompt: list[list[float | None]] | None = None
    generations: list[dict[str, Any]] = field(default_factory=list)
    next_generation: int = 0
    epoch: int = 0
    vocab: Vocabulary | None = None
    run_cache: tuple[Any, Run] | None = None
    lock: threading.RLock = field(default_factory=threading.RLock)

    def vocabulary(self) -> Vocabulary:
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


def _weak_call(shared: _Recording, method: Any) -> Any:
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


def _vocabulary_source(shared: _Recording) -> Any:
    """Builds a run's vocabulary on first use: the recording's cached one while it lives, else from the tokenizer."""
    ref = weakref.ref(shared)
    tokenizer, size = shared.tokenizer, shared.recorder.vocab_size or 0

    def load() -> Vocabulary:
        recording = ref()
        if recording is not None and recording.recorder.vocab_size == size:
            return recording.vocabulary()
        return Vocabulary.placeholder(size) if tokenizer is None else vocab_for(tokenizer, size)

    return load


def _describer(shared: _Recording) -> Any:
    """What the recorder writes beside spilled chunks: run metadata and vocabulary."""
    return _weak_call(shared, lambda r: (r.metadata().to_json(), r.vocabulary().serialize()))


def _new_run_id() -> str:
    return f"{_dt.datetime.now(_dt.timezone.utc):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:8]}"


def _delegate(method: Any) -> Any:
    """A tracker method answering like the same :class:`~tracker.Run` method on the recorded run."""

    @functools.wraps(method)
    def call(self: "LogitTrackingProcessor", *args: Any, **kwargs: Any) -> Any:
        return getattr(self.run, method.__name__)(*args, **kwargs)

    return call


_BEAMS = (
    "beam search (num_beams > 1) is not tracked: the tracker records rows by position and beam search reorders "
    "its beams at every step, so the recorded rows are not sequences. Track greedy or sampled generation "
    "(num_beams=1); for several candidates per prompt use do_sample=True with num_return_sequences"
)


class LogitTrackingProcessor(LogitsProcessor):
    """Record the logits before and after a wrapped processor, and the chosen tokens.

    Args:
        processor: the processor to wrap: a logitscope processor, a
            transformers one (or ``LogitsProcessorList``), any callable
            ``(input_ids, scores) -> scores``; wrap other conventions with
            ``processors.from_vllm/from_dynamo/from_trtllm``. ``None`` records
            the model's own distribution only.
        tokenizer: for token texts; by default the wrapped processor's
            ``tokenizer`` attribute. Without one, tokens show as ``<id>``.
        storage: ``"float32"``, ``"float16"``, ``"bfloat16"`` (the whole
            vocabulary per row) or ``"topk"`` (the ``top_k`` best per stage,
            with the row's log-sum-exp and allowed count); every mode keeps
            each row's exact statistics. ``"auto"`` (the default): float32
            when 500 steps of the batch fit in ``memory_limit`` (or no bound
            or a zero one is given), else bfloat16 if that fits, else top-k;
            decided at the first step.
        top_k: values kept per row with ``storage="topk"``.
        memory_limit: bytes of recorded rows kept in memory; past it, finished
            chunks spill to Arrow IPC files in ``spill_dir``. ``None``: no bound.
        spill_dir: where spilled chunks go (``spill_dir/<run_id>/``, readable
            with ``Run.load`` even if the process dies); by default a
            temporary folder removed with the tracker.
        chunk_bytes: rows are kept in chunks of about this size.
        eos_token_id: end-of-sequence id(s); by default the tokenizer's.
        model: the model or its name, for the run's metadata.
        processor_stages: with a ``ProcessorList`` of two or more, record the
            logits after each processor as its own stage (``after:<name>``;
            see :mod:`tracker.stages`). Off by default: each extra stage costs
            a row per step (``4 V`` bytes in float32).
        prompt_logprobs: record each prompt's per-token log-probabilities
            from the prefill logits (hosts that call ``on_prefill``, such as
            logitscope's Generator; else :meth:`score_prompt`).
        pad_token_id: the id a host pads prompts with on the left; without an
            attention mask from the host, a row's leading run of it is left
            out of its recorded prompt. By default the tokenizer's.
        statistics: when each row's statistics (entropy, the chosen token's
            probability and rank, removed mass, margin, EOS probability) are
            computed: ``"record"`` as rows are recorded (on their device, no
            synchronisation), ``"read"`` when a query needs them (full storage
            only), ``"auto"``: when recorded, except for float32 rows on a
            CPU, which keep the whole row exactly: there they are computed
            when read (the same values; the passes over every row would cost
            the CPU more than the step's copy).
    """

    def __init__(
        self,
        processor: Any = None,
        tokenizer: Any = None,
        *,
        storage: Literal["auto", "float32", "float16", "bfloat16", "topk"] = "auto",
        top_k: int = 20,
        memory_limit: int | None = 2 << 30,
        spill_dir: str | Path | None = None,
        chunk_bytes: int = 32 << 20,
        eos_token_id: int | Sequence[int] | None = None,
        model: Any = None,
        processor_stages: bool = False,
        prompt_logprobs: bool = False,
        pad_token_id: int | None = None,
        statistics: Literal["auto", "record", "read"] = "auto",
    ) -> None:
        self._stage_names: list[str] = []
        if processor_stages and processor is not None:
            processor, self._stage_names = per_processor(processor)
        self.processor: LogitsProcessor | None = None if processor is None else as_processor(processor)
        self._records_prompt = bool(prompt_logprobs)
        if tokenizer is None:
            tokenizer = find_tokenizer(processor, getattr(self.processor, "fn", None))
        parsed = Storage.parse(storage, top_k)
        stages = ["natural"] if self.processor is None else ["natural", *self._stage_names[:-1], "constrained"]
        run_id = _new_run_id()
        recorder = Recorder(
            parsed, stages, chunk_bytes=chunk_bytes, memory_limit=memory_limit, spill_dir=spill_dir, run_id=run_id,
            statistics=statistics,
        )
        if model is not None and not isinstance(model, str):
            config = getattr(model, "config", None)
            model = getattr(config, "_name_or_path", None) or type(model).__name__
        self._shared = _Recording(
            recorder=recorder,
            storage=parsed,
            tokenizer=tokenizer,
            eos_token_ids=list(eos_token_ids(tokenizer, eos_token_id)),
            model=model,
            processors=None if self.processor is None else repr(self.processor),
            run_id=run_id,
            created_at=_now(),
            stage_aliases={self._stage_names[-1]: "constrained"} if self._stage_names else {},
        )
        recorder.describe = _describer(self._shared)
        recorder.eos_token_ids = list(self._shared.eos_token_ids)
        if pad_token_id is None:
            pad_token_id = getattr(tokenizer, "pad_token_id", None)
        if pad_token_id is not None and not isinstance(pad_token_id, (int, np.integer)):
            raise TypeError(f"pad_token_id must be an int or None, got {pad_token_id!r}")
        self.pad_token_id: int | None = None if pad_token_id is None else int(pad_token_id)
        self._local = threading.local()

    # ---------------------------------------------------------------- per-thread state

    @property
    def _gen(self) -> _Generation | None:
        """This thread's generation in progress."""
        return getattr(self._local, "gen", None)

    @_gen.setter
    def _gen(self, value: _Generation | None) -> None:
        self._local.gen = value

    def _host(self) -> _HostState:
        """What a transformers-style host showed this thread last."""
        host = getattr(self._local, "host", None)
        if host is None:
            host = self._local.host = _HostState()
        return host

    def _forget_host(self) -> None:
        self._local.host = None

    # ---------------------------------------------------------------- properties

    @property
    def inplace(self) -> bool:  # type: ignore[override]
        """True when the wrapped processor may modify the logits it is given."""
        return self.processor is not None and self.processor.inplace

    @property
    def tokenizer(self) -> Any:
        return self._shared.tokenizer

    @property
    def storage(self) -> Storage:
        """How rows are kept (with ``storage="auto"``: the mode chosen at the first step)."""
        return self._shared.recorder.storage

    @property
    def recorder(self) -> Recorder:
        return self._shared.recorder

    @property
    def run_id(self) -> str:
        return self._shared.run_id

    @property
    def name(self) -> str:
        inner = "none" if self.processor is None else self.processor.name
        return f"LogitTrackingProcessor({inner})"

    def __repr__(self) -> str:
        return (
            f"LogitTrackingProcessor({self.processor!r}, storage={self.storage.kind!r}, "
            f"stages={self.recorder.stages}, rows={self.recorder.rows})"
        )

    def annotate(self, *, model: Any = None, sampling: Any = None, **extra: Any) -> None:
        """Add facts to the run's metadata: the model's name, sampling parameters, anything JSON-ready."""
        if model is not None:
            self._shared.model = model if isinstance(model, str) else getattr(
                getattr(model, "config", None), "_name_or_path", type(model).__name__
            )
        if sampling is not None:
            self._shared.sampling = sampling.to_dict() if hasattr(sampling, "to_dict") else sampling
            self._shared.sampling_from_user = True
        self._shared.extra.update(extra)

    def add_stage(self, stage: str) -> None:
        """Record a further stage (e.g. ``"sampled"``) through :meth:`record_stage`."""
        if not isinstance(stage, str) or not stage.isidentifier():
            raise ValueError(f"stage must be an identifier-like name, got {stage!r}")
        self.recorder.add_stage(stage)

    # ---------------------------------------------------------------- the processor protocol

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """The transformers convention: ``(input_ids [B, L], scores [B, V]) -> scores``.

        The first call of a generation marks the prompt; a call that is not
        the next step of this thread's last one (see the module docstring)
        resets the tracker and the wrapped processor and starts a new
        generation. Reads no device value.
        """
        if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
            shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise ValueError(f"input_ids must be a 2-D [batch, length] tensor, got {shape}")
        host = self._host()
        if host.last_ids is not None and not _continues(input_ids, host.last_ids):
            self.reset()
            host = self._host()
        if host.last_ids is None:
            host.prompt_length = int(input_ids.shape[1])
        host.last_ids = input_ids
        return self.process(scores, BatchContext(input_ids=input_ids, prompt_length=host.prompt_length))

    def process(self, logits: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
        """Record ``logits [B, V]``, call the wrapped processor, record and return its output."""
        if not isinstance(logits, torch.Tensor):
            raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
        if logits.ndim != 2:
            raise ValueError(f"logits must be 2-D [batch, vocab], got shape {tuple(logits.shape)}")
        if not logits.is_floating_point():
            raise TypeError(f"logits must be floating point, got {logits.dtype}")
        batch = int(logits.shape[0])
        if ctx.input_ids.shape[0] != batch:
            raise ValueError(f"logits has {batch} rows but input_ids has {ctx.batch_size}")
        shared = self._shared
        recorder = shared.recorder
        step = ctx.num_generated
        with shared.lock:
            gen = self._generation_for(ctx, batch, step)
            if gen.last_rows is not None and not gen.chosen_known and step == gen.last_step + 1:
                last = ctx.input_ids[:, -1]
                _check_chosen(last, int(logits.shape[1]), f"input_ids (generation {gen.id}, step {gen.last_step})")
                recorder.set_chosen(gen.last_rows, last)
            rows = recorder.begin_step(gen.id, step, batch, int(logits.shape[1]), logits.device)
            gen.last_rows, gen.last_step, gen.chosen_known = rows, step, False
            recorder.write(rows, "natural", logits)
        processor = self.processor
        if processor is None:
            return logits
        natural = logits.clone() if processor.inplace else logits  # the chosen token's statistics read it later
        try:
            if len(self._stage_names) > 1:
                names = self._stage_names
                out = apply_recording(processor, logits, ctx,  # type: ignore[arg-type]
                                      lambda i, x: recorder.write(rows, names[i], x, natural=natural))
            else:
                out = check_logits(processor.name, processor.process(logits, ctx), logits)
        except Exception as exc:
            recorder.mark_error(rows)
            where = f"(the tracker recorded generation {gen.id}, step {step} with processor_error=True)"
            if isinstance(exc, ProcessorError):
                raise ProcessorError(f"{exc} {where}") from exc
            raise ProcessorError(f"processor {processor.name} raised {type(exc).__name__}: {exc} {where}") from exc
        recorder.write(rows, "constrained", out, natural=natural)
        return out

    def on_generation_start(self, sampling: Sequence[Mapping[str, Any]]) -> None:
        """Keep how each row of the coming generation is sampled (logitscope's Generator tells).

        Each generation's metadata gets the per-row parameters (seeds
        included, so a run can be replayed); the run's ``sampling`` becomes a
        summary (one dict, or one per request) unless :meth:`annotate` set it.
        """
        rows = [dict(r) for r in sampling]
        shared = self._shared
        with shared.lock:
            shared.pending_sampling = rows
            if not shared.sampling_from_user:
                shared.sampling = _summarise_sampling(rows)
        if self.processor is not None:
            self.processor.on_generation_start(sampling)

    @property
    def wants_prefill_logits(self) -> bool:  # type: ignore[override]
        return self._records_prompt or (self.processor is not None and self.processor.wants_prefill_logits)

    def on_prefill(self, logits: torch.Tensor, ctx: BatchContext) -> None:
        """Keep the prompt's log-probabilities for the coming generation (see :mod:`tracker.prompt`)."""
        if self._records_prompt:
            self._shared.pending_prompt = prompt_logprobs(logits, ctx.input_ids, ctx.attention_mask)
        if self.processor is not None and self.processor.wants_prefill_logits:
            self.processor.on_prefill(logits, ctx)

    def score_prompt(self, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> None:
        """Score the prompts of the next generation with one forward pass (for ``model.generate``)."""
        self._shared.pending_prompt = score_prompt(model, input_ids, attention_mask)

    def on_sampled(self, tokens: torch.Tensor, ctx: BatchContext) -> None:
        """Record the tokens chosen at this step (hosts such as logitscope's Generator call it).

        Ids outside ``[0, vocab)`` are refused (ValueError naming the row);
        tokens on the CPU are checked here, tokens on an accelerator when the
        run is built, so this reads no device value.
        """
        gen = self._current()
        if gen is not None and gen.last_rows is not None:
            _check_chosen(tokens, self.recorder.vocab_size or 0, f"on_sampled (generation {gen.id}, step {gen.last_step})")
            self.recorder.set_chosen(gen.last_rows, tokens)
            gen.chosen_known = True
        if self.processor is not None:
            self.processor.on_sampled(tokens, ctx)

    def reset(self) -> None:
        """End the generation in progress and reset the wrapped processor."""
        self._end_generation()
        if self.processor is not None:
            self.processor.reset()

    def record_stage(self, stage: str, values: torch.Tensor, kind: StageKind = "logits") -> None:
        """Record ``values [B, V]`` as ``stage`` for the current step (a sampling tap calls this).

        ``kind`` says what the values are: logits, log-probabilities, or
        probabilities (stored as their logarithm, so zeros become ``-inf``).
        """
        if kind not in ("logits", "logprobs", "probs"):
            raise ValueError(f"kind must be 'logits', 'logprobs' or 'probs', got {kind!r}")
        if stage not in self.recorder.stages:
            raise ValueError(f"stage {stage!r} is not recorded; call add_stage({stage!r}) before the generation")
        gen = self._current()
        if gen is None or gen.last_rows is None:
            raise RuntimeError(f"record_stage({stage!r}): no step in progress; call it after process() of the step")
        if kind == "probs":
            values = torch.log(values.float())
        self.recorder.write(gen.last_rows, stage, values)

    def sample_tap(self, values: Any, *args: Any, **kwargs: Any) -> None:
        """Observer for sampling taps: records the distribution sampled from as the ``"sampled"`` stage.

        Takes what logitscope's sampling hands its taps: float32 probabilities
        ``[B, V]`` (``Generator.sample_taps``), or a tagged tensor from a
        ``LogitsPipe`` tap (probabilities or logits, as its tag says).
        """
        kind: StageKind = "probs"
        if not isinstance(values, torch.Tensor) and hasattr(values, "data"):
            tag = getattr(getattr(values, "type", None), "value", "probs")
            kind = "logits" if tag == "logits" else "probs"
            values = values.data
        self.record_stage("sampled", values, kind)

    # ---------------------------------------------------------------- chosen tokens for transformers-style hosts

    def stopping_criteria(self) -> Any:
        """A transformers ``StoppingCriteria`` that never stops and tells the tracker each step's token.

        Pass it as ``model.generate(..., stopping_criteria=StoppingCriteriaList([tracker.stopping_criteria()]))``
        so that the last step's token is recorded without calling :meth:`finish`.
        """
        from transformers import StoppingCriteria

        tracker = self

        class TrackerChosenTokens(StoppingCriteria):
            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
                tracker._observe_sequences(input_ids)
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        return TrackerChosenTokens()

    def finish(self, output: Any = None) -> Run:
        """End the generation in progress; with the host's output, record the last step's tokens.

        ``output`` is what the tracked generation returned: a ``[B, L]``
        tensor of sequences (prompt and generated tokens), an object with
        ``.sequences`` (transformers' ``generate`` with
        ``return_dict_in_generate=True``), or logitscope's list of
        ``RequestOutput``. Returns the recorded run.
        """
        gen = self._current()
        if output is not None:
            if gen is None or gen.last_rows is None:
                raise ValueError("finish(output): no generation in progress; call it right after the tracked generate()")
            tokens = self._last_tokens(output, gen)
            if isinstance(tokens, torch.Tensor):
                _check_chosen(tokens, self.recorder.vocab_size or 0, f"finish(output) (generation {gen.id}, step {gen.last_step})")
            self.recorder.set_chosen(gen.last_rows, tokens)
            gen.chosen_known = True
        self._end_generation()
        self._forget_host()
        return self.run

    def _last_tokens(self, output: Any, gen: _Generation) -> torch.Tensor | list[int]:
        if isinstance(output, (list, tuple)) and output and hasattr(output[0], "outputs"):
            rows = [c.token_ids for request in output for c in request.outputs]
            if len(rows) != gen.batch:
                raise ValueError(f"output holds {len(rows)} completions, the tracked batch had {gen.batch} rows")
            return [int(r[gen.last_step]) if len(r) > gen.last_step else -1 for r in rows]
        if getattr(output, "beam_indices", None) is not None:
            raise ValueError(f"finish(output): {_BEAMS}")
        sequences = getattr(output, "sequences", output)
        if isinstance(sequences, np.ndarray):
            sequences = torch.from_numpy(sequences)
        if not isinstance(sequences, torch.Tensor) or sequences.ndim != 2:
            raise TypeError(
                "output must be a [batch, length] tensor of sequences, an object with .sequences, "
                f"or a list of RequestOutput; got {type(output).__name__}"
            )
        column = gen.prompt_length + gen.last_step
        if sequences.shape[0] != gen.batch or sequences.shape[1] <= column:
            raise ValueError(
                f"output sequences have shape {tuple(sequences.shape)}, but the tracked generation has "
                f"{gen.batch} rows and its last step {gen.last_step} is column {column} (prompt length "
                f"{gen.prompt_length}); pass the output of the generate() call that was tracked"
                + (f" (if it ran with num_beams > 1: {_BEAMS})" if sequences.shape[0] < gen.batch else "")
            )
        return sequences[:, column]

    def _observe_sequences(self, input_ids: torch.Tensor) -> None:
        gen = self._current()
        if gen is None or gen.last_rows is None or gen.chosen_known:
            return
        if input_ids.shape[0] == gen.batch and input_ids.shape[1] == gen.prompt_length + gen.last_step + 1:
            last = input_ids[:, -1]
            _check_chosen(last, self.recorder.vocab_size or 0, f"stopping_criteria (generation {gen.id}, step {gen.last_step})")
            self.recorder.set_chosen(gen.last_rows, last)
            gen.chosen_known = True

    # ---------------------------------------------------------------- generations

    def _current(self) -> _Generation | None:
        gen = self._gen
        if gen is not None and gen.epoch != self._shared.epoch:
            self._gen = gen = None  # clear() was called (maybe on a copy sharing this recording)
        return gen

    def _generation_for(self, ctx: BatchContext, batch: int, step: int) -> _Generation:
        """This thread's generation for a step: the one in progress if the step follows on, else a new one."""
        gen = self._current()
        if gen is not None and step == gen.last_step + 1 and batch == gen.batch:
            return gen
        self._end_generation()
        shared = self._shared
        gid = shared.next_generation
        shared.next_generation += 1
        prompts = ctx.input_ids[:, : ctx.prompt_length]
        if ctx.attention_mask is not None:
            keep = ctx.attention_mask[:, : ctx.prompt_length].bool().cpu()
            prompt_ids = [row[mask].tolist() for row, mask in zip(prompts.cpu(), keep)]
        else:
            prompt_ids = _strip_left_padding(prompts, self.pad_token_id)
        record: dict[str, Any] = {"generation": gid, "batch_size": batch, "prompt_ids": prompt_ids, "started_at": _now()}
        if shared.pending_sampling is not None and len(shared.pending_sampling) == batch:
            record["sampling"] = shared.pending_sampling
        shared.pending_sampling = None
        if shared.pending_prompt is not None and len(shared.pending_prompt) == batch:
            record["prompt_logprobs"] = shared.pending_prompt
        shared.pending_prompt = None
        shared.generations.append(record)
        self._gen = _Generation(gid, batch, ctx.prompt_length, shared.epoch)
        return self._gen

    def _end_generation(self) -> None:
        gen = self._current()
        if gen is not None:
            self.recorder.end_generation(gen.id)
        self._gen = None

    def clear(self) -> None:
        """Forget everything recorded: rows, generations, spill files; the next call starts a new run."""
        shared = self._shared
        with shared.lock:
            shared.recorder.clear()
            shared.generations.clear()
            shared.next_generation = 0
            shared.epoch += 1
            shared.run_cache = None
            shared.run_id = _new_run_id()
            shared.created_at = _now()
            shared.recorder.run_id = shared.run_id
        self._gen = None
        self._forget_host()
        if self.processor is not None:
            self.processor.reset()

    def __deepcopy__(self, memo: dict[int, Any]) -> "LogitTrackingProcessor":
        """A copy that shares this tracker's recording, with its own copy of the wrapped processor."""
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone.__dict__.pop("_host_boundary", None)
        clone.processor = copy.deepcopy(self.processor, memo)
        clone._local = threading.local()
        return clone

    # ---------------------------------------------------------------- the run

    @property
    def run(self) -> Run:
        """The recorded run so far (rebuilt only when something new was recorded)."""
        shared = self._shared
        with shared.lock:
            key = (shared.epoch, shared.recorder.version, len(shared.generations), shared.model, str(shared.sampling),
                   tuple(shared.extra.items()).__repr__())
            if shared.run_cache is not None and shared.run_cache[0] == key:
                return shared.run_cache[1]
            batches = shared.recorder.batches()
            _check_recorded_chosen(batches, shared.recorder.vocab_size or 0)
            run = Run(batches, shared.metadata(), _vocabulary_source(shared))
            shared.run_cache = (key, run)
            return run

    def to_arrow(self):
        """The recorded run as an Arrow table (zero-copy; see :meth:`tracker.Run.to_arrow`)."""
        return self.run.to_arrow()

    def to_parquet(self, path: Any, **kwargs: Any) -> Path:
        """Write the recorded run to one Parquet file, atomically (see :meth:`tracker.Run.to_parquet`)."""
        return self.run.to_parquet(path, **kwargs)

    def to_dataset(self, root: Any, **kwargs: Any) -> Path:
        """Write the recorded run under ``root/run_id=<id>/`` (see :meth:`tracker.Run.to_dataset`)."""
        return self.run.to_dataset(root, **kwargs)

    get_top_tokens = _delegate(Analysis.get_top_tokens)
    to_dataframe = _delegate(Analysis.to_dataframe)
    sequence = _delegate(Analysis.sequence)
    get_logits = _delegate(Analysis.get_logits)
    get_probabilities = _delegate(Analysis.get_probabilities)
    stats = _delegate(Analysis.stats)
    continuation_probability = _delegate(Analysis.continuation_probability)
    generations = _delegate(Analysis.generations)
    sequences = _delegate(Analysis.sequences)
    why = _delegate(Insight.why)
    diff = _delegate(Insight.diff)
    perplexity = _delegate(Insight.perplexity)
    view = _delegate(Insight.view)
    step = _delegate(Insight.step)
    show = _delegate(Insight.show)
    _repr_html_ = _delegate(Insight._repr_html_)

