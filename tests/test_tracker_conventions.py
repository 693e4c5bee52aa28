"""The tracker in every host and convention, and what it does with bad input."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from test_tracker_support import byte_tokenizer, random_gpt2

from processors import LogitsProcessor, ProcessorError, from_dynamo, to_dynamo, to_trtllm, to_vllm
from sampling import Generator, SamplingParams
from tracker import LogitTrackingProcessor, add_tracking

V = 32


class MaskEven(LogitsProcessor):
    def process(self, logits, ctx):
        return logits.masked_fill(torch.arange(logits.shape[1]) % 2 == 0, float("-inf"))


def test_add_tracking_on_logitscope_generator_records_every_row_and_the_last_token():
    tok = byte_tokenizer()
    model = random_gpt2(len(tok), seed=5)
    banned = MaskEven()
    generator = add_tracking(Generator(model, tok, logits_processor=[banned]))
    tracker = generator.logits_processor
    assert isinstance(tracker, LogitTrackingProcessor) and tracker.tokenizer is tok
    assert generator.sample_taps == [tracker.sample_tap]
    params = SamplingParams(temperature=0.9, top_k=6, seed=3, max_new_tokens=8, n=2)
    outputs = generator.generate(["the cat", "héllo wörld"], params)
    completions = [c for out in outputs for c in out.outputs]
    assert tracker.sequences() == [0, 1, 2, 3]
    assert tracker.recorder.stages == ["natural", "constrained", "sampled"]
    for row, completion in enumerate(completions):
        stats = tracker.stats(sequence=row)
        assert stats["chosen_id"].tolist() == completion.token_ids  # the last token included
        assert (stats["p_chosen_constrained"] > 0).all()
        # the sampled stage is the distribution the token was drawn from (top-k 6 after temperature)
        np.testing.assert_allclose(np.log(stats["p_chosen_sampled"]), completion.logprobs, rtol=1e-4, atol=1e-5)
        sampled = tracker.get_logits(sequence=row)["sampled"]
        assert (np.isfinite(sampled).sum(axis=1) <= 6).all()
        natural = torch.from_numpy(tracker.get_logits(sequence=row)["unstructured"]).double()
        chosen = torch.tensor(completion.token_ids)
        raw_lp = torch.log_softmax(natural, 1).gather(1, chosen[:, None])[:, 0]
        np.testing.assert_allclose(raw_lp.numpy(), completion.raw_logprobs, rtol=1e-4, atol=1e-5)
        assert tracker.sequence(sequence=row) == tok.decode(completion.token_ids)
    assert add_tracking(generator) is generator and generator.logits_processor is tracker
    generator.generate(["2"], SamplingParams(max_new_tokens=3))
    assert tracker.generations() == [0, 1]


def test_add_tracking_on_a_real_outlines_generator_shows_the_text_outlines_returned():
    """Outlines 1.x: the tracker unwraps its TransformerTokenizer, whose decode returns lists, and reads bytes."""
    outlines = pytest.importorskip("outlines")
    from outlines.types import Regex

    tok = byte_tokenizer()
    model = random_gpt2(len(tok), seed=6)
    generator = add_tracking(outlines.Generator(outlines.from_transformers(model, tok), Regex(r"[0-9]{3}-[0-9]{4}")))
    tracker = generator.logits_processor
    assert isinstance(tracker, LogitTrackingProcessor) and tracker.tokenizer is tok
    texts = [generator("Call ", max_new_tokens=12), generator("Phone: ", max_new_tokens=12)]
    assert tracker.generations() == [0, 1]  # Outlines resets its processor per call; a new generation starts
    for generation, text in enumerate(texts):
        assert len(text) == 8 and text[3] == "-" and text.replace("-", "").isdigit()
        assert tracker.sequence(generation=generation) == text
        top = tracker.get_top_tokens(k=3, generation=generation)
        chosen = ["".join(t["token"] for t in step["tokens"] if t["is_chosen"]) for step in top]
        assert "".join(chosen) == text and top[-1]["text_so_far"] + chosen[-1] == text
        frame = tracker.to_dataframe(generation=generation)
        assert "".join(frame.loc[frame["chosen"], "token"]) == text
        natural = tracker.get_logits(generation=generation)["unstructured"]
        structured = tracker.get_logits(generation=generation)["structured"]
        assert np.isfinite(natural).all() and np.isinf(structured).any(axis=1).all()  # recorded before the mask


def test_add_tracking_fails_clearly_without_a_processor_attribute():
    with pytest.raises(TypeError, match="must have a logits_processor attribute.*got object"):
        add_tracking(object())


def _step_rows(gen, batch=1):
    return torch.randn(batch, V, generator=gen)


def test_vllm_convention_per_request_callable():
    tracker = LogitTrackingProcessor(MaskEven())
    gen = torch.Generator().manual_seed(1)
    outputs = []
    for _request in range(2):
        fn = to_vllm(tracker, with_prompt=True)  # vLLM makes one callable per request
        prompt, output = [1, 2, 3], []
        for _ in range(4):
            row = _step_rows(gen)[0]
            out = fn(prompt, output, row.clone())
            assert torch.isinf(out[::2]).all()
            output.append(int(out.argmax()))
        fn.finish(output)  # the last token, which no call shows
        outputs.append(output)
    assert tracker.generations() == [0, 1]
    for g in (0, 1):
        assert tracker.stats(generation=g)["chosen_id"].tolist() == outputs[g]


def test_vllm_requests_called_in_turn_each_become_a_generation():
    """vLLM calls the requests' callables one after another within each step."""
    tracker = LogitTrackingProcessor(MaskEven())
    gen = torch.Generator().manual_seed(5)
    requests = {name: ([1, 2, 3][:n], [], to_vllm(tracker, with_prompt=True)) for name, n in (("a", 3), ("b", 2))}
    seen: dict[str, list] = {name: [] for name in requests}
    for _ in range(3):
        for name, (prompt, output, fn) in requests.items():
            row = _step_rows(gen)[0]
            seen[name].append(row.clone())
            output.append(int(fn(prompt, output, row).argmax()))
    with pytest.raises(ValueError, match="outputs at its last call plus the token chosen then"):
        requests["a"][2].finish(requests["a"][1][:-1])
    for _, output, fn in requests.values():
        fn.finish(output)
    assert tracker.generations() == [0, 1]
    for g, (name, (prompt, output, _)) in enumerate(requests.items()):
        assert tracker.stats(generation=g)["chosen_id"].tolist() == output
        assert np.array_equal(tracker.get_logits(generation=g)["unstructured"], torch.stack(seen[name]).numpy())
        assert tracker.run.metadata.generations[g]["prompt_ids"] == [prompt]


