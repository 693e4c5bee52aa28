"""What a run answers beyond the tracking API: per-processor stages, surprisal and perplexity, the
prompt, the "why" of a step, comparison with another run, and notebook display.

:class:`Insight` is a mixin of :class:`~tracker.Run`; each method is a thin
call into the module that does the work (:mod:`tracker.reading.why`,
:mod:`tracker.reading.prompt`, :mod:`tracker.reading.compare`, :mod:`tracker.reading.display`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import pandas as pd

from tracker.format.stages import display_stages
from tracker.reading import metrics
from tracker.reading.engine_stages import ENGINE_STAGES
from tracker.reading.prompt import perplexity as _perplexity
from tracker.reading.selection import count_arg, index_arg
from tracker.reading.why import why

__all__ = ["Insight"]


class Insight:
    """Mixin over :class:`~tracker.reading.analysis.Analysis` (it uses its selection and block helpers)."""

    # ---------------------------------------------------------------- stats with surprisal and per-processor mass

    def stats(
        self,
        *,
        sequence: int | None = 0,
        generation: int = -1,
        include_finished: bool = False,
        positions: int | Sequence[int] | None = None,
    ) -> pd.DataFrame:
        """Per-step statistics (see :meth:`tracker.reading.analysis.Analysis.stats`), plus:

        ``surprisal_{stage}`` (``-log p_chosen``, nats) for every stage and,
        when the run has a stage per processor, ``removed_mass_after:<name>``:
        the natural probability mass each processor masked (net of what it
        let back), from the statistics recorded with the rows where the run
        has them (exact in every storage mode), else from the stored rows.
        """
        options = {"generation": generation, "include_finished": include_finished, "positions": positions}
        if sequence is None:
            frames = [self.stats(sequence=s, **options) for s in self.sequences(generation)]  # type: ignore[attr-defined]
            return pd.concat(frames, ignore_index=True)
        frame = super().stats(sequence=sequence, **options)  # type: ignore[misc]
        for stage in self.stages:  # type: ignore[attr-defined]
            with np.errstate(divide="ignore"):
                # 0 - log p, not -log p: a certain token's surprisal is 0.0, never -0.0
                frame[f"surprisal_{stage}"] = 0.0 - np.log(frame[f"p_chosen_{stage}"].to_numpy(dtype=np.float64))
        if self.metadata.stage_aliases:  # type: ignore[attr-defined]
            sel, _ = self._at(self._select(generation, sequence, include_finished), positions)  # type: ignore[attr-defined]
            removed = self._cached(
                ("removed_by", sel.generation, sel.sequence, sel.length, sel.part),  # type: ignore[attr-defined]
                lambda: self._removed_by_processor(sel),
            )
            for name, values in removed.items():
                frame[f"removed_mass_{name}"] = values
        engine = self._engine_stages()
        if engine:  # vLLM's sampling stages: what each one let through and cut
            sel, _ = self._at(self._select(generation, sequence, include_finished), positions)  # type: ignore[attr-defined]
            key = ("engine_masks", sel.generation, sel.sequence, sel.length, sel.part)
            allowed, removed = self._cached(key, lambda: self._masks(sel, engine))  # type: ignore[attr-defined]
            for stage in engine:
                frame[f"allowed_{stage}"] = allowed[stage]
                frame[f"removed_mass_{stage}"] = removed[stage]
        return frame

    def _engine_stages(self) -> list[str]:
        """The stages computed from a serving engine's sampler (:data:`tracker.reading.engine_stages.ENGINE_STAGES`),
        when the run has them."""
        stages = list(self.metadata.stages)  # type: ignore[attr-defined]
        return list(ENGINE_STAGES) if set(ENGINE_STAGES) <= set(stages) else []

    def _masks(self, sel: Any, stages: list[str]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Per stage: its allowed count, and the natural mass it removed beyond the stage before it."""
        if self._has_stats(sel):  # type: ignore[attr-defined]
            allowed = {stage: self._column(f"{stage}_allowed", sel) for stage in stages}  # type: ignore[attr-defined]
        else:
            parts = self._map(sel, stages, lambda start, b: [metrics.allowed(b[stage]) for stage in stages])  # type: ignore[attr-defined]
            allowed = {s: np.concatenate([p[j] for p in parts]) if parts else np.zeros(0) for j, s in enumerate(stages)}
        return allowed, self._removed_by(sel, stages, stages)

    def _processor_stages(self) -> list[str]:
        stages = list(self.metadata.stages)  # type: ignore[attr-defined]
        if "constrained" not in stages:
            return []
        return stages[1 : stages.index("constrained") + 1]

    def _removed_by_processor(self, sel: Any) -> dict[str, np.ndarray]:
        stages = self._processor_stages()
        return self._removed_by(sel, stages, display_stages(stages, self.metadata.stage_aliases))  # type: ignore[attr-defined]

    def _removed_by(self, sel: Any, stages: list[str], names: list[str]) -> dict[str, np.ndarray]:
        """Per stage (under ``names``): the natural mass it masked beyond the stage before it."""
        if self._has_stats(sel):  # type: ignore[attr-defined]
            # each stage's removed mass against the natural row, recorded from the whole rows: exact in every storage
            cumulative = [self._column(f"{stage}_removed_mass", sel) for stage in stages]  # type: ignore[attr-defined]
        elif self.metadata.storage == "topk":  # type: ignore[attr-defined]
            return {name: np.full(sel.length, math.nan) for name in names}
        else:
            parts = self._map(
                sel,
                ["natural", *stages],  # type: ignore[attr-defined]
                lambda start, b: [metrics.removed_mass(b["natural"], b[stage]) for stage in stages],
            )
            cumulative = [np.concatenate([p[j] for p in parts]) if parts else np.zeros(0) for j in range(len(stages))]
        out: dict[str, np.ndarray] = {}
        before = np.zeros(sel.length)
        for name, now in zip(names, cumulative):
            out[name] = now - before
            before = now
        return out

    # ---------------------------------------------------------------- the prompt and perplexity

    def _prompt_values(self, generation: int, sequence: int) -> tuple[list[int], list[float | None] | None]:
        g = self._generation_id(generation)  # type: ignore[attr-defined]
        sequence = index_arg("sequence", sequence)
        record = next((r for r in self.metadata.generations if r.get("generation") == g), {})  # type: ignore[attr-defined]
        prompts = record.get("prompt_ids") or []
        if not 0 <= sequence < max(len(prompts), 1):
            raise ValueError(f"sequence={sequence} is not in generation {g}; it has {len(prompts)} rows")
        ids = list(prompts[sequence]) if prompts else []
        logprobs = record.get("prompt_logprobs")
        return ids, (list(logprobs[sequence]) if logprobs else None)

    def prompt_logprobs(self, *, generation: int = -1, sequence: int = 0) -> pd.DataFrame:
        """The prompt's tokens with ``logprob`` and ``surprisal`` (NaN for the first token, or when not recorded).

        Recorded with ``LogitTrackingProcessor(..., prompt_logprobs=True)``
        (see :mod:`tracker.reading.prompt`). Columns: ``position`` (0 is the first
        prompt token), ``token_id, token, logprob, surprisal``.
        """
        ids, logprobs = self._prompt_values(generation, sequence)
        values = np.full(len(ids), math.nan)
        if logprobs is not None:
            values[:] = [math.nan if v is None else float(v) for v in logprobs]
        display = self.vocab.display  # type: ignore[attr-defined]
        return pd.DataFrame(
            {
                "position": np.arange(len(ids), dtype=np.int64),
                "token_id": np.asarray(ids, dtype=np.int64),
                "token": [display[i] for i in ids],
                "logprob": values,
                "surprisal": 0.0 - values,  # 0.0 for a certain token, never -0.0
            }
        )

    def perplexity(self, *, generation: int | None = -1, include_finished: bool = False) -> pd.DataFrame:
        """One row per sequence: ``generation, sequence, prompt_tokens, prompt_perplexity, tokens`` and
        ``perplexity_{stage}``.

        ``generation`` is one generation, the last by default (``-1``, as in
        every query), or ``None`` for every generation of the run, in order.
        A stage's perplexity is ``exp`` of the mean surprisal of the chosen
        tokens under that stage (``natural``: how surprising the text was to
        the model). NaN where not recorded (prompt) or not stored (top-k).
        """
        if generation is None:
            tables = [self.perplexity(generation=g, include_finished=include_finished) for g in self.generations()]  # type: ignore[attr-defined]
            return pd.concat(tables, ignore_index=True)
        rows = []
        for s in self.sequences(generation):  # type: ignore[attr-defined]
            ids, logprobs = self._prompt_values(generation, s)
            stats = self.stats(sequence=s, generation=generation, include_finished=include_finished)
            row: dict[str, Any] = {
                "generation": self._generation_id(generation),  # type: ignore[attr-defined]
                "sequence": s,
                "prompt_tokens": len(ids),
                "prompt_perplexity": _perplexity(logprobs) if logprobs is not None else math.nan,
                "tokens": int(stats["chosen_id"].notna().sum()),
            }
            for stage in self.stages:  # type: ignore[attr-defined]
                surprisal = stats[f"surprisal_{stage}"].to_numpy(dtype=np.float64)
                row[f"perplexity_{stage}"] = _perplexity(-surprisal)
            rows.append(row)
        return pd.DataFrame(rows)

    def to_dataframe(
        self,
        show: Literal["probs", "logits"] = "probs",
        min_value: float | None = None,
        *,
        section: Literal["steps", "prompt"] = "steps",
        **kwargs: Any,
    ) -> pd.DataFrame:
        """:meth:`tracker.reading.analysis.Analysis.to_dataframe`; ``section="prompt"`` gives :meth:`prompt_logprobs`.

        ``section="prompt"`` takes one sequence (an int) and ``generation``;
        ``show``, ``min_value`` and the other options of the steps table do
        not apply to it and raise ValueError when given.
        """
        if section == "prompt":
            given = {"show": show} if show != "probs" else {}
            given.update({"min_value": min_value} if min_value is not None else {})
            given.update({name: kwargs[name] for name in sorted(set(kwargs) - {"generation", "sequence"})})
            if given:
                shown = ", ".join(f"{name}={value!r}" for name, value in given.items())
                raise ValueError(
                    f"section='prompt' takes only sequence= and generation=, got {shown} (options of section='steps')"
                )
            sequence = kwargs.get("sequence", 0)
            if sequence is None:
                raise ValueError(
                    "section='prompt' takes one sequence (an int >= 0), got sequence=None; "
                    "call it for each of run.sequences(generation)"
                )
            return self.prompt_logprobs(generation=kwargs.get("generation", -1), sequence=sequence)
        if section != "steps":
            raise ValueError(f"section must be 'steps' or 'prompt', got {section!r}")
        return super().to_dataframe(show, min_value, **kwargs)  # type: ignore[misc]

    # ---------------------------------------------------------------- one step, two runs, display

    def why(
        self, position: int, *, sequence: int = 0, generation: int = -1, include_finished: bool = False
    ) -> pd.DataFrame:
        """Which stage changed the chosen token and the model's favourite at ``position`` (see :func:`tracker.reading.why.why`).

        A position past the sequence's end raises ValueError unless ``include_finished`` is True.
        """
        return why(self, position, sequence=sequence, generation=generation, include_finished=include_finished)

    def diff(self, other: Any, **options: Any) -> Any:
        """This run compared with ``other`` step by step (see :func:`tracker.reading.compare.compare`)."""
        from tracker.reading.compare import compare

        return compare(self, other, **options)

    def view(self, generation: int = -1, sequence: int = 0) -> Any:
        """One sequence, shown in a notebook as coloured text with hover details and a top-k table."""
        from tracker.reading.display import SequenceView

        self._select(generation, sequence, False)  # type: ignore[attr-defined]
        return SequenceView(self, generation, sequence)

    def step(
        self, position: int, *, generation: int = -1, sequence: int = 0, k: int = 10, include_finished: bool = False
    ) -> Any:
        """One step, shown in a notebook as its top-``k`` table and chart; ``.why()`` explains it.

        A position past the sequence's end raises ValueError unless ``include_finished`` is True.
        """
        from tracker.reading.display import StepView, step_html

        k = count_arg("k", k)
        view = StepView(self, position, generation, sequence, k, include_finished)
        step_html(  # checks the arguments now
            self, position, generation=generation, sequence=sequence, k=k, include_finished=include_finished
        )
        return view

    def show(
        self,
        step: int | None = None,
        *,
        generation: int = -1,
        sequence: int = 0,
        k: int = 10,
        include_finished: bool = False,
    ) -> Any:
        """Draw a step's replay chart (or, with ``step=None``, the sequence) inline in a notebook; returns the view.

        A step past the sequence's end raises ValueError unless ``include_finished`` is True.
        """
        from tracker.reading.display import show

        return show(
            self.view(generation, sequence)
            if step is None
            else self.step(step, generation=generation, sequence=sequence, k=k, include_finished=include_finished)
        )

    def _repr_html_(self) -> str:
        from tracker.reading.display import run_html

        return run_html(self)
