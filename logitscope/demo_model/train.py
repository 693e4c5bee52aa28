"""Train logitscope's tiny demo model from scratch, on CPU, in a few minutes.

What the model is
    A 4-layer GPT-2 (``GPT2LMHeadModel``: 128-dim embeddings, 4 heads,
    256 positions, tied input/output embeddings; about 0.96 M parameters,
    3.9 MB of float32 safetensors) with its own byte-level BPE tokenizer of
    about 1.1 k tokens (asked for 4096, but the template corpus runs out of
    merges first: see :func:`train_tokenizer`).  Spaces and digits are
    tokens of their own.  It is trained on the synthetic corpus of
    :mod:`logitscope.demo_model.corpus` (JSON person records, phone-number
    sentences, small arithmetic, template prose), so it is small enough to
    ship inside the package and to run in tests, yet its next-token
    distributions are worth looking at: near-certain on JSON syntax, spread
    out over names, cities and phone digits.  It writes valid JSON records
    and well-formed phone numbers, but it gets most arithmetic wrong (it has
    not learned the facts in this budget), which is itself something to look
    at.  ``<|endoftext|>`` is token id 0 and serves as the eos, bos and pad
    token.

Why we train our own
    The toolkit's tests and demos must work offline, with no Hugging Face hub,
    and be fast on a laptop CPU.  A committed, reproducible toy model does that.

How long
    The default run (``--steps 1000`` of 32 x 128-token batches, from
    ``--docs 40000`` documents) takes about 4 minutes on 2 otherwise idle CPU
    cores (``torch.set_num_threads(2)``, about 0.21 s a step), and far longer
    when other processes compete for them.  It reaches a training loss of
    about 0.80 nats per token, and it is deterministic for a given ``--seed``
    on the same torch build and thread count.

Regenerate the committed files (from the repository root)::

    python -m logitscope.demo_model.train

which writes ``logitscope/demo_model/files/`` (``--out DIR`` to put it
elsewhere).  The output folder is replaced as a whole: files are first written
into a temporary sibling folder, which is then renamed into place.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from logitscope.demo_model.corpus import EOT, iter_documents, write_corpus

if TYPE_CHECKING:
    from transformers import GPT2LMHeadModel, GPT2TokenizerFast

__all__ = ["TrainResult", "train", "main", "DEFAULT_OUT"]

#: Where ``python -m logitscope.demo_model.train`` writes by default.
DEFAULT_OUT = Path(__file__).resolve().parent / "files"

DEFAULT_SEED = 0
DEFAULT_STEPS = 1000
DEFAULT_DOCS = 40_000
VOCAB_SIZE = 4096  # an upper bound: the corpus runs out of merges first (see train_tokenizer)
SEQ_LEN = 128
BATCH_SIZE = 32
LEARNING_RATE = 3e-3
WARMUP_FRACTION = 0.05
WEIGHT_DECAY = 0.01
LOG_EVERY = 50
NUM_THREADS = 2


@dataclass(frozen=True)
class TrainResult:
    """What :func:`train` reports back."""

    out_dir: Path
    final_loss: float  # mean training loss over the last ``LOG_EVERY`` steps (or fewer)
    steps: int
    wall_seconds: float
    n_rows: int  # number of packed training sequences


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def _read_documents(corpus_path: Path) -> Iterator[str]:
    """Documents of a corpus file written by :func:`write_corpus`, without ``EOT``.

    The tokenizer trainer must not see the literal ``<|endoftext|>`` text, or it
    wastes merges on pieces such as ``<|`` and ``endoftext``.
    """
    text = corpus_path.read_text(encoding="utf-8")
    for doc in text.split(EOT):
        doc = doc.lstrip("\n")
        if doc:
            yield doc


def train_tokenizer(corpus_path: Path, vocab_size: int = VOCAB_SIZE) -> GPT2TokenizerFast:
    """Train a byte-level BPE tokenizer on a corpus file and wrap it for transformers.

    ``<|endoftext|>`` is the first special token, hence id 0, and is used as
    eos, bos and pad.  No bos is prepended on encoding, and decoding does not
    "clean up" spaces, so ``decode(encode(text)) == text`` for any text.

    Unlike GPT-2, every space is a token of its own (``"Call Maria"`` is
    ``Call``, ``" "``, ``Maria``).  GPT-2 glues a space to the next word, so a
    prompt ending in a space (``"Call "``, ``"7 + 5 = "``) ends in a lone
    space token that training text never contains, and a small model then
    continues it badly.  With isolated spaces every prompt, with or without a
    trailing space, is tokenized exactly as in training: no tokenization
    surprises in a debugging demo, at the cost of more tokens per text.

    Digits are single tokens too.  Phone numbers are uniformly random, so a
    multi-digit token such as ``"0134"`` is one of thousands of equally likely
    choices and greedy decoding would prefer any slightly-too-likely
    non-digit token; one digit at a time is a 10-way choice, and greedy
    decoding of ``"Call Maria at "`` really produces a phone number.

    ``vocab_size`` is an upper bound.  With digits and spaces split off, the
    template corpus only has a few hundred distinct words, and merges stop
    once every word that occurs at least twice is a single token, at about
    1.1 k tokens for the default corpus.  The model's ``vocab_size`` is taken
    from the tokenizer, so the two always agree.
    """
    from tokenizers import ByteLevelBPETokenizer, pre_tokenizers
    from transformers import GPT2TokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe._tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(" ", behavior="isolated"),
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    bpe.train_from_iterator(
        _read_documents(corpus_path),
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        show_progress=False,
    )
    if bpe.token_to_id(EOT) != 0:  # pragma: no cover - guaranteed by the trainer
        raise RuntimeError(f"expected {EOT!r} to get id 0, got {bpe.token_to_id(EOT)}")
    return GPT2TokenizerFast(
        tokenizer_object=bpe._tokenizer,
        bos_token=EOT,
        eos_token=EOT,
        pad_token=EOT,
        unk_token=EOT,
        model_max_length=256,
        clean_up_tokenization_spaces=False,
    )


def pack_documents(token_docs: Iterable[Sequence[int]], seq_len: int) -> torch.Tensor:
    """Pack tokenized documents into rows of ``seq_len`` tokens.

    Every row starts at the start of a document (so the model learns to begin
    a document with no preceding ``<|endoftext|>``, which is how it is prompted)
    and is filled with the following documents.  The document cut off at the
    end of a row starts the next row, so nothing is lost.  Returns a
    ``(n_rows, seq_len)`` int64 tensor; a short final remainder is dropped.
    """
    stream: list[int] = []
    starts: list[int] = []
    for ids in token_docs:
        starts.append(len(stream))
        stream.extend(ids)
    rows: list[list[int]] = []
    i = 0  # index into ``starts`` of the document that begins the current row
    while i < len(starts) and starts[i] + seq_len <= len(stream):
        begin = starts[i]
        rows.append(stream[begin : begin + seq_len])
        # Next row: the last document starting at or before this row's end, i.e.
        # the one cut off (or the one starting exactly at the end).  A single
        # document longer than a row is skipped past instead of looping forever.
        i = max(i + 1, bisect.bisect_right(starts, begin + seq_len) - 1)
    return torch.tensor(rows, dtype=torch.long)


def _lr_at(step: int, steps: int, warmup: int, peak: float) -> float:
    """Linear warmup to ``peak`` then cosine decay to 10 % of it."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def _make_readable(folder: Path) -> None:
    """Give ``folder`` and its files the usual umask-based modes.

    ``tempfile.mkdtemp`` creates a 0700 folder and some writers create 0600
    files; the shipped model must be readable like any other package data.
    """
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.iterdir():
        path.chmod(0o666 & ~umask)


