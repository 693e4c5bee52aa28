"""vLLM's sampling stages computed when a run is read (:mod:`tracker.reading.engine_stages`), without vLLM.

The maths against straightforward references on fresh random rows (vLLM's own sampler is the reference in
``tests/test_engine_vllm_stages.py`` and in the real engine, ``tests/test_engine_vllm_served.py``); then runs
recorded by the real tracker with vLLM's request metadata, read back through ``Run.load``, the dashboard's
reader, SQL and the Step replay page.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

from dashboard.paths import APP
from dashboard.reader import BadRunError, RunReader
from dashboard.synthetic import hand_made_run
from tracker import Run, open_dataset
from tracker.format.layout import RunFileError
from tracker.reading.engine_requests import request_from, row_params, vllm_requests
from tracker.reading.engine_stages import ENGINE_STAGES
from tracker.reading.vllm_sampler import min_p, penalties, sampled, temperature, top_k, top_p

V = 64
REQUESTS = [
    dict(temperature=0.7, top_p=0.9, top_k=20, min_p=0.02, repetition_penalty=1.3, frequency_penalty=0.5,
         presence_penalty=0.4),
    dict(temperature=0.0, repetition_penalty=1.2),
    dict(temperature=1.0),
]  # fmt: skip
PROMPT = (5, 6, 5, 40)


def _params(request: dict, rows: int):
    return row_params([request_from({"sampler": "vllm", **request}, PROMPT)] * rows, V)


# ---------------------------------------------------------------- the maths, against plain definitions


def test_penalties_follow_their_definitions_token_by_token():
    rng = np.random.default_rng(1)
    rows = (rng.standard_normal((5, V)) * 3).astype(np.float32)
    rows[:, 7] = -np.inf
    counts = rng.integers(0, 3, (5, V)) * (rng.random((5, V)) < 0.2)
    prompt = np.zeros((5, V), bool)
    prompt[:, list(PROMPT)] = True
    params = _params(REQUESTS[0], 5)
    got = penalties(rows, prompt, counts, params)
    want = rows.astype(np.float64)
    for r in range(5):
        for t in range(V):
            if prompt[r, t] or counts[r, t]:  # repetition: a positive logit divided, any other multiplied
                want[r, t] = want[r, t] / 1.3 if want[r, t] > 0 else want[r, t] * 1.3
            want[r, t] -= 0.5 * counts[r, t] + 0.4 * (counts[r, t] > 0)
    finite = np.isfinite(want)
    assert np.array_equal(np.isfinite(got), finite)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-6, atol=1e-6)
    assert np.array_equal(penalties(rows, prompt, np.zeros_like(counts), _params(REQUESTS[2], 5)), rows)


def test_min_p_top_k_and_top_p_keep_what_their_definitions_keep():
    rng = np.random.default_rng(2)
    rows = (rng.standard_normal((40, V)) * 2).astype(np.float32)
    params = _params(dict(temperature=1.0, min_p=0.1, top_k=9, top_p=0.7), 40)
    wide = rows.astype(np.float64)
    p = np.exp(wide - wide.max(axis=1, keepdims=True))
    assert np.array_equal(min_p(rows, params) > -np.inf, p >= 0.1)  # p >= min_p * max p
    ninth = np.sort(wide, axis=1)[:, -9][:, None]
    assert np.array_equal(top_k(rows, params) > -np.inf, wide >= ninth)
    kept = top_p(rows, params) > -np.inf
    for r in range(40):  # the smallest set of the best tokens holding at least top_p of the mass
        order = np.argsort(-wide[r], kind="stable")
        probs = np.exp(wide[r] - wide[r].max())
        probs /= probs.sum()
        mass_before = np.concatenate([[0], np.cumsum(probs[order])[:-1]])
        assert set(np.nonzero(kept[r])[0]) == set(order[mass_before < 0.7]), r


def test_ties_follow_vllms_rules():
    """Top-k keeps every token tied with the k-th; at a top-p boundary inside equal logits the lower ids go
    (vLLM sorts ascending, equal values by id, and cuts from the start)."""
    rows = np.array([[1.0, 3.0, 2.0, 2.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]], np.float32)
    params = row_params([replace(_request(top_k=2, top_p=0.5))] * 2, 6)
    assert (top_k(rows[:1], params.take(np.array([0]))) > -np.inf).tolist() == [[0, 1, 1, 1, 1, 0]]
    uniform = top_p(rows[1:], params.take(np.array([1])))
    assert (uniform > -np.inf).tolist() == [[0, 0, 0, 1, 1, 1]]  # 3/6 of the mass cut: ids 0, 1, 2


def _request(**request):
    return request_from(request)


def test_off_values_change_nothing_and_greedy_samples_one_token():
    rng = np.random.default_rng(3)
    rows = rng.standard_normal((3, V)).astype(np.float32)
    rows[1, 3] = rows[1].max() + 1
    rows[1, 9] = rows[1, 3]  # two equal maxima: the first id wins
    for off in (dict(top_k=-1), dict(top_k=0), dict(top_k=V), dict(top_p=1.0), dict(min_p=0.0)):
        params = row_params([_request(**off)] * 3, V)
        for stage in (min_p, top_k, top_p):
            assert np.array_equal(stage(rows, params), rows), off
    greedy = row_params([_request(temperature=0.0, top_k=2)] * 3, V)
    assert np.array_equal(temperature(rows, greedy), rows)
    one_hot = sampled(rows, rows, greedy)
    assert ((one_hot == 0).sum(axis=1) == 1).all() and np.argmax(one_hot[1]) == 3
    logp = sampled(rows, rows, row_params([_request()] * 3, V))
    np.testing.assert_allclose(np.exp(logp.astype(np.float64)).sum(axis=1), 1, rtol=1e-6)


# ---------------------------------------------------------------- runs read back


def _vllm_run(storage: str = "float32", top_k: int = 4, seed: int = 0, steps: int = 7) -> Run:
    """A run the real tracker records from random rows, with the metadata logitscope's vLLM processor writes:
    one generation per request of :data:`REQUESTS`, batches of three rows (penalties count across them)."""
    rng = np.random.default_rng(seed)
    natural = (rng.standard_normal((len(REQUESTS), 1, steps, V)) * 3).astype(np.float32)
    chosen = rng.integers(0, V, (len(REQUESTS), 1, steps))
    chosen[0, 0, :3] = PROMPT[0]  # a token of the prompt, output again: both penalties count it
    run = hand_made_run(natural, chosen, [f"t{i}" for i in range(V)], storage=storage, top_k=top_k, prompt=PROMPT)
    generations = [
        dict(entry, sampling=[{"sampler": "vllm", **REQUESTS[i], "seed": i, "max_tokens": steps}])
        for i, entry in enumerate(run.metadata.generations)
    ]
    return Run(run.to_arrow().to_batches(max_chunksize=3), replace(run.metadata, generations=generations), run.vocab)


def _reference(natural: np.ndarray, chosen: np.ndarray, request: dict) -> dict[str, np.ndarray]:
    """Each stage of one request's rows, one step at a time, its output counted by a loop over its tokens."""
    out = {stage: [] for stage in ENGINE_STAGES}
    params = _params(request, 1)
    prompt = np.zeros((1, V), bool)
    prompt[0, list(PROMPT)] = True
    for step, row in enumerate(natural):
        counts = np.zeros((1, V), np.int64)
        for token in chosen[:step]:
            counts[0, token] += 1
        pen = penalties(row[None], prompt, counts, params)
        tem = temperature(pen, params)
        cut = top_p(top_k(min_p(tem, params), params), params)
        for stage, value in zip(ENGINE_STAGES, (pen, tem, min_p(tem, params), top_k(min_p(tem, params), params), cut)):
            out[stage].append(value[0])
        out["sampled"].append(sampled(cut, pen, params)[0])
    return {stage: np.stack(rows) for stage, rows in out.items()}


