"""Rows copied into chunk memory with streaming stores (``tracker.recording.streaming``) arrive intact.

The copy skips the cache on x86-64 where the optional C extension was built; everywhere else it is
``np.copyto``. Either way the chunk must hold exactly the row handed in, at any length and any alignment.
"""

from __future__ import annotations

import platform
import shutil
import sys

import numpy as np
import pytest
import torch

import tracker.recording.streaming as streaming
from processors import BatchContext, LogitsProcessor
from tracker import LogitTrackingProcessor
from tracker.recording.streaming import copy_rows


@pytest.fixture(params=["streaming", "numpy"])
def path(request, monkeypatch):
    """Each test runs through the extension (where built) and through numpy."""
    if request.param == "streaming" and not streaming.STREAMING:
        pytest.skip("the _stream extension is not built here")
    if request.param == "numpy":
        monkeypatch.setattr(streaming, "_stream_copy", None)
    return request.param


def test_the_extension_is_built_where_a_compiler_is():
    """setup.py builds it wherever a C compiler is found (CI included): the recorder's copies then stream."""
    if not (sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")):
        pytest.skip("streaming stores are written for x86-64")
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: the install copies with numpy")
    assert streaming.STREAMING, "tracker.recording._stream was not built: reinstall with `pip install -e .`"


@pytest.mark.parametrize("columns", [4096, 4097, 50257, 131072])
@pytest.mark.parametrize("offset", [0, 1, 2, 3])  # destination start, in float32 elements: every alignment
def test_rows_arrive_intact(path, columns, offset):
    rng = np.random.default_rng(columns * 7 + offset)
    rows = 3
    src = rng.standard_normal((rows, columns), dtype=np.float32)
    src[0, ::97] = np.inf
    src[1, ::89] = -np.inf
    src[2, ::83] = np.nan
    flat = np.full(rows * columns + 8, 7.5, dtype=np.float32)
    dst = flat[offset : offset + rows * columns].reshape(rows, columns)
    copy_rows(dst, src)
    assert dst.tobytes() == src.tobytes()  # bit for bit, NaN payloads included
    assert (flat[:offset] == 7.5).all() and (flat[offset + rows * columns :] == 7.5).all()  # nothing outside


def test_half_precision_and_strided_sources(path):
    rng = np.random.default_rng(5)
    src = rng.standard_normal((2, 40000)).astype(np.float16)
    dst = np.zeros_like(src)
    copy_rows(dst, src)
    assert dst.tobytes() == src.tobytes()
    wide = rng.standard_normal((2, 80000), dtype=np.float32)
    strided = wide[:, ::2]  # not contiguous: numpy copies it
    out = np.zeros((2, 40000), dtype=np.float32)
    copy_rows(out, strided)
    assert np.array_equal(out, strided)


def test_the_extension_refuses_mismatched_buffers():
    if not streaming.STREAMING:
        pytest.skip("the _stream extension is not built here")
    from tracker.recording._stream import copy

    a = np.zeros(10000, dtype=np.float32)
    with pytest.raises(ValueError, match="dst holds 40000 bytes and src 39996"):
        copy(a, np.ones(9999, dtype=np.float32))
    with pytest.raises((ValueError, BufferError), match="contiguous"):
        copy(a[::2], np.ones(5000, dtype=np.float32))
    readonly = np.zeros(4, dtype=np.float32)
    readonly.flags.writeable = False
    with pytest.raises((ValueError, BufferError)):
        copy(readonly, np.ones(4, dtype=np.float32))


class Shift(LogitsProcessor):
    """Adds a fixed random bias with -inf entries (a new tensor, as most processors return)."""

    def __init__(self, vocab: int, seed: int) -> None:
        bias = torch.randn(vocab, generator=torch.Generator().manual_seed(seed))
        bias[::7] = -torch.inf
        self.bias = bias

    def process(self, logits: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
        return logits + self.bias


def test_a_tracked_run_holds_the_rows_it_was_given(path):
    """End to end at a real vocabulary size: every natural and constrained row reads back bit for bit."""
    vocab, steps, batch = 32768, 40, 2
    seed = int(np.random.SeedSequence().entropy % (1 << 31))
    gen = torch.Generator().manual_seed(seed)
    tracker = LogitTrackingProcessor(Shift(vocab, seed), memory_limit=None)
    ids = torch.randint(0, vocab, (batch, 4), generator=gen)
    natural, constrained = [], []
    for _ in range(steps):
        logits = torch.randn(batch, vocab, generator=gen) * 3
        natural.append(logits.numpy().copy())
        constrained.append(tracker(ids, logits).numpy().copy())
        ids = torch.cat([ids, torch.randint(0, vocab, (batch, 1), generator=gen)], dim=1)
    tracker.finish(ids)
    table = tracker.run.to_arrow()
    for stage, given in (("natural", natural), ("constrained", constrained)):
        got = table.column(f"{stage}_logits").combine_chunks()
        got = got.values.to_numpy(zero_copy_only=False).reshape(len(got), vocab)
        assert got.tobytes() == np.concatenate(given).tobytes(), f"seed {seed}"
