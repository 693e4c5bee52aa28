"""Requests through vLLM's offline engine (``LLM``), with or without logitscope's processor; what vLLM returned.

Runs in vLLM's environment, called by ``tests/vllm_engine.run_script`` as ``generate.py ARGS.json OUT.json``:

- ARGS: ``{"model": folder, "engine": {LLM keyword arguments}, "processor": true/false,
  "batches": [[{"prompt": text} or {"prompt_ids": [ids]}, "params": {SamplingParams keyword arguments}}, ...]]}``;
  each batch is one ``LLM.generate`` call (its requests share the engine's batch).
- OUT: ``{"batches": [[{"prompt_ids": [...], "outputs": [{"token_ids": [...], "finish_reason": ...,
  "logprobs": [{"id": logprob, ...} per position] or null}]}]]}``.

Runs land where ``LOGITSCOPE_RUNS`` says (the processor reads it in the engine's process).
"""

from __future__ import annotations

import json
import sys


def answers(llm, prompts, params) -> list[dict]:
    """One ``LLM.generate`` call; per request its prompt ids and, per completion, its token ids, finish reason and
    logprobs (``{id: logprob}`` per position, or None)."""
    return [
        {
            "prompt_ids": list(answer.prompt_token_ids),
            "outputs": [
                {
                    "token_ids": list(out.token_ids),
                    "finish_reason": out.finish_reason,
                    "logprobs": None
                    if out.logprobs is None
                    else [{str(t): lp.logprob for t, lp in pos.items()} for pos in out.logprobs],
                }
                for out in answer.outputs
            ],
        }
        for answer in llm.generate(prompts, params, use_tqdm=False)
    ]


def main(args_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    args = json.loads(open(args_path).read())
    engine = {"dtype": "float32", "enforce_eager": True, "max_model_len": 256, "seed": 0, **args.get("engine", {})}
    if args.get("processor", True):
        engine["logits_processors"] = ["tracker.recording.engines.vllm:LogitscopeLogitsProcessor"]
    llm = LLM(model=args["model"], **engine)
    batches = []
    for batch in args["batches"]:
        prompts = [TokensPrompt(prompt_token_ids=r["prompt_ids"]) if "prompt_ids" in r else r["prompt"] for r in batch]
        batches.append(answers(llm, prompts, [SamplingParams(**r.get("params", {})) for r in batch]))
    with open(out_path, "w") as f:
        json.dump({"batches": batches}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