@pytest.fixture(scope="module")
def vllm_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm") / "served.parquet"
    _vllm_run().to_parquet(path)
    return path


def test_a_vllm_run_read_back_holds_every_stage_of_its_sampler(vllm_file):
    run = Run.load(vllm_file)
    assert run.metadata.stages == ["natural", *ENGINE_STAGES]
    assert Run.load(vllm_file, engine_stages=False).metadata.stages == ["natural"]
    for g, request in enumerate(REQUESTS):
        logits = run.get_logits(generation=g)
        chosen = run.stats(generation=g)["chosen_id"].to_numpy(dtype=np.int64)
        want = _reference(logits["unstructured"], chosen, request)
        for stage in ENGINE_STAGES:
            assert np.array_equal(logits[stage], want[stage]), (g, stage)
    greedy = run.get_probabilities(generation=1)["sampled"]
    assert ((greedy > 0).sum(axis=1) == 1).all()
    assert (run.get_logits(generation=0)["penalties"] != run.get_logits(generation=0)["unstructured"]).any()


def test_each_stage_has_the_statistics_of_any_stage(vllm_file):
    run = Run.load(vllm_file)
    stats = run.stats(generation=0)
    probs = run.get_probabilities(generation=0)
    chosen = stats["chosen_id"].to_numpy(dtype=np.int64)
    natural = probs["unstructured"].astype(np.float64)
    before = np.zeros(len(stats))
    for stage in ENGINE_STAGES:
        p = probs[stage].astype(np.float64)
        np.testing.assert_allclose(p.sum(axis=1), 1, rtol=1e-5)
        np.testing.assert_allclose(stats[f"p_chosen_{stage}"], p[np.arange(len(p)), chosen], rtol=1e-5, atol=1e-7)
        logp = np.log(np.where(p > 0, p, 1))
        np.testing.assert_allclose(stats[f"entropy_{stage}"], -(p * logp).sum(axis=1), rtol=1e-4, atol=1e-5)
        assert stats[f"allowed_{stage}"].tolist() == (p > 0).sum(axis=1).tolist()
        removed = (natural * (p == 0)).sum(axis=1)  # the natural mass of what this stage and those before cut
        np.testing.assert_allclose(stats[f"removed_mass_{stage}"], removed - before, atol=1e-6)
        before = removed
    assert (stats["allowed_top_p"] < V).all() and (stats["allowed_temperature"] == V).all()
    why = run.why(2, generation=0)
    assert why["stage"].tolist()[:7] == ["natural", *ENGINE_STAGES]
    tops = run.get_top_tokens(k=3, positions=1, generation=0, stage="sampled")[0]["tokens"]
    assert [t["structured_prob"] for t in tops] == sorted((t["structured_prob"] for t in tops), reverse=True)


