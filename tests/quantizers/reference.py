"""An independent dequantization of a quantizer-written checkpoint, through the quantizers' own code.

Run in the quantizer venv (scripts/quantizer_venv.sh), never in the project's:

    python tests/quantizers/reference.py CKPT OUT.safetensors

writes, for every quantized module of CKPT, `<module>.weight` = (q - z) * s as float32 [N, K]
(out_features x in_features, the layout of a torch Linear weight).  Each format is unpacked by the
code of a tool that reads it, never by transformers' `from_pretrained` (which leaves the experts of
a GPTQ/AWQ MoE at their random init without an error) and never by wna16ctl:

- GPTQ (`quant_method: gptq`, any writer): GPTQModel's own safetensors dequantizer
  (`gptqmodel.utils.model_dequant.convert_gptq_file`): it undoes v1's zero-minus-one where
  `checkpoint_format` says so and follows `g_idx`.
- AWQ (`quant_method: awq`): AutoRound's own GEMM dequantizer (`auto_round.export.export_to_awq.utils
  .dequantize_gemm`), which undoes AWQ's interleaved order.  (GPTQModel's `convert_awq_file` unpacks
  the columns in plain order, so it is not used.)
- AutoRound's own format (`quant_method: auto-round`): AutoRound's torch QuantLinear of its
  `packing_format` (`auto_round_extension.torch.qlinear_torch_zp` for `auto_round:auto_gptq`, whose
  zero points are stored minus one), loaded with the stored tensors and its scales in float32, run
  on the identity: its forward is x @ ((q - z) * s), so that is the dequantized weight, exactly.

All three compute (q - z) * s in float32 from fp16 scales, which is exact, so the result equals any
other exact float32 dequantization bit for bit.
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _shards(ckpt: Path) -> list[Path]:
    return sorted(ckpt.glob("*.safetensors"))


def _quantization_config(ckpt: Path) -> dict:
    config = json.loads((ckpt / "config.json").read_text())
    if "quantization_config" in config:
        return config["quantization_config"]
    return json.loads((ckpt / "quantize_config.json").read_text())


def _stored_modules(ckpt: Path) -> dict[str, dict]:
    """module -> {suffix: tensor} for every module with a qweight."""
    from safetensors import safe_open

    modules: dict[str, dict] = defaultdict(dict)
    for shard in _shards(ckpt):
        with safe_open(str(shard), framework="pt") as reader:
            for key in reader.keys():
                module, _, suffix = key.rpartition(".")
                if suffix in ("qweight", "qzeros", "scales", "g_idx"):
                    modules[module][suffix] = reader.get_tensor(key)
    return {m: t for m, t in modules.items() if "qweight" in t}


def dequantize_gptq(ckpt: Path, qc: dict) -> dict:
    import torch
    from gptqmodel.utils.model_dequant import convert_gptq_file

    out = {}
    for shard in _shards(ckpt):
        tensors = convert_gptq_file(shard, torch.float32, qc, "cpu")
        modules = {k.rpartition(".")[0] for k in tensors if k.endswith(".weight")}
        with_codes = {m for m in modules if m + ".weight" in tensors} & set(_stored_modules(ckpt))
        out.update({m + ".weight": tensors[m + ".weight"] for m in with_codes})
    return out


def dequantize_awq(ckpt: Path, qc: dict) -> dict:
    import torch
    from auto_round.export.export_to_awq.utils import dequantize_gemm

    out = {}
    for module, t in _stored_modules(ckpt).items():
        weight = dequantize_gemm(t["qweight"], t["qzeros"], t["scales"].to(torch.float32), qc["bits"],
                                 qc["group_size"])
        out[module + ".weight"] = weight.t().contiguous()
    return out


def dequantize_auto_round(ckpt: Path, qc: dict) -> dict:
    import torch

    packing = qc.get("packing_format", "auto_round:auto_gptq")
    if packing != "auto_round:auto_gptq":
        raise SystemExit(f"reference.py: no reference for AutoRound packing_format {packing!r}")
    from auto_round_extension.torch.qlinear_torch_zp import QuantLinear

    out = {}
    for module, t in _stored_modules(ckpt).items():
        scales = t["scales"].to(torch.float32)
        in_features = t["qweight"].shape[0] * 32 // qc["bits"]
        layer = QuantLinear(qc["bits"], qc["group_size"], in_features, scales.shape[1], bias=False)
        layer.qweight, layer.qzeros, layer.scales = t["qweight"], t["qzeros"], scales
        if "g_idx" in t:
            layer.g_idx = t["g_idx"]
        layer.post_init()
        with torch.no_grad():
            out[module + ".weight"] = layer(torch.eye(in_features, dtype=torch.float32)).t().contiguous()
    return out


READERS = {"gptq": dequantize_gptq, "awq": dequantize_awq, "auto-round": dequantize_auto_round,
           "intel/auto-round": dequantize_auto_round}


def reference_weights(ckpt: Path) -> dict:
    qc = _quantization_config(ckpt)
    method = qc.get("quant_method", "gptq")
    if method not in READERS:
        raise SystemExit(f"reference.py: {ckpt}: no reference for quant_method {method!r}")
    return READERS[method](ckpt, qc)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: reference.py CKPT OUT.safetensors", file=sys.stderr)
        return 2
    from safetensors.torch import save_file

    ckpt, out = Path(argv[0]), Path(argv[1])
    weights = reference_weights(ckpt)
    if not weights:
        raise SystemExit(f"reference.py: {ckpt}: no quantized module found")
    stage = out.with_name(out.name + ".partial")
    save_file(weights, str(stage))
    stage.rename(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
