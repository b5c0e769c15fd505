"""Greedy generation with vLLM for the engine test tier (runs in the engine venv, not the project's).

    python scripts/vllm_greedy.py REQUEST.json RESULT.json

REQUEST: {"model": DIR, "prompts": [[token ids], ...], "max_tokens": N, "dtype": "bfloat16"}, optionally
"load_format" (e.g. "sharded_state"), "tensor_parallel_size", "enable_expert_parallel", "logprobs" (how many top logprobs per step),
"save_sharded_state" (a directory: vLLM's own save_sharded_state of the loaded model goes there, after
the generation; with no prompts the script ends without generating), "moe_backend" (e.g. "marlin"), "register_wna16ctl" (register the
load format `wna16ctl` in this process, for a wna16ctl that is importable but not pip-installed: the
engine then runs in this process, VLLM_ENABLE_V1_MULTIPROCESSING=0, so TP 1 only), "prompt_logits"
(the vocabulary size V) with "forced_prompts" (token id lists: after the greedy run, each is run
teacher-forced and the raw logits at each of its positions are returned), "capture" (a directory:
each decoder layer's attention output, MoE block output, router logits and residual stream of the
first prompt's prefill are saved there with torch.save, one file per module, for a layer-by-layer
comparison).
RESULT: {"tokens": [[generated ids], ...], "logprobs": [[{token id: logprob} per step], ...] (with
"logprobs"), "prompt_logits": [[[V floats] per position 1.. of the forced prompt], ...] (with
"prompt_logits"), "vllm": version, "seconds": load + generate time}.
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
    if req.get("enable_expert_parallel"):
        extra["enable_expert_parallel"] = True
    if req.get("register_wna16ctl"):
        import os

        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from wna16ctl.integrations.vllm_plugin import register

        register()
    started = time.monotonic()
    # on the CPU backend gpu_memory_utilization is the share of host memory vLLM reserves: a
    # demo model needs a sliver of it
    vocab = req.get("prompt_logits")
    if vocab:
        extra.update(max_logprobs=vocab, logprobs_mode="raw_logits")
    llm = LLM(model=req["model"], dtype=req.get("dtype", "auto"), max_model_len=req.get("max_model_len", 2048),
              gpu_memory_utilization=req.get("memory_fraction", 0.05), enforce_eager=True, seed=0,
              skip_tokenizer_init=True, load_format=req.get("load_format", "auto"),
              tensor_parallel_size=req.get("tensor_parallel_size", 1), **extra)
    if req.get("save_sharded_state") and not req["prompts"]:
        llm.llm_engine.engine_core.save_sharded_state(path=req["save_sharded_state"])
        with open(result_path, "w") as f:
            json.dump({"saved": req["save_sharded_state"], "vllm": vllm.__version__}, f)
        return
    if req.get("capture"):
        return capture_layers(llm, req, result_path)
    params = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], detokenize=False,
                            logprobs=req.get("logprobs"))
    outs = llm.generate([{"prompt_token_ids": ids} for ids in req["prompts"]], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    result = {"tokens": tokens, "vllm": vllm.__version__, "seconds": time.monotonic() - started}
    if req.get("logprobs"):
        result["logprobs"] = [[{str(t): lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs or []]
                              for o in outs]
    if vocab:
        # raw logits (logprobs_mode) of every token at every prompt position: position j holds the
        # scores of the token that follows the first j tokens
        forced = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False, prompt_logprobs=vocab)
        outs = llm.generate([{"prompt_token_ids": ids} for ids in req["forced_prompts"]], forced, use_tqdm=False)
        result["prompt_logits"] = [[[pos[t].logprob for t in range(vocab)] for pos in o.prompt_logprobs[1:]]
                                   for o in outs]
    if req.get("save_sharded_state"):
        llm.llm_engine.engine_core.save_sharded_state(path=req["save_sharded_state"])
        result["saved"] = req["save_sharded_state"]
    with open(result_path, "w") as f:
        json.dump(result, f)


def capture_layers(llm, req: dict, result_path: str) -> None:
    """Forward hooks on every decoder layer and its attention and MoE block; one prefill of the
    first prompt. A vLLM decoder layer returns (block output, residual before the block), so the
    stream after the layer is their sum."""
    import os
    import re

    import vllm
    from vllm import SamplingParams

    target = req["capture"]

    def install(model):
        import torch

        os.makedirs(target, exist_ok=True)
        handles = []

        def saver(name):
            def hook(module, args, output):
                if isinstance(output, tuple):
                    tensors = [o for o in output if isinstance(o, torch.Tensor)]
                    if name.endswith(("layers", "norm")) or re.search(r"layers\.\d+$", name):
                        saved = {"output": tensors[0].float().cpu(), "residual": tensors[1].float().cpu()} \
                            if len(tensors) > 1 else {"output": tensors[0].float().cpu()}
                    else:
                        saved = {"output": tensors[0].float().cpu()}
                else:
                    saved = {"output": output.float().cpu()}
                torch.save(saved, os.path.join(target, name + ".pt"))
            return hook

        for name, module in model.named_modules():
            if re.search(r"layers\.\d+(\.(self_attn|mlp|block_sparse_moe)(\.gate)?)?$", name) or name.endswith("model.norm"):
                handles.append(module.register_forward_hook(saver(name)))
        return len(handles)

    installed = llm.apply_model(install)
    params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    llm.generate([{"prompt_token_ids": req["prompts"][0]}], params, use_tqdm=False)

    with open(result_path, "w") as f:
        json.dump({"captured": target, "hooks": installed, "vllm": vllm.__version__}, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
