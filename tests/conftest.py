"""Shared fixtures: a tiny model and tokenizer built in the test, the demo model, a slow disk for spilling."""

from __future__ import annotations

import os
import time

import pytest
import torch
from test_tracker_support import random_gpt2
from transformers import GPT2LMHeadModel

EOS = 0

# torch's CPU unary kernels (MKL VML) may return low-precision values on their first call in a process when two
# threads share the call (pytorch/pytorch#188792; torch 2.13 here: torch.exp of 4 x 5,000 floats, 2 fresh processes
# of 16, half the values 6e-5 off float64, the next call exact; never with one thread). Each is called once here,
# so that no test's first call, compared with a float64 reference, is the one that races.
_WARM = torch.zeros(1 << 16)
for _op in (torch.exp, torch.log, torch.log1p, torch.expm1, torch.tanh, torch.sigmoid, torch.sqrt):
    _op(_WARM)


class CharTokenizer:
    """One token per character (code points 1..V-1); token 0 is end-of-text.

    Small enough to reason about in tests, with the parts of the transformers
    tokenizer interface the Generator uses.
    """

    def __init__(self, vocab_size: int = 128) -> None:
        self.vocab_size = vocab_size
        self.eos_token_id = EOS
        self.pad_token_id = EOS
        self.eos_token = "<eos>"

    def __call__(self, text: str) -> dict[str, list[int]]:
        ids = [ord(c) for c in text]
        bad = [c for c in text if not 0 < ord(c) < self.vocab_size]
        if bad:
            raise ValueError(f"characters outside the tiny vocabulary: {bad}")
        return {"input_ids": ids}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return "".join(("" if skip_special_tokens else self.eos_token) if i == EOS else chr(i) for i in ids)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that skips without CUDA (a ``skipif`` whose reason says it "needs CUDA" or "needs a CUDA
    device") is in the ``cuda`` set, so ``pytest -m cuda`` runs exactly the tests a GPU machine adds."""
    for item in items:
        reasons = [str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif")]
        if any(r.startswith("needs CUDA") or r.startswith("needs a CUDA device") for r in reasons):
            item.add_marker(pytest.mark.cuda)


@pytest.fixture(autouse=True, scope="session")
def _run_index_cache(tmp_path_factory):
    """Dataset listings keep what they read of run markers in a cache folder: the tests' own, not the user's."""
    folder = tmp_path_factory.mktemp("run-index")
    previous = os.environ.get("LOGITSCOPE_CACHE")
    os.environ["LOGITSCOPE_CACHE"] = str(folder)
    yield
    if previous is None:
        os.environ.pop("LOGITSCOPE_CACHE", None)
    else:
        os.environ["LOGITSCOPE_CACHE"] = previous


@pytest.fixture(scope="session")
def tiny_model() -> GPT2LMHeadModel:
    """A random GPT-2 over the 128 ids of :class:`CharTokenizer`."""
    return random_gpt2(128, seed=0, init=0.3)


@pytest.fixture(scope="session")
def char_tokenizer() -> CharTokenizer:
    return CharTokenizer()


@pytest.fixture(scope="session")
def demo():
    """The shipped demo model and tokenizer (loaded once per session)."""
    from logitscope.demo_model import load_demo_model

    return load_demo_model()


@pytest.fixture
def slow_disk(monkeypatch):
    """``slow_disk(seconds)``: every spill file then takes that much longer to write, so chunks queue up on
    their way to disk."""
    import tracker.format.spill as spill

    original = spill.write_ipc

    def slow(seconds: float) -> None:
        def slow_write(*args, **kwargs):
            time.sleep(seconds)
            return original(*args, **kwargs)

        monkeypatch.setattr(spill, "write_ipc", slow_write)

    return slow
