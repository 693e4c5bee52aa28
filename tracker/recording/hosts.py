"""Where each host's quirks live: how the tracker learns prompts, steps and chosen tokens from its host.

- transformers' ``model.generate`` and Outlines 1.x call a processor as
  ``(input_ids [B, L], scores [B, V]) -> scores`` and never say which token
  was chosen: :class:`TransformersHost` marks the prompt at a generation's
  first call, starts a new generation when the input is not the next step of
  the last one, reads each step's token from the next call's ``input_ids``,
  and the last step's from :meth:`~TransformersHost.stopping_criteria` or
  from the output given to :meth:`~TransformersHost.finish`. Outlines'
  tokenizer wrappers are unwrapped by :func:`find_tokenizer`.
- logitscope's ``Generator`` says everything itself (``on_generation_start``,
  ``on_prefill``, ``on_sampled``, sampling taps): see
  :class:`~tracker.LogitTrackingProcessor`.
- A vLLM V1 engine takes the batch-level processor of
  :mod:`tracker.recording.engines.vllm`, which follows the engine's persistent batch.
- The per-request conventions (vLLM's ``AdapterLogitsProcessor`` form,
  Dynamo, TensorRT-LLM) reach the tracker through
  ``processors.to_vllm/to_dynamo/to_trtllm(tracker)``; those adapters copy
  the processor per request, and such copies share the tracker's recording
  (``LogitTrackingProcessor.__deepcopy__``).
"""

from __future__ import annotations

import functools
import numbers
import os
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from processors import BatchContext
from processors.protocol import continues, free_to_read
from processors.vocab import hf_tokenizer
from tracker.reading.run import Run
from tracker.recording.recorder import Recorder
from tracker.recording.run_metadata import Generation

__all__ = ["BEAMS", "HostState", "TransformersHost", "check_chosen", "check_tracker_arguments", "find_tokenizer"]
__all__ += ["host_ids", "ids_continue", "ids_in_range"]

BEAMS = (
    "beam search (num_beams > 1) is not tracked: the tracker records rows by position and beam search reorders "
    "its beams at every step, so the recorded rows are not sequences. Track greedy or sampled generation "
    "(num_beams=1); for several candidates per prompt use do_sample=True with num_return_sequences"
)


_REORDERED = (
    "a step's input did not extend the last step's rows (compared on the device): either the rows changed "
    "order, or a new generate() call one column longer than the last came without finish() between; the "
    "generation's rows are not sequences."
)


HOST_IDS = (torch.int64, torch.int32)  # id tensors read as they are (a numpy view)
_FEW = 64  # up to this many ids are compared in Python, cheaper than numpy's reductions


def host_ids(ids: torch.Tensor) -> np.ndarray | None:
    """A numpy view of ``ids`` when it is an int64 or int32 tensor whose values are free to read (on the CPU:
    :func:`~processors.protocol.free_to_read`), else None. Every step; does not synchronise."""
    if ids.dtype not in HOST_IDS or not free_to_read(ids):
        return None
    return ids.numpy()


def ids_continue(ids: np.ndarray, last: np.ndarray) -> bool:
    """Whether ``ids [B, L + 1]`` extends ``last [B, L]`` column for column (host arrays of one dtype):
    :func:`~processors.protocol.continues` on numpy views, a memcmp for one row. Every step; no synchronisation."""
    if ids.shape[0] != last.shape[0] or ids.shape[1] != last.shape[1] + 1 or ids.dtype != last.dtype:
        return False
    head = ids[:, :-1]
    if ids.shape[0] == 1:
        return head.tobytes() == last.tobytes()
    return bool((head == last).all())


def ids_in_range(values: np.ndarray, vocab_size: int) -> bool:
    """Whether every id of ``values`` (a host array) lies in ``[0, vocab_size)`` (``vocab_size <= 0``: no bound
    known yet). Every step; no synchronisation."""
    if vocab_size <= 0 or values.size == 0:
        return True
    if values.size <= _FEW:
        listed = values.ravel().tolist()
        return min(listed) >= 0 and max(listed) < vocab_size
    return bool(values.min() >= 0) and bool(values.max() < vocab_size)


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


