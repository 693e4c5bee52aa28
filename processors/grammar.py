"""Regex, JSON-schema and context-free-grammar constraints, on llguidance.

>>> proc = RegexLogitsProcessor(r"\\(\\d{3}\\) \\d{3}-\\d{4}", tokenizer)
>>> proc = JSONLogitsProcessor(Person, tokenizer)          # a pydantic model, a dict or a string
>>> proc = CFGLogitsProcessor('start: NUM " + " NUM', tokenizer)   # Lark; syntax="gbnf" for GBNF

Each row of a batch gets its own matcher, created when the batch is first
seen and advanced with the tokens the row generated (read from the host's
``ctx.generated`` or from ``ctx.input_ids[:, ctx.prompt_length:]``, so the
processors also work inside ``model.generate``). Under logitscope's
``Generator``, which reports each step's tokens on the host through
``on_sampled``, the next step's masks are computed on a worker thread while
the model runs (as SGLang and vLLM do), the rows filled in parallel by
llguidance; the mask is applied on the logits' device, copied there from
pinned memory without a synchronisation. The generated text of every row matches the constraint
as a whole: EOS is allowed exactly when the grammar accepts, and a row whose
grammar is complete, or that has ended, is allowed EOS only (hosts keep
finished rows in the batch and feed them padding). A pattern, schema or
grammar that cannot be compiled fails at construction with the engine's
message. The llguidance tokenizer set-up (about a second at 128k tokens) is
made once per tokenizer and cached; it reads each token's bytes from
logitscope's own vocabulary, so every tokenizer family
:mod:`processors.vocab` reads can be constrained.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal

import llguidance
import torch

from processors.bitmask import HostBitmask, apply_bitmask_, bitmask_words, pack_bool, unpack_bitmask
from processors.grammar_tokenizer import llguidance_tokenizer
from processors.protocol import BatchContext, LogitsProcessor
from processors.token_feed import TokenFeed

__all__ = [
    "GrammarLogitsProcessor",
    "RegexLogitsProcessor",
    "JSONLogitsProcessor",
    "CFGLogitsProcessor",
    "GrammarSyntax",
    "llguidance_tokenizer",
]

GrammarSyntax = Literal["lark", "gbnf"]

_EXECUTOR: llguidance.LLExecutor | None = None
_WORKER: ThreadPoolExecutor | None = None


def _worker() -> ThreadPoolExecutor:
    """The thread that prepares grammar masks while the host queues the next forward pass."""
    global _WORKER
    if _WORKER is None:
        _WORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="logitscope-grammar")
    return _WORKER


def _executor() -> llguidance.LLExecutor:
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = llguidance.LLExecutor()
    return _EXECUTOR


class GrammarLogitsProcessor(LogitsProcessor):
    """Allow, in each row, only the tokens that keep its text inside an llguidance grammar.

    Where the grammar forces the next bytes, llguidance allows only the
    tokenizer's own split of them (after ``Pa`` in ``Paris|Lima``: ``ris``,
    not ``r``), so a valid token split otherwise is masked there.

    Works in place: sets the logits of disallowed tokens to -inf in the
    tensor it is given and returns it (``inplace = True``). Tokens the
    tokenizer does not have (a model's vocabulary may be wider) are never
    allowed. Keeps one matcher per row; :meth:`reset` forgets them.

    Args:
        grammar: an llguidance grammar (see ``llguidance.grammar_from``).
        tokenizer: the model's Hugging Face tokenizer (any family :mod:`processors.vocab` reads).
        eos_token_id: end-of-sequence id(s), default the tokenizer's.
        argument, description: how construction errors name the user's input.
    """

    inplace = True

    def __init__(
        self,
        grammar: str,
        tokenizer: Any,
        *,
        eos_token_id: int | Sequence[int] | None = None,
        argument: str = "grammar",
        description: str = "grammar",
    ) -> None:
        self.tokenizer = tokenizer
        self.description = description
        self._ll_tokenizer = llguidance_tokenizer(tokenizer, eos_token_id)
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._ll_tokenizer)
        if failed:
            raise ValueError(f"{argument}: the {description} cannot be compiled: {messages[0].strip()}")
        template = llguidance.LLMatcher(self._ll_tokenizer, grammar, log_level=0)
        if template.is_error():
            raise ValueError(f"{argument}: the {description} cannot be compiled: {template.get_error().strip()}")
        self._template = template
        self._n_tokens = int(self._ll_tokenizer.vocab_size)
        self._eos = frozenset(int(t) for t in self._ll_tokenizer.eos_tokens)
        pad = getattr(tokenizer, "pad_token_id", None)
        self._pad = int(pad) if isinstance(pad, int) else None
        eos_only = torch.zeros(1, self._n_tokens, dtype=torch.bool)
        eos_only[0, [t for t in self._eos if t < self._n_tokens]] = True
        self._eos_only = pack_bool(eos_only)[0]
        self._matchers: list[llguidance.LLMatcher] | None = None
        self._done: list[bool] = []
        self._masks: HostBitmask | None = None
        self._pending: Future[torch.Tensor] | None = None  # the next step's mask, on the worker
        self._feed = TokenFeed()

    # ------------------------------------------------------------ state

    def _start(self, batch: int) -> None:
        self._matchers = [self._template.deep_copy() for _ in range(batch)]
        self._done = [False] * batch
        self._masks = None

    def reset(self) -> None:
        """Forget every row's matcher; the next call starts a new generation."""
        self._drop_pending()
        self._matchers = None
        self._feed.reset()

    def __deepcopy__(self, memo: dict[int, Any]) -> GrammarLogitsProcessor:
        """A fresh copy that shares the compiled grammar and the tokenizer set-up."""
        clone = copy.copy(self)
        clone.__dict__.pop("_host_boundary", None)
        clone._matchers = None
        clone._masks = None
        clone._pending = None
        clone._feed = TokenFeed()
        return clone

    def _advance(self, row: int, tokens: list[int]) -> None:
        matcher = self._matchers[row]  # type: ignore[index]
        for token in tokens:
            if self._done[row]:
                return
            if token in self._eos:
                # The row ended; whatever the host feeds it from now on is padding.
                if matcher.is_accepting():
                    matcher.consume_token(token)
                self._done[row] = True
                continue
            stopped = matcher.is_stopped()
            if stopped or not matcher.consume_token(token):
                if token == self._pad:  # a host that ended the row for its own reasons
                    self._done[row] = True
                    continue
                reason = "the text was already complete" if stopped else matcher.get_error().strip()
                raise ValueError(
                    f"{self.name}: row {row} generated token {token} "
                    f"({self._ll_tokenizer.dbg_tokens([token])}), which the grammar does not allow "
                    f"there ({reason}); did a later processor undo the mask?"
                )

    def _sync(self, ctx: BatchContext) -> bool:
        """Create the row matchers if needed and feed them the tokens generated since the last call.

        Returns whether anything changed (a new generation, or tokens fed).
        """
        update = self._feed.update(ctx, self.name)
        changed = update.restarted or self._matchers is None
        if changed:
            self._start(update.batch)
        for row, tokens in enumerate(update.new_tokens):
            if tokens:
                self._advance(row, tokens)
                changed = True
        return changed

    def _fill(self, bitmask: torch.Tensor) -> torch.Tensor:
        """Fill ``bitmask`` (host, ``[B, words]`` int32) with each row's next allowed tokens, rows in parallel."""
        matchers, done = self._matchers, self._done
        assert matchers is not None
        live = [(m, row) for row, m in enumerate(matchers) if not done[row]]
        row_bytes = bitmask.shape[1] * 4
        if len(live) == 1:
            matcher, row = live[0]
            matcher.unsafe_compute_mask_ptr(bitmask.data_ptr() + row * row_bytes, row_bytes)
        elif live:
            _executor().unsafe_compute_mask_ptr(live, bitmask.data_ptr(), row_bytes, bitmask.shape[0])
        for row, is_done in enumerate(done):
            if is_done:
                bitmask[row] = self._eos_only
        for matcher, row in live:
            if matcher.is_error():
                error = matcher.get_error().strip()
                if error.startswith("NoExtensionBias"):
                    raise ValueError(
                        f"{self.name}: row {row}: no token of this tokenizer spells a continuation the "
                        f"{self.description} allows here (a WordPiece tokenizer, for one, cannot start a generated "
                        f"text without a space)"
                    )
                raise ValueError(f"{self.name}: the matcher of row {row} failed: {error}")
        return bitmask

    def _host_masks(self, device: torch.device) -> HostBitmask:
        batch = len(self._matchers or ())
        masks = self._masks
        if masks is None or masks.device != device or masks.shape[0] != batch:
            masks = self._masks = HostBitmask(batch, bitmask_words(self._n_tokens), device)
        return masks

    # ------------------------------------------------------------ the worker

    def _advance_and_fill(self, tokens: list[int], masks: HostBitmask) -> torch.Tensor:
        """On the worker: advance each row by its new token, then fill the next step's mask."""
        for row, token in enumerate(tokens):
            self._advance(row, [token])
        return self._fill(masks.acquire())

    def _take_pending(self) -> torch.Tensor | None:
        """The mask the worker prepared (waiting for it if it is still running), re-raising its error."""
        pending, self._pending = self._pending, None
        return None if pending is None else pending.result()

    def _drop_pending(self) -> None:
        """Wait for the worker and drop its result: it was for a step that will not come."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.exception()

    # ------------------------------------------------------------ step

    def process(self, logits: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
        """Set to -inf the logits of every token the row's grammar does not allow next (in place).

        Does not synchronise: the mask is filled on the host (by the worker
        when the host reported the last tokens through :meth:`on_sampled`,
        else here), then copied to the logits' device from pinned memory.
        """
        prepared = self._take_pending()
        changed = self._sync(ctx)
        masks = self._host_masks(logits.device)
        host = prepared if prepared is not None and not changed else self._fill(masks.acquire())
        return apply_bitmask_(logits, masks.send(host), self._n_tokens)

    def on_sampled(self, tokens: torch.Tensor, ctx: BatchContext) -> None:
        """Start computing the next step's masks on a worker thread, from tokens already on the host.

        No synchronisation: tokens on a device are not read here.

        The worker advances each row's matcher and fills the next mask while
        the host queues the next forward pass; :meth:`process` then only waits
        for it. Tokens on a device, or that do not follow the step this
        processor saw, are left for the next :meth:`process` to read from its
        context. An error of the worker (a token the grammar does not allow)
        is raised by the next :meth:`process`, naming the row.
        """
        if tokens.device.type != "cpu" or self._masks is None or self._pending is not None:
            return
        if not self._feed.consume(ctx.batch_size, ctx.num_generated):
            return
        new = tokens.numpy().tolist()  # a CPU tensor: a view, no read of a device
        self._pending = _worker().submit(self._advance_and_fill, new, self._masks)

    def allowed_token_mask(self, ctx: BatchContext) -> torch.Tensor:
        """``[B, n_tokens]`` bool: the tokens each row may take next (for inspection)."""
        self._take_pending()
        self._sync(ctx)
        bitmask = torch.zeros((len(self._matchers or ()), bitmask_words(self._n_tokens)), dtype=torch.int32)
        return unpack_bitmask(self._fill(bitmask), self._n_tokens)

    def is_accepting(self) -> list[bool]:
        """Per row: whether the text generated so far is a complete match."""
        self._take_pending()
        if self._matchers is None:
            return []
        return [m.is_accepting() for m in self._matchers]


class RegexLogitsProcessor(GrammarLogitsProcessor):
    """Constrain each row's generated text to match ``pattern`` as a whole (``re.fullmatch``).

    ``pattern`` uses Rust ``regex`` syntax (close to Python's ``re``; ``\\d``
    is any Unicode digit, as in Python). Works in place.
    """

    def __init__(self, pattern: str, tokenizer: Any, *, eos_token_id: int | Sequence[int] | None = None) -> None:
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"pattern must be a non-empty regular expression string, got {pattern!r}")
        self.pattern = pattern
        description = f"regex '{pattern}'"  # as typed: a repr would double its backslashes
        try:
            super().__init__(
                llguidance.grammar_from("regex", pattern),
                tokenizer,
                eos_token_id=eos_token_id,
                argument="pattern",
                description=description,
            )
        except ValueError as exc:
            said = f"pattern: the {description} cannot be compiled: "
            if not str(exc).startswith(said):
                raise
            raise ValueError(said + _regex_reason(str(exc)[len(said) :])) from None

    def __repr__(self) -> str:
        return f"RegexLogitsProcessor(pattern={self.pattern!r})"


#: The regex engine's error inside llguidance's: the pattern, a line of carets under the fault, the reason.
_REGEX_ERROR = re.compile(r"regex parse error:\n( *)(.*)\n( *)\^+\nerror: ([^\n]*)")


def _regex_reason(engine: str) -> str:
    """The regex engine's reason and where (``unclosed group (at character 1)``) out of llguidance's error,
    which repeats the pattern escaped twice and draws carets under it; the engine's text when it says
    something else."""
    found = _REGEX_ERROR.search(engine)
    if found is None:
        return " ".join(engine.split())
    indent, _, pad, reason = found.groups()
    return f"{reason} (at character {len(pad) - len(indent) + 1})"


def _schema_text(schema: Any) -> str:
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        return json.dumps(schema.model_json_schema())
    if isinstance(schema, Mapping):
        try:
            return json.dumps(schema)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"schema: the dict is not JSON-serialisable: {exc}") from exc
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"schema: the string is not valid JSON ({exc}): {schema[:80]!r}") from exc
        if not isinstance(parsed, (dict, bool)):
            raise ValueError(f"schema: a JSON schema is an object or a boolean, got {type(parsed).__name__}")
        return schema
    raise TypeError(
        f"schema must be a JSON-schema dict, a JSON string or a pydantic model class, got {type(schema).__name__}"
    )


class JSONLogitsProcessor(GrammarLogitsProcessor):
    """Constrain each row's generated text to a JSON document valid against ``schema``.

    Args:
        schema: a JSON-schema dict, its JSON text, or a pydantic model class.
        tokenizer: the model's Hugging Face tokenizer (any family :mod:`processors.vocab` reads).
        separators: the whitespace policy. An ``(item, key)`` pair fixes the
            separators and allows no other whitespace; the default
            ``(", ", ": ")`` is how most training text writes JSON, and leaves
            a sampled model nothing to loop on, so the document ends. Use
            ``(",", ":")`` for compact output. ``None`` is the flexible
            policy (llguidance's own): any JSON whitespace between tokens;
            a model sampled at temperature 1 can keep emitting whitespace
            and never close the document, so give it a token budget.
        lenient: ignore schema keywords the engine cannot enforce instead of
            refusing the schema (by default ``uniqueItems``, ``not``, ``if`` ...
            fail at construction, naming the keyword).

    Works in place.
    """

    def __init__(
        self,
        schema: Any,
        tokenizer: Any,
        *,
        separators: tuple[str, str] | None = (", ", ": "),
        lenient: bool = False,
        eos_token_id: int | Sequence[int] | None = None,
    ) -> None:
        text = _schema_text(schema)
        options: dict[str, Any] = {}
        if separators is not None:
            if (
                not isinstance(separators, (tuple, list))
                or len(separators) != 2
                or not all(isinstance(s, str) and s.strip() in {",", ":"} for s in separators)
            ):
                raise ValueError(
                    f"separators must be an (item, key) pair of strings like (', ', ': '), got {separators!r}"
                )
            options.update(item_separator=separators[0], key_separator=separators[1], whitespace_flexible=False)
        if lenient:
            options["lenient"] = True
        self.schema = json.loads(text)
        self.separators = None if separators is None else tuple(separators)
        self.lenient = bool(lenient)
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(text, overrides=options or None)
        except ValueError as exc:
            raise ValueError(f"schema: the JSON schema cannot be compiled: {exc}") from exc
        super().__init__(grammar, tokenizer, eos_token_id=eos_token_id, argument="schema", description="JSON schema")

    def __repr__(self) -> str:
        """The whole schema and the options that differ from the defaults: a run keeps this text as its processor."""
        options = "" if self.separators == (", ", ": ") else f", separators={self.separators!r}"
        options += ", lenient=True" if self.lenient else ""
        return f"JSONLogitsProcessor(schema={json.dumps(self.schema)!r}{options})"


class CFGLogitsProcessor(GrammarLogitsProcessor):
    """Constrain each row's generated text to a context-free grammar.

    Args:
        grammar: the grammar text, its start rule named ``start`` (Lark) or
            ``root`` (GBNF).
        tokenizer: the model's Hugging Face tokenizer (any family :mod:`processors.vocab` reads).
        syntax: ``"lark"`` (llguidance's Lark dialect) or ``"gbnf"``
            (llama.cpp's GBNF).

    Works in place.
    """

    def __init__(
        self,
        grammar: str,
        tokenizer: Any,
        *,
        syntax: GrammarSyntax = "lark",
        eos_token_id: int | Sequence[int] | None = None,
    ) -> None:
        if syntax not in ("lark", "gbnf"):
            raise ValueError(f"syntax must be 'lark' or 'gbnf', got {syntax!r}")
        if not isinstance(grammar, str) or not grammar.strip():
            raise ValueError(f"grammar must be a non-empty {syntax} grammar string, got {grammar!r}")
        self.grammar = grammar
        self.syntax = syntax
        try:
            compiled = llguidance.grammar_from(syntax, grammar)
        except ValueError as exc:
            raise ValueError(f"grammar: the {syntax} grammar cannot be compiled: {exc}") from exc
        super().__init__(
            compiled, tokenizer, eos_token_id=eos_token_id, argument="grammar", description=f"{syntax} grammar"
        )

    def __repr__(self) -> str:
        """The whole grammar: a run keeps this text as its processor."""
        return f"CFGLogitsProcessor(syntax={self.syntax!r}, grammar={self.grammar!r})"
