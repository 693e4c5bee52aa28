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
gives the same generations, except for a call on the last call's output
(``generate(out)``), which is the next step and extends the last generation
unless :meth:`finish` came between. Rows that change order between steps
(beam search) are refused: on the CPU at that step, on an accelerator by
:meth:`finish`, which reads a flag kept on the device (without it, the next
generation's first step warns, reading the flag once). A row's recorded prompt leaves out its left
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
Those adapters copy the processor per request: copies made with
``copy.deepcopy`` share this tracker's recording (each records its own
generations) and deep-copy the wrapped processor.

The tracker is a composition: recording (:mod:`tracker.recording.recorder`), the
hosts' quirks (:mod:`tracker.recording.hosts`), the run's description and generations
(:mod:`tracker.recording.run_metadata`) and queries on the recorded run
(:mod:`tracker.recording.queries`).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from processors import BatchContext, LogitsProcessor, ProcessorError, as_processor
from processors.protocol import check_logits
from processors.vocab import eos_token_ids
from tracker.format.fs import is_url
from tracker.format.layout import folder_arg
from tracker.reading.prompt import leading_pad_mask, prompt_logprobs, prompt_rows, score_prompt
from tracker.reading.run import Run
from tracker.recording.hosts import TransformersHost, check_chosen, check_tracker_arguments, find_tokenizer
from tracker.recording.processor_stages import apply_recording, per_processor
from tracker.recording.queries import RunQueries
from tracker.recording.recorder import Recorder, Storage
from tracker.recording.run_metadata import (
    Generation,
    SharedRecording,
    check_pad_token_id,
    model_name,
    new_run_id,
    now,
)

__all__ = ["LogitTrackingProcessor", "find_tokenizer"]

StageKind = Literal["logits", "logprobs", "probs"]