def test_dynamo_requests_called_in_turn_each_become_a_generation():
    tracker = LogitTrackingProcessor(MaskEven())
    gen = torch.Generator().manual_seed(6)
    requests = {name: ([1, 2, 3][:n], to_dynamo(tracker)) for name, n in (("a", 3), ("b", 2))}
    for _ in range(3):
        for ids, fn in requests.values():
            row = _step_rows(gen)[0]
            fn(ids, row)
            ids.append(int(row.argmax()))
    for ids, fn in requests.values():
        fn.finish(ids)
    assert tracker.generations() == [0, 1]
    for g, (ids, _) in enumerate(requests.values()):
        assert tracker.stats(generation=g)["chosen_id"].tolist() == ids[-3:]


def test_dynamo_convention_in_place_and_wrapping_an_in_place_processor():
    def zero_first_half(ids, row):
        row[: V // 2] = float("-inf")

    tracker = LogitTrackingProcessor(from_dynamo(zero_first_half))
    fn = to_dynamo(tracker)
    gen = torch.Generator().manual_seed(2)
    ids, seen = [5, 6], []
    for _ in range(3):
        row = _step_rows(gen)[0]
        seen.append(row.clone())
        assert fn(ids, row) is None
        assert torch.isinf(row[: V // 2]).all()  # modified in place for the host
        ids.append(int(row.argmax()))
    natural = tracker.get_logits()["unstructured"]
    assert np.array_equal(natural, torch.stack(seen).numpy())  # snapshot taken before the in-place processor
    assert tracker.stats()["chosen_id"].tolist()[:2] == ids[2:4]
    with pytest.raises(ValueError, match="the ids of the last call"):
        fn.finish(ids[:-1])
    fn.finish(ids)  # the last token, which no call shows
    assert tracker.stats()["chosen_id"].tolist() == ids[2:]


def test_trtllm_convention_copies_share_one_recording():
    tracker = LogitTrackingProcessor(MaskEven())
    fn = to_trtllm(tracker)
    gen = torch.Generator().manual_seed(3)
    tokens = {"a": [[1, 2]], "b": [[3, 4, 5]]}
    for _ in range(3):
        for req in ("a", "b"):  # interleaved requests
            logits = _step_rows(gen)[None]  # [beam, 1, V]
            fn(req, logits, tokens[req], None, None)
            tokens[req][0].append(int(logits[0, 0].argmax()))
    assert sorted(tracker.generations()) == [0, 1]
    for g, req in ((0, "a"), (1, "b")):
        assert tracker.stats(generation=g)["chosen_id"].tolist()[:2] == tokens[req][0][-3:-1]
    assert copy.deepcopy(tracker).recorder is tracker.recorder


def test_transformers_convention_is_the_tracker_itself():
    tracker = LogitTrackingProcessor(MaskEven())
    out = tracker(torch.tensor([[1, 2]]), torch.randn(1, V))
    assert torch.isinf(out[0, ::2]).all() and tracker.recorder.rows == 1


# ---------------------------------------------------------------- bad input


def test_logits_of_the_wrong_rank_are_an_error(tmp_path):
    tracker = LogitTrackingProcessor(MaskEven())
    with pytest.raises(ValueError, match=r"logits must be 2-D \[batch, vocab\] .*, got shape \(1, 1, 32\)"):
        tracker(torch.tensor([[1]]), torch.randn(1, 1, V))
    with pytest.raises(ValueError, match="logits has 2 rows but input_ids has 1"):
        tracker(torch.tensor([[1]]), torch.randn(2, V))
    for empty in ((0, V), (1, 0)):  # nothing to record: refused before a generation starts
        with pytest.raises(ValueError, match=rf"batch >= 1 and vocab >= 1, got shape \({empty[0]}, {empty[1]}\)"):
            tracker(torch.zeros(empty[0], 1, dtype=torch.long), torch.randn(empty))
    assert tracker.recorder.rows == 0
    with pytest.raises(ValueError, match="nothing recorded yet"):
        tracker.to_parquet(tmp_path / "never-written.parquet")


def test_a_vocabulary_that_changes_size_midway_is_an_error():
    tracker = LogitTrackingProcessor(MaskEven())
    tracker(torch.tensor([[1]]), torch.randn(1, V))
    with pytest.raises(ValueError, match=f"vocabulary size changed from {V} to {V + 1}"):
        tracker(torch.tensor([[1, 2]]), torch.randn(1, V + 1))


def test_nan_logits_are_recorded_and_flagged():
    tracker = LogitTrackingProcessor(MaskEven())
    logits = torch.randn(2, V)
    logits[1, 3] = float("nan")
    tracker(torch.tensor([[1], [2]]), logits)
    assert tracker.stats(sequence=1)["nonfinite"].tolist() == [True]
    assert tracker.stats(sequence=0)["nonfinite"].tolist() == [False]
    assert np.isnan(tracker.get_logits(sequence=1)["unstructured"][0, 3])
    assert tracker.to_arrow().column("natural_nonfinite").to_pylist() == [False, True]


def test_a_processor_that_raises_is_reported_and_its_step_flagged():
    class Breaks(LogitsProcessor):
        def process(self, logits, ctx):
            if ctx.num_generated == 1:
                raise RuntimeError("grammar state lost")
            return logits

    tracker = LogitTrackingProcessor(Breaks())
    tracker(torch.tensor([[1]]), torch.randn(1, V))
    with pytest.raises(
        ProcessorError, match="Breaks raised RuntimeError: grammar state lost.*step 1 with processor_error=True"
    ):
        tracker(torch.tensor([[1, 2]]), torch.randn(1, V))
    stats = tracker.stats()
    assert stats["processor_error"].tolist() == [False, True]
    table = tracker.to_arrow()
    assert table.column("constrained_logits").null_count == 1 and table.column("natural_logits").null_count == 0
    assert np.isnan(tracker.get_logits()["structured"][1]).all()


def test_a_processor_returning_the_wrong_shape_is_reported():
    class Wrong(LogitsProcessor):
        def process(self, logits, ctx):
            return logits[:, :-1]

    tracker = LogitTrackingProcessor(Wrong())
    with pytest.raises(ProcessorError, match=r"returned logits of shape \(1, 31\), expected \(1, 32\)"):
        tracker(torch.tensor([[1]]), torch.randn(1, V))
    assert tracker.stats()["processor_error"].tolist() == [True]


def test_a_logits_pipe_tap_records_the_sampled_stage():
    from sampling.pipe import TaggedTensor

    tracker = LogitTrackingProcessor(MaskEven())
    tracker.add_stage("sampled")
    logits = torch.randn(2, V)
    out = tracker(torch.tensor([[1], [2]]), logits)
    probs = torch.softmax(out / 0.5, dim=1)
    tracker.sample_tap(TaggedTensor.probs(probs))
    recorded = tracker.get_probabilities(sequence=1)["sampled"]
    np.testing.assert_allclose(recorded[0], probs[1].numpy(), rtol=1e-5, atol=1e-9)
    with pytest.raises(ValueError, match="stage 'other' is not recorded"):
        tracker.record_stage("other", probs)


def test_the_generator_tells_the_tracker_how_each_row_was_sampled():
    """Run metadata carries the sampling parameters with no annotate() call, seeds included."""
    tokenizer = byte_tokenizer()
    model = random_gpt2(len(tokenizer), seed=7)
    gen = add_tracking(Generator(model, tokenizer))
    hot = SamplingParams(temperature=0.9, top_k=5, max_new_tokens=4)
    gen.generate(["ab", "abc"], hot)
    meta = gen.logits_processor.run.metadata
    rows = meta.generations[0]["sampling"]
    assert [(r["request"], r["temperature"], r["top_k"]) for r in rows] == [(0, 0.9, 5), (1, 0.9, 5)]
    assert meta.sampling["temperature"] == 0.9 and len(meta.sampling["seed"]) == 2  # alike but for the seeds
    # a drawn seed replays the same tokens
    first = gen.generate(["ab"], hot)[0].outputs[0].token_ids
    seed = gen.logits_processor.run.metadata.generations[-1]["sampling"][0]["seed"]
    replay = Generator(model, tokenizer).generate(
        ["ab"], SamplingParams(temperature=0.9, top_k=5, max_new_tokens=4, seed=seed)
    )
    assert replay[0].outputs[0].token_ids == first
    # mixed requests: one entry per request; an explicit annotate() wins
    gen.generate(["ab", "b"], [hot, SamplingParams(max_new_tokens=3)])
    assert [p["greedy"] for p in gen.logits_processor.run.metadata.sampling] == [False, True]
    gen.logits_processor.annotate(sampling={"note": "by hand"})
    gen.generate(["ab"], hot)
    assert gen.logits_processor.run.metadata.sampling == {"note": "by hand"}


@pytest.mark.parametrize("statistics", ["record", "read"])
def test_queries_never_change_the_recorded_rows(statistics):
    tracker = LogitTrackingProcessor(MaskEven(), statistics=statistics)
    logits = torch.randn(3, V)
    logits[1, 3] = float("nan")
    logits[2, 5] = float("inf")
    tracker(torch.tensor([[1], [2], [3]]), logits)
    for sequence in (1, 2):  # rows after the first: slices of the stored buffer
        tracker.stats(sequence=sequence)
        tracker.get_top_tokens(k=3, sequence=sequence)
        tracker.to_dataframe(sequence=sequence)
    stored = tracker.to_arrow().column("natural_logits").to_pylist()
    assert np.isnan(stored[1][3]) and stored[2][5] == float("inf")
    assert tracker.to_arrow().column("natural_nonfinite").to_pylist() == [False, True, True]


def test_a_sequence_that_stops_early_ends_there_not_in_the_padding_it_was_fed(tmp_path):
    """Rows of one batch stop at different steps (their own max_new_tokens); each sequence ends where its
    completion ended, in queries, in the dashboard's reader and after a round trip through Parquet."""
    from dashboard.reader import RunReader
    from tracker import Run

    tokenizer = byte_tokenizer()
    model = random_gpt2(len(tokenizer), seed=7)
    gen = add_tracking(Generator(model, tokenizer))
    requests = [SamplingParams(max_new_tokens=n, temperature=0.9, seed=n, ignore_eos=True) for n in (2, 7, 4)]
    out = gen.generate(["ab", "abc", "b"], requests)
    lengths = [len(o.outputs[0].token_ids) for o in out]
    assert lengths == [2, 7, 4]
    run = gen.logits_processor.run
    saved = Run.load(run.to_parquet(tmp_path / "run.parquet"))
    reader = RunReader(tmp_path / "run.parquet")
    for s, (n, o) in enumerate(zip(lengths, out)):
        for r in (run, saved):
            stats = r.stats(sequence=s)
            assert stats["position"].tolist() == list(range(n))
            assert stats["chosen_id"].tolist() == o.outputs[0].token_ids
            assert len(r.stats(sequence=s, include_finished=True)) == 7  # the padding is there when asked for
            assert len(r.get_top_tokens(k=2, sequence=s)) == n
        assert reader.track(0, s).length == n
        assert reader.track(0, s, include_finished=True).length == 7


def test_a_sequence_that_ignores_eos_goes_on_past_it():
    """With ignore_eos the end-of-sequence token does not end the sequence: it ends where the Generator stopped it."""
    tokenizer = byte_tokenizer()
    model = random_gpt2(len(tokenizer), seed=7)
    eos = tokenizer.eos_token_id

    class EosAtStep1(LogitsProcessor):
        def process(self, logits, ctx):
            if ctx.num_generated == 1:
                logits = torch.full_like(logits, float("-inf"))
                logits[:, eos] = 0.0
            return logits

    gen = add_tracking(Generator(model, tokenizer, [EosAtStep1()]))
    out = gen.generate(["ab"], SamplingParams(max_new_tokens=5, seed=1, ignore_eos=True))
    tokens = out[0].outputs[0].token_ids
    assert len(tokens) == 5 and tokens[1] == eos
    assert gen.logits_processor.run.stats()["chosen_id"].tolist() == tokens


def test_trtllm_end_request_records_the_last_tokens_and_checks_its_input():
    tracker = LogitTrackingProcessor(MaskEven())
    fn = to_trtllm(tracker)
    gen = torch.Generator().manual_seed(4)
    tokens = {"a": [[1, 2]], "b": [[3, 4, 5]]}
    for _ in range(3):
        for req in ("a", "b"):
            logits = _step_rows(gen)[None]
            fn(req, logits, tokens[req], None, None)
            tokens[req][0].append(int(logits[0, 0].argmax()))
    with pytest.raises(ValueError, match=r"plus the token chosen then, got lengths \[4\]"):
        fn.end_request("a", [tokens["a"][0][:-1]])
    for req in ("a", "b"):
        fn.end_request(req, tokens[req])  # the refused call above left "a" in progress
    with pytest.raises(ValueError, match="req_id 'a' is not a request in progress"):
        fn.end_request("a", tokens["a"])
    for g, req in ((0, "a"), (1, "b")):
        assert tracker.stats(generation=g)["chosen_id"].tolist() == tokens[req][0][-3:]
        assert tracker.sequence(generation=g) == tracker.run.vocab.decode(tokens[req][0][-3:])