def test_sql_and_the_dashboards_reader_show_the_same_stages(vllm_file):
    run = Run.load(vllm_file)
    steps = (
        open_dataset(vllm_file)
        .sql(
            "SELECT generation, step, p_chosen_sampled, entropy_temperature, allowed_top_p, removed_mass_top_k "
            "FROM steps ORDER BY generation, step"
        )
        .to_pandas()
    )
    stats = run.stats(sequence=None, generation=0)
    mine = steps[steps["generation"] == 0]
    np.testing.assert_allclose(mine["p_chosen_sampled"], stats["p_chosen_sampled"], rtol=1e-6)
    np.testing.assert_allclose(mine["entropy_temperature"], stats["entropy_temperature"], rtol=1e-6)
    assert mine["allowed_top_p"].tolist() == stats["allowed_top_p"].tolist()
    np.testing.assert_allclose(mine["removed_mass_top_k"], stats["removed_mass_top_k"], atol=1e-7)
    reader = RunReader(vllm_file)
    assert reader.stages == ["natural", *ENGINE_STAGES]
    track = reader.track(0, 0)
    logits = run.get_logits(generation=0)
    for position in range(track.length):
        row = reader.step(track, position)
        for stage in ENGINE_STAGES:
            assert np.array_equal(row.stages[stage].logits, logits[stage][position]), (position, stage)
            assert row.stages[stage].allowed == int((logits[stage][position] > -np.inf).sum())


def test_the_step_replay_draws_each_stage_of_the_sampler(vllm_file):
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.session_state["root"] = str(vllm_file.parent)
    at.switch_page("app_pages/replay.py")
    at.run()
    assert not at.exception, at.exception[0].message if at.exception else ""
    [picker] = [m for m in at.multiselect if m.label == "Stages"]
    assert picker.value == ["natural", *ENGINE_STAGES]  # every stage drawn at first
    numbers = {m.label.replace("\\", ""): m.value for m in at.metric}
    assert {f"p, {s}" for s in ("penalties", "temperature", "min_p", "top_k", "top_p")} <= set(numbers)
    shown = at.sidebar.selectbox(key="generation").value
    stats = Run.load(vllm_file).stats(generation=shown)
    assert stats["allowed_sampled"][0] < V  # the first generation's filters cut
    assert numbers["Allowed tokens"] == f"{int(stats['allowed_sampled'][0])} / {V}"  # what the sampler left
    for page in ("overview", "compare"):  # the other pages take the run's stages too
        at.switch_page(f"app_pages/{page}.py").run()
        assert not at.exception, (page, at.exception[0].message if at.exception else "")


