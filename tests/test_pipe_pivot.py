"""The "pivot" algorithm (top-p cuts and draws by bisection on the weight, no sort) against the float64 reference.

Rows of exact dyadic probabilities (every sum exact in float32 and float64),
so the reference's kept set is the right answer to the bit: random rows with
many ties, a uniform row, a tied block straddling the top-p cut, a cut that
falls exactly on a token's preceding mass, weights near the bottom of the
float32 range, a one-hot row. The Triton kernel runs in Triton's interpreter
(``TRITON_INTERPRET=1``, in a subprocess because the variable must be set
before Triton is imported) and must give the PyTorch version's crossings and
the CPU algorithm's tokens.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from test_pipe_reference import reference_probs

from sampling.pipe import SAMPLED, LogitsPipe, MinP, Sample, Tap, TensorType, TopP
from sampling.pipe import kernels as K
from sampling.pipe import pivot as P

VOCAB = K.SORT_BELOW + 500  # the whole-vocabulary path, where "pivot" runs


def dyadic_rows(vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    """Adversarial probability rows, each summing to exactly 1 (integers over a power of two)."""
    g = torch.Generator().manual_seed(seed)
    rows = [
        torch.randint(0, 9, (vocab,), generator=g).double(),  # many ties at every level
        torch.ones(vocab, dtype=torch.float64),  # uniform: one tied block
        torch.randint(0, 3, (vocab,), generator=g).double() * 64,  # few levels, large blocks
    ]
    block = torch.zeros(vocab, dtype=torch.float64)
    block[[3, 900, 1700, vocab - 1]] = 256  # four tied tokens spread over the ids: top-p 0.5 cuts inside the block
    block[10:20] = 1
    rows.append(block)
    exact = torch.zeros(vocab, dtype=torch.float64)
    exact[[5, 6, 7]] = torch.tensor(
        [512.0, 256.0, 256.0], dtype=torch.float64
    )  # mass before token 6 is exactly 0.5, before 7 0.75
    rows.append(exact)
    tiny = torch.zeros(vocab, dtype=torch.float64)
    tiny[0] = 1
    tiny[100:200] = 2.0**-120  # weights near the bottom of the float32 range
    rows.append(tiny)
    hot = torch.zeros(vocab, dtype=torch.float64)
    hot[vocab - 1] = 1
    rows.append(hot)
    out = []
    for row in rows:
        total = row.sum()
        scale = 2.0 ** np.ceil(np.log2(float(total)))
        row[int(row.argmax())] += scale - total  # top up the largest token so the row sums to a power of two
        out.append(row / scale)
    return torch.stack(out).float()


def _kept(pipe: LogitsPipe, x: torch.Tensor, **params) -> np.ndarray:
    seen: list[torch.Tensor] = []
    u = torch.zeros(x.shape[0], dtype=torch.float64)
    pipe.sample(x, u=u, taps=[Tap(SAMPLED, lambda t: seen.append(t.data))], **params)
    return (seen[0] > 0).numpy()


@pytest.mark.parametrize(
    "params",
    [
        dict(top_p=0.5),
        dict(top_p=0.75),
        dict(top_p=0.9),
        dict(top_p=0.999),
        dict(min_p=0.125),
        dict(min_p=0.5),
        dict(min_p=0.25, top_p=0.5),
        dict(min_p=2.0**-10, top_p=0.95),
    ],
    ids=str,
)
def test_pivot_keeps_exactly_the_float64_references_set(params):
    x = dyadic_rows()
    stages = ([MinP()] if "min_p" in params else []) + ([TopP()] if "top_p" in params else []) + [Sample()]
    expected = reference_probs(x.double(), from_probs=True, **params) > 0
    for compiled in (True, False):
        pipe = LogitsPipe(stages, compile=compiled, algorithm="pivot", input_type=TensorType.PROBS)
        got = _kept(pipe, x, **params)
        wrong = [(r, int((got[r] != expected[r]).sum())) for r in range(x.shape[0]) if (got[r] != expected[r]).any()]
        assert not wrong, f"{params} compiled={compiled}: (row, tokens differing from the reference): {wrong}"


def test_pivot_draws_the_token_the_reference_cdf_gives():
    x = dyadic_rows(seed=1)
    u = torch.rand(x.shape[0], dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    for params in (dict(top_p=0.75), dict(min_p=0.125)):
        stages = ([MinP()] if "min_p" in params else []) + ([TopP()] if "top_p" in params else []) + [Sample()]
        probs = reference_probs(x.double(), from_probs=True, **params)
        order = np.argsort(-probs, axis=-1, kind="stable")
        ordered = np.take_along_axis(probs, order, -1)
        at = (np.cumsum(ordered, -1) <= u.numpy()[:, None]).sum(-1)  # before(t) <= u < before(t) + p(t)
        expected = order[np.arange(len(at)), at]
        pipe = LogitsPipe(stages, algorithm="pivot", input_type=TensorType.PROBS)
        assert pipe(x, u=u, **params).tolist() == expected.tolist(), params


def test_pivot_crossing_needs_no_more_than_its_fixed_steps_on_any_row():
    # 31 steps find any float32 weight: a row whose crossing weight is the smallest positive float
    w = torch.zeros(2, VOCAB)
    w[0, :2] = torch.tensor([2.0**-148, 2.0**-149])
    w[1, 7] = 2.0**-149
    total = w.sum(-1, dtype=torch.float64)
    fraction = torch.tensor([(2.0**-148 + 2.0**-150) / float(total[0]), 0.0], dtype=torch.float64)
    _, need = P.targets(total, fraction, None, inclusive=True)
    value, above, ties = P.pivot_crossing_torch(w, need, inclusive=True)
    assert value.tolist() == [2.0**-149, 2.0**-149]
    assert above.tolist() == [2.0**-148, 0.0] and ties.tolist() == [1, 1]
    # a draw at (or, by rounding, past) the row's total: the smallest positive weight, never a removed token
    rows = dyadic_rows()
    value, _, _ = P.pivot_crossing_torch(rows, rows.sum(-1, dtype=torch.float64) * (1 + 1e-9), inclusive=False)
    assert value.tolist() == torch.where(rows > 0, rows, 2.0).amin(-1).tolist()


def test_the_pytorch_search_can_be_kept_where_the_kernel_would_run(monkeypatch):
    w = torch.ones(1, 4)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("LOGITSCOPE_PIVOT_TRITON", "0")
    assert not P._triton_ready(w)
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.delenv("LOGITSCOPE_PIVOT_TRITON")
    assert not P._triton_ready(w)  # a CPU tensor outside the interpreter


TRITON_CHECK = textwrap.dedent(
    """
    import torch
    from test_pipe_pivot import dyadic_rows
    from sampling.pipe import LogitsPipe, MinP, Sample, Softmax, Temperature, TopP
    from sampling.pipe import pivot as P, pivot_triton as T

    assert T.AVAILABLE
    x = dyadic_rows(vocab=2100)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 2100, generator=g) * 3
    logits[:, 5:40] = logits[:, 2:3]
    logits[1, 1001:] = float("-inf")
    rows = torch.cat([x, torch.softmax(logits, -1)])
    for inclusive, scale in ((True, 1.0), (False, 1.0), (False, 1.5)):  # 1.5: a third of the targets past the total
        need = torch.rand(rows.shape[0], dtype=torch.float64, generator=g) * scale
        torch_out = P.pivot_crossing_torch(rows, need, inclusive)
        triton_out = T.pivot_crossing_triton(rows, need, inclusive)
        assert torch.equal(torch_out[0], triton_out[0]), ("value", inclusive)
        assert torch.equal(torch_out[2], triton_out[2]), ("ties", inclusive)
        assert torch.allclose(torch_out[1], triton_out[1], rtol=1e-12, atol=0), ("above", inclusive)
    u = torch.rand(4, dtype=torch.float64, generator=g)
    stages = [Temperature(), Softmax(), MinP(), TopP(), Sample()]
    params = dict(temperature=0.8, min_p=0.01, top_p=0.9)
    cpu = LogitsPipe(stages, algorithm="cpu").sample(logits, u=u, **params)
    pivot = LogitsPipe(stages, algorithm="pivot").sample(logits, u=u, **params)
    assert torch.equal(cpu.tokens, pivot.tokens), (cpu.tokens, pivot.tokens)
    print("TRITON PIVOT OK")
    """
)


def test_the_triton_kernel_gives_the_pytorch_crossings_in_the_interpreter():
    pytest.importorskip("triton", reason="the Triton kernel needs triton installed")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(root), str(root / "tests")]))
    done = subprocess.run(
        [sys.executable, "-c", TRITON_CHECK], env=env, capture_output=True, text=True, timeout=600, cwd=root
    )
    assert done.returncode == 0 and "TRITON PIVOT OK" in done.stdout, done.stdout[-2000:] + done.stderr[-4000:]
