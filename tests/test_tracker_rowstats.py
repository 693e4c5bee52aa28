"""Record-time row statistics and top-k selection (``tracker.recording.record_stats``) against float64 and
``torch.topk`` references.

CPU rows take the ``_rowstats`` extension's passes; accelerators (and a CPU without the extension) take torch
kernels (run here on CPU tensors). Both must give what a straightforward float64 computation gives, on
ordinary, masked and edge rows (NaN, ``+inf``, nothing allowed, one token allowed), at every row length. The
CPU's top-k must keep the same values as ``torch.topk``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tracker.recording.record_stats as record_stats
from tracker import LogitTrackingProcessor
from tracker.recording.modes import Storage
from tracker.recording.record_stats import CHOSEN_STATS, ROW_STATS, chosen_stats, row_stats, stored_lse, top_k

NEG = -np.inf


@pytest.fixture(params=["extension", "torch"])
def path(request, monkeypatch):
    """Each test runs through the CPU's C extension (where built) and the torch kernels an accelerator (or a
    CPU without the extension) runs."""
    if request.param == "extension" and record_stats._rowstats is None:
        pytest.skip("the _rowstats extension is not built here")
    if request.param == "torch":
        monkeypatch.setattr(record_stats, "_rowstats", None)
    return request.param


def test_the_extension_is_built_where_a_compiler_is():
    """setup.py builds it wherever a C compiler is found (CI included)."""
    import platform
    import shutil
    import sys

    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "AMD64", "aarch64"):
        pytest.skip("built and checked on Linux")
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: the statistics are torch's")
    assert record_stats._rowstats is not None, "tracker.recording._rowstats was not built: `pip install -e .`"


def _chosen_args(ids=(2, 1), kept=None, id_type=np.int64):
    """``chosen_stats``'s arguments for two rows of 8 tokens, with one of them the wrong shape or type."""
    f32 = np.float32
    k = None if kept is None else np.zeros(kept, f32)
    return np.zeros((2, 8), f32), np.zeros(ids, id_type), np.zeros((2, 8), f32), k, np.zeros((2, 3), f32)


def _half_args(offset=None, bits=None, kind=0):
    """``half_rows``'s arguments for two rows of 8 tokens, with one of them the wrong shape, type or value."""
    f32 = np.float32
    offset = np.zeros((2, 1), f32) if offset is None else offset
    bits = np.zeros((2, 8), np.int16) if bits is None else bits
    return np.zeros((2, 8), f32), offset, bits, np.zeros((2, 1), f32), kind


@pytest.mark.parametrize(
    "call",
    [
        lambda ext: ext.row_stats(np.zeros((2, 8)), None, np.zeros((2, 8), np.float32)),  # float64 rows
        lambda ext: ext.row_stats(np.zeros(8, np.float32), None, np.zeros((1, 8), np.float32)),  # one dimension
        lambda ext: ext.row_stats(np.zeros((2, 8), np.float32), None, np.zeros((3, 8), np.float32)),  # wrong out
        lambda ext: ext.row_stats(np.zeros((2, 16), np.float32)[:, ::2], None, np.zeros((2, 8), np.float32)),
        lambda ext: ext.row_stats(np.zeros((2, 8), np.float32), np.array([[8]]), np.zeros((2, 8), np.float32)),
        lambda ext: ext.row_stats(np.zeros((2, 8), np.float32), np.array([[-1]]), np.zeros((2, 8), np.float32)),
        lambda ext: ext.half_rows(*_half_args(kind=2)),  # neither float16 nor bfloat16
        lambda ext: ext.half_rows(*_half_args(bits=np.zeros((2, 8), np.int32))),
        lambda ext: ext.half_rows(*_half_args(bits=np.zeros((2, 7), np.int16))),
        lambda ext: ext.half_rows(*_half_args(offset=np.zeros((3, 1), np.float32))),
        lambda ext: ext.pair_stats(
            np.zeros((2, 8), np.float32), np.zeros((2, 9), np.float32), np.zeros((2, 3), np.float32)
        ),
        lambda ext: ext.top_k(np.zeros((2, 8), np.float32), np.zeros((2, 9), np.float32), np.zeros((2, 9), np.int64)),
        lambda ext: ext.top_k(np.zeros((2, 8), np.float32), np.zeros((2, 3), np.float32), np.zeros((2, 3), np.int32)),
        lambda ext: ext.chosen_stats(*_chosen_args(ids=(3, 1))),  # ids of another batch
        lambda ext: ext.chosen_stats(*_chosen_args(kept=(3, 4))),  # kept of another batch
        lambda ext: ext.chosen_stats(*_chosen_args(id_type=np.int32)),  # int32 ids
    ],
)
def test_the_extension_refuses_buffers_it_cannot_read(call):
    if record_stats._rowstats is None:
        pytest.skip("the _rowstats extension is not built here")
    with pytest.raises((ValueError, BufferError)):
        call(record_stats._rowstats)