def test_rows_that_cannot_be_known_are_null_never_guessed(tmp_path):
    run = _vllm_run(steps=6)
    table = run.to_arrow()
    keep = ~((table.column("generation").to_numpy() == 0) & (table.column("step").to_numpy() < 2))
    nan_row = (table.column("generation").to_numpy() == 2) & (table.column("step").to_numpy() == 3)
    values = np.array(table.column("natural_logits").to_pylist(), dtype=np.float32)
    values[nan_row, 5] = np.nan
    import pyarrow as pa

    column = pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), V)
    table = table.set_column(
        table.schema.get_field_index("natural_logits"), table.schema.field("natural_logits"), column
    )
    table = table.drop_columns([c for c in table.column_names if c.startswith("natural_") and c != "natural_logits"])
    resumed = [dict(g, sampling=[dict(g["sampling"][0], resumed_at_step=2)]) if g["generation"] == 0 else g
               for g in run.metadata.generations]  # fmt: skip
    cut = Run(table.filter(pa.array(keep)).to_batches(), replace(run.metadata, generations=resumed), run.vocab)
    derived = cut.with_engine_stages().to_arrow()
    gen, step = derived.column("generation").to_numpy(), derived.column("step").to_numpy()
    for stage in ENGINE_STAGES:
        valid = derived.column(f"{stage}_logits").is_valid().to_numpy(zero_copy_only=False)
        assert not valid[gen == 0].any(), stage  # penalties need tokens output before the request resumed
        assert not valid[(gen == 2) & (step == 3)].any(), stage  # a NaN natural row: vLLM would sample NaN
        assert valid[gen == 1].all() and valid[(gen == 2) & (step != 3)].all(), stage


def test_damaged_sampling_parameters_are_refused_naming_the_request_and_the_key(tmp_path):
    run = _vllm_run()
    entries = [dict(g, sampling=[dict(g["sampling"][0], top_p=1.5)]) for g in run.metadata.generations]
    path = tmp_path / "bad.parquet"
    Run(run._record_batches(), replace(run.metadata, generations=entries), run.vocab).to_parquet(path)
    with pytest.raises(
        RunFileError, match=r"generation 0, sequence 0: sampling\['top_p'\] must be a number in \(0, 1\], got 1.5"
    ):
        Run.load(path)
    with pytest.raises(BadRunError, match=r"sampling\['top_p'\]"):
        RunReader(path)
    assert Run.load(path, engine_stages=False).metadata.stages == ["natural"]


def test_a_run_whose_metadata_names_vllm_as_its_engine_gets_the_stages():
    """The run-level marker (``extra["engine"]``, as the vLLM processor names the engine) serves as well as a
    request's ``"sampler"``."""
    served = _vllm_run()
    plain = [
        dict(g, sampling=[{k: v for k, v in g["sampling"][0].items() if k != "sampler"}])
        for g in served.metadata.generations
    ]
    named = replace(served.metadata, generations=plain, extra={"engine": {"name": "vllm", "version": "0.32.0"}})
    run = Run(served._record_batches(), named, served.vocab).with_engine_stages()
    assert run.metadata.stages == ["natural", *ENGINE_STAGES]
    expected = served.with_engine_stages().get_logits(generation=0)
    assert np.array_equal(run.get_logits(generation=0)["sampled"], expected["sampled"])
    other = replace(named, extra={"engine": {"name": "sglang"}})
    assert Run(served._record_batches(), other, served.vocab).with_engine_stages().metadata.stages == ["natural"]


def test_runs_vllm_did_not_sample_are_read_as_recorded():
    plain = hand_made_run(np.zeros((3, V), np.float32), [1, 2, 3], [f"t{i}" for i in range(V)])
    assert plain.with_engine_stages() is plain and not vllm_requests(plain.metadata)
    served = _vllm_run()
    derived = served.with_engine_stages()
    assert derived.with_engine_stages() is derived  # already has them


