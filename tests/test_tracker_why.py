"""``run.why`` / ``step`` / ``show`` / ``view`` and ``to_dataframe(section="prompt")`` as a user reads them:
ranks exact (or flagged) in every storage, no step past a sequence's end, clear errors, both probabilities shown."""

from __future__ import annotations

import html
import math
import re

import numpy as np
import pytest

from processors import LogitBiasLogitsProcessor, PenaltiesLogitsProcessor, ProcessorList
from sampling import Generator, SamplingParams
from tracker import Run, add_tracking
from tracker.reading.display import format_probability, token_label

PROMPT = "abcab"
KEYS = {"natural": "unstructured", "constrained": "structured"}
# everything from "(" up but the digits masked: the chosen token is often far down the natural row
MASK = {t: float("-inf") for t in range(40, 128) if not chr(t).isdigit()}


def _staged(model, tok, storage):
    bias = LogitBiasLogitsProcessor({ord("a"): -3.0, ord("b"): 2.5, ord("q"): float("-inf")})
    processors = ProcessorList([bias, PenaltiesLogitsProcessor(repetition_penalty=1.8, frequency_penalty=0.4)])
    gen = add_tracking(Generator(model, tok, processors), storage=storage, processor_stages=True)
    gen.generate(PROMPT, SamplingParams(max_new_tokens=12, temperature=1.5, seed=3))
    return gen.logits_processor.run


def _masked(model, tok, storage):
    gen = add_tracking(Generator(model, tok, [LogitBiasLogitsProcessor(MASK)]), storage=storage)
    gen.generate(PROMPT, SamplingParams(max_new_tokens=8, temperature=1.0, seed=0))
    return gen.logits_processor.run


def _reference(run):
    """Per stage: float64 log-probabilities and ranks (tokens with a higher logit) from the float32 run's rows."""
    logits = run.get_logits()
    out = {}
    for stage in run.stages:
        rows = logits[KEYS.get(stage, stage)].astype(np.float64)
        finite = np.where(np.isneginf(rows), -np.inf, rows)
        logp = finite - np.logaddexp.reduce(finite, axis=1, keepdims=True)
        ranks = (rows[:, None, :] > rows[:, :, None]).sum(axis=2)  # [T, V]: rank of each token
        out[stage] = (logp, ranks)
    return out


def _check_rank(row, true_rank, where):
    """``rank`` is the exact rank, or NaN with bounds that hold it (never a silently wrong number)."""
    if math.isnan(row["rank"]):
        low, high = row.get("rank_min", math.nan), row.get("rank_max", math.nan)
        assert math.isnan(low) or low <= true_rank <= high, where
    else:
        assert row["rank"] == true_rank, where


@pytest.mark.parametrize("storage", ["bfloat16", "topk"])
def test_why_gives_the_chosen_tokens_exact_rank_and_logprob(tiny_model, char_tokenizer, storage):
    run = _staged(tiny_model, char_tokenizer, storage)
    reference = _staged(tiny_model, char_tokenizer, "float32")
    stats = run.stats()
    chosen = stats["chosen_id"].to_numpy()
    assert (chosen == reference.stats()["chosen_id"].to_numpy()).all()
    ref = _reference(reference)
    names = dict(zip(run.stages, ["natural", "after:logit_bias", "after:penalties", "sampled"]))
    tables = [run.why(pos) for pos in range(len(chosen))]
    steps = np.arange(len(chosen))
    rows = {
        stage: [t[(t["role"] == "chosen") & (t["stage"] == name)].iloc[0] for t in tables]
        for stage, name in names.items()
    }
    for stage in names:  # the ranks first: a rank counted over rounded or top-k rows is off
        expected = ref[stage][1][steps, chosen]
        np.testing.assert_array_equal([r["rank"] for r in rows[stage]], expected, err_msg=f"{storage} {stage}")
        np.testing.assert_array_equal(stats[f"rank_chosen_{stage}"], expected, err_msg=f"{storage} {stage}")
    for stage, name in names.items():
        logp, ranks = ref[stage]
        np.testing.assert_allclose(
            [r["logprob"] for r in rows[stage]], logp[steps, chosen], rtol=1e-5, err_msg=f"{storage} {stage}"
        )
        assert all(r["logprob_exact"] for r in rows[stage])
        for pos, table in enumerate(tables):
            fav = table[(table["role"] == "favourite") & (table["stage"] == name)].iloc[0]
            _check_rank(fav, ranks[pos, fav["token_id"]], f"{storage} position {pos} {name} favourite")


