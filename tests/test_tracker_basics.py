"""The tracker's basics every user relies on first: ``clear()``, the chosen token at the last position, top
tokens and ``min_value``, bfloat16 logits, batches, the vocabulary; each once a defect of the logits trackers
users had before.

Each test's number is the defect's; its name says what the defect was, e.g.
``test_1_clear_resets_everything...``: ``clear()`` used to leave the next
generation recording the last prompt token as its first choice.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_tracker_support import byte_tokenizer

from processors import LogitsProcessor
from tracker import LogitTrackingProcessor, Vocabulary

V = 64


class MaskBelow(LogitsProcessor):
    """Masks every token id below ``cut`` (returns a new tensor)."""

    def __init__(self, cut: int) -> None:
        self.cut = cut

    def process(self, logits, ctx):
        out = logits.clone()
        out[:, : self.cut] = float("-inf")
        return out


def drive(tracker, steps: int, batch: int = 1, seed: int = 0, prompt_len: int = 3, dtype=torch.float32):
    """Call the tracker transformers-style for ``steps`` steps, feeding back the argmax; returns (ids, rows)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (batch, prompt_len), generator=gen)
    seen = []
    for _ in range(steps):
        logits = (torch.randn(batch, V, generator=gen) * 3).to(dtype)
        seen.append(logits.float().clone())
        out = tracker(ids, logits)
        ids = torch.cat([ids, out.float().argmax(dim=1, keepdim=True)], dim=1)
    return ids, seen


def test_1_clear_resets_everything_so_the_next_generation_starts_clean():
    tracker = LogitTrackingProcessor(MaskBelow(8))
    first_ids, _ = drive(tracker, 4, seed=1)
    tracker.clear()
    assert tracker.recorder.rows == 0
    ids, _ = drive(tracker, 3, seed=2, prompt_len=9)  # longer prompt than the last input: no shrink to detect
    tracker.finish(ids)
    stats = tracker.stats()
    assert tracker.generations() == [0]
    assert stats["position"].tolist() == [0, 1, 2]
    # the first choice is the first generated token, not the last prompt token
    assert stats["chosen_id"].tolist() == ids[0, 9:].tolist()


def test_2_the_last_position_is_marked_chosen():
    tracker = LogitTrackingProcessor(MaskBelow(8))
    ids, _ = drive(tracker, 5)
    before = tracker.stats()["chosen_id"]
    assert before.isna().tolist() == [False] * 4 + [True]  # unknown until the host says
    tracker.finish(ids)
    top = tracker.get_top_tokens(k=V)
    last = top[-1]
    chosen = [t for t in last["tokens"] if t["is_chosen"]]
    assert len(chosen) == 1
    assert tracker.stats()["chosen_id"].tolist() == ids[0, 3:].tolist()


def test_3_is_chosen_compares_token_ids_not_text():
    # Two ids with the same text: only the chosen id is marked.
    pieces = [f"t{i}".encode() for i in range(V)]
    pieces[5] = pieces[6] = b"same"
    vocab = Vocabulary.from_parts(pieces)
    tracker = LogitTrackingProcessor(None)
    logits = torch.full((1, V), -5.0)
    logits[0, 5], logits[0, 6] = 3.0, 2.9
    ids = torch.tensor([[1, 2]])
    tracker(ids, logits)
    tracker.finish(torch.tensor([[1, 2, 6]]))
    run = tracker.run
    run._vocab_source = vocab
    tokens = run.get_top_tokens(k=2)[0]["tokens"]
    assert [t["token"] for t in tokens] == ["same", "same"]
    assert [t["is_chosen"] for t in tokens] == [False, True]
    frame = run.to_dataframe(min_value=0.01, token_ids=True)
    assert frame.loc[frame.chosen, "token_id"].tolist() == [6]


def test_4_min_value_keeps_every_row_above_the_threshold():
    tracker = LogitTrackingProcessor(MaskBelow(4))
    gen = torch.Generator().manual_seed(3)
    ids = torch.tensor([[1]])
    flat = torch.randn(2, V, generator=gen) * 0.05  # nearly flat: all 64 tokens near 1/64 each
    for logits in flat:
        ids = torch.cat([ids, tracker(ids, logits[None]).argmax(1, keepdim=True)], 1)
    frame = tracker.to_dataframe(min_value=0.01)
    probs = torch.softmax(flat.double(), dim=1)
    masked = flat.double().clone()
    masked[:, :4] = float("-inf")
    cprobs = torch.softmax(masked, dim=1)
    expected = int(((probs >= 0.01) | (cprobs >= 0.01)).sum())
    assert expected > 100  # far more than 10 per position
    assert len(frame) == expected
    logits_frame = tracker.to_dataframe(show="logits", min_value=0.0)
    assert len(logits_frame) == int(((flat >= 0) | (masked >= 0)).sum())


def test_5_bfloat16_logits_work():
    tracker = LogitTrackingProcessor(MaskBelow(8), storage="float32")
    ids, seen = drive(tracker, 3, dtype=torch.bfloat16)
    tracker.finish(ids)
    natural = tracker.get_logits()["unstructured"]
    assert np.array_equal(natural, torch.stack([s[0] for s in seen]).numpy())  # bf16 -> f32 is exact
    stored_bf16 = LogitTrackingProcessor(MaskBelow(8), storage="bfloat16")
    ids, seen = drive(stored_bf16, 3, dtype=torch.bfloat16)
    exact = torch.stack([s[0] for s in seen]).double().numpy()
    got = stored_bf16.get_logits()["unstructured"]
    top = exact.max(axis=1, keepdims=True)  # rows are kept minus their largest logit: within half a bf16 step
    np.testing.assert_array_less(np.abs(got - exact), 2.0**-8 * np.abs(exact - top) + 1e-6)
    assert len(stored_bf16.get_top_tokens(k=3)) == 3


