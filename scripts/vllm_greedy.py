"""Greedy generation with vLLM for the engine test tier (runs in the engine venv, not the project's).

    python scripts/vllm_greedy.py REQUEST.json RESULT.json

REQUEST: {"model": DIR, "prompts": [[token ids], ...], "max_tokens": N, "dtype": "bfloat16"}, optionally
"load_format" (e.g. "sharded_state"), "tensor_parallel_size", "logprobs" (how many top logprobs per step),
"save_sharded_state" (a directory: vLLM's own save_sharded_state of the loaded model goes there, then
the script ends without generating), "moe_backend" (e.g. "marlin"), "register_wna16ctl" (register the
load format `wna16ctl` in this process, for a wna16ctl that is importable but not pip-installed: the
engine then runs in this process, VLLM_ENABLE_V1_MULTIPROCESSING=0, so TP 1 only).
RESULT: {"tokens": [[generated ids], ...], "logprobs": [[{token id: logprob} per step], ...] (with
"logprobs"), "vllm": version, "seconds": load + generate time}.
Only vLLM and the standard library are imported (and wna16ctl's plugin with "register_wna16ctl"):
the engine venv does not have wna16ctl.
"""

from __future__ import annotations

import json
import sys
import time


def main(request_path: str, result_path: str) -> None:
    import vllm
    from vllm import LLM, SamplingParams

    req = json.loads(open(request_path).read())
    extra = {"moe_backend": req["moe_backend"]} if req.get("moe_backend") else {}
    if req.get("register_wna16ctl"):
        import os

        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from wna16ctl.integrations.vllm_plugin import register

        register()
    started = time.monotonic()
    # on the CPU backend gpu_memory_utilization is the share of host memory vLLM reserves: a
    # demo model needs a sliver of it
    llm = LLM(model=req["model"], dtype=req.get("dtype", "auto"), max_model_len=req.get("max_model_len", 2048),
              gpu_memory_utilization=req.get("memory_fraction", 0.05), enforce_eager=True, seed=0,
              skip_tokenizer_init=True, load_format=req.get("load_format", "auto"),
              tensor_parallel_size=req.get("tensor_parallel_size", 1), **extra)
    if req.get("save_sharded_state"):
        llm.llm_engine.engine_core.save_sharded_state(path=req["save_sharded_state"])
        with open(result_path, "w") as f:
            json.dump({"saved": req["save_sharded_state"], "vllm": vllm.__version__}, f)
        return
    params = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], detokenize=False,
                            logprobs=req.get("logprobs"))
    outs = llm.generate([{"prompt_token_ids": ids} for ids in req["prompts"]], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    result = {"tokens": tokens, "vllm": vllm.__version__, "seconds": time.monotonic() - started}
    if req.get("logprobs"):
        result["logprobs"] = [[{str(t): lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs or []]
                              for o in outs]
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
