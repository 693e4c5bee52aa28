"""The whole GPU proof in one short run: the CUDA tests, bench_gpu.py and the pipe grid, one Markdown report.

    python benchmarks/gpu_proof.py [--out FOLDER] [--budget SECONDS]
    benchmarks/gpu_proof.sh [FOLDER]          # installs carried wheels first (see gpu_wheels.txt)

Steps, each under its own time limit so that a report is always written:

1. the CUDA test set, ``pytest -m cuda`` over the files that hold tests
   needing a GPU (:func:`cuda_test_files`);
2. ``benchmarks/bench_gpu.py --skip-pipe``: the Generator against
   ``model.generate`` (B = 1, 8, 32), grammar steps against the free step
   (B = 1, 8, 32) and the tracked step against the untracked one in every
   storage mode (B = 1, 16, 64), on a random 1.2B Llama, bf16, 128k vocabulary;
   each ratio with its spread and host syncs per step;
3. ``benchmarks/bench_sampling.py --device cuda``: the pipe against
   transformers' warpers + softmax + multinomial for top-p alone, min-p and
   top-k + top-p at B = 1, 32, 256 and V = 32k, 128k (algorithms ``auto``,
   ``sort``, ``pivot``), each ratio with its spread and syncs per call.

The report (``gpu_proof.md``) gives the device, the versions, the test
summary and every figure with its spread and goal, beside the logs and JSON
of each step in the same folder. On a machine without CUDA it says so and
exits with status 2, having run nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
NEEDS_CUDA = 2  # the exit status on a machine without CUDA


def _run(name: str, cmd: list[str], out: str, limit: float) -> dict[str, Any]:
    """Run ``cmd`` from the repository root with its output in ``out/name.log``; never raises."""
    log = os.path.join(out, f"{name}.log")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    start = time.monotonic()
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        try:
            done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=max(limit, 1))
            status = done.returncode
        except subprocess.TimeoutExpired:
            status = "timed out"
    with open(log) as f:
        text = f.read()
    seconds = time.monotonic() - start
    print(f"{name}: {status} in {seconds:.0f} s ({log})", flush=True)
    return dict(name=name, status=status, seconds=seconds, log=text)


def cuda_test_files() -> list[str]:
    """The test files holding tests that need CUDA (a ``skipif`` with the reason "needs CUDA" or "needs a CUDA
    device", which ``tests/conftest.py`` marks ``cuda``). Only these are collected, so that modules importing
    what the GPU machine lacks (the dashboard's) are never imported there."""
    folder = os.path.join(ROOT, "tests")
    found = []
    for name in sorted(os.listdir(folder)):
        if name.startswith("test_") and name.endswith(".py"):
            with open(os.path.join(folder, name)) as f:
                text = f.read()
            if 'reason="needs CUDA' in text or 'reason="needs a CUDA device' in text:
                found.append(f"tests/{name}")
    return found


def _versions() -> dict[str, str]:
    import torch

    found = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("transformers", "triton", "llguidance", "pyarrow"):
        try:
            found[name] = __import__(name).__version__
        except Exception as e:  # absent or broken: say so in the report
            found[name] = f"missing ({type(e).__name__})"
    try:
        found["commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        found["commit"] = "unknown"
    return found


def _load(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _tests_section(step: dict[str, Any]) -> list[str]:
    summary = [ln for ln in step["log"].splitlines() if re.search(r"\d+ (passed|failed|error|skipped)", ln)]
    failed = [ln for ln in step["log"].splitlines() if ln.startswith(("FAILED", "ERROR"))]
    lines = [f"`pytest -m cuda`: status {step['status']}, {step['seconds']:.0f} s: {summary[-1] if summary else '?'}"]
    lines += ["", *[f"- {ln}" for ln in failed]] if failed else []
    return lines


def _gpu_section(data: dict[str, Any] | None, step: dict[str, Any]) -> list[str]:
    if data is None:
        return [f"bench_gpu.py gave no figures (status {step['status']}); see bench_gpu.log."]
    goals = {"regex": 1.05, "json": 1.05, "tracked float32": 1.10}
    lines = [
        data["header"],
        "",
        "| section | B | ms/step | free ms/step | syncs/step | ratio | spread | pairs | goal |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in data["rows"]:
        if r["ratio"] is None:
            lines.append(f"| {r['section']} | {r['batch']} | | | {r['syncs']:.2f} | | | | <= 1 sync |")
            continue
        section = r["section"]
        if section == "model.generate":
            goal, ok = ">= 1.5x", r["ratio"] >= 1.5
        elif section.startswith("stats kernels"):  # bench_gpu.py --stats-against-torch: against torch's kernels
            goal, ok = "< 1x", r["ratio"] < 1.0
        else:
            limit = goals.get(section, 1.03)
            goal, ok = f"<= {limit:.2f}x", r["ratio"] <= limit
        lines.append(
            f"| {section} | {r['batch']} | {r['step_ms']:.2f} | {r['baseline_ms']:.2f} | {r['syncs']:.2f} | "
            f"{r['ratio']:.3f}x | {r['spread']:.1%} | {r['pairs']} | {goal} {'ok' if ok else 'MISSED'} |"
        )
    lines += [
        "",
        "ratio: the section's step time over the free Generator's at the same batch, measured in alternating "
        "pairs (median of the per-pair ratios; spread: their interquartile range over the median); for "
        "model.generate above 1 means the Generator is faster.",
    ]
    return lines


def _grid_section(data: dict[str, Any] | None, step: dict[str, Any]) -> list[str]:
    if data is None:
        return [f"bench_sampling.py gave no figures (status {step['status']}); see bench_sampling.log."]
    lines = [
        f"{data['device']}, torch {data['torch']}",
        "",
        "| setting | algorithm | B | V | transformers ms | pipe ms | ratio | spread | syncs/call (pipe, transformers) "
        "| goal >= 2x |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in data["rows"]:
        lines.append(
            f"| {r['setting']} | {r['algorithm']} | {r['batch']} | {r['vocab']} | {r['transformers_ms']:.3f} | "
            f"{r['pipe_ms']:.3f} | {r['ratio']:.2f}x | {r['spread']:.1%} | {r['pipe_syncs']:.1f}, "
            f"{r['transformers_syncs']:.1f} | {'ok' if r['ratio'] >= 2 else 'MISSED'} |"
        )
    return lines


def report(out: str, device: str, versions: dict[str, str], steps: dict[str, dict[str, Any]]) -> str:
    """The Markdown report from the steps' results and JSON files; written to ``out/gpu_proof.md``."""
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# GPU proof: {device} ({when})", "", ", ".join(f"{k} {v}" for k, v in versions.items()), ""]
    lines += ["## CUDA tests", "", *_tests_section(steps["cuda_tests"]), ""]
    lines += [
        "## Decode step (bench_gpu.py)",
        "",
        *_gpu_section(_load(os.path.join(out, "bench_gpu.json")), steps["bench_gpu"]),
        "",
    ]
    lines += [
        "## Sampling pipe against transformers' warpers (bench_sampling.py --device cuda)",
        "",
        *_grid_section(_load(os.path.join(out, "bench_sampling.json")), steps["bench_sampling"]),
        "",
        "## Steps",
        "",
        *[f"- {s['name']}: status {s['status']}, {s['seconds']:.0f} s (log: {s['name']}.log)" for s in steps.values()],
        "",
    ]
    text = "\n".join(lines)
    path = os.path.join(out, "gpu_proof.md")
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "gpu_proof_out"))
    parser.add_argument("--budget", type=float, default=450.0, help="seconds for all steps together (default 450)")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(
            f"gpu_proof: needs a CUDA GPU, and torch {torch.__version__} sees none here "
            "(torch.cuda.is_available() is False); nothing was run",
            file=sys.stderr,
        )
        return NEEDS_CUDA
    os.makedirs(args.out, exist_ok=True)
    device = torch.cuda.get_device_name()
    versions = _versions()
    deadline = time.monotonic() + args.budget
    py = sys.executable
    # shares of what is left: the tests first (they must run), then the decode step, then the grid
    plan = [
        ("cuda_tests", [py, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", *cuda_test_files()], 0.3),
        (
            "bench_gpu",
            [
                py,
                "benchmarks/bench_gpu.py",
                "--skip-pipe",
                "--repeats",
                "3",
                "--max-repeats",
                "9",
                "--json",
                f"{args.out}/bench_gpu.json",
            ],
            0.6,
        ),
        (
            "bench_sampling",
            [
                py,
                "benchmarks/bench_sampling.py",
                "--device",
                "cuda",
                "--repeats",
                "6",
                "--max-repeats",
                "15",
                "--json",
                f"{args.out}/bench_sampling.json",
            ],
            1.0,
        ),
    ]
    steps: dict[str, dict[str, Any]] = {}
    for name, cmd, share in plan:
        steps[name] = _run(name, cmd, args.out, share * (deadline - time.monotonic()))
        report(args.out, device, versions, steps | {n: _pending(n) for n, _, _ in plan if n not in steps})
    path = report(args.out, device, versions, steps)
    print(f"report: {path}")
    return 0 if all(s["status"] == 0 for s in steps.values()) else 1


def _pending(name: str) -> dict[str, Any]:
    return dict(name=name, status="not run", seconds=0.0, log="")


if __name__ == "__main__":
    sys.exit(main())