def check_chosen(tokens: Any, vocab_size: int, where: str) -> None:
    """Refuse chosen ids outside ``[0, vocab_size)``, naming the row, the id and the range.

    Checks host values (a CPU tensor, a list); a tensor on an accelerator is
    not read here (that would synchronise every step) and is checked when the
    run is built. Runs every step; does not synchronise with the device.
    """
    if vocab_size <= 0:
        return
    if isinstance(tokens, torch.Tensor):
        if tokens.device.type != "cpu":
            return
        flat = tokens.detach().reshape(-1)
        values = (flat if flat.dtype in HOST_IDS else flat.to(torch.int64)).numpy()
    else:
        values = np.asarray(list(tokens), dtype=np.int64).reshape(-1)
    if ids_in_range(values, vocab_size):
        return
    bad = np.flatnonzero((values < 0) | (values >= vocab_size))
    if bad.size:
        row = int(bad[0])
        raise ValueError(
            f"{where}: chosen token of row {row} is {int(values[row])}, outside the vocabulary [0, {vocab_size})"
            + (f" ({bad.size} rows out of range)" if bad.size > 1 else "")
        )


@dataclass
class HostState:
    """What a transformers-style host showed this thread last: where its prompt ends, its last input.

    ``reordered``: on an accelerator, a device flag set when a step's rows did
    not extend the last step's rows in order (beam search); read once, by
    ``finish`` or by the first call of the next generation.
    """

    prompt_length: int = 0
    last_ids: torch.Tensor | None = None
    reordered: torch.Tensor | None = None
    last_host: np.ndarray | None = None  # a numpy view of last_ids, where it is a CPU tensor of ids


def reorders(input_ids: torch.Tensor, last: torch.Tensor) -> bool:
    """Whether ``input_ids`` is the step after ``last`` with its rows shuffled: every row extends *some* row
    of ``last`` (beam search keeps the best beams, in a new order). Host tensors only; reads every column,
    so call it only when :func:`~processors.protocol.continues` said no."""
    if input_ids.shape[0] != last.shape[0] or input_ids.shape[1] != last.shape[1] + 1:
        return False
    if not free_to_read(input_ids, last):
        return False
    same = (input_ids[:, None, :-1] == last[None, :, :]).all(dim=2)  # [new row, old row]
    return bool(same.any(dim=1).all())


def last_tokens(output: Any, gen: Generation, last_ids: torch.Tensor | None = None) -> torch.Tensor | list[int]:
    """The tokens chosen at ``gen``'s last step, read from what the host's generate returned.

    ``output``: a ``[B, L]`` tensor or array of sequences, an object with
    ``.sequences``, or a list of ``RequestOutput`` (logitscope's Generator).
    ``last_ids``: the last step's input; host sequences that do not extend it
    row by row (another generation's output, or beams sorted by score) are
    refused. Compared on the CPU only (elsewhere that would synchronise).
    """
    if isinstance(output, (list, tuple)) and output and hasattr(output[0], "outputs"):
        rows = [c.token_ids for request in output for c in request.outputs]
        if len(rows) != gen.batch:
            raise ValueError(f"output holds {len(rows)} completions, the tracked batch had {gen.batch} rows")
        return [int(r[gen.last_step]) if len(r) > gen.last_step else -1 for r in rows]
    if getattr(output, "beam_indices", None) is not None:
        raise ValueError(f"finish(output): {BEAMS}")
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
            + (f" (if it ran with num_beams > 1: {BEAMS})" if sequences.shape[0] < gen.batch else "")
        )
    if (
        last_ids is not None
        and free_to_read(sequences, last_ids)
        and tuple(last_ids.shape) == (gen.batch, column)
        and not torch.equal(sequences[:, :column].to(last_ids.dtype), last_ids)
    ):
        if reorders(sequences[:, : column + 1].to(last_ids.dtype), last_ids):
            raise ValueError(f"finish(output): the output's rows are the tracked rows in another order: {BEAMS}")
        raise ValueError(
            "finish(output): the output's sequences do not extend the input of the generation's last step "
            f"(generation {gen.id}, {gen.batch} rows, column {column}); pass the output of the generate() "
            "call that was tracked"
        )
    return sequences[:, column]


