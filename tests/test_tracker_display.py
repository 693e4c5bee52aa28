"""Notebook HTML: well formed, every piece of run text escaped, values as recorded."""

from __future__ import annotations

from html.parser import HTMLParser

import numpy as np
import pytest

from processors import LogitBiasLogitsProcessor, PenaltiesLogitsProcessor, ProcessorList
from sampling import Generator, SamplingParams
from tracker import Run, Vocabulary, add_tracking

HOSTILE = "<script>alert('x')</script>"
VOID = {"br", "hr", "img", "input", "meta", "link"}


class _Checker(HTMLParser):
    """Collects tags, checks nesting, keeps the text."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.tags: list[str] = []
        self.text: list[str] = []
        self.titles: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.titles += [v for k, v in attrs if k == "title" and v]
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.tags.append(tag)

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes {self.stack[-1:]}"
        self.stack.pop()

    def handle_data(self, data):
        self.text.append(data)


def _check(markup: str) -> _Checker:
    checker = _Checker()
    checker.feed(markup)
    checker.close()
    assert not checker.stack, f"unclosed tags: {checker.stack}"
    assert "script" not in checker.tags
    return checker


@pytest.fixture(scope="module")
def hostile_run(tiny_model, char_tokenizer):
    processors = ProcessorList([LogitBiasLogitsProcessor({5: 1.0}), PenaltiesLogitsProcessor(repetition_penalty=1.5)])
    gen = add_tracking(Generator(tiny_model, char_tokenizer, processors), processor_stages=True, prompt_logprobs=True)
    gen.generate("ab", SamplingParams(temperature=1.0, seed=0, max_new_tokens=6, ignore_eos=True))
    run = gen.logits_processor.run
    pieces = [f'{HOSTILE}{i}&"'.encode() for i in range(run.metadata.vocab_size)]
    run.metadata.model = HOSTILE
    return Run(run._record_batches(), run.metadata, Vocabulary.from_parts(pieces))


def test_run_sequence_and_step_html_are_valid_and_escaped(hostile_run):
    chosen = hostile_run.stats()["chosen_id"].tolist()
    for markup in (hostile_run._repr_html_(), hostile_run.view()._repr_html_(), hostile_run.step(2)._repr_html_()):
        checker = _check(markup)
        text = "".join(checker.text)
        assert HOSTILE in text  # shown as text
        assert "<script>" not in markup and "&lt;script&gt;" in markup
    seq = _check(hostile_run.view()._repr_html_())
    shown = "".join(seq.text)
    for token in chosen:
        assert f'{HOSTILE}{token}&"' in shown
    assert any(t.startswith("step 0:") for t in seq.titles)


def test_step_html_shows_the_recorded_probabilities(hostile_run):
    markup = hostile_run.step(1, k=4)._repr_html_()
    probs = hostile_run.get_probabilities()
    best = int(np.argmax(probs["unstructured"][1]))
    assert f"{probs['unstructured'][1, best]:.3f}" in markup
    assert "after:penalties" in markup and "after:logit_bias" in markup
    assert "<svg" in markup and "<rect" in markup
    assert hostile_run.show(step=1).position == 1  # no IPython here: returns the view


def test_step_view_rejects_unrecorded_positions(hostile_run):
    with pytest.raises(ValueError, match="position=99 was not recorded"):
        hostile_run.step(99)


def test_the_tracker_answers_like_its_run(tiny_model, char_tokenizer):
    gen = add_tracking(Generator(tiny_model, char_tokenizer))
    gen.generate("ab", SamplingParams(max_new_tokens=4))
    tracker = gen.logits_processor
    assert tracker._repr_html_() == tracker.run._repr_html_()
    assert tracker.why(1).equals(tracker.run.why(1))
    assert tracker.diff(tracker.run).same


def test_a_top_k_runs_step_view_warns_of_nothing_and_shows_its_stored_tokens():
    """Top-k storage knows k tokens per step: the others are unknown (NaN) in every stage, which is no cause
    for a warning (numpy's "All-NaN slice")."""
    import re
    import warnings

    from dashboard.synthetic import hand_made_run
    from tracker.reading.display import step_svg

    natural = np.random.default_rng().normal(size=(3, 12)).astype(np.float32)
    run = hand_made_run(natural, [0, 1, 2], [f"t{i}" for i in range(12)], storage="topk", top_k=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        svg = step_svg(run, 1)
        run.view()._repr_html_()
    shown = re.findall(r'font-weight="bold">([^<]*)<|<text x="0" y="\d+">([^<]*)<', svg)
    best = [f"t{i}" for i in np.argsort(-natural[1], kind="stable")[:4]]
    assert sorted("".join(t).removesuffix("  ◀ chosen") for t in shown) == sorted(best)