def reference(x: np.ndarray, eos: list[int], natural: np.ndarray | None) -> np.ndarray:
    """:data:`ROW_STATS` of each row in float64, from their definitions: NaN weighs nothing (and is
    counted), a row holding ``+inf`` is a one-hot on its ``+inf`` tokens, ``-inf`` is masked."""
    out = np.full((x.shape[0], len(ROW_STATS)), np.nan)
    for r, row in enumerate(x.astype(np.float64)):
        nan = np.isnan(row)
        vals = np.where(nan, NEG, row)
        top = vals.max()
        if top == np.inf:
            p = (vals == np.inf) / (vals == np.inf).sum()
            lse, allowed, entropy = np.inf, (vals == np.inf).sum(), np.log((vals == np.inf).sum())
        elif top == NEG:
            p, lse, allowed, entropy = np.zeros_like(vals), NEG, 0, np.nan
        else:
            lse = top + np.log(np.exp(vals - top).sum())
            p = np.exp(vals - lse)
            allowed = (vals > NEG).sum()
            entropy = -(p[p > 0] * np.log(p[p > 0])).sum()
        removed = margin = np.nan
        if natural is not None:
            nat = natural[r].astype(np.float64)
            nat = np.where(np.isnan(nat), NEG, nat)
            if (nat == np.inf).any():
                nat = np.where(nat == np.inf, 0.0, NEG)
            gone = ~(vals > NEG)
            if nat.max() == NEG:
                removed = 0.0
            else:
                q = np.exp(nat - nat.max())
                removed = q[gone].sum() / q.sum()
            kept = nat[~gone].max() if (~gone).any() else NEG
            with np.errstate(invalid="ignore"):  # nothing allowed in either row: -inf - -inf, NaN
                margin = nat.max() - kept
        out[r] = [lse, allowed, top, entropy, nan.sum(), p[eos].sum() if eos else np.nan, removed, margin]
    return out


def edge_rows(rng: np.random.Generator, vocab: int) -> np.ndarray:
    """Ordinary, peaked, masked and edge rows of ``vocab`` float32 logits."""
    rows = [
        rng.normal(scale=3.0, size=vocab),
        rng.normal(scale=25.0, size=vocab),  # peaked: most tokens far below the best
        np.where(rng.random(vocab) < 0.6, NEG, rng.normal(scale=2.0, size=vocab)),  # masked
        np.full(vocab, NEG),  # nothing allowed
        np.where(np.arange(vocab) == rng.integers(vocab), 4.0, NEG),  # one token allowed
        np.where(rng.random(vocab) < 0.02, np.nan, rng.normal(size=vocab)),  # NaN entries
        np.where(np.arange(vocab) % 7 == 3, np.inf, rng.normal(size=vocab)),  # +inf entries
        np.full(vocab, 1e-3),  # flat
    ]
    return np.stack(rows).astype(np.float32)


