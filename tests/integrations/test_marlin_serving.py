"""The vLLM plugin's checks without vLLM: the manifest of a real `repack --layout marlin` output,
the one-line refusals of another engine, the shapes each rank must have, the in-place copy into
processed parameters, and the entry point that installs the plugin."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO_ROOT
from wna16ctl.errors import UsageError
from wna16ctl.integrations import marlin_serving as ms
from wna16ctl.integrations import vllm_plugin


@pytest.fixture(scope="module")
def marlin_out(make_ckpt, tmp_path_factory) -> Path:
    import wna16ctl

    out = tmp_path_factory.mktemp("plugin") / "out"
    wna16ctl.repack(make_ckpt(), out, 2, layout="marlin", vllm="0.32.0", gpu="sm90")
    return out


ENGINE = dict(vllm_version="0.32.0", capability=90, moe_backend="auto", tp=2, pp=1, ep=False)


def test_the_output_is_read_and_a_matching_engine_passes(marlin_out):
    out = ms.read_marlin_output(marlin_out)
    assert (out.release, out.gpu, out.tp, out.ep, out.scale_dtype) == ("0.32.0", "sm90", 2, False, "BF16")
    assert [layer.name for layer in out.layers] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    ms.check_engine(out, **ENGINE)
    ms.check_engine(out, **(ENGINE | {"vllm_version": "0.32.0+cu130", "moe_backend": "marlin"}))


@pytest.mark.parametrize("change,needle", [
    ({"vllm_version": "0.33.0"}, "repacked for vLLM 0.32.0, this is vLLM 0.33.0; repack with --vllm 0.33.0"),
    ({"vllm_version": "0.31.0"}, f"serves vLLM {', '.join(ms.SERVED_RELEASES)}; this is vLLM 0.31.0"),
    ({"capability": 80}, "repacked for sm90, this GPU is sm80 (compute capability 8.0); repack with --gpu sm80"),
    ({"capability": None}, "no CUDA GPU here"),
    ({"moe_backend": "humming"}, "--moe-backend humming cannot read the Marlin layout; serve with --moe-backend marlin"),
    ({"tp": 4}, "repacked for tensor parallel size 2, served with 4"),
    ({"pp": 2}, "pipeline parallelism (2 stages)"),
    ({"ep": True}, "expert parallelism is not served"),
])
def test_another_engine_is_refused_with_one_line(marlin_out, change, needle):
    out = ms.read_marlin_output(marlin_out)
    with pytest.raises(UsageError) as err:
        ms.check_engine(out, **(ENGINE | change))
    text = str(err.value)
    assert needle in text and "\n" not in text and str(marlin_out) in text


def _with_manifest(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    m = json.loads((dst / ms.MANIFEST).read_text())
    edit(m)
    (dst / ms.MANIFEST).write_text(json.dumps(m))
    return dst


@pytest.mark.parametrize("edit,needle", [
    (lambda m: m.update(layout="vllm"), "serve it with --load-format sharded_state"),
    (lambda m: m.update(layout="transposed"), "repack with --layout marlin"),
    (lambda m: m["identity"]["settings"].update(moe_backend="triton"), "repacked for --moe-backend triton"),
    (lambda m: m.pop("engine"), "unreadable manifest (KeyError"),
])
def test_another_output_is_refused_with_one_line(marlin_out, tmp_path, edit, needle):
    root = _with_manifest(marlin_out, tmp_path / "o", edit)
    with pytest.raises(UsageError) as err:
        ms.check_engine(ms.read_marlin_output(root), **ENGINE)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_no_manifest_is_refused(tmp_path):
    with pytest.raises(UsageError, match="no wna16ctl.json"):
        ms.read_marlin_output(tmp_path)


def test_rank_shapes_are_the_files_shapes(marlin_out):
    from safetensors import safe_open

    out = ms.read_marlin_output(marlin_out)
    for rank in range(out.tp):
        index = json.loads((out.rank_dir(rank) / "model.safetensors.index.json").read_text())["weight_map"]
        for layer in out.layers:
            shapes = layer.rank_shapes(rank, out.scale_dtype)
            assert set(shapes) == set(layer.tensors)
            for name, (shape, dtype) in shapes.items():
                full = f"{layer.name}.{name}"
                with safe_open(str(out.rank_dir(rank) / index[full]), framework="pt") as f:
                    sl = f.get_slice(full)
                    assert (tuple(sl.get_shape()), sl.get_dtype()) == (shape, dtype), full


class _Backend:
    value = "MARLIN"


class _Method:
    wna16_backend = _Backend()


def _processed_model(out: ms.MarlinOutput, rank: int, *, backend: str = "MARLIN") -> torch.nn.Module:
    """A stand-in for vLLM's processed model: the expert parameters where vLLM keeps them
    (`…experts.routed_experts`), of the processed shapes, filled with garbage."""
    model = torch.nn.Module()
    dtypes = {"I32": torch.int32, "BF16": torch.bfloat16}
    for layer in out.layers:
        experts = torch.nn.Module()
        experts.quant_method = _Method() if backend == "MARLIN" else object()
        for name, (shape, dtype) in layer.rank_shapes(rank, out.scale_dtype).items():
            t = torch.full(shape, 7, dtype=dtypes[dtype])
            experts.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
        e = layer.experts[rank]
        experts.register_parameter("w13_weight_shape", torch.nn.Parameter(torch.empty(e, 2, dtype=torch.bfloat16),
                                                                         requires_grad=False))
        parent = model
        for part in layer.name.split("."):
            if part not in parent._modules:
                parent.add_module(part, torch.nn.Module())
            parent = parent._modules[part]
        parent.add_module("routed_experts", experts)
    return model


def test_the_copy_fills_the_processed_parameters_in_place(marlin_out):
    from safetensors.torch import load_file

    out = ms.read_marlin_output(marlin_out)
    rank = 1
    model = _processed_model(out, rank)
    held = {n: p.data for n, p in model.named_parameters()}  # what a kernel object would hold
    assert vllm_plugin.copy_expert_tensors(model, out, rank) == 2 * 4
    files = {}
    for f in out.rank_dir(rank).glob("*.safetensors"):
        files |= load_file(f)
    for layer in out.layers:
        module = vllm_plugin.find_expert_module(model, layer.name)
        for name in layer.tensors:
            param = module._parameters[name]
            assert torch.equal(param, files[f"{layer.name}.{name}"])
            assert param.data.data_ptr() == held[f"{layer.name}.routed_experts.{name}"].data_ptr()
        assert module.w13_weight_shape.tolist() == [[256.0, 256.0]] * 8  # gate/up [I, H]
    names = [n for n, _ in vllm_plugin.non_expert_tensors(out, rank)]
    assert "model.embed_tokens.weight" in names and not any(n.startswith(tuple(layer.name for layer in out.layers))
                                                            for n in names)


def test_a_wrong_processed_shape_or_backend_is_refused(marlin_out):
    out = ms.read_marlin_output(marlin_out)
    model = _processed_model(out, 0)
    first = vllm_plugin.find_expert_module(model, out.layers[0].name)
    first.w13_weight_scale = torch.nn.Parameter(torch.ones(8, 1, 256, dtype=torch.bfloat16), requires_grad=False)
    with pytest.raises(UsageError, match=r"w13_weight_scale: vLLM's processed parameter is \[8, 1, 256\] BF16, "
                                         r"the manifest says \[8, 2, 256\] BF16"):
        vllm_plugin.copy_expert_tensors(model, out, 0)
    model = _processed_model(out, 0, backend="HUMMING")
    with pytest.raises(UsageError, match="not Marlin; serve with --moe-backend marlin"):
        vllm_plugin.copy_expert_tensors(model, out, 0)


def test_the_vllm_extra_installs_the_entry_point():
    if sys.version_info < (3, 11):
        pytest.skip("tomllib needs Python 3.11")
    import importlib
    import tomllib

    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    target = project["entry-points"]["vllm.general_plugins"]["wna16ctl"]
    module, func = target.split(":")
    assert getattr(importlib.import_module(module), func) is vllm_plugin.register
    assert any(r.startswith("vllm") for r in project["optional-dependencies"]["vllm"])
    assert not any(r.startswith("vllm") for r in project["dependencies"])
    assert ms.LOAD_FORMAT == "wna16ctl"