def _save_atomically(out_dir: Path, model: GPT2LMHeadModel, tokenizer: GPT2TokenizerFast) -> None:
    """Save into a temporary sibling folder, then rename it over ``out_dir``.

    A reader sees either the old folder or the complete new one (apart from the
    instant between the two renames, when it sees none).
    """
    from transformers import GenerationConfig

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        eot = tokenizer.eos_token_id
        GenerationConfig(bos_token_id=eot, eos_token_id=eot, pad_token_id=eot).save_pretrained(tmp)
        _make_readable(tmp)
        old = None
        if out_dir.exists():
            old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
            out_dir.rename(old)
        tmp.rename(out_dir)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def train(
    out_dir: str | Path = DEFAULT_OUT,
    seed: int = DEFAULT_SEED,
    steps: int = DEFAULT_STEPS,
    n_docs: int = DEFAULT_DOCS,
    *,
    batch_size: int = BATCH_SIZE,
    seq_len: int = SEQ_LEN,
    lr: float = LEARNING_RATE,
    log_every: int = LOG_EVERY,
    num_threads: int | None = NUM_THREADS,
    verbose: bool = True,
) -> TrainResult:
    """Build the corpus and tokenizer, train the model, and save everything to ``out_dir``.

    Deterministic for a given ``seed`` on a given torch build and thread count.
    ``num_threads=None`` leaves torch's thread setting alone.
    """
    from transformers.utils import logging as hf_logging

    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    for name, value in (
        ("steps", steps),
        ("n_docs", n_docs),
        ("batch_size", batch_size),
        ("seq_len", seq_len),
        ("log_every", log_every),
    ):
        _check_positive(name, value)
    if seq_len > 256:
        raise ValueError(f"seq_len must be <= 256 (n_positions), got {seq_len}")
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    out_dir = Path(out_dir).resolve()

    def log(msg: str) -> None:
        if verbose:
            print(msg, flush=True)

    t0 = time.perf_counter()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    torch.manual_seed(seed)
    verbosity, progress_bar = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # silence config chatter such as "loss_type=None"
    hf_logging.disable_progress_bar()  # no "Writing model shards" bar
    try:
        result = _train(out_dir, seed, steps, n_docs, batch_size, seq_len, lr, log_every, log, t0)
    finally:
        hf_logging.set_verbosity(verbosity)
        if progress_bar:
            hf_logging.enable_progress_bar()
    return result