def _follows(input_ids: torch.Tensor, ids: np.ndarray | None, last_ids: torch.Tensor, last: np.ndarray | None) -> bool:
    """:func:`~processors.protocol.continues`, on numpy views where both inputs are host ids of one dtype (the
    common case: a memcmp instead of two torch operations). Every step; does not synchronise."""
    if ids is not None and last is not None and ids.dtype == last.dtype:
        return ids_continue(ids, last)
    return continues(input_ids, last_ids)


class TransformersHost:
    """The transformers convention of :class:`~tracker.LogitTrackingProcessor` (``model.generate``, Outlines).

    A mixin: besides the attributes below, the tracker gives it ``process``,
    ``reset``, ``run``, ``_current()`` (this thread's :class:`Generation`)
    and ``_end_generation()``.
    """

    recorder: Recorder
    _local: threading.local

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """The transformers convention: ``(input_ids [B, L], scores [B, V]) -> scores``.

        The first call of a generation marks the prompt; a call that is not
        the next step of this thread's last one (see :mod:`tracker.recording.processor`)
        resets the tracker and the wrapped processor and starts a new
        generation; a step whose rows extend the last step's in another
        order (beam search) is refused. Runs every step; reads no device
        value (does not synchronise): on an accelerator the reorder check is a
        device flag that :meth:`finish` reads, or the first call of the next
        generation (once per generation, with a warning).
        """
        if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
            shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise ValueError(f"input_ids must be a 2-D [batch, length] tensor, got {shape}")
        host = self._host()
        ids = host_ids(input_ids)  # a numpy view where the ids are free to read (on the CPU), else None
        if host.last_ids is not None and not _follows(input_ids, ids, host.last_ids, host.last_host):
            if reorders(input_ids, host.last_ids):
                raise ValueError(f"input_ids: the rows changed order between two steps: {BEAMS}")
            self._warn_if_reordered(host)
            self.reset()
            host = self._host()
        elif host.last_ids is not None and not free_to_read(input_ids, host.last_ids):
            # on an accelerator the columns are not read per step: a reorder is flagged there, read at finish
            moved = (input_ids[:, :-1] != host.last_ids).any()
            host.reordered = moved if host.reordered is None else host.reordered | moved
        if host.last_ids is None:
            host.prompt_length = int(input_ids.shape[1])
        host.last_ids, host.last_host = input_ids, ids
        return self.process(scores, BatchContext(input_ids=input_ids, prompt_length=host.prompt_length))

    def _chosen_from_input(self, gen: Generation, ctx: BatchContext, vocab_size: int, step: int) -> None:
        """At the step after ``gen``'s last, its chosen tokens are the input's last column (unless a host said).

        Runs every step; the column stays on its device (no synchronisation).
        """
        if gen.last_rows is not None and not gen.chosen_known and step == gen.last_step + 1:
            last = ctx.input_ids[:, -1]
            check_chosen(last, vocab_size, f"input_ids (generation {gen.id}, step {gen.last_step})")
            self.recorder.set_chosen(gen.last_rows, last)

    def stopping_criteria(self) -> Any:
        """A transformers ``StoppingCriteria`` that never stops and tells the tracker each step's token.

        Pass it as ``model.generate(..., stopping_criteria=StoppingCriteriaList([tracker.stopping_criteria()]))``
        so that the last step's token is recorded without calling :meth:`finish`.
        """
        return _chosen_tokens_class()(self)

    def finish(self, output: Any = None) -> Run:
        """End the generation in progress; with the host's output, record the last step's tokens.

        ``output`` is what the tracked generation returned: a ``[B, L]``
        tensor of sequences (prompt and generated tokens), an object with
        ``.sequences`` (transformers' ``generate`` with
        ``return_dict_in_generate=True``), or logitscope's list of
        ``RequestOutput``. Returns the recorded run.

        Refuses a generation whose rows changed order between steps (beam
        search): read here once on an accelerator (synchronises once), and
        an output whose sequences do not extend the last step's input.
        """
        gen = self._current()
        host = getattr(self._local, "host", None)
        if host is not None and host.reordered is not None and bool(host.reordered):
            self._end_generation()
            self._forget_host()
            raise ValueError(f"finish: {_REORDERED} {BEAMS}")
        if output is not None:
            if gen is None or gen.last_rows is None:
                raise ValueError(
                    "finish(output): no generation in progress; call it right after the tracked generate() "
                    "(behind to_vllm, to_dynamo or to_trtllm each request has its own copy: call the callable's "
                    "finish or the adapter's end_request instead)"
                )
            tokens = last_tokens(output, gen, None if host is None else host.last_ids)
            if isinstance(tokens, torch.Tensor):
                check_chosen(
                    tokens, self.recorder.vocab_size or 0, f"finish(output) (generation {gen.id}, step {gen.last_step})"
                )
            self.recorder.set_chosen(gen.last_rows, tokens)
            gen.chosen_known = True
        self._end_generation()
        self._forget_host()
        self.recorder.raise_failure()  # a chunk the disk refused during the generation, said once
        return self.run

    def _observe_sequences(self, input_ids: torch.Tensor) -> None:
        """The stopping criteria's view of a step: its last column is the token just chosen (no synchronisation)."""
        gen = self._current()
        if gen is None or gen.last_rows is None or gen.chosen_known:
            return
        if input_ids.shape[0] == gen.batch and input_ids.shape[1] == gen.prompt_length + gen.last_step + 1:
            last = input_ids[:, -1]
            check_chosen(
                last, self.recorder.vocab_size or 0, f"stopping_criteria (generation {gen.id}, step {gen.last_step})"
            )
            self.recorder.set_chosen(gen.last_rows, last)
            gen.chosen_known = True

    def _warn_if_reordered(self, host: HostState) -> None:
        """At a new generation, what :meth:`finish` would have refused of the last one, as a warning (on an
        accelerator: reads the device flag, once per generation, never per step)."""
        gen = self._current()
        if host.reordered is not None and bool(host.reordered):
            name = f"generation {gen.id}" if gen is not None else "the last generation"
            warnings.warn(f"{name}: {_REORDERED} {BEAMS}", RuntimeWarning, stacklevel=3)

    def _host(self) -> HostState:
        """What a transformers-style host showed this thread last."""
        host = getattr(self._local, "host", None)
        if host is None:
            host = self._local.host = HostState()
        return host

    def _forget_host(self) -> None:
        self._local.host = None


