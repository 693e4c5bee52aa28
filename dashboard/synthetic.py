"""Runs made without a model: small hand-made ones for tests, large streamed ones for benchmarks.

:func:`hand_made_run` feeds given logits through the real
:class:`tracker.LogitTrackingProcessor` (so the run is exactly what the
tracker records) and names the tokens; :func:`write_large_run` streams a run
of any length and vocabulary straight to Parquet or Arrow IPC in the
tracker's schema, block by block, so that a 10,000-step run at a 128k
vocabulary never has to fit in memory.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

import tracker
from processors import BatchContext
from tracker import Vocabulary
from tracker.format.dataset import open_table
from tracker.format.schema import META_RUN, META_VOCAB, RunMetadata, run_schema
from tracker.format.spill import atomic_path

__all__ = ["hand_made_run", "write_large_run", "large_run_metadata", "write_run_dataset"]


class _Rows:
    """A transformers-style processor returning given rows, ``constrained[sequence, step]``, step by step."""

    def __init__(self) -> None:
        self.constrained = np.zeros((0, 0, 0), dtype=np.float32)
        self.step = 0

    def start(self, constrained: np.ndarray) -> None:
        self.constrained, self.step = constrained, 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = torch.as_tensor(self.constrained[:, self.step], dtype=scores.dtype)
        self.step += 1
        return out


def hand_made_run(
    natural: np.ndarray,
    chosen: np.ndarray | Sequence[Sequence[int]],
    tokens: Sequence[str],
    *,
    constrained: np.ndarray | None = None,
    eos_token_id: int | None = None,
    storage: Literal["float32", "float16", "bfloat16", "topk"] = "float32",
    top_k: int = 4,
    prompt: Sequence[int] = (0,),
    generations: int = 1,
    title: str = "hand-made run",
) -> tracker.Run:
    """A run recorded by the tracker from given logits.

    Args:
        natural: the logits the "model" produced: ``[T, V]``, ``[B, T, V]``
            (a batch of ``B`` sequences) or ``[G, B, T, V]`` (``G`` generations).
        chosen: the tokens chosen at each step: ``natural``'s shape without ``V``.
        tokens: the ``V`` token texts.
        constrained: the wrapped processor's output, shaped like ``natural``
            (``-inf`` masks a token); None records no processor.
        eos_token_id: the end-of-sequence id, if any.
        storage, top_k: the tracker's storage mode.
        prompt: prompt token ids (every row gets the same).
        generations: with a 2-D or 3-D ``natural``, how many generations repeat it.
        title: stored in the run's metadata (``extra["title"]``).
    """
    nat = np.asarray(natural, dtype=np.float32)
    picks = np.asarray(chosen, dtype=np.int64)
    if nat.ndim not in (2, 3, 4) or picks.shape != nat.shape[:-1]:
        raise ValueError(
            f"natural must be [T, V], [B, T, V] or [G, B, T, V] and chosen its shape without V; "
            f"got natural {nat.shape}, chosen {picks.shape}"
        )
    while nat.ndim < 4:
        nat, picks = nat[None], picks[None]
    con = None if constrained is None else np.asarray(constrained, dtype=np.float32).reshape(nat.shape)
    if nat.shape[0] == 1 and generations > 1:
        nat, picks = np.repeat(nat, generations, 0), np.repeat(picks, generations, 0)
        con = None if con is None else np.repeat(con, generations, 0)
    vocab = nat.shape[-1]
    if len(tokens) != vocab:
        raise ValueError(f"tokens must name every one of the {vocab} ids, got {len(tokens)}")
    processor = None if con is None else _Rows()
    track = tracker.LogitTrackingProcessor(
        processor, storage=storage, top_k=top_k, eos_token_id=eos_token_id, memory_limit=None, model="hand-made"
    )
    track.annotate(sampling={"temperature": 0.0}, title=title)
    for g in range(nat.shape[0]):
        if processor is not None:
            processor.start(con[g])  # type: ignore[index]
        ids = torch.tensor([list(prompt)] * nat.shape[1], dtype=torch.long)
        for step in range(nat.shape[2]):
            ctx = BatchContext(input_ids=ids, prompt_length=len(prompt))
            track.process(torch.from_numpy(nat[g, :, step].copy()), ctx)
            picked = torch.from_numpy(picks[g, :, step].copy())
            track.on_sampled(picked, ctx)
            ids = torch.cat([ids, picked[:, None]], dim=1)
        track.reset()
    recorded = track.run
    vocabulary = Vocabulary.from_parts([t.encode("utf-8") for t in tokens])
    return tracker.Run(recorded.to_arrow().to_batches(), recorded.metadata, vocabulary)


def large_run_metadata(steps: int, vocab_size: int, *, storage: str = "float32", top_k: int = 0) -> RunMetadata:
    """Metadata of a :func:`write_large_run` run (one generation, one sequence, natural and constrained)."""
    now = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    return RunMetadata(
        run_id=f"synthetic-{steps}x{vocab_size}",
        storage=storage,
        top_k=top_k,
        stages=["natural", "constrained"],
        vocab_size=vocab_size,
        eos_token_ids=[],
        model="synthetic",
        processors="AllowedWindow(1024 tokens)",
        sampling={"temperature": 0.0},
        generations=[{"generation": 0, "batch_size": 1, "prompt_ids": [[1, 2, 3]], "started_at": now}],
        library_version="synthetic",
        created_at=now,
        extra={"title": f"synthetic {steps:,} steps x {vocab_size:,} tokens"},
    )


def _blocks(
    steps: int, vocab_size: int, rows: int, allowed: int, seed: int
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Blocks of (step numbers, natural [n, V], constrained [n, V]) with a moving window of allowed tokens."""
    rng = np.random.default_rng(seed)
    pool = rng.standard_normal((rows, vocab_size), dtype=np.float32) * 2.0
    for start in range(0, steps, rows):
        n = min(rows, steps - start)
        step_ids = np.arange(start, start + n, dtype=np.int32)
        natural = pool[:n].copy()
        natural[np.arange(n), (step_ids * 7919) % vocab_size] += 8.0  # the model's favourite
        constrained = np.full_like(natural, -np.inf)
        for i, step in enumerate(step_ids.tolist()):
            lo = (step * 131) % max(1, vocab_size - allowed)
            constrained[i, lo : lo + allowed] = natural[i, lo : lo + allowed]
        yield step_ids, natural, constrained