class LogitTrackingProcessor(TransformersHost, RunQueries, LogitsProcessor):
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
        top_k: values kept per row with ``storage="topk"`` (or when ``"auto"`` chooses it); the
            other modes keep the whole row, which holds every top ``k``, and do not use it.
        memory_limit: bytes of host memory for recorded rows: the rows kept,
            chunks on their way to disk and the buffers kept for the next
            chunk; past it, finished chunks spill to Arrow IPC files in
            ``spill_dir``. Chunks are sized to fit (at most a sixth of the
            bound, but at least 1 MiB and one step of the batch: a smaller
            bound is exceeded by up to six such chunks). Not in it: the
            step's own temporaries (the host's and the processor's copies of
            the logits), on CUDA the pinned staging ring (3 chunks), and the
            C heap's free pages, which glibc keeps until the heap is trimmed
            (done as chunks spill; other C libraries keep them). Measured at
            32-512 MiB (float32, 32k-128k tokens, batch 1-8): resident memory
            peaked at 0.4-0.9 times the bound above the process's baseline.
            ``None``: no bound.
        spill_dir: where spilled chunks go (``spill_dir/<run_id>/``, readable
            with ``Run.load`` even if the process dies); by default a
            temporary folder removed with the tracker.
        chunk_bytes: rows are kept in chunks of about this size (smaller under
            a small ``memory_limit``, see there).
        eos_token_id: end-of-sequence id(s); by default the tokenizer's.
        model: the model or its name, for the run's metadata.
        processor_stages: with a ``ProcessorList`` of two or more, record the
            logits after each processor as its own stage (``after:<name>``;
            see :mod:`tracker.recording.processor_stages`). Off by default: each extra stage costs
            a row per step (``4 V`` bytes in float32).
        prompt_logprobs: record each prompt's per-token log-probabilities
            from the prefill logits (hosts that call ``on_prefill``, such as
            logitscope's Generator; else :meth:`score_prompt`).
        pad_token_id: the id a host pads prompts with on the left; without an
            attention mask from the host, a row's leading run of it is left
            out of its recorded prompt. By default the tokenizer's, else the
            model's ``generation_config.pad_token_id`` (with ``add_tracking``),
            read when each generation starts.
        statistics: when each row's statistics (entropy, the chosen token's
            probability and rank, removed mass, margin, EOS probability) are
            computed: ``"record"`` as rows are recorded (on their device, no
            synchronisation), ``"read"`` when a query needs them (float32
            storage only; other modes record them, as only the full row gives
            them exactly), ``"auto"``: when recorded, except for float32 rows on a
            CPU, which keep the whole row exactly: there they are computed when
            the rows are first read or written, a chunk of rows at once (the
            same values; as rows are recorded the passes over every row would
            cost more than the step's copy). float16, bfloat16 and top-k rows
            are converted or selected, and summed up, as they are recorded.
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
        check_tracker_arguments(processor, tokenizer, memory_limit, chunk_bytes, processor_stages, prompt_logprobs)
        if spill_dir is not None:
            if is_url(spill_dir):
                raise ValueError(
                    f"spill_dir must be a local folder, got the URL {spill_dir!r}: spilled chunks are Arrow files "
                    "memory-mapped and read back in place, which an object store cannot do; write the run to a "
                    "URL with to_dataset() or stream_to() instead"
                )
            folder_arg("spill_dir", spill_dir)
        self._stage_names: list[str] = []
        if processor_stages and processor is not None:
            processor, self._stage_names = per_processor(processor)
        self.processor: LogitsProcessor | None = None if processor is None else as_processor(processor)
        self._records_prompt = bool(prompt_logprobs)
        if tokenizer is None:
            tokenizer = find_tokenizer(processor, getattr(self.processor, "fn", None))
        parsed = Storage.parse(storage, top_k)
        stages = ["natural"] if self.processor is None else ["natural", *self._stage_names[:-1], "constrained"]
        run_id = new_run_id()
        recorder = Recorder(
            parsed,
            stages,
            chunk_bytes=chunk_bytes,
            memory_limit=memory_limit,
            spill_dir=spill_dir,
            run_id=run_id,
            statistics=statistics,
        )
        self._shared = SharedRecording(
            recorder=recorder,
            storage=parsed,
            tokenizer=tokenizer,
            eos_token_ids=list(eos_token_ids(tokenizer, eos_token_id)),
            model=model_name(model),
            processors=None if self.processor is None else repr(self.processor),
            run_id=run_id,
            created_at=now(),
            stage_aliases={self._stage_names[-1]: "constrained"} if self._stage_names else {},
        )
        self._pad_token_id = check_pad_token_id(pad_token_id)  # None: looked up at each generation's start
        self.pad_model: Any = None  # its generation_config's pad id, for a tokenizer without one (add_tracking)
        self._local = threading.local()

    @property
    def pad_token_id(self) -> int | None:
        """The pad id, read as a generation starts (one set later counts): the one given, else the tokenizer's,
        else ``pad_model.generation_config``'s, as logitscope's Generator pads; a negative one means none."""
        if self._pad_token_id is not None:
            return self._pad_token_id
        config = getattr(self.pad_model, "generation_config", None)
        for pad in (getattr(self.tokenizer, "pad_token_id", None), getattr(config, "pad_token_id", None)):
            if isinstance(pad, int) and not isinstance(pad, bool) and pad >= 0:
                return pad
        return None

    @pad_token_id.setter
    def pad_token_id(self, value: int | None) -> None:
        self._pad_token_id = check_pad_token_id(value)

    # ---------------------------------------------------------------- properties

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
        self._shared.annotate(model, sampling, extra)

    def add_stage(self, stage: str) -> None:
        """Record a further stage (e.g. ``"sampled"``) through :meth:`record_stage`."""
        if not isinstance(stage, str) or not stage.isidentifier():
            raise ValueError(f"stage must be an identifier-like name, got {stage!r}")
        self.recorder.add_stage(stage)

    # ---------------------------------------------------------------- the processor protocol

    def process(self, logits: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
        """Record ``logits [B, V]``, call the wrapped processor, record and return its output.

        Runs every step. Reads no device value (does not synchronise): the
        rows are copied with ``non_blocking`` copies (see :mod:`tracker.recording.recorder`).
        """
        if not isinstance(logits, torch.Tensor):
            raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
        if logits.ndim != 2 or 0 in logits.shape:
            raise ValueError(
                f"logits must be 2-D [batch, vocab] with batch >= 1 and vocab >= 1, got shape {tuple(logits.shape)}"
            )
        if not logits.is_floating_point():
            raise TypeError(f"logits must be floating point, got {logits.dtype}")
        batch = int(logits.shape[0])
        if ctx.input_ids.shape[0] != batch:
            raise ValueError(f"logits has {batch} rows but input_ids has {ctx.batch_size}")
        recorder = self.recorder
        step = ctx.num_generated
        with self._shared.lock:
            gen = self._generation_for(ctx, batch, step)
            self._chosen_from_input(gen, ctx, int(logits.shape[1]), step)
            rows = recorder.begin_step(gen.id, step, batch, int(logits.shape[1]), logits.device)
            gen.last_rows, gen.last_step, gen.chosen_known = rows, step, False
            recorder.write(rows, "natural", logits)
        processor = self.processor
        if processor is None:
            return logits
        # an in-place processor works on a copy: the host's tensor (transformers keeps it as the raw logits
        # of output_logits) stays as the model gave it, and the natural rows stay readable for the statistics
        natural = logits
        work = logits.clone() if processor.inplace else logits
        try:
            if len(self._stage_names) > 1:
                names = self._stage_names
                out = apply_recording(
                    processor,
                    work,
                    ctx,  # type: ignore[arg-type]
                    lambda i, x: recorder.write(rows, names[i], x, natural=natural),
                )
            else:
                out = check_logits(processor.name, processor.process(work, ctx), work)
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
        self._shared.expect_sampling([dict(r) for r in sampling])
        if self.processor is not None:
            self.processor.on_generation_start(sampling)

    def on_generation_end(self, lengths: Sequence[int]) -> None:
        """Keep how many tokens each row of the generation produced: queries end each sequence there
        (unless ``include_finished``), so the padding a host fed a row that stopped early is not shown.
        Then raises, once, a disk's refusal of a spilled chunk during the generation (rows kept in memory)."""
        self._shared.note_lengths([int(n) for n in lengths])
        if self.processor is not None:
            self.processor.on_generation_end(lengths)
        self.recorder.raise_failure()

    @property
    def wants_prefill_logits(self) -> bool:  # type: ignore[override]
        return self._records_prompt or (self.processor is not None and self.processor.wants_prefill_logits)

    def on_prefill(self, logits: torch.Tensor, ctx: BatchContext) -> None:
        """Keep the prompt's log-probabilities for the coming generation (see :mod:`tracker.reading.prompt`)."""
        if self._records_prompt:
            scores = prompt_logprobs(logits, ctx.input_ids, ctx.attention_mask)
            self._shared.pending_prompt = (prompt_rows(ctx.input_ids, ctx.attention_mask), scores)
        if self.processor is not None and self.processor.wants_prefill_logits:
            self.processor.on_prefill(logits, ctx)

    def score_prompt(
        self,
        model: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        generation: int | None = None,
    ) -> None:
        """Score prompts with one forward pass (for ``model.generate``, which gives the tracker no prefill).

        Pass the ``input_ids`` and ``attention_mask`` given to ``generate``
        (without a mask, each row's leading run of the pad id is its padding,
        as the tracker reads the prompts). By default the scores go to the next
        generation (call it before ``generate``): they are kept only if its
        prompts are these (each may be repeated, as ``num_return_sequences``
        does), else a warning says so. ``generation=`` gives them to one
        already recorded (``-1``: the latest), ValueError if its prompts differ.
        """
        if attention_mask is None:
            attention_mask = leading_pad_mask(input_ids, self.pad_token_id)
        scored = (prompt_rows(input_ids, attention_mask), score_prompt(model, input_ids, attention_mask))
        if generation is None:
            self._shared.pending_prompt = scored
        else:
            self._shared.attach_prompt_logprobs(self.run._generation_id(generation), scored)

    def on_sampled(self, tokens: torch.Tensor, ctx: BatchContext) -> None:
        """Record the tokens chosen at this step (hosts such as logitscope's Generator call it).

        Ids outside ``[0, vocab)`` are refused (ValueError naming the row);
        tokens on the CPU are checked here, tokens on an accelerator when the
        run is built. Runs every step; reads no device value (does not synchronise).
        """
        gen = self._current()
        if gen is not None and gen.last_rows is not None:
            vocab = self.recorder.vocab_size or 0
            check_chosen(tokens, vocab, f"on_sampled (generation {gen.id}, step {gen.last_step})")
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
        Runs every step a tap fires; does not synchronise with the device.
        """
        if kind not in ("logits", "logprobs", "probs"):
            raise ValueError(f"kind must be 'logits', 'logprobs' or 'probs', got {kind!r}")
        if stage not in self.recorder.stages:
            raise ValueError(f"stage {stage!r} is not recorded; call add_stage({stage!r}) before the generation")
        gen = self._current()
        if gen is None or gen.last_rows is None:
            raise RuntimeError(f"record_stage({stage!r}): no step in progress; call it after process() of the step")
        owned = kind == "probs"  # the tracker's own tensor: nobody can write into it before the token comes
        if owned:
            values = torch.log(values.float())
        self.recorder.write(gen.last_rows, stage, values, owned=owned)

    def sample_tap(self, values: Any, *args: Any, **kwargs: Any) -> None:
        """Observer for sampling taps: records the distribution sampled from as the ``"sampled"`` stage.

        Takes what logitscope's sampling hands its taps: float32 probabilities
        ``[B, V]`` (``Generator.sample_taps``), or a tagged tensor from a
        ``LogitsPipe`` tap (probabilities or logits, as its tag says). Runs
        every step; does not synchronise with the device.
        """
        kind: StageKind = "probs"
        if not isinstance(values, torch.Tensor) and hasattr(values, "data"):
            tag = getattr(getattr(values, "type", None), "value", "probs")
            kind = "logits" if tag == "logits" else "probs"
            values = values.data
        self.record_stage("sampled", values, kind)

    # ---------------------------------------------------------------- generations (per thread)

    def _current(self) -> Generation | None:
        """This thread's generation in progress (None after clear(), maybe called on a copy)."""
        gen = getattr(self._local, "gen", None)
        if gen is not None and gen.epoch != self._shared.epoch:
            self._local.gen = gen = None
        return gen

    def _generation_for(self, ctx: BatchContext, batch: int, step: int) -> Generation:
        """This thread's generation for a step: the one in progress if the step follows on, else a new one."""
        gen = self._current()
        if gen is not None and step == gen.last_step + 1 and batch == gen.batch:
            return gen
        self._end_generation()
        self._local.gen = gen = self._shared.open_generation(ctx, batch, self.pad_token_id)
        return gen

    def _end_generation(self) -> None:
        gen = self._current()
        if gen is not None:
            self.recorder.end_generation(gen.id)
        self._local.gen = None

    def clear(self) -> None:
        """Forget everything recorded: rows, generations, spill files; the next call starts a new run."""
        self._shared.restart()
        self._local.gen = None
        self._forget_host()
        if self.processor is not None:
            self.processor.reset()

    def __deepcopy__(self, memo: dict[int, Any]) -> LogitTrackingProcessor:
        """A copy that shares this tracker's recording, with its own copy of the wrapped processor."""
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone.processor = copy.deepcopy(self.processor, memo)
        clone._local = threading.local()
        return clone

    @property
    def run(self) -> Run:
        """The recorded run so far (rebuilt only when something new was recorded)."""
        return self._shared.run()
