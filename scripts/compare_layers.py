"""Layer by layer: the e2e reference model against vLLM's forward-hook capture of the same prefill.

    python scripts/compare_layers.py CKPT SEQUENCE.json CAPTURE_DIR

CKPT is the (quantized) demo checkpoint the reference reads; SEQUENCE.json a list of token ids;
CAPTURE_DIR what scripts/vllm_greedy.py wrote for a request with "capture": CAPTURE_DIR and
"prompts": [that sequence] (run in the engine venv with VLLM_ENABLE_V1_MULTIPROCESSING=0 and
VLLM_ALLOW_INSECURE_SERIALIZATION=1, on the checkpoint or its write_dequantized_checkpoint copy).
Prints, per module, vLLM − reference and the reference's own bf16 run − reference (one sample of
bf16 rounding), then every position where a layer's top-k experts differ, with the router logits.
Runs in the project's venv.
"""

from __future__ import annotations

import json
import sys


def main(ckpt: str, sequence: str, capture: str, top_k: int = 2) -> None:
    from wna16ctl.verification.engine_reference import engine_layer_outputs, reference_layer_outputs

    ids = json.loads(open(sequence).read())
    ref = reference_layer_outputs(ckpt, ids)
    low = reference_layer_outputs(ckpt, ids, model_dtype=True)
    eng = engine_layer_outputs(capture)
    print(f"{'module':20s} {'ref RMS':>8s} {'vLLM-ref max':>12s} {'(RMS)':>8s} {'bf16ref-ref max':>15s} {'(RMS)':>8s}")
    for name, a in ref.items():
        if name not in eng:
            print(f"{name:20s} not captured")
            continue
        d1, d2 = eng[name] - a, low[name] - a
        print(f"{name:20s} {a.pow(2).mean().sqrt():8.4f} {d1.abs().max():12.5f} {d1.pow(2).mean().sqrt():8.5f} "
              f"{d2.abs().max():15.5f} {d2.pow(2).mean().sqrt():8.5f}")
    for name in [n for n in ref if n.endswith(".router") and n in eng]:
        r, v = ref[name], eng[name]
        rs, vs = r.topk(top_k).indices.sort().values, v.topk(top_k).indices.sort().values
        for pos in (rs != vs).any(-1).nonzero().flatten().tolist():
            order = r[pos].sort(descending=True)
            k, k1 = order.indices[top_k - 1], order.indices[top_k]
            print(f"{name} position {pos}: reference experts {rs[pos].tolist()}, vLLM {vs[pos].tolist()}; "
                  f"router logits of experts {int(k)}, {int(k1)}: reference {r[pos, k]:.5f} {r[pos, k1]:.5f}, "
                  f"vLLM {v[pos, k]:.5f} {v[pos, k1]:.5f}")


if __name__ == "__main__":
    main(*sys.argv[1:4])