def _train(
    out_dir: Path,
    seed: int,
    steps: int,
    n_docs: int,
    batch_size: int,
    seq_len: int,
    lr: float,
    log_every: int,
    log: Callable[[str], None],
    t0: float,
) -> TrainResult:
    """The body of :func:`train`, once arguments are checked and logging is set up."""
    from transformers import GPT2Config, GPT2LMHeadModel

    with tempfile.TemporaryDirectory(prefix="logitscope-demo-corpus-") as tmp:
        corpus_path = write_corpus(Path(tmp) / "corpus.txt", n_docs, seed)
        tokenizer = train_tokenizer(corpus_path)
    eot = tokenizer.eos_token_id
    token_docs = (tokenizer(doc)["input_ids"] for doc in iter_documents(n_docs, seed))
    rows = pack_documents(token_docs, seq_len)
    if len(rows) == 0:
        raise ValueError(f"n_docs={n_docs} is too small to fill one {seq_len}-token sequence")
    log(f"corpus: {n_docs} documents -> {len(rows)} sequences of {seq_len} tokens ({time.perf_counter() - t0:.1f}s)")

    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_embd=128,
        n_layer=4,
        n_head=4,
        n_positions=256,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
    )
    with _deterministic():
        model = GPT2LMHeadModel(config)
        model.train()
        decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
            lr=lr,
            betas=(0.9, 0.98),
        )
        warmup = max(1, int(steps * WARMUP_FRACTION))
        gen = torch.Generator().manual_seed(seed)
        order = torch.randperm(len(rows), generator=gen)
        cursor = 0
        recent: list[float] = []
        for step in range(steps):
            if cursor + batch_size > len(order):
                order = torch.randperm(len(rows), generator=gen)
                cursor = 0
            batch = rows[order[cursor : cursor + batch_size]]
            cursor += batch_size
            for group in optimizer.param_groups:
                group["lr"] = _lr_at(step, steps, warmup, lr)
            loss = model(input_ids=batch, labels=batch).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            recent = (recent + [loss.item()])[-log_every:]
            if (step + 1) % log_every == 0 or step == 0:
                log(
                    f"step {step + 1:5d}/{steps}  loss {loss.item():.4f}  "
                    f"lr {optimizer.param_groups[0]['lr']:.2e}  {time.perf_counter() - t0:6.1f}s"
                )
    final_loss = sum(recent) / len(recent)

    model.eval()
    _save_atomically(out_dir, model, tokenizer)
    wall = time.perf_counter() - t0
    log(f"final loss {final_loss:.4f} (mean of last {len(recent)} steps); saved to {out_dir} in {wall:.1f}s total")
    return TrainResult(out_dir=out_dir, final_loss=final_loss, steps=steps, wall_seconds=wall, n_rows=len(rows))


@contextlib.contextmanager
def _deterministic() -> Iterator[None]:
    """``torch.use_deterministic_algorithms(True)`` inside the block, restored after it."""
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: ``python -m logitscope.demo_model.train``."""
    parser = argparse.ArgumentParser(
        prog="python -m logitscope.demo_model.train",
        description="Train logitscope's tiny demo GPT-2 and its tokenizer from a synthetic corpus.",
    )
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"output folder, replaced as a whole (default: {DEFAULT_OUT})"
    )
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="random seed (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="optimizer steps (default: %(default)s)")
    parser.add_argument(
        "--docs", type=int, default=DEFAULT_DOCS, help="number of corpus documents (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    train(args.out, seed=args.seed, steps=args.steps, n_docs=args.docs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