def test_6_top_k_lists_never_include_masked_tokens():
    tracker = LogitTrackingProcessor(MaskBelow(60))  # only 4 tokens allowed
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(1, V, generator=gen)
    logits[0, :10] += 20.0  # the model's favourites are all masked
    tracker(torch.tensor([[1]]), logits)
    tokens = tracker.get_top_tokens(k=10, include_logits=True)[0]["tokens"]
    assert len(tokens) == 4
    assert all(t["structured_prob"] > 0 for t in tokens)
    assert all(t["structured_logit"] > float("-inf") for t in tokens)
    probs = [max(t["unstructured_prob"], t["structured_prob"]) for t in tokens]
    assert probs == sorted(probs, reverse=True)


def test_7_probabilities_are_computed_once_and_cached():
    """Asking again hands back the answer computed the first time; a new step or clear_cache() computes afresh."""
    tracker = LogitTrackingProcessor(MaskBelow(8))
    ids, seen = drive(tracker, 6)
    probs, logits = tracker.get_probabilities(), tracker.get_logits()
    first, stats = tracker.get_top_tokens(k=5), tracker.stats()
    frame = tracker.to_dataframe(min_value=0.01)
    expected = torch.softmax(torch.stack([s[0] for s in seen]).double(), dim=-1).numpy()
    np.testing.assert_allclose(probs["unstructured"], expected, rtol=1e-5, atol=1e-7)
    for _ in range(3):
        # the very arrays of the first answer, not a recomputation of them
        assert tracker.get_probabilities() is probs
        assert tracker.get_logits() is logits
        assert tracker.get_top_tokens(k=5) == first
        assert tracker.stats().equals(stats)
        assert tracker.to_dataframe(min_value=0.01).equals(frame)

    # dropping the cache computes the same answer again, as new arrays
    tracker.run.clear_cache()
    again = tracker.get_probabilities()
    assert again is not probs
    for key in probs:
        assert np.array_equal(again[key], probs[key])

    # a new step is never answered from the old cache
    logits_7 = torch.randn(1, V, generator=torch.Generator().manual_seed(7)) * 3
    tracker(ids, logits_7)
    grown = tracker.get_probabilities()["unstructured"]
    assert grown.shape[0] == probs["unstructured"].shape[0] + 1
    assert np.array_equal(grown[:-1], probs["unstructured"])
    np.testing.assert_allclose(grown[-1], torch.softmax(logits_7[0].double(), dim=-1).numpy(), rtol=1e-5, atol=1e-7)


def test_8_batches_work_and_no_per_step_host_copy_through_cpu(monkeypatch):
    """Batches of several rows are recorded row by row; the recorder never calls ``.cpu()`` per step."""
    calls = {"cpu": 0}
    original = torch.Tensor.cpu

    def counting_cpu(self, *args, **kwargs):
        calls["cpu"] += 1
        return original(self, *args, **kwargs)

    tracker = LogitTrackingProcessor(MaskBelow(8))
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, V, (3, 2), generator=gen)
    first = tracker(ids, torch.randn(3, V, generator=gen))  # a generation's first step notes its prompt once
    ids = torch.cat([ids, first.argmax(1, keepdim=True)], 1)
    monkeypatch.setattr(torch.Tensor, "cpu", counting_cpu)
    seen = []
    for _ in range(5):
        logits = torch.randn(3, V, generator=gen)
        seen.append(logits.clone())
        out = tracker(ids, logits)
        ids = torch.cat([ids, out.argmax(1, keepdim=True)], 1)
    assert calls["cpu"] == 0
    monkeypatch.undo()
    for row in range(3):
        natural = tracker.get_logits(sequence=row)["unstructured"][1:]
        assert np.array_equal(natural, torch.stack([s[row] for s in seen]).numpy())


def test_9_the_vocabulary_is_built_in_one_pass_without_decode_per_id(monkeypatch):
    tok = byte_tokenizer()
    calls = {"decode": 0}
    for name in ("decode", "batch_decode", "_decode"):
        original = getattr(type(tok), name)

        def counting(self, *args, _original=original, **kwargs):
            calls["decode"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(type(tok), name, counting)
    vocab = Vocabulary.from_tokenizer(tok, len(tok) + 3)
    assert calls["decode"] == 0
    monkeypatch.undo()
    assert [vocab.token_bytes(i).decode("utf-8", "replace") for i in range(len(tok))] == [
        tok.decode([i], skip_special_tokens=True) for i in range(len(tok))
    ]
    assert vocab.display[len(tok)] == f"<{len(tok)}>"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_8_cuda_steps_do_not_synchronise(monkeypatch):
    calls = {"sync": 0}
    original = torch.cuda.synchronize

    def counting(*args, **kwargs):
        calls["sync"] += 1
        return original(*args, **kwargs)

    tracker = LogitTrackingProcessor(MaskBelow(8))
    ids = torch.zeros(2, 3, dtype=torch.long, device="cuda")
    first = tracker(ids, torch.randn(2, V, device="cuda"))  # a generation's first step notes its prompt once
    ids = torch.cat([ids, first.argmax(1, keepdim=True)], 1)
    monkeypatch.setattr(torch.cuda, "synchronize", counting)
    monkeypatch.setattr(torch.Tensor, "cpu", lambda *a, **k: pytest.fail(".cpu() called per step"))
    monkeypatch.setattr(torch.Tensor, "item", lambda *a, **k: pytest.fail(".item() called per step"))
    for _ in range(20):
        out = tracker(ids, torch.randn(2, V, device="cuda"))
        ids = torch.cat([ids, out.argmax(1, keepdim=True)], 1)
    assert calls["sync"] == 0
