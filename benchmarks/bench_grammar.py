"""Per-step cost of logitscope's Regex and JSON processors against llguidance's own fill-and-apply.

For each vocabulary size (the demo model's, then synthetic byte-level BPE
tokenizers of 32k and 128k tokens trained here on generated text) and each
constraint, a valid completion is tokenised and replayed step by step:

- logitscope: ``processor.process(logits, ctx)``, which advances the row's
  matcher with the last token, fills the mask and applies it;
- llguidance: ``matcher.consume_token`` + ``fill_next_token_bitmask`` +
  ``apply_token_bitmask_inplace`` (its ``torch.compile``d kernel) on a matcher
  of the same grammar and tokenizer set-up.

Both work on the same logits, copied in before every step (outside the
timing), and must leave the same logits. The ratio is logitscope / llguidance
per step (goal: at most 1.2); the first call of each path is reported
separately, since llguidance's apply kernel compiles on first use (in the
first case of the run only). "apply/rand" times the mask application alone on
random masks, the worst case for logitscope (every word mixed: its table
path), against llguidance's compiled kernel.

Per-step times are the best of the repeats for each step, averaged over the
steps: on a shared machine the minimum is the stable statistic; medians are
printed beside them.

    python benchmarks/bench_grammar.py            # demo, 32k, 128k; batch 1 and 8
    python benchmarks/bench_grammar.py --sizes demo 32000 --batch 1
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import llguidance
import llguidance.torch as llg_torch
import torch

from processors import BatchContext, JSONLogitsProcessor, RegexLogitsProcessor
from processors.bitmask import apply_bitmask_
from processors.grammar import llguidance_tokenizer

EOT = "<|endoftext|>"
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
PHONE_TEXT = "(555) 123-4567"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "email": {"type": "string"},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PERSON_TEXT = '{"name": "Alice Moreau", "age": 34, "city": "Lyon", "email": "alice.moreau@example.com"}'


def _corpus(n_words: int, seed: int = 0):
    """Lines of random words plus the JSON and phone-number text the constraints produce."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words: set[str] = set()
    while len(words) < n_words:
        words.add("".join(rng.choice(letters) for _ in range(rng.randint(3, 10))))
    ordered = sorted(words)
    for _ in range(3):
        rng.shuffle(ordered)
        for i in range(0, len(ordered), 12):
            yield " ".join(ordered[i : i + 12])
    for _ in range(2000):
        yield PERSON_TEXT
        yield f"Call Maria at ({rng.randint(200, 999)}) {rng.randint(200, 999)}-{rng.randint(0, 9999):04d}."


def synthetic_tokenizer(vocab_size: int, cache: Path) -> Any:
    """A byte-level BPE tokenizer of ``vocab_size`` tokens, trained on generated text (cached on disk)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    path = cache / f"bpe-{vocab_size}.json"
    if not path.is_file():
        bpe = ByteLevelBPETokenizer()
        bpe.train_from_iterator(
            _corpus(max(20000, vocab_size + vocab_size // 4)),
            vocab_size=vocab_size,
            min_frequency=2,
            special_tokens=[EOT],
            show_progress=False,
        )
        cache.mkdir(parents=True, exist_ok=True)
        bpe.save(str(path))
    return PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token=EOT, pad_token=EOT)


def demo_tokenizer() -> Any | None:
    try:
        from transformers import AutoTokenizer

        from logitscope.demo_model import DEMO_MODEL_PATH
    except ImportError:
        return None
    if not (DEMO_MODEL_PATH / "tokenizer.json").is_file():
        return None
    return AutoTokenizer.from_pretrained(DEMO_MODEL_PATH, local_files_only=True)


def _time(fn: Callable[[], Any]) -> float:
    start = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - start) / 1000.0


def run_case(
    tokenizer: Any, make: Callable[[], Any], grammar: str, text: str, batch: int, repeats: int
) -> dict[str, float]:
    """Replay ``text``'s tokens through both paths; per-step microseconds (median over repeats)."""
    vocab = len(tokenizer)
    tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    steps = tokens + [eos]
    prompt = torch.full((batch, 3), eos, dtype=torch.long)
    contexts = []
    for k in range(len(steps)):
        generated = torch.tensor(tokens[:k], dtype=torch.long).expand(batch, -1)
        contexts.append(BatchContext(input_ids=torch.cat([prompt, generated], dim=1), prompt_length=3))
    base = torch.randn(batch, vocab)
    logits = base.clone()
    ll_tok = llguidance_tokenizer(tokenizer)
    executor = llguidance.LLExecutor()

    processor = make()
    first_ours = _time(lambda: processor.process(logits, contexts[0]))
    matchers = [llguidance.LLMatcher(ll_tok, grammar, log_level=0) for _ in range(batch)]
    mask = llg_torch.allocate_token_bitmask(batch, vocab)

    def llg_fill() -> None:
        if batch == 1:
            llg_torch.fill_next_token_bitmask(matchers[0], mask, 0)
        else:
            llg_torch.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], mask)

    def llg_step() -> None:
        llg_fill()
        llg_torch.apply_token_bitmask_inplace(logits, mask)

    logits.copy_(base)
    first_llg = _time(llg_step)

    ours = [[0.0] * len(contexts) for _ in range(repeats)]
    theirs = [[0.0] * len(contexts) for _ in range(repeats)]
    for rep in range(repeats):
        processor.reset()
        for m in matchers:
            m.reset()
        for k, ctx in enumerate(contexts):
            logits.copy_(base)
            ours[rep][k] = _time(lambda: processor.process(logits, ctx))
            allowed_ours = logits.clone()
            logits.copy_(base)

            def llg_full_step() -> None:
                if k:
                    for m in matchers:
                        m.consume_token(steps[k - 1])
                llg_step()

            theirs[rep][k] = _time(llg_full_step)
            if not torch.equal(allowed_ours, logits):
                raise AssertionError(f"masks differ at step {k} ({len(steps)} steps)")
    return {
        "steps": len(contexts),
        "ours_us": _per_step(ours, min),
        "llg_us": _per_step(theirs, min),
        "ours_median_us": _per_step(ours, statistics.median),
        "llg_median_us": _per_step(theirs, statistics.median),
        "first_ours_ms": first_ours / 1000,
        "first_llg_ms": first_llg / 1000,
    }


