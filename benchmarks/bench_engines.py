"""The vLLM V1 processor's per-step cost, against the sampling step it rides on, in one process.

    python benchmarks/bench_engines.py [--device cuda] [--batch 1 16 64] [--vocab 131072] [--steps 200]

Per batch size and share of tracked requests (none, 10 %, all), over ``--steps``
steps: the time of :meth:`LogitscopeLogitsProcessor.apply` per step, and the
ratio to a baseline step measured in the same loop (a float32 ``softmax``,
``argmax`` and an exponential-race sample over the same logits, the cheapest
sampler vLLM has). Batch membership is set up once through ``update_state``,
as vLLM does when requests join; parts are not written during the timed steps
(they are written off the step's thread when requests end). On CUDA each
measurement ends with one synchronisation; the steps themselves never wait.
Works without vLLM installed (the processor's base class is then ``object``).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass, field

import torch

from tracker.recording.engines.vllm import LogitscopeLogitsProcessor


@dataclass
class _Params:
    extra_args: dict | None = None
    temperature: float = 1.0


@dataclass
class _Update:
    """vLLM's BatchUpdate fields (vLLM's own class when it imports)."""

    batch_size: int
    removed: list = field(default_factory=list)
    added: list = field(default_factory=list)
    moved: list = field(default_factory=list)


def _update(batch: int, tracked: int, outputs: list[list[int]]):
    added = [
        (i, _Params(extra_args={"logitscope": True} if i < tracked else None), [1, 2, 3], outputs[i])
        for i in range(batch)
    ]
    try:
        from vllm.v1.sample.logits_processor import BatchUpdate

        return BatchUpdate(batch_size=batch, removed=[], added=added, moved=[])
    except ImportError:
        return _Update(batch, added=added)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(batch: int, vocab: int, share: float, steps: int, device: torch.device) -> tuple[float, float]:
    """Seconds per step of apply() and of the baseline sampling step."""
    tracked = 0 if share == 0 else max(1, round(batch * share))
    with tempfile.TemporaryDirectory() as root:

        class Bench(LogitscopeLogitsProcessor):
            runs = root

        processor = Bench(None, device, device.type == "cuda")
        outputs: list[list[int]] = [[] for _ in range(batch)]
        processor.update_state(_update(batch, tracked, outputs))
        logits = torch.randn(batch, vocab, device=device)
        noise = torch.empty_like(logits)
        apply_s = base_s = 0.0
        for step in range(steps + 10):
            _sync(device)
            t0 = time.perf_counter()
            processor.apply(logits)
            _sync(device)
            t1 = time.perf_counter()
            probs = logits.softmax(dim=-1)
            sampled = probs.div_(noise.exponential_()).argmax(dim=-1)
            _sync(device)
            t2 = time.perf_counter()
            if step >= 10:
                apply_s, base_s = apply_s + t1 - t0, base_s + t2 - t1
            for out in outputs:
                out.append(int(step % vocab))
            del sampled
        processor.update_state(_Update(batch, removed=list(range(batch))))
        processor.flush()
    return apply_s / steps, base_s / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--vocab", type=int, default=131072)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"device {device}, vocab {args.vocab}, {args.steps} steps (float32 storage)")
    print(f"{'batch':>5} {'tracked':>8} {'apply ms':>9} {'sample ms':>9} {'ratio':>6}")
    for batch in args.batch:
        for share in (0.0, 0.1, 1.0):
            apply_s, base_s = measure(batch, args.vocab, share, args.steps, device)
            print(f"{batch:>5} {share:>8.0%} {apply_s * 1e3:>9.3f} {base_s * 1e3:>9.3f} {apply_s / base_s:>6.2f}")


if __name__ == "__main__":
    main()
