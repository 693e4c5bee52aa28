"""The analysis API against straightforward float64 references on fresh random logits."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from processors import LogitsProcessor
from tracker import LogitTrackingProcessor, Run, Vocabulary

V = 48
EOS = 0


class RandomMask(LogitsProcessor):
    """Masks a fixed random half of the vocabulary and adds a bias to one token (returns a new tensor)."""

    def __init__(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.mask = torch.rand(V, generator=gen) < 0.5
        self.mask[EOS] = False

    def process(self, logits, ctx):
        out = logits.masked_fill(self.mask, float("-inf"))
        out[:, 7] += 1.5
        return out


def record(steps=12, batch=2, seed=0, processor=None, storage="float32", top_k=20):
    tracker = LogitTrackingProcessor(
        RandomMask(seed) if processor is None else processor, storage=storage, top_k=top_k, eos_token_id=EOS
    )
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (batch, 4), generator=gen)
    natural, constrained = [], []
    for _ in range(steps):
        logits = torch.randn(batch, V, generator=gen) * 2.5
        logits[:, EOS] -= 6.0  # keep sequences going
        natural.append(logits.clone())
        out = tracker(ids, logits)
        constrained.append(out.clone())
        probs = torch.softmax(out, dim=1)
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=gen)], dim=1)
    tracker.finish(ids)
    return tracker, torch.stack(natural, 1).double(), torch.stack(constrained, 1).double(), ids[:, 4:]


def test_get_top_tokens_matches_a_float64_reference():
    tracker, nat, con, chosen = record()
    for s in range(2):
        result = tracker.get_top_tokens(k=6, sequence=s)
        assert [r["position"] for r in result] == list(range(12))
        for t, entry in enumerate(result):
            pn = torch.softmax(nat[s, t], 0)
            pc = torch.softmax(con[s, t], 0)
            score = torch.where(torch.isfinite(con[s, t]), torch.maximum(pn, pc), -1.0)
            ref = torch.argsort(score, descending=True)[:6].tolist()
            got_ids = [
                int(np.argmax([tracker.run.vocab.display[i] == tok["token"] for i in range(V)]))
                for tok in entry["tokens"]
            ]
            assert got_ids == ref
            for tok, i in zip(entry["tokens"], ref):
                assert tok["unstructured_prob"] == pytest.approx(float(pn[i]), rel=1e-5, abs=1e-9)
                assert tok["structured_prob"] == pytest.approx(float(pc[i]), rel=1e-5, abs=1e-9)
                assert tok["unstructured_logit"] == pytest.approx(float(nat[s, t, i]), rel=1e-6)
                assert tok["is_chosen"] == (i == int(chosen[s, t]))
            assert entry["text_so_far"] == tracker.run.vocab.decode(chosen[s, :t].tolist())
    only = tracker.get_top_tokens(k=2, positions=3, include_logits=False)
    assert [r["position"] for r in only] == [3]
    assert set(only[0]["tokens"][0]) == {"token", "unstructured_prob", "structured_prob", "is_chosen"}
    assert tracker.get_top_tokens(positions=[100]) == []


@pytest.mark.parametrize("show", ["probs", "logits"])
def test_to_dataframe_matches_a_reference(show):
    tracker, nat, con, chosen = record(seed=1)
    threshold = 0.02 if show == "probs" else 1.0
    frame = tracker.to_dataframe(show=show, min_value=threshold, sequence=1, token_ids=True)
    assert list(frame.columns) == ["position", "token", "natural", "constrained", "chosen", "token_id"]
    vn, vc = (torch.softmax(nat[1], 1), torch.softmax(con[1], 1)) if show == "probs" else (nat[1], con[1])
    keep = (vn >= threshold) | (vc >= threshold)
    rows, ids = keep.nonzero(as_tuple=True)
    assert frame["position"].tolist() == rows.tolist()
    assert frame["token_id"].tolist() == ids.tolist()
    np.testing.assert_allclose(frame["natural"].to_numpy(), vn[rows, ids].numpy(), rtol=1e-5)
    np.testing.assert_allclose(frame["constrained"].to_numpy(), vc[rows, ids].numpy(), rtol=1e-5)
    assert frame["chosen"].tolist() == (ids == chosen[1, rows]).tolist()
    everything = tracker.to_dataframe()
    assert len(everything) == 12 * V
    both = tracker.to_dataframe(min_value=threshold if show == "probs" else 0.02, sequence=None)
    assert set(both["sequence"]) == {0, 1}


@pytest.mark.parametrize(("show", "threshold"), [("probs", 0.0), ("probs", -1.0), ("logits", -math.inf)])
def test_a_threshold_at_or_below_every_value_keeps_the_masked_tokens(show, threshold):
    tracker, nat, con, chosen = record(seed=4)
    assert (~torch.isfinite(con[1])).any()  # the constraint masked tokens
    frame = tracker.to_dataframe(show=show, min_value=threshold, sequence=1, token_ids=True)
    assert len(frame) == 12 * V  # every token of every step, a masked one with constrained value 0 / -inf
    masked = ~np.isfinite(con[1].numpy())[frame["position"].to_numpy(), frame["token_id"].to_numpy()]
    assert (frame["constrained"].to_numpy()[masked] == (0.0 if show == "probs" else -np.inf)).all()


def test_positions_and_sequences_of_the_wrong_kind_are_refused_by_name():
    tracker = record(seed=5)[0]
    assert [r["position"] for r in tracker.get_top_tokens(k=1, positions=np.arange(2))] == [0, 1]
    assert [r["position"] for r in tracker.get_top_tokens(k=1, positions=torch.tensor(3))] == [3]
    for bad, kind in (("10", TypeError), ([2.7], TypeError), (True, TypeError), (-1, ValueError)):
        with pytest.raises(kind, match="positions"):
            tracker.get_top_tokens(k=1, positions=bad)
    with pytest.raises(TypeError, match="sequence must be an int >= 0, got '0'"):
        tracker.get_top_tokens(k=1, sequence="0")
    with pytest.raises(TypeError, match="position must be an int >= 0, got '3'"):
        tracker.run.step("3")
    for bad in (0, -3):  # -3 listed all but 3 tokens of the vocabulary
        with pytest.raises(ValueError, match=f"k must be an int >= 1, got {bad}"):
            tracker.run.step(0, k=bad)
        with pytest.raises(ValueError, match=f"k must be an int >= 1, got {bad}"):
            tracker.run.show(step=0, k=bad)
    with pytest.raises(TypeError, match=r"pos must be an int >= 0, got True \(bool\)"):
        tracker.sequence(pos=True)  # True is not the position 1
    assert tracker.sequence(pos=np.int64(2)) == tracker.sequence()[: len(tracker.sequence(pos=2))]


def test_numpy_scalars_count_as_the_numbers_they_hold():
    # what a user computes with numpy (k from an array's length, a threshold from probabilities.max() / 2)
    tracker = record()[0]
    probs = tracker.get_probabilities()["unstructured"]
    threshold = probs.max() / 2  # a numpy float32
    assert tracker.get_top_tokens(k=np.int64(3)) == tracker.get_top_tokens(k=3)
    assert tracker.to_dataframe(min_value=threshold).equals(tracker.to_dataframe(min_value=float(threshold)))
    topk = LogitTrackingProcessor(storage="topk", top_k=np.int32(5))
    assert topk.storage.top_k == 5 and type(topk.storage.top_k) is int
    with pytest.raises(ValueError, match=r"k must be an int >= 1, got np.True_"):
        tracker.get_top_tokens(k=np.bool_(True))


class MaskLeastLikely(LogitsProcessor):
    """Masks each row's ``n`` least likely tokens: a removed mass far below float32's 1e-7 resolution of 1 - kept."""

    def __init__(self, n: int) -> None:
        self.n = n

    def process(self, logits, ctx):
        least = torch.nan_to_num(logits, nan=float("inf")).argsort(dim=1)[:, : self.n]
        return logits.scatter(1, least, float("-inf"))


@pytest.mark.parametrize("storage", ["float32", "float16", "topk"])
@pytest.mark.parametrize("n", [1, 5])
def test_a_tiny_removed_mass_is_measured_not_rounded_to_zero(storage, n, tmp_path):
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 31)))
    logits = torch.randn(2, 1000, generator=gen) * 2
    logits[1, 3] = float("nan")  # a row holding NaN takes the whole-row torch path
    tracker = LogitTrackingProcessor(MaskLeastLikely(n), storage=storage, top_k=8)
    ids = torch.zeros(2, 1, dtype=torch.long)
    tracker(ids, logits.clone())
    tracker.finish(torch.cat([ids, torch.ones(2, 1, dtype=torch.long)], 1))
    x = torch.nan_to_num(logits.double(), nan=float("-inf"))
    p = torch.softmax(x, 1)
    least = torch.nan_to_num(logits, nan=float("inf")).argsort(dim=1)[:, :n]
    want = p.gather(1, least).sum(1).numpy()
    assert (want < 1e-5).all()  # near or below what 1 - (mass kept) can tell from 0 in float32 (1e-7)
    for run in (tracker.run, Run.load(tracker.to_parquet(tmp_path / "run.parquet"))):
        got = np.array([run.stats(sequence=s)["removed_mass"].iloc[0] for s in (0, 1)])
        np.testing.assert_allclose(got, want, rtol=1e-4)


def test_stats_match_a_reference():
    tracker, nat, con, chosen = record(seed=2)
    stats = tracker.stats(sequence=0)
    n, c, ch = nat[0], con[0], chosen[0]
    pn, pc = torch.softmax(n, 1), torch.softmax(c, 1)
    allowed = torch.isfinite(c)

    def entropy(p):
        return -torch.where(p > 0, p * torch.log(p), torch.zeros_like(p)).sum(1)

    rows = torch.arange(12)
    np.testing.assert_allclose(stats["entropy_natural"], entropy(pn), rtol=1e-4)
    np.testing.assert_allclose(stats["entropy_constrained"], entropy(pc), rtol=1e-4)
    np.testing.assert_allclose(stats["p_chosen_natural"], pn[rows, ch], rtol=1e-5)
    np.testing.assert_allclose(stats["p_chosen_constrained"], pc[rows, ch], rtol=1e-5)
    assert stats["rank_chosen_natural"].tolist() == (n > n[rows, ch][:, None]).sum(1).double().tolist()
    assert stats["rank_chosen_constrained"].tolist() == (c > c[rows, ch][:, None]).sum(1).double().tolist()
    np.testing.assert_allclose(stats["removed_mass"], (pn * ~allowed).sum(1), rtol=1e-4, atol=1e-7)
    best_allowed = torch.where(allowed, n, -math.inf).max(1).values
    np.testing.assert_allclose(stats["margin"], n.max(1).values - best_allowed, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats["p_eos_natural"], pn[:, EOS], rtol=1e-4)
    assert stats["allowed"].tolist() == allowed.sum(1).double().tolist()
    assert stats["chosen_id"].tolist() == ch.tolist()
    assert not stats["processor_error"].any() and not stats["nonfinite"].any()
    assert len(tracker.stats(sequence=None)) == 24


def test_get_logits_and_probabilities_are_per_sequence_arrays():
    tracker, nat, con, _ = record(seed=3)
    logits = tracker.get_logits(sequence=1)
    probs = tracker.get_probabilities(sequence=1)
    assert set(logits) == set(probs) == {"unstructured", "structured"}
    assert np.array_equal(logits["unstructured"], nat[1].float().numpy())
    assert np.array_equal(logits["structured"], con[1].float().numpy())
    np.testing.assert_allclose(probs["structured"], torch.softmax(con[1], 1).numpy(), rtol=1e-5, atol=1e-8)
    assert (probs["structured"][np.isinf(logits["structured"])] == 0).all()


def test_sequence_text_and_selectors():
    tracker, _, _, chosen = record(seed=4)
    vocab = tracker.run.vocab
    assert tracker.sequence() == vocab.decode(chosen[0].tolist())
    assert tracker.sequence(3, sequence=1) == vocab.decode(chosen[1, :3].tolist())
    assert tracker.sequence(0) == ""
    with pytest.raises(ValueError, match="sequence=5 is not in generation 0"):
        tracker.sequence(sequence=5)
    with pytest.raises(ValueError, match="generation=3 was not recorded"):
        tracker.stats(generation=3)


def test_a_sequence_ends_at_its_end_of_sequence_token():
    class ForceEosAtStep2(LogitsProcessor):
        def process(self, logits, ctx):
            out = logits.clone()
            if ctx.num_generated == 2:
                out[0] = float("-inf")
                out[0, EOS] = 0.0
            return out

    tracker, _, _, chosen = record(processor=ForceEosAtStep2(), seed=5)
    assert int(chosen[0, 2]) == EOS
    assert len(tracker.stats(sequence=0)) == 3
    assert len(tracker.stats(sequence=0, include_finished=True)) == 12
    assert len(tracker.stats(sequence=1)) == 12


def test_continuation_probability_sums_over_the_tokens_that_spell_it():
    pieces = [b"<eos>", b"c", b"ca", b"cat", b"catfish", b"cats", b"dog", b"f", b"fish", b"x"]
    vocab = Vocabulary.from_parts(pieces)
    n = len(pieces)
    tracker = LogitTrackingProcessor(None, eos_token_id=0)
    gen = torch.Generator().manual_seed(6)
    steps = [torch.randn(1, n, generator=gen) for _ in range(3)]
    path = [3, 8, 9]  # "cat", "fish", "x"
    ids = torch.tensor([[9]])
    for t, logits in enumerate(steps):
        tracker(ids, logits)
        ids = torch.cat([ids, torch.tensor([[path[t]]])], 1)
    tracker.finish(ids)
    run = tracker.run
    run._vocab_source = vocab
    p = [torch.softmax(s[0].double(), 0) for s in steps]
    cat = run.continuation_probability("cat")
    # tokens starting with "cat" at step 0: cat, catfish, cats; "c" and "ca" are prefixes not taken -> lower bound
    assert cat.natural == pytest.approx(float(p[0][3] + p[0][4] + p[0][5]), rel=1e-6)
    assert not cat.exact
    catfish = run.continuation_probability("catfish")
    # "catfish" in one token, or "cat" (the chosen path) then "fish" at step 1
    assert catfish.natural == pytest.approx(float(p[0][4] + p[0][3] * p[1][8]), rel=1e-6)
    assert catfish.natural < cat.natural
    assert catfish.path == [3]
    fishx = run.continuation_probability("fishx", position=1)
    assert fishx.natural == pytest.approx(float(p[1][8] * p[2][9]), rel=1e-6)
    with pytest.raises(ValueError, match="position=7 was not recorded"):
        run.continuation_probability("cat", position=7)


def test_continuation_probability_in_top_k_storage_is_a_flagged_lower_bound():
    pieces = [b"<eos>", b"c", b"ca", b"cat", b"catfish", b"cats", b"dog", b"f", b"fish", b"x"]
    n = len(pieces)
    results = {}
    for storage in ("float32", "topk"):
        tracker = LogitTrackingProcessor(None, eos_token_id=0, storage=storage, top_k=2)
        gen = torch.Generator().manual_seed(6)
        ids = torch.tensor([[9]])
        for token in (3, 8, 9):
            tracker(ids, torch.randn(1, n, generator=gen))
            ids = torch.cat([ids, torch.tensor([[token]])], 1)
        tracker.finish(ids)
        run = tracker.run
        run._vocab_source = Vocabulary.from_parts(pieces)
        results[storage] = run.continuation_probability("catfish")
    full, top = results["float32"], results["topk"]
    assert not np.isnan(top.natural) and not top.exact  # values top-k did not keep count as 0: a lower bound
    assert 0 <= top.natural <= full.natural + 1e-12


@pytest.mark.parametrize("storage", ["float16", "bfloat16"])
def test_half_storage_answers_close_to_float32(storage):
    full, nat, con, _ = record(seed=7)
    half, _, _, _ = record(seed=7, storage=storage)
    a, b = full.get_top_tokens(k=4), half.get_top_tokens(k=4)
    # Rows are kept as logit - the row's largest logit, rounded: the likely tokens lie near 0, where
    # half precision is finest (bfloat16 keeps 8 significant bits: 0.4% of a value, 0.004 at -1).
    eps = 2.0**-8 if storage == "bfloat16" else 2.0**-11  # half a unit in the last place, relative
    for ea, eb in zip(a, b):
        for ta, tb in zip(ea["tokens"], eb["tokens"]):
            assert tb["structured_prob"] == pytest.approx(ta["structured_prob"], rel=8 * eps)
    logits, exact = half.get_logits()["unstructured"], nat[0].double().numpy()
    top = exact.max(axis=1, keepdims=True)
    np.testing.assert_array_less(np.abs(logits - exact), eps * np.abs(exact - top) + 1e-5)
    assert (logits.max(axis=1) == np.float32(top[:, 0])).all()  # the favourite's logit is exact


def test_topk_storage_answers_from_the_stored_values():
    tracker, nat, con, chosen = record(seed=8, storage="topk", top_k=5)
    for t, entry in enumerate(tracker.get_top_tokens(k=3)):
        pn, pc = torch.softmax(nat[0, t], 0), torch.softmax(con[0, t], 0)
        top_con = torch.argsort(con[0, t], descending=True)[:5]
        score = torch.maximum(pn[top_con], pc[top_con])
        ref = top_con[torch.argsort(score, descending=True)[:3]]
        for tok, i in zip(entry["tokens"], ref.tolist()):
            assert tok["structured_prob"] == pytest.approx(float(pc[i]), rel=1e-5)
            assert tok["unstructured_prob"] == pytest.approx(float(pn[i]), rel=1e-5)
    stats = tracker.stats()
    assert stats["allowed"].tolist() == torch.isfinite(con[0]).sum(1).double().tolist()
    # The chosen token's probability and rank are exact even when it is not among the 5 kept.
    p_chosen = torch.softmax(con[0], 1).gather(1, chosen[0, :12, None])[:, 0]
    np.testing.assert_allclose(stats["p_chosen_constrained"], p_chosen.numpy(), rtol=1e-5, atol=1e-7)
    logits = tracker.get_logits()["structured"]
    assert np.isnan(logits).sum(axis=1).tolist() == [V - 5] * 12
    frame = tracker.to_dataframe(min_value=0.05)
    assert (frame["natural"] >= 0.05).any()


def test_the_query_modules_import_no_torch(tmp_path):
    """The read side's maths and queries load where torch, transformers and llguidance cannot be imported."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    script = f"""
import importlib.abc, sys, types
class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("torch", "transformers", "llguidance"):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Blocked())
package = types.ModuleType("tracker")  # the modules alone, not the package's public surface
package.__path__ = [{str(root / "tracker")!r}]
sys.modules["tracker"] = package
import numpy as np
from tracker.format import stages
from tracker.reading import analysis, block, candidates, metrics, passes, rows, selection
x = np.random.default_rng(0).standard_normal((3, 5000)).astype(np.float32)
values, ids = rows.topk_rows(x, 4)
assert (values[:, 0] == x.max(axis=1)).all()
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=root, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