def test_why_bounds_a_rank_the_top_k_rows_cannot_tell(tiny_model, char_tokenizer):
    """A run without the recorded statistics (written before schema 1.1): ranks come from the stored top-k rows."""
    recorded = _masked(tiny_model, char_tokenizer, "topk")
    batches = [b.drop_columns(["natural_entropy"]) for b in recorded._record_batches()]
    run = Run(batches, recorded.metadata, recorded.vocab)
    assert not run._has_stats(run._select())
    reference = _masked(tiny_model, char_tokenizer, "float32")
    logp, ranks = _reference(reference)["natural"]
    bounded = 0
    for pos in range(len(recorded.stats())):
        table = run.why(pos)
        for _, row in table.iterrows():
            if row["stage"] != "natural":
                continue
            true_rank = ranks[pos, row["token_id"]]
            _check_rank(row, true_rank, f"position {pos} {row['role']}")
            if math.isnan(row["rank"]) and not math.isnan(row["logprob"]):  # stored, but below the k-th best
                assert row["rank_min"] < true_rank
                np.testing.assert_allclose(row["logprob"], logp[pos, row["token_id"]], rtol=1e-5)
                bounded += 1
    assert bounded  # the case a count over the stored values would get wrong


@pytest.fixture(scope="module")
def stopped_early(tiny_model, char_tokenizer):
    """Sequence 1 stops after 3 steps; the batch runs on to 8 (sequence 1 gets padding steps)."""
    gen = add_tracking(Generator(tiny_model, char_tokenizer, []))
    params = [
        SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=1.0, seed=1),
        SamplingParams(max_new_tokens=3, ignore_eos=True, temperature=1.0, seed=2),
    ]
    gen.generate([PROMPT, "xyz"], params)
    return gen.logits_processor


def test_why_step_and_show_refuse_a_step_past_the_sequences_end(stopped_early):
    run = stopped_early.run
    assert len(run.stats(sequence=1)) == 3 and run.get_top_tokens(positions=5, sequence=1) == []
    message = r"position=5 is past the end of sequence 1 .*recorded positions are 0\.\.2.*include_finished=True"
    for call in (
        lambda: run.why(5, sequence=1),
        lambda: run.step(5, sequence=1),
        lambda: run.show(step=5, sequence=1),
        lambda: stopped_early.why(5, sequence=1),
    ):
        with pytest.raises(ValueError, match=message):
            call()
    with pytest.raises(ValueError, match=r"position=9 was not recorded; recorded positions are 0\.\.2"):
        run.why(9, sequence=1)
    # on purpose: the padding step, as recorded
    padding = run.why(5, sequence=1, include_finished=True)
    chosen = int(run.stats(sequence=1, include_finished=True)["chosen_id"][5])
    assert padding[padding["role"] == "chosen"]["token_id"].eq(chosen).all()
    view = run.show(step=5, sequence=1, include_finished=True)
    assert "<b>Step 5</b>" in view._repr_html_() and view.why().equals(padding)
    assert run.why(2, sequence=1).equals(run.why(2, sequence=1, include_finished=True))


