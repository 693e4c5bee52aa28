"""The sample runs: a handful of generations of the demo model that show what the dashboard is for.

Each :class:`Recipe` is one run: a prompt or a batch of prompts, a processor
(or none) and sampling parameters for one or more generations, recorded by
the tracker with every stage (natural, constrained, sampled) in float16 so
that the whole set stays a few MB. :func:`record` writes them as Parquet
files; ``python -m logitscope.make_sample_runs`` rebuilds the shipped
``sample_runs/`` with it, and ``logitscope demo`` records them afresh.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dashboard.threads import one_torch_thread
from processors import (
    BadWordsLogitsProcessor,
    CFGLogitsProcessor,
    JSONLogitsProcessor,
    PenaltiesLogitsProcessor,
    RegexLogitsProcessor,
)
from sampling import Generator, SamplingParams
from tracker import add_tracking

__all__ = ["Recipe", "RECIPES", "Recorded", "record"]

EOT = "<|endoftext|>"
RECORD_START = '{"name": "Alice Moreau", "age": 34, "'

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"enum": ["Lyon", "Oslo", "Lima"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}

ARITHMETIC = r"""
start: NUMBER " " OP " " NUMBER " = " NUMBER
OP: "+" | "-" | "*"
NUMBER: /[0-9]{1,3}/
"""


@dataclass(frozen=True)
class Recipe:
    """One sample run.

    Attributes:
        name: the file name (``{name}.parquet``).
        title: what the run browser shows.
        description: one sentence on what to look at.
        prompts: the prompts, decoded together as one batch.
        params: sampling parameters, one per generation (each generation is one ``generate`` call).
        processor: builds the processor from the tokenizer; None records the model alone.
        processor_stages: record one stage per processor of a list (and the prompt's log-probabilities).
    """

    name: str
    title: str
    description: str
    prompts: tuple[str, ...]
    params: tuple[SamplingParams, ...]
    processor: Callable[[Any], Any] | None = field(default=None, compare=False)
    processor_stages: bool = False


RECIPES: tuple[Recipe, ...] = (
    Recipe(
        "json_record",
        "JSON record (schema)",
        "A JSON schema with the city limited to three values: watch the constraint remove mass at the city.",
        (EOT,),
        (SamplingParams(max_new_tokens=40),),
        lambda tok: JSONLogitsProcessor(PERSON_SCHEMA, tok),
    ),
    Recipe(
        "regex_phone",
        "Phone number (regex)",
        "The model likes 555-0134; the regex asks for (555) 123-4567.",
        ("Call Maria at ",),
        (SamplingParams(temperature=0.7, seed=0, max_new_tokens=24),),
        lambda tok: RegexLogitsProcessor(r"\(\d{3}\) \d{3}-\d{4}\.", tok),
    ),
    Recipe(
        "cfg_arithmetic",
        "Arithmetic line (CFG)",
        "A Lark grammar for 'a op b = c': the grammar fixes the form, the model does the sum.",
        (EOT,),
        (SamplingParams(max_new_tokens=24),),
        lambda tok: CFGLogitsProcessor(ARITHMETIC, tok),
    ),
    Recipe(
        "bad_words",
        "Bad words",
        "'city' is banned: the model's favourite next key is masked, so it writes its second choice, 'email', instead. Compare with 'Greedy'.",
        (RECORD_START,),
        (SamplingParams(max_new_tokens=32),),
        lambda tok: BadWordsLogitsProcessor(["city"], tok),
    ),
    Recipe(
        "greedy",
        "Greedy",
        "No constraint, greedy decoding: compare with 'High temperature' (two temperatures) or 'Bad words' (a constraint).",
        (RECORD_START,),
        (SamplingParams(max_new_tokens=32),),
    ),
    Recipe(
        "hot",
        "High temperature (1.6)",
        "The same prompt sampled at temperature 1.6: it leaves the greedy path at the city, then drifts off the format.",
        (RECORD_START,),
        (SamplingParams(temperature=1.6, seed=2, max_new_tokens=32),),
    ),
    Recipe(
        "batch",
        "Batch of four",
        "Four prompts decoded together, top-p 0.9: pick a sequence in the sidebar.",
        ('{"name": "', "Call ", "7 + 5 = ", "My cat"),
        (SamplingParams(temperature=0.8, top_p=0.9, seed=0, max_new_tokens=32),),
    ),
    Recipe(
        "two_seeds",
        "Two seeds",
        "The same prompt sampled twice (seeds 0 and 1), one generation each: pick a generation in the sidebar.",
        ("My dog",),
        (
            SamplingParams(temperature=1.0, seed=0, max_new_tokens=32),
            SamplingParams(temperature=1.0, seed=1, max_new_tokens=32),
        ),
    ),
    Recipe(
        "two_processors",
        "Regex then penalty (a stage per processor)",
        "A regex and a repetition penalty, each recorded as its own stage: the regex removes the mass, "
        "the penalty then moves the digits already used.",
        ("Call Maria at ",),
        (SamplingParams(temperature=0.7, seed=0, max_new_tokens=24),),
        lambda tok: [
            RegexLogitsProcessor(r"\(\d{3}\) \d{3}-\d{4}\.", tok),
            PenaltiesLogitsProcessor(repetition_penalty=1.5),
        ],
        processor_stages=True,
    ),
)


@dataclass(frozen=True)
class Recorded:
    """A recorded recipe: where it was written and what each generation produced (prompt + text)."""

    recipe: Recipe
    path: Path
    texts: list[list[str]]


def _sampling(params: tuple[SamplingParams, ...]) -> Any:
    if len(params) == 1:
        return params[0].to_dict()
    return {f"generation {i}": p.to_dict() for i, p in enumerate(params)}


def record(
    out: str | Path,
    model: Any,
    tokenizer: Any,
    *,
    recipes: tuple[Recipe, ...] = RECIPES,
    storage: str = "float16",
    model_name: str = "logitscope demo model",
) -> Iterator[Recorded]:
    """Record each recipe with ``model`` into ``out/{name}.parquet``; yields as each one is written.

    ``model_name`` goes into the runs' metadata (rather than the model's
    folder, which would name this machine's paths).
    """
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    for recipe in recipes:
        processor = recipe.processor(tokenizer) if recipe.processor is not None else None
        generator = add_tracking(
            Generator(model, tokenizer, logits_processor=processor),
            storage=storage,
            memory_limit=None,
            model=model_name,
            processor_stages=recipe.processor_stages,
            prompt_logprobs=recipe.processor_stages,
        )
        tracker = generator.logits_processor
        texts = []
        with one_torch_thread():
            for params in recipe.params:
                outputs = generator.generate(list(recipe.prompts), params)
                texts.append([o.prompt + c.text for o in outputs for c in o.outputs])
        tracker.annotate(sampling=_sampling(recipe.params), title=recipe.title, description=recipe.description)
        yield Recorded(recipe, tracker.to_parquet(folder / f"{recipe.name}.parquet"), texts)
