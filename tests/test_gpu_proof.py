"""The prepared GPU proof off a GPU: it refuses cleanly, and its benchmarks' code runs end to end at tiny sizes.

``benchmarks/gpu_proof.sh`` / ``gpu_proof.py`` must say they need CUDA and
exit with status 2 on a machine without it, having run nothing. The code the
proof runs on a GPU (``bench_gpu.measure``, ``bench_sampling.pipe_grid``) is
device-agnostic, so it runs here on a tiny Llama and tiny grid, and the
report writer turns their real output into the Markdown tables.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


@no_cuda
@pytest.mark.parametrize("script", ["gpu_proof.py", "gpu_proof.sh"])
def test_the_proof_says_it_needs_cuda_and_exits_2(script, tmp_path):
    cmd = [sys.executable, f"benchmarks/{script}", "--out", str(tmp_path)] if script.endswith(".py") else None
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHON=sys.executable)
    if cmd is None:
        cmd = ["bash", "benchmarks/gpu_proof.sh", str(tmp_path)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "needs a CUDA GPU" in done.stderr and "nothing was run" in done.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.bench
def test_the_benchmarks_run_end_to_end_on_a_cpu_and_the_report_shows_them(tmp_path):
    import bench_gpu
    import gpu_proof
    from bench_sampling import pipe_grid
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = bench_gpu.synthetic_tokenizer(size=300, specials=8)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    rows = bench_gpu.measure(
        model, tok, "cpu", batches=(2,), tracked_batches=(2,), steps=(1, 2, 2), repeats=1, max_repeats=1,
        log=lambda line: None, stats_against_torch=True,
    )  # fmt: skip
    sections = [r.section for r in rows]
    tracked = [s for m in bench_gpu.STORAGE_MODES for s in (f"tracked {m}", f"stats kernels {m}")]
    assert sections == ["free", "regex", "json", "model.generate", *tracked]
    assert {r.baseline for r in rows if r.section.startswith("stats kernels")} == {"torch statistics"}
    assert all(r.ratio is not None and r.ratio == r.ratio and r.pairs == 1 for r in rows[1:])
    grid = pipe_grid("cpu", batches=(2,), vocabs=(2100,), repeats=1, max_repeats=1, algorithms=("auto", "pivot"))
    assert len(grid) == 3 * 2 and all(g["ratio"] > 0 for g in grid)
    (tmp_path / "bench_gpu.json").write_text(json.dumps(dict(header="tiny", rows=[asdict(r) for r in rows], grid=[])))
    (tmp_path / "bench_sampling.json").write_text(json.dumps(dict(device="cpu", torch=torch.__version__, rows=grid)))
    steps = {
        "cuda_tests": dict(name="cuda_tests", status=0, seconds=1.0, log="12 passed in 1.00s\n"),
        "bench_gpu": dict(name="bench_gpu", status=0, seconds=1.0, log=""),
        "bench_sampling": dict(name="bench_sampling", status=0, seconds=1.0, log=""),
    }
    text = Path(gpu_proof.report(str(tmp_path), "a CPU", {"torch": torch.__version__}, steps)).read_text()
    assert "12 passed" in text
    assert text.count("| tracked ") == len(bench_gpu.STORAGE_MODES)
    assert text.count("| min-p | pivot | 2 | 2100 |") == 1
    assert "model.generate" in text and "spread" in text