def test_the_prompt_section_refuses_what_it_does_not_take(tiny_model, char_tokenizer):
    gen = add_tracking(Generator(tiny_model, char_tokenizer), prompt_logprobs=True)
    gen.generate([PROMPT, "xy"], SamplingParams(max_new_tokens=3))
    run = gen.logits_processor.run
    assert run.to_dataframe(section="prompt", sequence=1).equals(run.prompt_logprobs(sequence=1))
    with pytest.raises(ValueError, match=r"section='prompt' takes one sequence .*got sequence=None"):
        run.to_dataframe(section="prompt", sequence=None)
    for options, named in (
        ({"show": "logits"}, "show='logits'"),
        ({"min_value": 0.1}, "min_value=0.1"),
        ({"include_finished": True}, "include_finished=True"),
    ):
        with pytest.raises(ValueError, match=rf"section='prompt' takes only sequence= and generation=, got {named}"):
            run.to_dataframe(section="prompt", **options)
    with pytest.raises(TypeError, match="sequence must be an int >= 0, got '1'"):
        run.to_dataframe(section="prompt", sequence="1")


_ALTERNATIVE = re.compile(r"(\S+) (\S+) / (\S+)(?:, |$)")


def _shown(text: str, value: float) -> bool:
    """``text`` is ``value`` written by format_probability (to its precision)."""
    written = format_probability(float(text)) == text  # three decimals, or two significant digits below 0.001
    return written and math.isclose(float(text), value, rel_tol=0.05, abs_tol=5.1e-4)


def test_the_sequence_view_shows_both_probabilities_of_each_alternative(tiny_model, char_tokenizer):
    run = _masked(tiny_model, char_tokenizer, "float32")
    markup = run.view()._repr_html_()
    probs = run.get_probabilities()
    ids = {token_label(text): i for i, text in enumerate(run.vocab.display)}
    assert "best alternatives: p constrained / natural" in markup
    rows = re.findall(r"<tr><td>(\d+)</td><td>.*?</td><td>.*?</td><td>(.*?)</td></tr>", markup)
    assert len(rows) == 8
    checked = 0
    for position, cell in rows:
        pos, cell = int(position), html.unescape(cell)
        found = _ALTERNATIVE.findall(cell)
        assert ", ".join(f"{a} {b} / {c}" for a, b, c in found) == cell
        best = []
        for label, constrained, natural in found:
            token = ids[label]
            assert _shown(constrained, probs["structured"][pos, token]), (pos, label, constrained)
            assert _shown(natural, probs["unstructured"][pos, token]), (pos, label, natural)
            best.append(max(probs["structured"][pos, token], probs["unstructured"][pos, token]))
            checked += 1
        assert best == sorted(best, reverse=True)  # ordered by the larger of the two, as both are shown
    assert checked
    titles = [html.unescape(t) for t in re.findall(r'title="(step \d+:[^"]*)"', markup)]
    lines = titles[0].split("\n")
    assert lines[1] == "best alternatives: p constrained / natural"
    for line in lines[2:]:
        label, constrained, natural = _ALTERNATIVE.fullmatch(line).groups()
        assert _shown(constrained, probs["structured"][0, ids[label]])
        assert _shown(natural, probs["unstructured"][0, ids[label]])


def test_without_a_constraint_the_view_shows_one_probability(tiny_model, char_tokenizer):
    gen = add_tracking(Generator(tiny_model, char_tokenizer))
    gen.generate(PROMPT, SamplingParams(max_new_tokens=4, temperature=1.0, seed=0))
    run = gen.logits_processor.run
    markup = html.unescape(run.view()._repr_html_())
    probs = run.get_probabilities()["unstructured"]
    ids = {token_label(text): i for i, text in enumerate(run.vocab.display)}
    assert " / " not in markup
    cell = re.findall(r"<tr><td>0</td><td>.*?</td><td>.*?</td><td>(.*?)</td></tr>", markup)[0]
    for label, p in re.findall(r"(\S+) (\S+)(?:, |$)", cell):
        assert _shown(p, probs[0, ids[label]])