def check_tracker_arguments(
    processor: Any, tokenizer: Any, memory_limit: Any, chunk_bytes: Any, processor_stages: Any, prompt_logprobs: Any
) -> None:
    """Refuse, by name, constructor arguments of the wrong kind (each would fail later, far from here)."""
    if hasattr(processor, "convert_ids_to_tokens"):  # a tokenizer is callable, so it would pass as a processor
        raise TypeError(
            f"processor is a tokenizer ({type(processor).__name__}): pass it as tokenizer=, e.g. "
            "LogitTrackingProcessor(my_processor, tokenizer=tok) or LogitTrackingProcessor(None, tokenizer=tok)"
        )
    if isinstance(tokenizer, (str, bytes, os.PathLike)):
        raise TypeError(
            f"tokenizer must be a tokenizer object (e.g. AutoTokenizer.from_pretrained(path)), got {tokenizer!r}: "
            "logitscope does not load tokenizers by name"
        )
    for name, value, none_ok in (("memory_limit", memory_limit, True), ("chunk_bytes", chunk_bytes, False)):
        if not (value is None and none_ok) and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
            raise TypeError(f"{name} must be a number of bytes (an int{' or None' if none_ok else ''}), got {value!r}")
    for name, value in (("processor_stages", processor_stages), ("prompt_logprobs", prompt_logprobs)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")


@functools.cache
def _chosen_tokens_class() -> type:
    """The class of :meth:`TransformersHost.stopping_criteria`'s objects, made once (transformers imported then): a
    class made per call would hold its tracker in a closure inside a reference cycle, so a tracker dropped
    after ``generate`` would keep its chunks until the cyclic collector ran, and the next tracker would take
    fresh memory instead of reusing them (see ``docs/performance.md``)."""
    from transformers import StoppingCriteria

    class TrackerChosenTokens(StoppingCriteria):
        def __init__(self, tracker: Any) -> None:
            self.tracker = tracker

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            self.tracker._observe_sequences(input_ids)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return TrackerChosenTokens