@pytest.mark.parametrize("vocab", [1, 7, 8, 255, 256, 257, 4099, 50257])
def test_row_statistics_equal_float64_on_ordinary_and_edge_rows(path, vocab):
    rng = np.random.default_rng()
    x = edge_rows(rng, vocab)
    natural = x.copy()
    natural[[0, 1, 7]] = rng.normal(scale=3.0, size=(3, vocab)).astype(np.float32)
    masked = rng.random(x.shape) < 0.3
    x[0][masked[0]] = NEG  # a constrained row: the natural row with tokens masked
    # natural rows holding +inf (row 2) or NaN (row 0) only where the constraint masked the token
    natural[2] = rng.normal(size=vocab).astype(np.float32)
    natural[2, x[2] == NEG] = np.inf
    natural[0, x[0] == NEG] = np.nan
    eos = sorted({0, vocab - 1})
    got = row_stats(torch.from_numpy(x), torch.tensor(eos), torch.from_numpy(natural)).numpy()
    want = reference(x, eos, natural)
    np.testing.assert_allclose(got[:, [1, 2, 4]], want[:, [1, 2, 4]])  # allowed, max, NaN count: exact
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, equal_nan=True)
    for r in range(x.shape[0]):  # each row alone too: in a batch, one special row sends every row another way
        one = row_stats(torch.from_numpy(x[r : r + 1]), torch.tensor(eos), torch.from_numpy(natural[r : r + 1]))
        np.testing.assert_allclose(one.numpy()[0], want[r], rtol=2e-5, atol=2e-5, equal_nan=True, err_msg=f"row {r}")
    if path == "extension":  # sums in double: within the float32 result's own rounding and 1e-6 of exp's
        lse, finite = ROW_STATS.index("lse"), np.isfinite(want[:, 0])
        ulp = np.spacing(np.abs(want[finite, lse]).astype(np.float32)).astype(np.float64)
        assert (np.abs(got[finite, lse] - want[finite, lse]) <= ulp + 1e-6).all()


@pytest.mark.parametrize("vocab", [32768, 131072])
def test_large_rows_and_a_batch_equal_float64(path, vocab):
    rng = np.random.default_rng()
    natural = (rng.normal(size=(3, vocab)) * rng.uniform(1, 10, size=(3, 1))).astype(np.float32)
    x = np.where(rng.random((3, vocab)) < rng.uniform(0.05, 0.95, size=(3, 1)), NEG, natural).astype(np.float32)
    got = row_stats(torch.from_numpy(x), None, torch.from_numpy(natural)).numpy()
    want = reference(x, [], natural)
    entropy = ROW_STATS.index("entropy")  # a difference of two sums over 131k float32 terms: ~1e-4 nats
    np.testing.assert_allclose(got[:, entropy], want[:, entropy], rtol=5e-5, atol=1e-6)
    others = [i for i in range(len(ROW_STATS)) if i != entropy]
    np.testing.assert_allclose(got[:, others], want[:, others], rtol=2e-5, atol=1e-6, equal_nan=True)


def test_a_removed_mass_far_below_the_best_token_is_summed_not_lost(path):
    """Masking only tokens 60 nats below the best removes about 1e-26 of the mass, not 0 (nor a clamp's
    residue); masking nothing removes exactly 0."""
    vocab = 4096
    natural = np.zeros((2, vocab), dtype=np.float32)
    natural[:, 1:] = -60.0
    x = natural.copy()
    x[0, 1:11] = NEG  # ten tokens at -60
    got = row_stats(torch.from_numpy(x), None, torch.from_numpy(natural)).numpy()
    removed = got[:, ROW_STATS.index("removed_mass")]
    expected = 10 * np.exp(-60.0) / (1 + (vocab - 1) * np.exp(-60.0))
    assert removed[0] == pytest.approx(expected, rel=1e-4)
    assert removed[1] == 0.0


def test_stored_log_sum_exp_and_chosen_token_statistics_of_half_precision_rows(path):
    """The log-sum-exp of the rows as stored (rounded to float16, minus their best logit) and the chosen
    token's logit, probability and rank."""
    rng = np.random.default_rng()
    x = (rng.normal(scale=4.0, size=(4, 5000))).astype(np.float32)
    x[1, rng.random(5000) < 0.5] = NEG
    t = torch.from_numpy(x)
    stats = row_stats(t, None, None)
    offset = stats[:, ROW_STATS.index("max")]
    kept = (t - offset[:, None]).to(torch.float16)
    stored = stored_lse(kept, stats[:, 0] - offset) + offset
    rounded = kept.double().numpy()
    want = np.log(np.exp(rounded).sum(axis=1)) + offset.double().numpy()
    np.testing.assert_allclose(stored.double().numpy(), want, rtol=1e-6)
    chosen = torch.from_numpy(rng.integers(0, 5000, size=4))
    chosen[1] = int(np.flatnonzero(x[1] > NEG)[0])
    found = chosen_stats(t, chosen, stats).numpy()
    for r in range(4):
        c = int(chosen[r])
        lse = reference(x[r : r + 1], [], None)[0, 0]
        assert found[r, CHOSEN_STATS.index("chosen_logit")] == x[r, c]
        assert found[r, CHOSEN_STATS.index("p_chosen")] == pytest.approx(np.exp(float(x[r, c]) - lse), rel=1e-5)
        assert found[r, CHOSEN_STATS.index("rank_chosen")] == (x[r] > x[r, c]).sum()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 7, 8, 257, 4099])