def _record_batch(
    schema: pa.Schema, step_ids: np.ndarray, natural: np.ndarray, constrained: np.ndarray
) -> pa.RecordBatch:
    n, vocab = natural.shape
    chosen = constrained.argmax(axis=1).astype(np.int64)
    columns = {
        "generation": pa.array(np.zeros(n, np.int32)),
        "sequence": pa.array(np.zeros(n, np.int32)),
        "step": pa.array(step_ids),
        "chosen": pa.array(chosen),
        "processor_error": pa.array(np.zeros(n, bool)),
    }
    for stage, values in (("natural", natural), ("constrained", constrained)):
        columns[f"{stage}_logits"] = pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), vocab)
        columns[f"{stage}_nonfinite"] = pa.array(np.zeros(n, bool))
    return pa.RecordBatch.from_arrays([columns[name] for name in schema.names], schema=schema)


def write_large_run(
    path: str | Path,
    steps: int,
    vocab_size: int,
    *,
    rows_per_block: int | None = None,
    allowed: int = 1024,
    seed: int = 0,
    compression: str | None = "zstd",
) -> Path:
    """Stream a synthetic float32 run to ``path`` (``.parquet``, or ``.arrow`` for Arrow IPC), atomically.

    ``rows_per_block`` is the Parquet row-group size or the IPC batch size; by
    default the tracker's rule (about 8 MiB of values per row group).
    Returns the path.
    """
    if steps < 1 or vocab_size < 2:
        raise ValueError(f"steps must be >= 1 and vocab_size >= 2, got steps={steps}, vocab_size={vocab_size}")
    target = Path(path)
    metadata = large_run_metadata(steps, vocab_size)
    vocab = Vocabulary.placeholder(vocab_size)
    schema = run_schema(
        "float32", metadata.stages, vocab_size, 0, {META_RUN: metadata.to_json(), META_VOCAB: vocab.serialize()}
    )
    rows = rows_per_block or max(1, (8 << 20) // (vocab_size * 4 * len(metadata.stages)))
    blocks = _blocks(steps, vocab_size, rows, min(allowed, vocab_size), seed)
    with atomic_path(target) as tmp:
        if target.suffix in (".arrow", ".feather", ".ipc"):
            with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
                for block in blocks:
                    writer.write_batch(_record_batch(schema, *block))
        else:
            with pq.ParquetWriter(
                tmp,
                schema,
                compression=compression,
                use_dictionary=["generation", "sequence"],
                write_statistics=["generation", "sequence", "step", "chosen"],
                store_schema=False,  # the run files' layout (tracker.format.columns): the vocabulary once
            ) as writer:
                for block in blocks:
                    writer.write_batch(_record_batch(schema, *block), row_group_size=rows)
                writer.add_key_value_metadata(schema.metadata)
    return target


#: What :func:`write_run_dataset` varies between runs, for filters to find.
FLEET_MODELS = ("llama-3-8b", "qwen2.5-7b", "mistral-7b", "gemma-2-9b")
FLEET_PROCESSORS = ("none", "JSONSchema", "Regex", "BadWords")


def write_run_dataset(
    root: str | Path, runs: int, *, steps: int = 8, vocab: int = 64, seed: int = 0, start: int = 0
) -> list[str]:
    """Write ``runs`` small recorded runs (numbered from ``start``) into the table at ``root`` (a folder or
    URL), in one commit.

    One run is recorded through the real tracker (random logits, two
    sequences); the others are it under new ids, titles, models, processors
    and dates (what the run browser filters on). Returns the run ids.
    """
    from dataclasses import replace

    recorder = tracker.LogitTrackingProcessor(None)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    for _ in range(steps):
        out = recorder(ids, torch.randn(2, vocab, generator=gen) * 3)
        ids = torch.cat([ids, out.argmax(1, keepdim=True)], 1)
    recorder.finish(ids)
    template = recorder.run
    day = _dt.datetime(2026, 1, 1, tzinfo=_dt.timezone.utc)
    table = open_table(root)
    staged, written = [], []
    for i in range(start, start + runs):
        created = (day + _dt.timedelta(hours=i)).isoformat(timespec="seconds")
        metadata = replace(
            template.metadata,
            run_id=f"{created[:19].replace('-', '').replace(':', '')}-{i:016x}",
            created_at=created,
            model=FLEET_MODELS[i % len(FLEET_MODELS)],
            processors=FLEET_PROCESSORS[(i // len(FLEET_MODELS)) % len(FLEET_PROCESSORS)],
            extra={"title": f"request {i}"},
        )
        staged.append(
            table.stage(tracker.Run(template._record_batches(), metadata, template.vocab).to_arrow(), metadata)
        )
        written.append(metadata.run_id)
    table.commit(staged)
    return written
