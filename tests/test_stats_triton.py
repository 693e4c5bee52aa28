"""The recorder's statistics kernels (tracker/recording/stats_triton.py) against torch's kernels and float64.

On a CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, in a subprocess because the
variable must be set before Triton is imported); on a GPU, as compiled, through the recorder.
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def rows_with_edges(seed: int, batch: int = 9, vocab: int = 2500) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, natural)``: random rows (a stage after a processor, and the rows before it) with the cases the
    statistics treat apart: masked entries, NaN, +inf, nothing allowed, one token allowed, a natural row holding
    +inf where the stage masks it, a natural NaN."""
    g = torch.Generator().manual_seed(seed)
    natural = torch.randn(batch, vocab, generator=g) * 4
    x = natural + torch.randn(batch, vocab, generator=g) * 0.5
    x[0, ::3] = -math.inf
    x[1, 5], x[1, 7] = math.nan, math.nan
    x[2] = -math.inf
    x[3, 10], x[3, 11] = math.inf, math.inf
    x[4, : vocab - 1] = -math.inf
    natural[5, 3], x[5, 3] = math.inf, -math.inf
    natural[6, 8] = math.nan
    x[7, vocab // 2 :] = -math.inf  # half the row masked: removed mass and margin of a real constraint
    return x, natural


def check(device: str, seed: int) -> None:
    """Every kernel against :mod:`tracker.recording.record_stats`' torch path on ``device``, and the plain rows'
    log-sum-exp and entropy against float64."""
    from tracker.recording import record_stats as R
    from tracker.recording import stats_triton as T

    x, natural = (t.to(device) for t in rows_with_edges(seed))
    assert T.kernel_ready(x)
    eos = torch.tensor([1, 3, 10, x.shape[1] - 1], device=device)

    def close(got, want, what, rtol=3e-5, atol=3e-6):
        ok = torch.isclose(got, want, rtol=rtol, atol=atol, equal_nan=True)
        assert ok.all(), (what, seed, ok.logical_not().nonzero().tolist(), got[~ok].tolist(), want[~ok].tolist())

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        xs, nat = x.to(dtype), natural.to(dtype)
        for n in (None, nat):
            for e in (None, eos):
                close(T.row_stats(xs, e, n), R._row_stats_general(xs, e, n), ("row stats", dtype, n is None, e is None))
        stats = R._row_stats_general(xs, eos, nat)
        chosen = torch.tensor([0, 5, 3, 10, x.shape[1] - 1, -1, x.shape[1], 7, 2], device=device)
        close(T.chosen_stats(xs, chosen, stats), R._chosen_stats_general(xs, chosen, stats), ("chosen", dtype))
        # a view with a row stride of its own (a step's last position of [B, T, V] logits)
        wide = torch.stack([xs, xs], dim=1)[:, 1]
        close(T.row_stats(wide, eos, None), R._row_stats_general(xs, eos, None), ("strided rows", dtype))

    plain = x[[6, 7, 8]].double()
    plain = plain.masked_fill(plain.isnan(), -math.inf)
    lse = torch.logsumexp(plain, dim=1)
    p = torch.exp(plain - lse[:, None])
    entropy = -(p * torch.where(p > 0, plain - lse[:, None], 0.0)).sum(dim=1)
    got = T.row_stats(x[[6, 7, 8]], None, None).double()
    close(got[:, 0], lse, "lse against float64", rtol=1e-6, atol=1e-6)
    close(got[:, 3], entropy, "entropy against float64", rtol=1e-5, atol=1e-5)

    for dtype in (torch.float16, torch.bfloat16):
        stats, offset = R.offset_rows(x, eos, None)
        want = (x.float() - offset[:, None]).to(dtype)
        want_stats = stats.clone()
        want_stats[:, 0] = R.stored_lse(want, stats[:, 0] - offset) + offset
        kept, stored = T.half_rows(x, stats, offset, dtype)
        same = (kept.view(torch.int16) == want.view(torch.int16)) | (kept.isnan() & want.isnan())
        assert same.all(), (dtype, seed, same.logical_not().nonzero()[:5].tolist())  # rounded to nearest even
        close(stored, want_stats, ("stored log-sum-exp", dtype))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_statistics_kernels_on_a_gpu():
    check("cuda", random.randrange(1 << 30))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_tracked_gpu_run_has_the_torch_statistics(monkeypatch):
    """The recorder on a GPU through the kernels, and with LOGITSCOPE_STATS_TRITON=0 (torch's kernels): the
    same statistics in every storage mode."""
    from test_tracker_support import byte_tokenizer, random_gpt2

    from sampling import Generator, SamplingParams
    from tracker import add_tracking

    tok = byte_tokenizer()
    model = random_gpt2(len(tok)).cuda()
    for storage in ("float32", "bfloat16", "topk"):
        tables = []
        for kernels in ("1", "0"):
            monkeypatch.setenv("LOGITSCOPE_STATS_TRITON", kernels)
            gen = add_tracking(Generator(model, tok), storage=storage, top_k=5, statistics="record")
            gen.generate(["ab", "cd"], SamplingParams(temperature=1.0, seed=3, max_new_tokens=6))
            tables.append(gen.logits_processor.run.stats())
        a, b = tables
        assert a["chosen_id"].tolist() == b["chosen_id"].tolist(), storage
        for column in a.columns:
            if a[column].dtype.kind == "f":
                assert a[column].to_numpy() == pytest.approx(b[column].to_numpy(), rel=3e-5, abs=3e-6, nan_ok=True), (
                    storage,
                    column,
                )


def test_the_statistics_kernels_in_the_interpreter():
    pytest.importorskip("triton", reason="the kernels need triton installed")
    root = Path(__file__).resolve().parents[1]
    seed = random.randrange(1 << 30)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(root), str(root / "tests")]))
    code = f"import test_stats_triton as t; t.check('cpu', {seed}); print('KERNELS OK')"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, cwd=root)
    assert done.returncode == 0 and "KERNELS OK" in done.stdout, (seed, done.stdout[-2000:] + done.stderr[-4000:])


def test_a_kernel_triton_refuses_leaves_the_statistics_to_torch(monkeypatch):
    """A Triton that cannot build a kernel for the GPU at hand (its compiler, the GPU's limits): one warning
    naming the error, then the same statistics from torch's kernels for the rest of the process."""
    pytest.importorskip("triton")
    import warnings

    from triton.runtime.errors import OutOfResources

    from tracker.recording import record_stats as R
    from tracker.recording import stats_triton as T

    class Refused:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise OutOfResources(1 << 20, 1 << 16, "shared memory")

            return launch

    monkeypatch.setattr(T, "FAILED", [])
    monkeypatch.setattr(T, "_row_stats_kernel", Refused())
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the kernels' path for CPU rows
    x, natural = rows_with_edges(random.randrange(1 << 30))
    with pytest.warns(RuntimeWarning, match=r"statistics kernels cannot run here \(OutOfResources: .*shared memory"):
        found = R.row_stats(x, None, natural)
    want = R._row_stats_general(x, None, natural)
    assert torch.allclose(found, want, rtol=3e-5, atol=3e-6, equal_nan=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        stats = R.row_stats(x, None, None)
        chosen = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9])
        assert torch.allclose(
            R.chosen_stats(x, chosen, stats), R._chosen_stats_general(x, chosen, stats), equal_nan=True
        )