def test_half_precision_rows_are_torchs_rounding_and_their_log_sum_exp_float64s(path, dtype, vocab):
    """What float16 and bfloat16 storage keep: each row minus its best logit, rounded as torch rounds (bit for
    bit: values near 0, subnormal, past float16's range, masked), with the log-sum-exp of the rounded values
    within float32 rounding of float64's; rows holding NaN or +inf as torch's kernels give them."""
    rng = np.random.default_rng()
    x = edge_rows(rng, vocab)
    x[0] *= np.float32(2e4)  # far past float16's range below the best logit: rounds to -inf there
    x[1, : vocab // 2] = x[1].max() - rng.uniform(0, 1e-4, size=vocab // 2).astype(np.float32)  # subnormal gaps
    for rows in (x[[0, 1, 2, 3, 4, 7]], x):  # without and with the rows that hold NaN or +inf
        t = torch.from_numpy(rows)
        stats = row_stats(t, None, None)
        offset = torch.where(torch.isfinite(stats[:, 2]), stats[:, 2], 0.0)
        kept, stored = record_stats.half_rows(t, stats, offset, dtype)
        want = (t - offset[:, None]).to(dtype)
        assert torch.equal(kept.view(torch.int16), want.view(torch.int16))
        rounded = want.double().numpy()
        rounded = np.where(np.isnan(rounded), NEG, rounded)
        with np.errstate(divide="ignore"):
            lse = np.log(np.exp(rounded).sum(axis=1)) + offset.double().numpy()
        exact = stats[:, 0].double().numpy()
        lse = np.where(np.isfinite(lse) & np.isfinite(exact), lse, exact)  # nothing allowed, +inf: the row's own
        np.testing.assert_allclose(stored[:, 0].double().numpy(), lse, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(stored[:, 1:].numpy(), stats[:, 1:].numpy())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_chosen_token_statistics_of_the_cpu_path_equal_the_device_path(dtype):
    """The CPU's spelling of the chosen token's statistics (the extension's count) and the torch kernels an
    accelerator runs (here on CPU tensors) agree on ordinary, masked, NaN, +inf and empty rows, and on ids
    outside the vocabulary (NaN)."""
    if record_stats._rowstats is None:
        pytest.skip("the _rowstats extension is not built here")
    rng = np.random.default_rng()
    x = torch.from_numpy(edge_rows(rng, 999)).to(dtype)
    stats = row_stats(x, None, None)
    ids = torch.from_numpy(rng.integers(0, 999, size=x.shape[0]))
    ids[5] = int(torch.nonzero(torch.isnan(x[5].float()))[0])  # a NaN entry chosen
    ids[6] = 3  # a +inf token of the one-hot row
    ids[0], ids[7] = -1, 999  # outside the vocabulary
    cpu = record_stats._chosen_stats_cpu(x, ids, stats, None).numpy()
    general = record_stats._chosen_stats_general(x, ids, stats).numpy()
    np.testing.assert_allclose(cpu, general, rtol=1e-6, equal_nan=True)
    assert np.isnan(cpu[[0, 7]]).all()
    assert cpu[6].tolist() == [np.inf, pytest.approx(1 / (x[6].float() == np.inf).sum().item()), 0.0]


@pytest.mark.parametrize("k", [1, 5, 20])
def test_a_chosen_rank_counted_among_the_kept_top_k_equals_the_count_over_the_row(k):
    """Top-k storage counts a chosen token's rank among the kept values when the token is one of them (or ties
    the last): the same rank as counting over the whole row, for tokens inside, tied with the last kept value,
    far below it, NaN, masked and out of range, on ordinary, tied, masked and edge rows."""
    rng = np.random.default_rng()
    x = np.concatenate([edge_rows(rng, 999), rng.integers(-3, 3, size=(4, 999)).astype(np.float32)])  # ties
    t = torch.from_numpy(x)
    stats = row_stats(t, None, None)
    values, ids = top_k(t, k)
    chosen = ids[:, rng.integers(k)].clone()  # a kept token
    chosen[[1, 8]] = ids[[1, 8], -1]  # the last kept value (row 8: tied with tokens outside the top k)
    chosen[[0, 9]] = torch.from_numpy(np.argsort(x[[0, 9]], axis=1)[:, 10])  # far below the top k
    chosen[5] = int(np.flatnonzero(np.isnan(x[5]))[0])  # a NaN entry
    chosen[2] = int(np.flatnonzero(x[2] == NEG)[0])  # a masked token
    chosen[10] = -1  # unknown
    got = chosen_stats(t, chosen, stats, values).numpy()
    want = record_stats._chosen_stats_general(t, chosen, stats).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, equal_nan=True)
    rows = [r for r in range(x.shape[0]) if r != 10 and not np.isinf(x[r]).any() and not np.isnan(x[r]).any()]
    for r in rows:  # the rank is the count of entries above the chosen one
        assert got[r, 2] == (x[r] > x[r, int(chosen[r])]).sum(), f"row {r}"


@pytest.mark.parametrize("vocab", [50, 1079, 4099, 32768, 131072])
@pytest.mark.parametrize("k", [1, 20])
def test_top_k_keeps_the_values_torch_topk_keeps_and_never_nan(path, vocab, k):
    """Ordinary, peaked, masked, tied and edge rows (NaN and +inf take the full-row path): the same values, in
    the same order, as ``torch.topk`` over the row with NaN as -inf; every id names its value."""
    rng = np.random.default_rng()
    rows = edge_rows(rng, vocab)
    ties = np.round(rng.normal(size=vocab), 1).astype(np.float32)  # many equal values
    rising = np.sort(rng.normal(size=vocab)).astype(np.float32)  # each token above the last: the bar rises each time
    ordered = np.stack([rising, rising[::-1]])
    x = torch.from_numpy(np.concatenate([rows, ties[None], ordered, rng.normal(size=(5, vocab)).astype(np.float32)]))
    values, ids = top_k(x, min(k, vocab))
    want, _ = torch.topk(x.masked_fill(torch.isnan(x), -np.inf), min(k, vocab), dim=1)
    assert torch.equal(values, want)
    assert torch.equal(x.gather(1, ids).masked_fill(torch.isnan(x.gather(1, ids)), -np.inf), values)
    assert not torch.isnan(values).any()
    assert all(len(set(r)) == len(r) for r in ids.tolist())  # no id twice


def test_the_top_k_storage_of_a_tracker_reads_back_as_torch_topk(path):
    rng = np.random.default_rng()
    tracker = LogitTrackingProcessor(None, storage="topk", top_k=20)
    x = torch.from_numpy((rng.normal(size=(3, 40000)) * 3).astype(np.float32))
    tracker(torch.ones(3, 2, dtype=torch.long), x)
    for row in range(3):
        got = tracker.get_logits(sequence=row)["unstructured"][0]
        values, ids = torch.topk(x[row], 20)
        np.testing.assert_array_equal(got[ids.numpy()], values.numpy())
        assert np.isnan(got).sum() == 40000 - 20


@pytest.mark.parametrize("storage", ["float32", "float16", "bfloat16", "topk"])
def test_the_accelerator_path_reads_no_device_value(storage):
    """Each storage mode's work and the chosen token's statistics, on a device other than the CPU, are kernels
    only: run on the meta device, which holds no values, any host read (``item``, ``bool``, ``tolist``,
    ``nonzero``) raises."""
    with pytest.raises(RuntimeError):  # what makes this test able to fail
        bool(torch.zeros(1, device="meta").any())
    x, natural = torch.randn(4, 1000, device="meta"), torch.randn(4, 1000, device="meta")
    eos, ids = torch.tensor([2], device="meta"), torch.zeros(4, dtype=torch.int64, device="meta")
    stored = Storage.parse(storage, 20).store(x, natural, eos, True)
    assert {t.device.type for t in stored.columns.values()} == {"meta"}
    kept = stored.columns["logits"] if storage == "topk" else None
    assert chosen_stats(x, ids, stored.stats, kept).shape == (4, len(CHOSEN_STATS))
