"""One engine start for bench/bench_engine_load.py (runs in the engine's python: vLLM and the
standard library only).

    python bench/_engine_load_driver.py REQUEST.json

REQUEST: {"model": DIR, "load_format": "auto" | "sharded_state", "tensor_parallel_size": N,
"max_model_len": N, "memory_fraction": F, "kv_cache_bytes": N (the KV cache per rank; None: vLLM's default)}.  Prints one line `ENGINE_LOAD {json}` with wall-clock stamps (time.time()) of
the start of this process, vLLM imported, the engine ready (LLM() returned) and the first token of a
one-token greedy request; then waits for its standard input to close, so that the benchmark reads
the workers' peak memory while they are still alive.
"""

from __future__ import annotations

import json
import sys
import time

STARTED = time.time()


def main(request_path: str) -> None:
    with open(request_path) as f:
        req = json.load(f)
    import vllm
    from vllm import LLM, SamplingParams

    imported = time.time()
    llm = LLM(model=req["model"], load_format=req["load_format"], tensor_parallel_size=req["tensor_parallel_size"],
              dtype="bfloat16", max_model_len=req.get("max_model_len", 1024), enforce_eager=True, seed=0,
              skip_tokenizer_init=True, gpu_memory_utilization=req.get("memory_fraction", 0.9),
              kv_cache_memory_bytes=req.get("kv_cache_bytes"))
    ready = time.time()
    params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12]}], params, use_tqdm=False)
    first = time.time()
    print("ENGINE_LOAD " + json.dumps({"started": STARTED, "imported": imported, "ready": ready, "first_token": first,
                                       "token": list(out[0].outputs[0].token_ids), "vllm": vllm.__version__}),
          flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main(sys.argv[1])
