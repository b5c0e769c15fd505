"""scan_shard's grouped pass against its tensor-by-tensor definition (`_scan_each`).

The grouped pass must give the same per-layer facts wherever it answers, and answer nothing
(leaving the verdict and the message to `_scan_each`) wherever a tensor is out of the ordinary.
Headers are built in memory: no files, no torch."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from wna16ctl.errors import BadInput
from wna16ctl.sources.config import read_model_config
from wna16ctl.sources.headers import ShardHeader
from wna16ctl.sources.scan import _expert_groups, _scan_each, _scan_grouped, scan_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import synthetic_headers

H, I, GS, E = 64, 32, 32, 4


@pytest.fixture()
def config(tmp_path):
    d = synthetic_headers.write(tmp_path / "ck", layers=3, experts=E, hidden=H, inter=I, gs=GS, shards=1, vocab=16)
    return d


def _config(d: Path, **weights):
    if weights:
        raw = json.loads((d / "config.json").read_text())
        raw["quantization_config"]["config_groups"]["group_0"]["weights"].update(weights)
        (d / "config.json").write_text(json.dumps(raw))
    return read_model_config(d)


def _header(mutate=None) -> ShardHeader:
    entries = {}
    for name, dt, shape in synthetic_headers._tensors(3, E, H, I, GS, 4, 16):
        entries[name] = {"dtype": dt, "shape": shape, "data_offsets": [0, 0]}  # offsets play no part here
    if mutate:
        mutate(entries)
    return ShardHeader(Path("/x/model.safetensors"), 0, 8, entries, {})


def _facts(result):  # scheme ids as the schemes they stand for, lists as sets
    layers, table = result
    return {p: (lay["family"], {k: sorted(v) for k, v in lay["present"].items()},
                {r: sorted((e, table[s]) for e, s in v) for r, v in lay["schemes"].items()},
                set(lay["zp"]), set(lay["scales"])) for p, lay in layers.items()}


def _both(cfg, sh):
    return (_scan_grouped("/x/model.safetensors", _expert_groups(sh.entries), cfg, I),
            _scan_each("/x/model.safetensors", sh, cfg, I))


def test_grouped_equals_each_on_an_ordinary_shard(config):
    cfg = _config(config)
    grouped, each = _both(cfg, _header())
    assert grouped is not None
    assert _facts(grouped) == _facts(each)
    assert len(grouped[0]) == 2 and {"gate.weight_packed", "down.weight_scale"} <= set(
        grouped[0]["model.layers.1.mlp.experts"]["present"])


def test_other_names_under_experts_are_skipped_alike(config):
    def add(entries):
        entries["model.layers.1.mlp.experts.gate_up_proj"] = {"dtype": "BF16", "shape": [2], "data_offsets": [0, 0]}
        entries["model.layers.1.mlp.experts.0.gate_proj.bias"] = {"dtype": "BF16", "shape": [2], "data_offsets": [0, 0]}

    cfg = _config(config)
    grouped, each = _both(cfg, _header(add))
    assert grouped is not None and _facts(grouped) == _facts(each)


def test_a_wrong_tensor_is_left_to_the_tensor_by_tensor_pass(config):
    bad = "model.layers.2.mlp.experts.3.up_proj.weight_scale"

    def shrink(entries):
        entries[bad]["shape"] = [I, H // GS - 1]

    cfg = _config(config)
    sh = _header(shrink)
    assert _scan_grouped("/x/model.safetensors", _expert_groups(sh.entries), cfg, I) is None
    with pytest.raises(BadInput, match=f"tensor {bad} is BF16"):
        scan_shard("/x/model.safetensors", cfg, I, keep_entries=True, header=sh)


def test_unpacked_zero_points_go_tensor_by_tensor(config):
    def zero_points(entries, dtype, shape):
        for name in [n for n in entries if n.endswith(".weight_scale") and ".experts." in n]:
            entries[name[: -len("scale")] + "zero_point"] = {"dtype": dtype, "shape": shape(entries[name]["shape"]),
                                                            "data_offsets": [0, 0]}

    cfg = _config(config, symmetric=False)
    packed = _header(lambda en: zero_points(en, "I32", lambda s: [-(-s[0] // 8), s[1]]))
    grouped, each = _both(cfg, packed)
    assert grouped is not None and _facts(grouped) == _facts(each)
    assert {"packed"} == set(grouped[0]["model.layers.1.mlp.experts"]["zp"])
    unpacked = _header(lambda en: zero_points(en, "I8", lambda s: s))
    grouped, each = _both(cfg, unpacked)
    assert grouped is None
    assert {"unpacked"} == set(each[0]["model.layers.1.mlp.experts"]["zp"])


def test_per_expert_schemes_go_tensor_by_tensor(config):
    raw = json.loads((config / "config.json").read_text())
    groups = raw["quantization_config"]["config_groups"]
    groups["group_1"] = json.loads(json.dumps(groups["group_0"]))
    groups["group_1"]["targets"] = [r"re:.*mlp\.experts\.3\.(gate|up|down)_proj$"]
    groups["group_1"]["weights"]["actorder"] = "static"  # another scheme, the same tensor shapes
    (config / "config.json").write_text(json.dumps(raw))
    cfg = read_model_config(config)
    grouped, each = _both(cfg, _header())
    assert grouped is None
    r = scan_shard("/x/model.safetensors", cfg, I, keep_entries=True, header=_header())
    assert _facts((r["layers"], r["schemes"])) == _facts(each)
    assert len({s for _, s in each[0]["model.layers.1.mlp.experts"]["schemes"]["gate"]}) == 2
