"""The Marlin layout of GPTQ and AWQ experts, from checkpoints GPTQModel and AutoRound write
(write_checkpoints.TP2_VARIANTS: intermediate size 128, which loads at TP 2), equals what vLLM's
own Marlin preparation makes of the stored tensors (_vllm_marlin_reference.py, run in the engine
venv); the planner gives such a layer its layout.  (Their `--layout vllm`: test_repack_verify_formats.py.)
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import engine_python

HERE = Path(__file__).resolve().parent
# variant -> (stored form the reference reads, the newest release that loads it at TP 2 on Marlin)
CASES = {"gptqmodel-gptq-actorder-sym4-tp2": ("gptq", "0.29.0"),  # desc_act is refused from 0.30.0
         "autoround-awq-asym4-tp2": ("awq", "0.33.0")}
RANK = 1


def _servable_copy(quantized, variant: str, dest: Path) -> Path:
    """A copy whose config also names num_experts: transformers 5 writes the Qwen3-MoE expert count
    as num_local_experts only, and wna16ctl refuses a config without num_experts (config.py)."""
    out = Path(shutil.copytree(quantized.checkpoint(variant), dest / variant))
    config = json.loads((out / "config.json").read_text())
    config["num_experts"] = config["num_local_experts"]
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("variant", list(CASES))
def test_marlin_experts_are_what_vllm_makes_of_the_stored_tensors(quantized, tmp_path, variant):
    from wna16ctl.layout.rank import build_rank_tensors
    from wna16ctl.layout.spec import MARLIN, RankLayout
    from wna16ctl.planning.moe import plan_layer
    from wna16ctl.sources import open_checkpoint
    from wna16ctl.sources.tensors import TensorReader

    stored, version = CASES[variant]
    src = _servable_copy(quantized, variant, tmp_path)
    ck = open_checkpoint(src)
    layer = ck.layers[0]
    plan = plan_layer(layer, 2, engine=version)
    assert plan.loadable and plan.layout == MARLIN, (plan.errors, plan.hazards)
    s = layer.scheme
    spec = RankLayout(layout=MARLIN, num_bits=s.num_bits, group_size=s.group_size, symmetric=s.symmetric,
                      act_order=s.act_order, hidden_size=layer.hidden_size, intermediate_size=layer.intermediate_size,
                      tp=2, rank=RANK, load_full_w2=plan.layout_w2.load_full_w2,
                      padded_intermediate=plan.padded_intermediate or plan.intermediate_size_per_partition)
    with TensorReader(ck.files) as reader:
        ours = build_rank_tensors([reader.read_expert(layer, e) for e in range(layer.num_experts)], spec)
    out = tmp_path / "reference.safetensors"
    r = subprocess.run([str(engine_python()), str(HERE / "_vllm_marlin_reference.py"), str(src), stored, layer.prefix,
                        str(layer.num_experts), "2", str(RANK), str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    want = load_file(str(out))
    assert len(want) == len(ours) * layer.num_experts
    for name, tensor in ours.items():
        for e in range(layer.num_experts):
            assert torch.equal(tensor[e], want[f"{e}.{name}"]), f"{variant}: expert {e} {name}"