@pytest.mark.parametrize("storage", ["float16", "bfloat16"])
def test_half_precision_runs_get_their_stages_in_their_storage(storage):
    full = _vllm_run().with_engine_stages()
    half = _vllm_run(storage=storage).with_engine_stages()
    assert half.metadata.storage == storage
    step = 2 ** (-10 if storage == "float16" else -7)
    for g in range(len(REQUESTS)):
        a, b = full.get_logits(generation=g), half.get_logits(generation=g)
        for stage in ENGINE_STAGES:
            finite = np.isfinite(a[stage]) & np.isfinite(b[stage])
            # kept relative to each row's largest logit, from a natural row rounded alike, then scaled by 1 / 0.7
            with np.errstate(invalid="ignore"):
                nat = a["unstructured"]
                scale = np.abs(a[stage] - a[stage].max(axis=1, keepdims=True)) + np.abs(nat - nat.max(axis=1)[:, None])
                assert (np.abs(a[stage] - b[stage])[finite] <= 2 * step * (scale[finite] + 1) / 0.7).all(), (g, stage)
            p = half.get_probabilities(generation=g)[stage].astype(np.float64)
            np.testing.assert_allclose(p.sum(axis=1), 1, rtol=1e-5)  # the stored lse is the stored row's


def test_top_k_storage_of_a_small_row_knows_every_stage(tmp_path):
    """A row that allowed no more tokens than top-k storage kept is known whole: every stage follows."""
    rng = np.random.default_rng(5)
    natural = np.full((1, 1, 5, V), -np.inf, np.float32)
    natural[..., :6] = rng.standard_normal((1, 1, 5, 6)) * 2
    run = hand_made_run(natural, rng.integers(0, 6, (1, 1, 5)), [f"t{i}" for i in range(V)], storage="topk", top_k=8)
    generations = [dict(run.metadata.generations[0], sampling=[{"sampler": "vllm", "temperature": 0.5, "top_p": 0.8}])]
    top = Run(run._record_batches(), replace(run.metadata, generations=generations), run.vocab).with_engine_stages()
    table = top.to_arrow()
    for stage in ENGINE_STAGES:
        assert table.column(f"{stage}_topk_ids").is_valid().to_numpy(zero_copy_only=False).all(), stage
    probs = top.get_probabilities(generation=0)
    row = natural[0, 0].astype(np.float64) / 0.5
    p = np.exp(row - row.max())
    np.testing.assert_allclose(probs["temperature"], p / p.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-8)
    assert math.isclose(float(probs["sampled"].sum(axis=1).max()), 1, rel_tol=1e-5)
    Run(run._record_batches(), replace(run.metadata, generations=generations), run.vocab).to_parquet(
        tmp_path / "t.parquet"
    )
    reader = RunReader(tmp_path / "t.parquet")
    row = reader.step(reader.track(0, 0), 2)
    shown = row.stages["temperature"]
    assert shown.recorded and set(shown.ids[np.isfinite(shown.values)]) == set(range(6))
    np.testing.assert_allclose(
        np.exp(shown.values[shown.ids < 6] - shown.lse), probs["temperature"][2, shown.ids[shown.ids < 6]], rtol=1e-5
    )


def test_top_p_over_a_large_vocabulary_sorts_only_the_best_tokens_and_cuts_the_same(monkeypatch):
    """Rows whose best :data:`CANDIDATES` tokens hold the mass top-p keeps are decided from them alone; flat rows
    and rows with a tie across that cut are sorted whole: the same tokens cut either way."""
    from tracker.reading import vllm_sampler

    rng = np.random.default_rng(6)
    candidates = vllm_sampler.CANDIDATES
    vocab = 3 * candidates
    rows = (rng.standard_normal((6, vocab)) * 3).astype(np.float32)
    rows[1] = rng.standard_normal(vocab).astype(np.float32) * 0.01  # flat: its best tokens hold too little
    rows[2] = np.round(rows[2])  # ties across the cut
    params = row_params([_request(top_p=0.8)] * 6, vocab)
    cut = top_p(rows, params)
    monkeypatch.setattr(vllm_sampler, "CANDIDATES", 10 * vocab)
    assert np.array_equal(cut, top_p(rows, params))
    kept = (cut > -np.inf).sum(axis=1)
    assert kept[1] > candidates > kept[0] > 1
