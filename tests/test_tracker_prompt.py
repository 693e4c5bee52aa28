"""Prompt log-probabilities and perplexity: against a direct forward pass, and exp of the mean NLL."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sampling import Generator, SamplingParams
from tracker import LogitTrackingProcessor, Run, add_tracking
from tracker.reading.prompt import perplexity, prompt_logprobs

PROMPTS = ["hello there", "abc"]


def _direct(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
    return logp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()


def test_prompt_logprobs_equal_a_direct_forward_pass(tiny_model, char_tokenizer, tmp_path):
    gen = add_tracking(Generator(tiny_model, char_tokenizer), prompt_logprobs=True)
    gen.generate(PROMPTS, SamplingParams(max_new_tokens=5))
    run = Run.load(gen.logits_processor.to_parquet(tmp_path / "run.parquet"))
    for row, prompt in enumerate(PROMPTS):  # the second prompt is left-padded in the batch
        ids = [ord(c) for c in prompt]
        frame = run.prompt_logprobs(sequence=row)
        assert frame["token_id"].tolist() == ids
        assert math.isnan(frame["logprob"][0])
        np.testing.assert_allclose(frame["logprob"][1:], _direct(tiny_model, ids), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(frame["surprisal"], -frame["logprob"])
        assert run.to_dataframe(section="prompt", sequence=row).equals(frame)


def test_perplexity_is_exp_of_the_mean_negative_logprob(tiny_model, char_tokenizer):
    gen = add_tracking(Generator(tiny_model, char_tokenizer), prompt_logprobs=True)
    gen.generate(PROMPTS, SamplingParams(temperature=1.0, seed=4, max_new_tokens=8, ignore_eos=True))
    run = gen.logits_processor.run
    table = run.perplexity()
    assert list(table["sequence"]) == [0, 1]
    for row, prompt in enumerate(PROMPTS):
        direct = _direct(tiny_model, [ord(c) for c in prompt])
        np.testing.assert_allclose(table["prompt_perplexity"][row], np.exp(-direct.mean()), rtol=1e-4)
        stats = run.stats(sequence=row)
        np.testing.assert_allclose(stats["surprisal_natural"], -np.log(stats["p_chosen_natural"]), rtol=1e-12)
        expected = np.exp(np.mean(-np.log(stats["p_chosen_natural"].to_numpy(dtype=np.float64))))
        np.testing.assert_allclose(table["perplexity_natural"][row], expected, rtol=1e-12)
        assert table["tokens"][row] == 8


def test_perplexity_is_the_last_generation_by_default_and_every_one_with_none(tiny_model, char_tokenizer):
    gen = add_tracking(Generator(tiny_model, char_tokenizer), prompt_logprobs=True)
    for seed in (1, 2):
        gen.generate(PROMPTS, SamplingParams(temperature=1.0, seed=seed, max_new_tokens=6, ignore_eos=True))
    run = gen.logits_processor.run
    last, every = run.perplexity(), run.perplexity(generation=None)
    assert list(last["generation"]) == [1, 1] and list(every["generation"]) == [0, 0, 1, 1]
    assert list(every["sequence"]) == [0, 1, 0, 1]
    for g in (0, 1):
        np.testing.assert_array_equal(
            every[every["generation"] == g].reset_index(drop=True), run.perplexity(generation=g)
        )


def test_a_certain_token_has_surprisal_zero_not_minus_zero(tiny_model, char_tokenizer):
    """Greedy decoding records a sampled stage of probability 1: its surprisal prints as 0.0, never -0.0."""
    gen = add_tracking(Generator(tiny_model, char_tokenizer), prompt_logprobs=True)
    gen.generate(PROMPTS, SamplingParams(max_new_tokens=4))
    run = gen.logits_processor.run
    surprisal = run.stats()["surprisal_sampled"]
    assert (surprisal == 0).all() and not np.signbit(surprisal.to_numpy()).any()
    assert "-0.0" not in run.stats().to_string()
    prompt = run.prompt_logprobs()["surprisal"].to_numpy()
    assert not np.signbit(prompt[~np.isnan(prompt)]).any()


def test_without_the_option_the_prompt_has_no_values(tiny_model, char_tokenizer):
    gen = add_tracking(Generator(tiny_model, char_tokenizer))
    gen.generate("abc", SamplingParams(max_new_tokens=3))
    run = gen.logits_processor.run
    assert run.prompt_logprobs()["logprob"].isna().all()
    assert math.isnan(run.perplexity()["prompt_perplexity"][0])


def test_score_prompt_serves_model_generate(tiny_model):
    from transformers import LogitsProcessorList

    ids = torch.tensor([[5, 9, 17, 33, 2]])
    tracker = LogitTrackingProcessor(None, prompt_logprobs=True)
    tracker.score_prompt(tiny_model, ids)
    tiny_model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        logits_processor=LogitsProcessorList([tracker]),
        max_new_tokens=3,
        do_sample=False,
        pad_token_id=0,
    )
    frame = tracker.run.prompt_logprobs()
    np.testing.assert_allclose(frame["logprob"][1:], _direct(tiny_model, ids[0].tolist()), rtol=1e-4, atol=1e-5)


def test_score_prompt_after_generate_scores_the_generation_it_names(tiny_model):
    from transformers import LogitsProcessorList

    ids = torch.tensor([[5, 9, 17, 33, 2]])
    tracker = LogitTrackingProcessor(None)
    out = tiny_model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        logits_processor=LogitsProcessorList([tracker]),
        max_new_tokens=3,
        do_sample=False,
        pad_token_id=0,
    )
    tracker.finish(out)
    assert tracker.run.prompt_logprobs()["logprob"].isna().all()  # nothing scored yet
    tracker.score_prompt(tiny_model, ids, generation=-1)
    frame = tracker.run.prompt_logprobs()
    np.testing.assert_allclose(frame["logprob"][1:], _direct(tiny_model, ids[0].tolist()), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="not its prompts"):
        tracker.score_prompt(tiny_model, ids[:, :3], generation=0)


def test_prompt_logprobs_checks_shapes_and_perplexity_of_known_values():
    with pytest.raises(ValueError, match="logits must be"):
        prompt_logprobs(torch.zeros(1, 3, 5), torch.zeros(1, 4, dtype=torch.long))
    values = [None, -1.0, -2.0, -0.5]
    assert perplexity(values) == pytest.approx(math.exp((1.0 + 2.0 + 0.5) / 3))
    assert math.isnan(perplexity([None]))


def test_score_prompt_keeps_scores_only_for_the_prompts_generated_from(demo):
    """Left padding without a mask, num_return_sequences, and other prompts than those generated from."""
    from transformers import LogitsProcessorList

    model, tok = demo
    side, tok.padding_side = tok.padding_side, "left"  # the fixture is shared: put the side back
    try:
        enc = tok(["Call Maria at ", "7 + 5 ="], return_tensors="pt", padding=True)
        other = tok(["Hello there friend", "Call Maria at "], return_tensors="pt", padding=True)
    finally:
        tok.padding_side = side
    assert (enc.attention_mask == 0).any()  # row 0 is padded

    def generated(score, **options):
        tracker = LogitTrackingProcessor(None, tokenizer=tok)
        score(tracker)
        out = model.generate(
            **enc,
            logits_processor=LogitsProcessorList([tracker]),
            max_new_tokens=3,
            return_dict_in_generate=True,
            pad_token_id=tok.pad_token_id,
            **options,
        )
        return tracker.finish(out)

    direct = [np.exp(-_direct(model, tok(p)["input_ids"]).mean()) for p in ("Call Maria at ", "7 + 5 =")]
    run = generated(lambda t: t.score_prompt(model, enc.input_ids))  # no mask: the leading pads are the padding
    np.testing.assert_allclose(run.perplexity()["prompt_perplexity"], direct, rtol=1e-4)
    assert run.prompt_logprobs(sequence=0)["token_id"].tolist() == tok("Call Maria at ")["input_ids"]
    run = generated(
        lambda t: t.score_prompt(model, enc.input_ids, enc.attention_mask), do_sample=True, num_return_sequences=2
    )
    np.testing.assert_allclose(run.perplexity()["prompt_perplexity"], np.repeat(direct, 2), rtol=1e-4)
    with pytest.warns(UserWarning, match="are not its prompts"):
        run = generated(lambda t: t.score_prompt(model, other.input_ids, other.attention_mask))
    assert run.perplexity()["prompt_perplexity"].isna().all()


def test_the_pad_id_is_read_when_a_generation_starts_from_the_model_s_generation_config():
    """An Outlines-style host whose tokenizer has no pad id; the user sets the model's pad id after tracking."""
    import copy

    from transformers import LogitsProcessorList

    from logitscope.demo_model import load_demo_model

    model, tokenizer = load_demo_model()
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.pad_token = None
    model.generation_config.pad_token_id = None

    class Host:  # what add_tracking sees of an Outlines 1.x Generator: .model, .tokenizer, .logits_processor
        def __init__(self) -> None:
            self.model, self.tokenizer, self.logits_processor = model, tokenizer, None

    host = add_tracking(Host())
    tracker = host.logits_processor
    assert tracker.pad_token_id is None
    pad = tokenizer.convert_tokens_to_ids("a")  # any id: what the user says pads
    model.generation_config.pad_token_id = pad  # set after the tracker was made
    prompts = [tokenizer("Call Maria at ").input_ids, tokenizer("Hi").input_ids]
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    out = model.generate(
        input_ids,
        attention_mask=(torch.cumprod((input_ids == pad).long(), dim=1) == 0).long(),
        logits_processor=LogitsProcessorList([tracker]),
        do_sample=False,
        max_new_tokens=3,
    )
    tracker.finish(out)
    assert tracker.run.metadata.generations[0]["prompt_ids"] == prompts  # the padding left out
