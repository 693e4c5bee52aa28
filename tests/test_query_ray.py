"""The Ray Data recipe: map_batches with a model-holding actor writes each batch as a run, then SQL across them.

Runs on a local Ray cluster (two CPUs, no dashboard, no usage report) with the
shipped demo model; marked ``ray`` (about a minute).
"""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.ray

PROMPTS = ["The city", "A", "Once", "Hello", "The", "In the"]


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # no report sent anywhere
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


def test_batches_generated_on_ray_actors_become_runs_that_sql_reads(ray_cluster, tmp_path):
    from logitscope.batch import TrackedGeneration
    from tracker import Run, open_dataset

    ray = ray_cluster
    root = tmp_path / "runs"
    prompts = ray.data.from_items([{"prompt": p} for p in PROMPTS])
    texts = prompts.map_batches(
        TrackedGeneration,
        fn_constructor_kwargs={"root": str(root), "params": {"max_new_tokens": 6}, "top_k": 5, "title": "ray"},
        batch_size=2,
        concurrency=2,
        num_cpus=1,
    ).take_all()
    assert sorted(t["prompt"] for t in texts) == sorted(PROMPTS)
    run_ids = sorted({t["run_id"] for t in texts})
    assert len(run_ids) == 3  # one run per batch of two prompts

    data = open_dataset(root)
    assert data.run_ids == run_ids
    runs = data.sql("SELECT run_id, title, storage, top_k, sequences FROM runs ORDER BY run_id").to_pylist()
    assert [(r["title"], r["storage"], r["top_k"], r["sequences"]) for r in runs] == [("ray", "topk", 5, 2)] * 3
    answered = data.sql("SELECT q.prompt, q.text FROM sequences q").to_pylist()
    assert sorted((a["prompt"], a["text"]) for a in answered) == sorted((t["prompt"], t["text"]) for t in texts)
    steps = data.sql("SELECT run_id, count(*) AS n, avg(entropy_natural) AS h FROM steps GROUP BY run_id")
    for row in steps.to_pylist():
        stats = Run.load(root, run_id=row["run_id"]).stats(sequence=None, generation=0)
        assert row["n"] == len(stats) and row["h"] == pytest.approx(stats["entropy_natural"].mean(), rel=1e-9)

    read = ray.data.read_delta(str(root)).select_columns(["run_id", "step"]).take_all()  # the committed parts
    assert {r["run_id"] for r in read} == set(run_ids)
