"""The recorder: storage modes, chunks, the memory bound and spilling, buffer reuse, and the CUDA path."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from tracker import PartialRunWarning, Run
from tracker.recording.memory import HostPool
from tracker.recording.recorder import Recorder, Storage

CPU = torch.device("cpu")


def fill(recorder: Recorder, steps: int, batch: int, vocab: int, seed: int = 0, end: bool = True):
    gen = torch.Generator().manual_seed(seed)
    natural, constrained = [], []
    for t in range(steps):
        rows = recorder.begin_step(0, t, batch, vocab, CPU)
        x = torch.randn(batch, vocab, generator=gen) * 4
        y = x.clone()
        y[:, ::3] = float("-inf")
        recorder.write(rows, "natural", x)
        recorder.write(rows, "constrained", y, natural=x)
        recorder.set_chosen(rows, torch.arange(batch) + t)
        natural.append(x)
        constrained.append(y)
    if end:
        recorder.end_generation(0)
    return torch.stack(natural, 1), torch.stack(constrained, 1)


def column_matrix(table: pa.Table, name: str, width: int) -> np.ndarray:
    column = table.column(name).combine_chunks()
    return column.values.to_numpy(zero_copy_only=False).reshape(len(column), width)


@pytest.mark.parametrize("kind", ["float32", "float16", "bfloat16"])
def test_full_storage_keeps_rows_exactly_in_the_storage_type(kind):
    recorder = Recorder(Storage.parse(kind), ["natural", "constrained"], chunk_bytes=4096)
    natural, constrained = fill(recorder, steps=9, batch=3, vocab=40)
    table = pa.Table.from_batches(recorder.batches())
    assert len(recorder.batches()) > 1  # several chunks
    assert table.column("step").to_pylist() == [t for t in range(9) for _ in range(3)]
    assert table.column("sequence").to_pylist() == [0, 1, 2] * 9
    assert table.column("chosen").to_pylist() == [t + b for t in range(9) for b in range(3)]
    dtype = getattr(torch, kind)
    stored = column_matrix(table, "constrained_logits", 40)
    if kind == "bfloat16":
        stored = torch.from_numpy(stored.view(np.int16).copy()).view(torch.bfloat16).float().numpy()
    rows = constrained.transpose(0, 1).reshape(-1, 40).float()
    if kind == "float32":
        expected = rows.numpy()
    else:  # half precision keeps each row minus its largest logit (the constrained_max column)
        top = rows.amax(dim=1, keepdim=True)
        expected = (rows - top).to(dtype).float().numpy()
        assert np.array_equal(table.column("constrained_max").to_numpy(), top[:, 0].numpy())
    assert np.array_equal(stored.astype(np.float32), expected)


def test_topk_storage_keeps_ids_values_lse_and_allowed_count():
    recorder = Recorder(Storage.parse("topk", 4), ["natural", "constrained"])
    natural, constrained = fill(recorder, steps=5, batch=2, vocab=30)
    table = pa.Table.from_batches(recorder.batches())
    rows_c = constrained.transpose(0, 1).reshape(-1, 30)
    rows_n = natural.transpose(0, 1).reshape(-1, 30)
    values, ids = torch.topk(rows_c, 4, dim=1)
    assert np.array_equal(column_matrix(table, "constrained_topk_ids", 4), ids.numpy())
    assert np.array_equal(column_matrix(table, "constrained_topk_logits", 4), values.numpy())
    assert np.array_equal(column_matrix(table, "constrained_topk_natural", 4), rows_n.gather(1, ids).numpy())
    np.testing.assert_allclose(
        table.column("constrained_lse").to_numpy(), torch.logsumexp(rows_c.double(), 1), rtol=1e-6
    )
    assert table.column("constrained_allowed").to_pylist() == [20] * 10
    assert table.column("natural_allowed").to_pylist() == [30] * 10


@pytest.mark.parametrize("kind", ["float32", "topk"])
def test_chosen_tokens_that_come_steps_late_get_their_statistics_where_the_storage_can_know_them(kind):
    """An engine may tell the chosen tokens after later steps were recorded (the rows no longer kept): full rows
    give every chosen token's probability and rank; top-k rows give them where the token is among the kept ones
    (or the rows are still kept) and leave the rest unknown (null), never a wrong number."""
    vocab, batch, steps = 500, 4, 3
    recorder = Recorder(Storage.parse(kind, 8), ["natural"])
    rows_of, logits = [], torch.randn(steps, batch, vocab, generator=torch.Generator().manual_seed(5)) * 3
    for t in range(steps):
        rows_of.append(recorder.begin_step(np.arange(batch), np.full(batch, t), batch, vocab, CPU, sequence=0))
        recorder.write(rows_of[-1], "natural", logits[t])
    order = logits.argsort(dim=2, descending=True)
    chosen = torch.stack([order[:, 0, 0], order[:, 1, 3], order[:, 2, 100], order[:, 3, 499]], dim=1)  # ranks
    for t in range(steps):
        recorder.set_chosen(rows_of[t], chosen[t])
    table = pa.Table.from_batches(recorder.batches()).sort_by([("step", "ascending"), ("generation", "ascending")])
    wide = logits.double().reshape(-1, vocab)
    ids = chosen.reshape(-1, 1)
    expected_p = torch.softmax(wide, dim=1).gather(1, ids)[:, 0].numpy()
    rank = np.tile([0, 3, 100, 499], steps)
    known = rank < 8 if kind == "topk" else np.ones(rank.size, dtype=bool)
    known[-batch:] = True  # the last step's rows are still kept when its tokens come: the whole row is known
    p = table.column("natural_p_chosen")
    assert p.is_valid().to_numpy(zero_copy_only=False).tolist() == known.tolist()
    got = p.to_numpy(zero_copy_only=False)[known].astype(np.float64)
    np.testing.assert_allclose(got, expected_p[known], rtol=1e-5)
    assert table.column("natural_rank_chosen").to_numpy(zero_copy_only=False)[known].tolist() == rank[known].tolist()
    assert table.column("natural_chosen_logit").to_numpy(zero_copy_only=False)[known].tolist() == (
        wide.gather(1, ids)[:, 0].float().numpy()[known].tolist()
    )


def test_past_the_memory_bound_finished_chunks_spill_to_ipc_and_read_back(tmp_path):
    recorder = Recorder(
        Storage.parse("float32"),
        ["natural", "constrained"],
        chunk_bytes=6 * 1024,
        memory_limit=16 * 1024,
        spill_dir=tmp_path,
        run_id="r1",
    )
    natural, constrained = fill(recorder, steps=40, batch=2, vocab=64)
    assert recorder.host_bytes <= 16 * 1024 + 6 * 1024 * 2
    files = sorted((tmp_path / "r1").glob("chunk-*.arrow"))
    assert files and recorder.spilled_bytes > 0
    table = pa.Table.from_batches(recorder.batches())
    assert table.num_rows == 80
    got = column_matrix(table, "natural_logits", 64)
    assert np.array_equal(got, natural.transpose(0, 1).reshape(-1, 64).numpy())
    recorder.clear()
    assert not (tmp_path / "r1").exists()


def test_a_crashed_run_leaves_its_spilled_chunks_readable(tmp_path):
    from tracker import LogitTrackingProcessor

    tracker = LogitTrackingProcessor(None, memory_limit=0, chunk_bytes=2048, spill_dir=tmp_path)
    gen = torch.Generator().manual_seed(1)
    ids = torch.tensor([[1, 2]])
    seen = []
    for _ in range(20):
        logits = torch.randn(1, 50, generator=gen)
        seen.append(logits)
        ids = torch.cat([ids, tracker(ids, logits).argmax(1, keepdim=True)], 1)
    folder = tmp_path / tracker.run_id
    tracker.recorder.flush()  # the chunks queued for the disk are written (else the writer may be mid-file)
    del tracker  # the process "dies": only what reached the disk is left
    with pytest.warns(PartialRunWarning, match="is a spill folder: it holds the rows that had spilled to disk"):
        run = Run.load(folder)  # a shorter run than was recorded, and it says so
    n = run.num_rows
    assert 0 < n < 20
    np.testing.assert_array_equal(run.get_logits(include_finished=True)["unstructured"], torch.cat(seen[:n]).numpy())
    assert run.stats()["chosen_id"].tolist() == ids[0, 2 : 2 + n].tolist()
    # no tokenizer: the folder carries no vocabulary table (nothing a placeholder would add), tokens read as <id>
    assert not (folder / "_vocab.arrow").exists()
    assert run.get_top_tokens(k=1, positions=0)[0]["tokens"][0]["token"] == f"<{int(seen[0].argmax())}>"


def test_a_spilled_run_carries_its_tokenizers_vocabulary(tmp_path, char_tokenizer):
    from tracker import LogitTrackingProcessor

    tracker = LogitTrackingProcessor(
        None, tokenizer=char_tokenizer, memory_limit=0, chunk_bytes=2048, spill_dir=tmp_path
    )
    logits = torch.full((1, 128), -5.0)
    logits[0, ord("q")] = 5.0
    ids = torch.tensor([[ord("a")]])
    for _ in range(8):
        ids = torch.cat([ids, tracker(ids, logits).argmax(1, keepdim=True)], 1)
    tracker.recorder.flush()
    with pytest.warns(PartialRunWarning):
        run = Run.load(tmp_path / tracker.run_id)
    assert run.num_rows >= 1
    assert run.get_top_tokens(k=1, positions=0)[0]["tokens"][0]["token"] == "q"


def test_buffers_are_reused_after_clear_but_never_under_a_table_someone_holds():
    recorder = Recorder(Storage.parse("float32"), ["natural", "constrained"], chunk_bytes=1 << 20, pool=HostPool())
    fill(recorder, steps=4, batch=1, vocab=1 << 14, seed=1)
    held = pa.Table.from_batches(recorder.batches())
    snapshot = column_matrix(held, "natural_logits", 1 << 14).copy()
    allocated = recorder._pool.allocated_bytes
    recorder.clear()
    fill(recorder, steps=4, batch=1, vocab=1 << 14, seed=2)
    assert recorder._pool.allocated_bytes > allocated  # the held table's buffers were not reused
    assert np.array_equal(column_matrix(held, "natural_logits", 1 << 14), snapshot)
    del held
    recorder.clear()
    allocated = recorder._pool.allocated_bytes
    fill(recorder, steps=4, batch=1, vocab=1 << 14, seed=3)
    assert recorder._pool.allocated_bytes == allocated  # nothing held: warm buffers reused


def fill_natural(recorder: Recorder) -> None:
    for t in range(40):
        recorder.write(recorder.begin_step(0, t, 1, 4096, CPU), "natural", torch.randn(1, 4096))


def test_a_new_recorder_reuses_the_memory_of_one_that_was_collected():
    pool = HostPool()
    first = Recorder(Storage.parse("float32"), ["natural"], chunk_bytes=1 << 20, pool=pool)
    fill_natural(first)
    allocated = pool.allocated_bytes
    del first
    second = Recorder(Storage.parse("float32"), ["natural"], chunk_bytes=1 << 20, pool=pool)
    fill_natural(second)
    assert pool.allocated_bytes == allocated


@pytest.mark.parametrize("nbytes", [1 << 16, 4 << 20])  # heap and mapped buffers
def test_buffer_pool_hands_back_only_unreferenced_buffers(nbytes):
    pool = HostPool()
    buf = pool.take(nbytes)
    view = torch.from_numpy(buf.owner).view(torch.float32).view(16, nbytes // 64)
    arrow = pa.array(view[:2].numpy().reshape(-1))
    pool.give(buf)
    del view
    assert pool.take(nbytes) is not buf  # the Arrow array still views it
    del arrow
    assert pool.take(nbytes) is buf


def test_vocabulary_size_change_is_an_error_naming_both_sizes():
    recorder = Recorder(Storage.parse("float32"), ["natural"])
    recorder.begin_step(0, 0, 1, 10, CPU)
    with pytest.raises(ValueError, match="vocabulary size changed from 10 to 11"):
        recorder.begin_step(0, 1, 1, 11, CPU)


def test_storage_validation_names_the_value():
    with pytest.raises(ValueError, match="storage must be one of"):
        Storage.parse("int8")
    with pytest.raises(ValueError, match="top_k must be an int >= 1"):
        Storage.parse("topk", 0)


class SimulatedStaging:
    """The CUDA staging bookkeeping on host memory: counts events recorded and waits."""

    def __init__(self):
        self.marks = 0
        self.waits = 0
        self.slots = 0

    def empty(self, nbytes):
        self.slots += 1
        return torch.full((nbytes,), 0xF7, dtype=torch.uint8)  # garbage, as a reused slot would hold

    def mark(self, chunk):
        self.marks += 1
        chunk.events[0] = "recorded"

    def wait(self, chunk):
        self.waits += 1


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "topk"])
def test_the_staging_ring_drains_only_when_full_or_read_and_records_the_same_rows(kind):
    staging = SimulatedStaging()
    ring = Recorder(Storage.parse(kind, 5), ["natural", "constrained"], chunk_bytes=4 * 1024, ring_slots=2)
    ring.staging_for = lambda device: staging  # the CUDA path's bookkeeping, on the CPU
    direct = Recorder(Storage.parse(kind, 5), ["natural", "constrained"], chunk_bytes=4 * 1024)
    gen = torch.Generator().manual_seed(0)
    previous = {}
    for t in range(60):
        x = torch.randn(2, 50, generator=gen)
        y = x.masked_fill(x < 0, float("-inf"))
        for rec in (ring, direct):
            if t:
                rec.set_chosen(previous[rec], y.argmax(1))  # learnt at the next step, as from input_ids
            rows = previous[rec] = rec.begin_step(0, t, 2, 50, CPU)
            rec.write(rows, "natural", x)
            rec.write(rows, "constrained", y, natural=x)
        if t == 30:
            assert pa.Table.from_batches(ring.batches()).equals(pa.Table.from_batches(direct.batches()))
    chunks = len(ring._chunks)
    assert staging.slots <= 2  # the ring's slots, reused (made by an earlier test, or here)
    assert staging.waits <= chunks + 1 < 60  # once per chunk drained, never per step
    assert staging.marks >= 60 * 2
    assert pa.Table.from_batches(ring.batches()).equals(pa.Table.from_batches(direct.batches()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["float32", "float16", "bfloat16", "topk"])
def test_cuda_path_records_what_a_synchronous_copy_records(kind):
    device = torch.device("cuda")
    recorder = Recorder(Storage.parse(kind, 5), ["natural", "constrained"], chunk_bytes=64 * 1024, ring_slots=2)
    reference = Recorder(Storage.parse(kind, 5), ["natural", "constrained"], chunk_bytes=64 * 1024)
    gen = torch.Generator(device=device).manual_seed(0)
    for t in range(50):
        x = torch.randn(3, 1000, device=device, generator=gen)
        y = x.masked_fill(x < 0, float("-inf"))
        for rec, dev in ((recorder, device), (reference, CPU)):
            rows = rec.begin_step(0, t, 3, 1000, dev)
            rec.write(rows, "natural", x.to(dev))
            rec.write(rows, "constrained", y.to(dev), natural=x.to(dev))
            rec.set_chosen(rows, y.argmax(1).to(dev))
    got = pa.Table.from_batches(recorder.batches())
    want = pa.Table.from_batches(reference.batches())
    for name in want.column_names:
        if pa.types.is_floating(want.schema.field(name).type):
            # a row statistic (log-sum-exp, entropy, probabilities): a reduction, which the GPU orders otherwise
            # than the CPU, so equal to float32 rounding; the values, ids and counts are bit-exact
            np.testing.assert_allclose(
                got.column(name).to_numpy(), want.column(name).to_numpy(), rtol=1e-5, err_msg=name
            )
        else:
            assert got.column(name).equals(want.column(name)), name


@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["float32", "float16", "bfloat16", "topk"])
def test_any_logits_dtype_into_any_storage(logits_dtype, kind):
    from tracker import LogitTrackingProcessor

    tracker = LogitTrackingProcessor(None, storage=kind, top_k=4)
    gen = torch.Generator().manual_seed(9)
    x = (torch.randn(2, 40, generator=gen) * 3).to(logits_dtype)
    tracker(torch.tensor([[1], [2]]), x)
    got = tracker.get_logits(sequence=1)["unstructured"][0]
    if kind == "topk":
        values, _ = torch.topk(x[1].float(), 4)  # half-precision rows tie: any of the tied ids may be kept
        kept = ~np.isnan(got)
        assert kept.sum() == 4 and np.array_equal(np.sort(got[kept])[::-1], values.numpy())
        assert np.array_equal(got[kept], x[1].float().numpy()[kept])
    elif kind == "float32":
        assert np.array_equal(got, x[1].float().numpy())
    else:  # kept minus the row's largest logit, rounded, read back plus it
        top = x[1].float().max()
        expected = (x[1].float() - top).to(getattr(torch, kind)).float().numpy() + np.float32(top)
        assert np.array_equal(got, expected) and got.max() == np.float32(top)


def test_a_collected_recorder_gives_its_buffers_back_without_taking_the_pools_lock():
    """The cyclic garbage collector runs finalizers inside whatever code allocates, the pool's own included: a
    finalizer that took the pool's lock there froze the process. It must return at once."""
    import gc
    import threading

    pool = HostPool()
    recorder = Recorder(Storage.parse("float32"), ["natural"], pool=pool)
    recorder.write(recorder.begin_step(0, 0, 1, 64, CPU), "natural", torch.randn(1, 64))
    recorder.cycle = recorder  # only the cyclic collector frees it
    del recorder

    def collect_holding_the_pools_lock():
        with pool._lock:  # as take() holds it while it allocates, when the collector may run
            gc.collect()

    thread = threading.Thread(target=collect_holding_the_pools_lock, daemon=True)
    thread.start()
    thread.join(20)
    assert not thread.is_alive(), "the recorder's finalizer waited for the pool's lock: a deadlock"
    assert pool.free_bytes > 0  # its buffers went back


def test_a_dropped_recorder_gives_its_pinned_slots_back_to_the_devices_ring():
    """The ring is the process's, one per device: slots of a recorder dropped while its chunks were still staging
    come back (after their copies), so the next recorder does not make pinned memory beyond the ring."""
    import gc

    from tracker.recording.memory import ring_for

    first, second = SimulatedStaging(), SimulatedStaging()
    for staging in (first, second):
        recorder = Recorder(Storage.parse("float32"), ["natural"], chunk_bytes=4 * 1024, ring_slots=2)
        recorder.staging_for = lambda device, s=staging: s
        for t in range(40):
            recorder.write(recorder.begin_step(0, t, 2, 50, CPU), "natural", torch.randn(2, 50))
        del recorder
        gc.collect()
    ring = ring_for(CPU, 2, 0)
    assert second.slots == 0 and ring.made <= 2  # the second recorder reused the first one's slots
