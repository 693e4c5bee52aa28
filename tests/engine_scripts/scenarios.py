"""One batch through two real vLLM engines, with and without logitscope's processor; what each returned.

Runs in vLLM's environment (``tests/vllm_engine.run_script``): ``scenarios.py ARGS.json OUT.json``.
ARGS: ``{"model": folder, "engine": {LLM keyword arguments}, "batches": [[{"prompt": text, "params":
{SamplingParams keyword arguments}}, ...], ...], "without": true}``. The engine with the processor runs each
batch in turn (one ``generate`` call each; its runs land in ``LOGITSCOPE_RUNS``); with ``without``, a second
engine without the processor runs the same requests, untracked. OUT: per request (batches flattened) and
completion, the token ids, finish reason and logprobs (``{id: logprob}`` per position) of each engine, and the
engine's preemption count.
"""

from __future__ import annotations

import json
import sys


def _run(llm, batches):
    from generate import answers  # beside this script
    from vllm import SamplingParams

    return [
        answer
        for requests in batches
        for answer in answers(llm, [r["prompt"] for r in requests], [SamplingParams(**r["params"]) for r in requests])
    ]


def _preemptions(llm) -> float:
    try:
        return sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    except Exception:  # noqa: BLE001 - metrics off: unknown
        return -1.0


def main(args_path: str, out_path: str) -> None:
    from vllm import LLM

    args = json.loads(open(args_path).read())
    engine = {"dtype": "float32", "enforce_eager": True, "max_model_len": 256, "seed": 0, **args.get("engine", {})}
    processor = ["tracker.recording.engines.vllm:LogitscopeLogitsProcessor"]
    tracked = LLM(model=args["model"], logits_processors=processor, disable_log_stats=False, **engine)
    out = {"with": _run(tracked, args["batches"])}
    out["preemptions"] = _preemptions(tracked)
    del tracked
    if args.get("without"):
        bare = [
            [{**r, "params": {k: v for k, v in r["params"].items() if k != "extra_args"}} for r in batch]
            for batch in args["batches"]
        ]
        plain = LLM(model=args["model"], **engine)
        out["without"] = _run(plain, bare)
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
