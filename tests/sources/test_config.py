"""Our tolerant quantization_config parser against compressed-tensors, wherever the library parses."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from wna16ctl.sources.config import parse_quantization_config
from wna16ctl.errors import BadInput

P = Path("config.json")

NAMES = [
    "model.layers.0.mlp.experts.0.gate_proj",
    "model.layers.0.mlp.experts.1.down_proj",
    "model.layers.3.mlp.experts.17.up_proj",
    "model.layers.3.mlp.shared_experts.gate_proj",
    "model.layers.1.block_sparse_moe.experts.2.w2",
    "model.layers.0.self_attn.q_proj",
    "lm_head",
]


def _weights(**kw):
    base = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128, "dynamic": False}
    base.update(kw)
    return base


TERSE = {  # compressed-tensors 0.20 style: defaults omitted
    "quant_method": "compressed-tensors", "format": "pack-quantized", "version": "0.20.1",
    "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": _weights(), "format": "pack-quantized"}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*"],
}
VERBOSE = {  # <= 0.18 style: every field written
    "quant_method": "compressed-tensors", "format": "pack-quantized", "version": "0.12.2",
    "quantization_status": "compressed", "global_compression_ratio": None, "kv_cache_scheme": None,
    "sparsity_config": {}, "transform_config": {},
    "config_groups": {"group_0": {
        "targets": [r"re:.*experts.*"],
        "weights": _weights(actorder=None, observer="minmax", observer_kwargs={}, block_structure=None),
        "input_activations": None, "output_activations": None, "format": None}},
    "ignore": ["lm_head"],
}
MIXED = {  # mixed precision: per-layer and per-expert regexes, exact names win over regexes
    "quant_method": "compressed-tensors", "format": "mixed-precision",
    "config_groups": {
        "int4": {"targets": [r"re:.*experts\.\d+\.(gate|up|down)_proj$", r"re:.*\.w[123]$"], "weights": _weights(), "format": "pack-quantized"},
        "int8": {"targets": [r"re:.*layers\.3\..*experts\.\d+\.(gate|up)_proj$", "model.layers.0.mlp.experts.1.down_proj"],
                 "weights": _weights(num_bits=8, strategy="channel", group_size=None), "format": "pack-quantized"},
    },
    "ignore": [],
}
CHANNEL_NULL = {
    "quant_method": "compressed-tensors", "format": "pack-quantized",
    "config_groups": {"g": {"targets": ["Linear"], "weights": _weights(strategy="channel", group_size=None, symmetric=False)}},
    "ignore": ["lm_head", r"re:.*self_attn.*"],
}
STATIC = copy.deepcopy(TERSE)
STATIC["config_groups"]["group_0"]["weights"]["actorder"] = "static"
PRESET = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"W4A16": ["Linear"]}, "ignore": ["lm_head"]}

CONFIGS = {"terse": TERSE, "verbose": VERBOSE, "mixed": MIXED, "channel_null": CHANNEL_NULL, "static": STATIC, "preset": PRESET}


@pytest.fixture(scope="module")
def ct():
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import is_match, match_targets

    return QuantizationConfig, match_targets, is_match, ct


def _library_scheme(ct, qc: dict, name: str):
    import torch

    QuantizationConfig, match_targets, is_match, _ = ct
    cfg = QuantizationConfig.model_validate(copy.deepcopy(qc))
    module = torch.nn.Linear(8, 8)
    target_to_scheme = {}
    for scheme in cfg.config_groups.values():
        for t in scheme.targets:
            target_to_scheme[t] = scheme
    if not is_match(name, module, list(target_to_scheme), cfg.ignore or []):
        return None
    return target_to_scheme[match_targets(name, module, target_to_scheme)[0]].weights


def _value(x):
    return str(getattr(x, "value", x))


@pytest.mark.parametrize("which", sorted(CONFIGS))
def test_scheme_resolution_agrees_with_library(ct, which):
    qc = CONFIGS[which]
    ours = parse_quantization_config(copy.deepcopy(qc), P)
    for name in NAMES:
        lib = _library_scheme(ct, qc, name)
        mine = ours.scheme_for(name)
        assert (lib is None) == (mine is None), name
        if lib is None:
            continue
        assert mine.num_bits == lib.num_bits
        assert mine.symmetric == lib.symmetric
        assert mine.strategy == _value(lib.strategy)
        assert mine.group_size == (lib.group_size if lib.group_size not in (None,) else -1)
        lib_ao = _value(lib.actorder) if lib.actorder is not None else None
        assert (mine.actorder in ("weight", "static")) == (lib_ao in ("weight", "static"))
        assert mine.act_order == (lib_ao == "group")


def test_library_rejects_group_actorder_but_we_read_it(ct):
    QuantizationConfig = ct[0]
    qc = copy.deepcopy(VERBOSE)
    qc["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    if ct[3].__version__ >= "0.19":
        with pytest.raises(Exception):
            QuantizationConfig.model_validate(copy.deepcopy(qc))
    s = parse_quantization_config(qc, P).scheme_for("model.layers.0.mlp.experts.0.gate_proj")
    assert s.act_order and s.actorder == "group"


@pytest.mark.parametrize("value,expected", [(None, None), (False, None), (True, "group"), ("group", "group"),
                                            ("dynamic", "dynamic"), ("weight", "weight"), ("static", "static")])
def test_actorder_forms(value, expected):
    qc = copy.deepcopy(TERSE)
    qc["config_groups"]["group_0"]["weights"]["actorder"] = value
    s = parse_quantization_config(qc, P).scheme_for("model.layers.0.mlp.experts.0.gate_proj")
    assert s.actorder == expected
    assert s.act_order == (expected in ("group", "dynamic"))


def test_channel_null_is_flagged():
    s = parse_quantization_config(copy.deepcopy(CHANNEL_NULL), P).scheme_for("model.layers.0.mlp.experts.0.gate_proj")
    assert s.group_size == -1 and s.strategy == "channel" and s.group_size_null and not s.symmetric


@pytest.mark.parametrize("mutate,needle", [
    (lambda q: q.update(quant_method="awq"), "awq"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(actorder="sometimes"), "actorder"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(group_size=None), "group_size"),
    (lambda q: q.update(ignore=["re:(unclosed"]), "regex"),
])
def test_nonsense_is_bad_input(mutate, needle):
    qc = copy.deepcopy(TERSE)
    mutate(qc)
    with pytest.raises(BadInput, match=needle):
        parse_quantization_config(qc, P)


@pytest.mark.parametrize("which", sorted(CONFIGS))
def test_bulk_resolution_equals_single(which):
    qc = parse_quantization_config(copy.deepcopy(CONFIGS[which]), P)
    names = [f"model.layers.{L}.mlp.experts.{e}.{p}" for L in (0, 3, 11) for e in range(40)
             for p in ("gate_proj", "up_proj", "down_proj")] + NAMES * 10
    assert qc.schemes_for(names) == [qc.scheme_for(n) for n in names]


def test_bulk_resolution_pattern_that_admits_newlines():
    qc = copy.deepcopy(TERSE)
    qc["config_groups"]["group_0"]["targets"] = [r"re:model[^x]*experts\.1\d*\.gate_proj$"]
    q = parse_quantization_config(qc, P)
    names = [f"model.layers.0.mlp.experts.{e}.gate_proj" for e in range(100)]
    assert q.schemes_for(names) == [q.scheme_for(n) for n in names]
    assert sum(s is not None for s in q.schemes_for(names)) == 11


def test_bulk_resolution_with_whole_text_anchors():
    qc = copy.deepcopy(TERSE)
    qc["config_groups"]["group_0"]["targets"] = [r"re:.*gate_proj\Z"]
    q = parse_quantization_config(qc, P)
    names = [f"model.layers.0.mlp.experts.{e}.{p}" for e in range(40) for p in ("gate_proj", "up_proj", "down_proj")]
    assert q.schemes_for(names) == [q.scheme_for(n) for n in names]