def _per_step(times: list[list[float]], pick: Callable[[list[float]], float]) -> float:
    """Mean over steps of ``pick`` (min or median) over the repeats of each step."""
    return statistics.mean(pick([rep[k] for rep in times]) for k in range(len(times[0])))


def apply_only(vocab: int, batch: int, repeats: int = 200) -> tuple[float, float]:
    """Microseconds to apply one random mask: logitscope's table kernel against llguidance's compiled one."""
    mask = torch.randint(-(2**31), 2**31 - 1, (batch, (vocab + 31) // 32), dtype=torch.int32)
    logits = torch.randn(batch, vocab)
    for _ in range(5):
        apply_bitmask_(logits, mask, vocab)
        llg_torch.apply_token_bitmask_inplace(logits, mask)
    ours, theirs = [], []
    for _ in range(repeats):
        ours.append(_time(lambda: apply_bitmask_(logits, mask, vocab)))
        theirs.append(_time(lambda: llg_torch.apply_token_bitmask_inplace(logits, mask)))
    return min(ours), min(theirs), statistics.median(ours), statistics.median(theirs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["demo", "32000", "128000"], help="'demo' or vocabulary sizes")
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (default 1: steadier on a shared machine)"
    )
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "logitscope-bench")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    rows = []
    for size in args.sizes:
        if size == "demo":
            tokenizer = demo_tokenizer()
            if tokenizer is None:
                print("demo model not found; using a synthetic 4096-token tokenizer")
                tokenizer = synthetic_tokenizer(4096, args.cache)
        else:
            tokenizer = synthetic_tokenizer(int(size), args.cache)
        vocab = len(tokenizer)
        setup = _time(lambda: llguidance_tokenizer(tokenizer)) / 1e6
        cases = {
            "regex": (
                lambda: RegexLogitsProcessor(PHONE, tokenizer),
                llguidance.grammar_from("regex", PHONE),
                PHONE_TEXT,
            ),
            "json": (
                lambda: JSONLogitsProcessor(PERSON, tokenizer),
                llguidance.grammar_from("json_schema", json.dumps(PERSON)),
                PERSON_TEXT,
            ),
        }
        for name, (make, grammar, text) in cases.items():
            for batch in args.batch:
                result = run_case(tokenizer, make, grammar, text, batch, args.repeats)
                rows.append((vocab, name, batch, result, setup))
        for batch in args.batch:
            ours, theirs, ours_median, theirs_median = apply_only(vocab, batch)
            result = {"ours_us": ours, "llg_us": theirs, "ours_median_us": ours_median, "llg_median_us": theirs_median}
            rows.append((vocab, "apply/rand", batch, result, setup))

    print(f"torch {torch.__version__}, llguidance {llguidance.__version__}, {torch.get_num_threads()} threads")
    print("per-step microseconds: best of the repeats for each step, averaged over the steps (median in brackets)")
    print(
        f"{'vocab':>7} {'case':>10} {'B':>3} {'steps':>5} {'logitscope':>18} {'llguidance':>18} "
        f"{'ratio':>6} {'(median)':>8} {'1st ours ms':>11} {'1st llg ms':>10} {'setup s':>7}"
    )
    for vocab, name, batch, r, setup in rows:
        ours = f"{r['ours_us']:.1f} ({r['ours_median_us']:.1f})"
        theirs = f"{r['llg_us']:.1f} ({r['llg_median_us']:.1f})"
        print(
            f"{vocab:>7} {name:>10} {batch:>3} {r.get('steps', ''):>5} {ours:>18} {theirs:>18} "
            f"{r['ours_us'] / r['llg_us']:>6.2f} {r['ours_median_us'] / r['llg_median_us']:>8.2f} "
            f"{r.get('first_ours_ms', float('nan')):>11.1f} {r.get('first_llg_ms', float('nan')):>10.1f} {setup:>7.2f}"
        )


if __name__ == "__main__":
    main()
