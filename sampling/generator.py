"""The decode loop over any transformers causal LM.

>>> gen = Generator(model, tokenizer)
>>> out = gen.generate(["2 + 2 = ", "Call "], SamplingParams(temperature=0.8, seed=1))
>>> out[0].text

Prompts of different lengths share a batch (left padding with an attention
mask, positions counted from each row's first real token), the model runs
with its KV cache, and each row is sampled with its own request's parameters.
The processors in ``generator.logits_processor`` (a
:class:`~processors.ProcessorList`) see every step; a wrapper such as a tracker
can be put around them by replacing that attribute.
"""

from __future__ import annotations

import inspect
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from processors import BatchContext, LogitsProcessor, ProcessorList
from processors.device import tensor_on
from processors.protocol import check_logits
from processors.vocab import decode_text, eos_token_ids, vocab_for
from sampling.decode_state import DeviceBatch, Prompt, Row, RowDraws, Stopping, prompt_list
from sampling.functional import sample
from sampling.outputs import Completion, RequestOutput
from sampling.params import SamplingParams
from sampling.pipe import TaggedTensor
from sampling.pipe.pipeline import dead_row_error
from sampling.step_copy import StepCopy

__all__ = ["Generator", "load_model", "load_tokenizer"]


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """Load only the tokenizer of the model in a local folder (fast: what checks a constraint before the
    model loads). Raises ``FileNotFoundError`` naming the path when it holds no model."""
    from transformers import AutoTokenizer

    folder = Path(path)
    if not folder.is_dir() or not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"model: no model folder at '{path}' (expected a local folder with config.json, "
            "as written by save_pretrained); logitscope never downloads models"
        )
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def load_model(path: str | os.PathLike[str], *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
    """Load a causal LM and its tokenizer from a local folder, never from the network.

    Raises ``FileNotFoundError`` naming the path when it holds no model.
    """
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(path)
    kwargs: dict[str, Any] = {"local_files_only": True}
    if dtype is not None:
        kwargs["dtype"] = dtype
    model = AutoModelForCausalLM.from_pretrained(Path(path), **kwargs).to(device).eval()
    return model, tokenizer


class Generator:
    """Generate from a transformers causal LM through logitscope's processors.

    Args:
        model: a transformers causal LM (``model(input_ids, attention_mask,
            position_ids, cache or past_key_values, use_cache=True)``).
        tokenizer: its tokenizer.
        logits_processor: processors applied to the next-token logits of every
            step, in order: logitscope processors, transformers processors, or
            functions of another convention wrapped with ``processors.from_*``.
    """

    def __init__(self, model: Any, tokenizer: Any, logits_processor: Any = None) -> None:
        if not callable(model):
            raise TypeError(f"model must be a transformers causal LM, got {type(model).__name__}")
        if not callable(tokenizer) or not callable(getattr(tokenizer, "decode", None)):
            raise TypeError(
                f"tokenizer must be a transformers tokenizer (callable on text, with decode), "
                f"got {type(tokenizer).__name__}"
            )
        self.model = model
        self.tokenizer = tokenizer
        if logits_processor is None:
            logits_processor = ProcessorList()
        elif not isinstance(logits_processor, LogitsProcessor):
            items = logits_processor if isinstance(logits_processor, (list, tuple)) else [logits_processor]
            logits_processor = ProcessorList(items)
        self.logits_processor: LogitsProcessor = logits_processor
        self.eos_token_ids = self._eos_ids()
        pad = getattr(tokenizer, "pad_token_id", None)
        if pad is None:
            pad = getattr(getattr(model, "generation_config", None), "pad_token_id", None)
        if pad is None:
            pad = self.eos_token_ids[0] if self.eos_token_ids else 0
        self.pad_token_id = int(pad)
        forward = inspect.signature(model.forward).parameters
        self._keeps_last_logits = "logits_to_keep" in forward
        # transformers 5.24 renamed past_key_values to cache (the old name goes in 5.40)
        self._cache_arg = "cache" if "cache" in forward else "past_key_values"
        # observers of the distribution each step samples from ([B, V] probabilities; see sampling.functional.sample)
        self.sample_taps: list = []
        # the sampling kernels: "auto" picks by device and batch size (the CPU algorithms on a CPU, the
        # sync-free ones elsewhere); "sort", "pivot" or "radix" force a sync-free one (see sampling.pipe.kernels)
        self.sampling_algorithm: str = "auto"

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        logits_processor: Any = None,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
    ) -> Generator:
        """A Generator over the model saved in the local folder ``path``."""
        model, tokenizer = load_model(path, device=device, dtype=dtype)
        return cls(model, tokenizer, logits_processor)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _eos_ids(self) -> list[int]:
        config = getattr(self.model, "generation_config", None)
        return list(eos_token_ids(self.tokenizer, generation_config=config))

    # ------------------------------------------------------------------ input

    def _encode(self, prompts: Sequence[Prompt]) -> list[list[int]]:
        encoded = []
        vocab = getattr(self.model.config, "vocab_size", None)
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                ids = list(self.tokenizer(prompt)["input_ids"])
            elif isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
                ids = list(prompt)
                bad = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
                if bad:
                    raise ValueError(f"prompts[{i}] holds token ids outside [0, {vocab}): {bad[:5]}")
            else:
                raise TypeError(f"prompts[{i}] must be a string or a list of token ids, got {type(prompt).__name__}")
            if not ids:
                raise ValueError(f"prompts[{i}] is empty: it has no tokens; give at least one token of text")
            encoded.append(ids)
        return encoded

    @staticmethod
    def _params_per_request(params: Any, n_requests: int, overrides: dict[str, Any]) -> list[SamplingParams]:
        if overrides:
            if params is not None:
                raise TypeError("give either params or keyword sampling parameters, not both")
            params = SamplingParams(**overrides)
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            return [params] * n_requests
        if not isinstance(params, (list, tuple)):
            raise TypeError(f"params must be a SamplingParams or a list of them, one per prompt; {_given(params)}")
        if len(params) != n_requests:
            raise ValueError(f"params must be one SamplingParams or one per prompt ({n_requests}), got {len(params)}")
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"params[{i}] must be a SamplingParams; {_given(p)}")
        return list(params)

    def _check_context(self, encoded: list[list[int]], per_request: list[SamplingParams]) -> None:
        """Refuse a request whose prompt and ``max_new_tokens`` exceed the model's context (when its config says)."""
        config = getattr(self.model, "config", None)
        for key in ("max_position_embeddings", "n_positions", "n_ctx"):
            limit = getattr(config, key, None)
            if isinstance(limit, int) and limit > 0:
                break
        else:
            return
        # rotary positions run past the trained length (worse text, no crash): a warning; learned ones cannot
        rotary = getattr(config, "rope_theta", None) is not None or getattr(config, "rope_scaling", None) is not None
        for i, (ids, params) in enumerate(zip(encoded, per_request)):
            if len(ids) + params.max_new_tokens > limit:
                fits = (
                    f"give max_new_tokens <= {limit - len(ids)} or a shorter prompt"
                    if len(ids) < limit
                    else f"shorten the prompt to at most {limit - 1} tokens"
                )
                message = (
                    f"prompts[{i}] has {len(ids)} tokens and max_new_tokens={params.max_new_tokens}: "
                    f"{len(ids) + params.max_new_tokens} in all, more than the model's context of {limit} tokens "
                    f"(config.{key}); {fits}"
                )
                if not rotary:
                    raise ValueError(message)
                warnings.warn(message + " (its rotary positions go on, untrained)", stacklevel=4)
                return

    def _requests(self, prompts: Any, params: Any, sampling: dict[str, Any]):
        """The prompts as a list, their ids and each one's parameters, checked (no model call)."""
        prompts = prompt_list(prompts)
        encoded = self._encode(prompts)
        per_request = self._params_per_request(params, len(prompts), sampling)
        self._check_context(encoded, per_request)
        return prompts, encoded, per_request

    def check_inputs(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        **sampling: Any,
    ) -> None:
        """Raise the error :meth:`generate` would raise for these arguments, without running the model."""
        self._requests(prompts, params, sampling)

    # ------------------------------------------------------------------ decode

    def _forward(self, batch: DeviceBatch, cache: Any, prefill: BatchContext | None = None):
        """Queue the model on the batch's next input; the last position's float32 logits and the cache.

        ``prefill`` (the prompts' context) hears every position's logits first.
        No synchronisation of its own (see :meth:`_model_mask`).
        """
        kwargs: dict[str, Any] = {}
        if self._keeps_last_logits:
            kwargs["logits_to_keep"] = 0 if prefill is not None else 1
        out = self.model(
            input_ids=batch.step_input,
            attention_mask=self._model_mask(batch.keep, batch.step_input.shape[1]),
            position_ids=batch.step_positions,
            use_cache=True,
            **{self._cache_arg: cache},
            **kwargs,
        )
        if prefill is not None:
            self.logits_processor.on_prefill(out.logits, prefill)
        return out.logits[:, -1, :].float(), getattr(out, self._cache_arg)

    def _model_mask(self, keep: torch.Tensor | None, new_columns: int) -> torch.Tensor | None:
        """The attention mask to give the model, in a form transformers uses without reading its values.

        ``keep`` is ``[B, L]`` bool, False on left padding (``None`` when no
        row is padded and the model has no pad id: then it gets no mask and relies on causal
        attention). A 2-D mask makes transformers check on the host whether
        anything is padded (a synchronisation per step); a prepared 4-D mask
        ``[B, 1, new_columns, L]`` is used as it is. SDPA takes it as bool,
        eager attention as an additive float mask; other attention kernels get
        the 2-D mask.
        """
        if keep is None:
            return None
        implementation = getattr(self.model.config, "_attn_implementation", None)
        if implementation not in ("sdpa", "eager"):
            return keep.long()
        mask = keep[:, None, None, :]
        if new_columns > 1:  # the prompt: causal as well, and a padding row attends to itself (never empty)
            length = keep.shape[1]
            causal = torch.ones(length, length, dtype=torch.bool, device=keep.device).tril()
            own = torch.eye(length, dtype=torch.bool, device=keep.device)
            mask = (mask & causal[-new_columns:]) | own[-new_columns:]
        if implementation == "eager":
            dtype = self.model.dtype
            return torch.zeros(mask.shape, dtype=dtype, device=keep.device).masked_fill_(~mask, torch.finfo(dtype).min)
        return mask

    @torch.inference_mode()
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        **sampling: Any,
    ) -> list[RequestOutput]:
        """Generate for each prompt; returns one :class:`RequestOutput` per prompt.

        ``params`` is one :class:`SamplingParams` for all prompts or one per
        prompt; keyword arguments (``temperature=0.7, max_new_tokens=20``) build
        one instead. Prompts are strings or lists of token ids. Every argument is
        checked before the model runs (:meth:`check_inputs`): among others, a
        prompt whose length plus ``max_new_tokens`` exceeds the model's context
        (``max_position_embeddings``, ``n_positions`` or ``n_ctx`` of its
        config) is a ``ValueError``.

        Each decode step synchronises once: the chosen ids, log-probabilities
        and validity flags reach the host together (:class:`StepCopy`); every
        decision in between is taken from host-side state.
        """
        # the requests: prompts as ids, each with its parameters and one row per sample
        prompts, encoded, per_request = self._requests(prompts, params, sampling)
        rows = [Row(r, j, p) for r, p in enumerate(per_request) for j in range(p.n)]
        # the batch on the device, left-padded. No mask for the model when nothing is padded, unless it knows
        # a pad id: given no mask, transformers then looks for that id in the input (a device read per step).
        device = self.device
        batch = DeviceBatch.left_padded(
            [encoded[r.request] for r in rows],
            self.pad_token_id,
            device,
            mask_unpadded=getattr(self.model.config, "pad_token_id", None) is not None,
        )
        # each row's random stream, from its request's seed and its sample index
        seeds = self._seeds(per_request)
        draws = RowDraws.build(rows, seeds, device)
        # the loop, then the outputs
        self._start_processors(rows, seeds)
        self._decode(batch, rows, draws)
        self.logits_processor.on_generation_end([len(r.tokens) for r in rows])
        return self._outputs(prompts, encoded, per_request, rows)

    @staticmethod
    def _seeds(per_request: list[SamplingParams]) -> list[int]:
        """Each request's seed: its own, or a fresh random one."""
        return [p.seed if p.seed is not None else int(torch.randint(0, 2**62, ()).item()) for p in per_request]

    def _start_processors(self, rows: list[Row], seeds: list[int]) -> None:
        """Reset the processors and tell them how each row will be sampled."""
        self.logits_processor.reset()
        self.logits_processor.on_generation_start(
            [{**r.params.to_dict(), "seed": seeds[r.request], "request": r.request, "sample": r.sample} for r in rows]
        )

    def _decode(self, batch: DeviceBatch, rows: list[Row], draws: RowDraws) -> None:
        """The decode loop: fills each row's tokens, log-probabilities and finish reason.

        Synchronises once per step (:meth:`StepCopy.fetch`); the stopping
        rules and the book-keeping read only the host's copy of the step.
        """
        stopping = Stopping(rows, self.eos_token_ids, self.tokenizer)
        fed: list[list[int]] = [[] for _ in rows]  # the host's copy of input_ids[:, width:]
        copy = StepCopy(len(rows), batch.input_ids.device)
        live = list(range(len(rows)))
        finished: torch.Tensor | None = None  # rows that ended, fed padding from then on
        cache = None
        prefill = batch.prompt_context() if self.logits_processor.wants_prefill_logits else None
        for step in range(stopping.max_steps):
            # 1. the model's next-token logits (queued on the device; the host does not wait)
            raw, cache = self._forward(batch, cache, prefill if step == 0 else None)
            # 2. the processors, told the tokens so far from the host's copy
            ctx = batch.context(step, fed)
            logits = self._process(raw, ctx)
            # 3. one token per row, each with its request's parameters and random stream
            drawn, tokens, raw_lp = self._sample(raw, logits, draws, step, finished)
            # 4. the step's one synchronisation: ids, log-probabilities and validity reach the host
            host = copy.fetch(tokens, drawn.logprobs, raw_lp, drawn.valid)
            _check_alive(host.valid, live, logits)
            self.logits_processor.on_sampled(host.token_tensor, ctx)
            # 5. book-keeping on the host: append, then stop rows on EOS, stop strings or length
            for b, row_fed in enumerate(fed):
                row_fed.append(host.tokens[b])
            still = stopping.record(host, live)
            if len(still) < len(live):  # the device's copy of the finished rows changes only here
                finished = tensor_on([r.finish_reason is not None for r in rows], torch.bool, batch.input_ids.device)
            live = still
            if not live:
                break
            # 6. feed the tokens back: one new column of ids, mask and positions, all on the device
            batch.feed(tokens)

    def _process(self, raw: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
        """The processors' logits, checked (the raw logits are kept intact for in-place processors).

        Synchronises only where a processor does (each processor's ``process`` says).
        """
        given = raw.clone() if self.logits_processor.inplace else raw
        return check_logits("logits_processor", self.logits_processor.process(given, ctx), raw)

    def _sample(self, raw: torch.Tensor, logits: torch.Tensor, draws: RowDraws, step: int, finished: Any):
        """One token per row from ``logits``, with the rows' draws of ``step``; ``finished`` rows get the pad id.

        Returns the draw, the tokens ``[B]`` (-1 for a row with nothing to
        sample: its values are meaningless, and raised after the step's copy)
        and each token's log-probability under the raw logits. No
        synchronisation on a GPU: all of it stays on the device.
        """
        u = draws.uniforms(step)
        algorithm = self.sampling_algorithm
        drawn = sample(logits, draws.params, u, taps=self.sample_taps, on_dead="flag", algorithm=algorithm)
        tokens = drawn.tokens if finished is None else drawn.tokens.masked_fill(finished, self.pad_token_id)
        raw_lp = raw.gather(1, tokens.clamp(min=0)[:, None]).squeeze(1) - torch.logsumexp(raw, dim=-1)
        return drawn, tokens, raw_lp

    def _outputs(self, prompts, encoded, per_request, rows: list[Row]) -> list[RequestOutput]:
        completions: list[list[Completion]] = [[] for _ in prompts]
        vocab = vocab_for(self.tokenizer)
        for row in rows:
            # the text the new tokens add after the prompt, as the tracker's sequence() shows it
            spelled = vocab.decode_bytes(row.tokens)
            if row.stop_reason is not None:
                spelled = spelled[: spelled.find(row.stop_reason.encode("utf-8"))]
            text = decode_text(spelled)
            completions[row.request].append(
                Completion(
                    index=row.sample,
                    token_ids=row.tokens,
                    text=text,
                    finish_reason=row.finish_reason or "length",  # type: ignore[arg-type]
                    stop_reason=row.stop_reason,
                    logprobs=row.logprobs,
                    raw_logprobs=row.raw_logprobs,
                )
            )
        return [
            RequestOutput(
                request_index=r,
                prompt=prompt if isinstance(prompt, str) else self.tokenizer.decode(encoded[r]),
                prompt_token_ids=encoded[r],
                params=per_request[r],
                outputs=completions[r],
            )
            for r, prompt in enumerate(prompts)
        ]

    def __call__(self, prompts: Prompt | Sequence[Prompt], params: Any = None, **sampling: Any) -> str | list[str]:
        """Generate and return the text: a string for one prompt, a list for several."""
        single = isinstance(prompts, str)
        outputs = self.generate(prompts, params, **sampling)
        texts = [c.text for out in outputs for c in out.outputs]
        return texts[0] if single and len(texts) == 1 else texts

    def reset(self) -> None:
        """Reset the processors (Outlines-style hosts call this between generations)."""
        self.logits_processor.reset()

    def __repr__(self) -> str:
        name = getattr(self.model.config, "_name_or_path", "") or type(self.model).__name__
        return f"Generator(model={name!r}, logits_processor={self.logits_processor!r})"


def _given(value: Any) -> str:
    """What was passed instead of a SamplingParams, and how to make one."""
    if isinstance(value, dict):
        return f"got a dict {value!r}; build one with SamplingParams(**d), or give the values as keywords"
    return f"got {type(value).__name__} {value!r}"


def _check_alive(valid: list[bool], live: list[int], logits: torch.Tensor) -> None:
    """Raise a :class:`DeadRowError` naming the live rows that had nothing to sample (host values only)."""
    dead = [b for b in live if not valid[b]]
    if dead:
        flags = torch.zeros(logits.shape[0], dtype=torch.bool)
        flags[dead] = True
        raise dead_row_error(TaggedTensor.logits(logits), flags.to(logits.device))
