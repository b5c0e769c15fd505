"""The GPTQ reader (`sources/formats/gptq.py`): configs as published, module resolution as vLLM
does it, the stored form checked against vLLM's own packing helpers, exact round trips, and each
bad input as one line, exit 2, the input untouched."""

from __future__ import annotations

import copy
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests import modelckpt
from tests.sources import vllm_reference
from tests.sources.qweight_ckpt import header_only, random_projection, store, tiny
from wna16ctl.errors import BadInput
from wna16ctl.sources import formats, open_checkpoint
from wna16ctl.sources.config import parse_quantization_config
from wna16ctl.sources.formats import CODES, G_IDX, SCALES, ZERO_POINTS
from wna16ctl.sources.formats.bits import unpack_bits
from wna16ctl.sources.tensors import TensorReader

P = Path("config.json")

# The quantization_config blocks as the checkpoints publish them (config.json).
QWEN3_30B_A3B_GPTQ_INT4 = {
    "bits": 4, "checkpoint_format": "gptq", "desc_act": False, "group_size": 128, "lm_head": False,
    "meta": {"damp_auto_increment": 0.0025, "damp_percent": 0.01, "mse": 0.0, "quantizer": ["gptqmodel:2.2.0"],
             "static_groups": False, "true_sequential": True, "uri": "https://github.com/modelcloud/gptqmodel"},
    "pack_dtype": "int32", "quant_method": "gptq", "sym": True,
}
QWEN15_MOE_A27B_CHAT_GPTQ_INT4 = {
    "bits": 4, "damp_percent": 0.01, "desc_act": False, "group_size": 128, "modules_in_block_to_quantize": None,
    "quant_method": "gptq", "sym": True, "true_sequential": True, "model_name_or_path": None,
    "model_file_base_name": "model", "static_groups": False, "is_marlin_format": False,
}
# GPTQModel's mixed-bits form (QuantTrio's Int4-Int8Mix checkpoints): later layers at 8 bits, the
# MTP layer and the router left out
DYNAMIC = {
    "bits": 4, "group_size": 128, "desc_act": False, "sym": True, "lm_head": False, "quant_method": "gptq",
    "checkpoint_format": "gptq",
    "dynamic": {
        r"-:.*\.mlp\.gate$": {},
        r"+:model\.layers\.([0-9]|1[0-9])\.mlp\.experts\..*": {"bits": 8, "group_size": 64},
        r"model\.layers\.2[0-9]\..*": {"desc_act": True, "sym": False},
        r"-:model\.layers\.61\..*": {},
    },
}


def _expert(layer: int, e: int = 0, proj: str = "gate_proj") -> str:
    return f"model.layers.{layer}.mlp.experts.{e}.{proj}"


def test_published_gptq_configs_parse():
    null_form = dict(QWEN15_MOE_A27B_CHAT_GPTQ_INT4, checkpoint_format=None)  # as some exports write it
    for qc in (QWEN3_30B_A3B_GPTQ_INT4, QWEN15_MOE_A27B_CHAT_GPTQ_INT4, null_form):
        q = parse_quantization_config(copy.deepcopy(qc), P)
        assert q.quant_method == "gptq" and formats.of(q) is formats.FORMATS["gptq"]
        s = q.scheme_for(_expert(3))
        assert (s.num_bits, s.group_size, s.symmetric, s.strategy, s.actorder, s.format) == \
            (4, 128, True, "group", None, "gptq")
        assert q.raw == qc  # the planner's method steps read the file's keys from it
        assert q.scheme_for("lm_head") is None  # lm_head: false (or absent) leaves the head in float


def test_dynamic_overrides_first_match_wins():
    q = parse_quantization_config(copy.deepcopy(DYNAMIC), P)
    assert q.scheme_for("model.layers.3.mlp.gate") is None  # "-:" excludes
    s = q.scheme_for(_expert(5))
    assert (s.num_bits, s.group_size, s.symmetric, s.actorder) == (8, 64, True, None)
    s = q.scheme_for(_expert(25))  # a bare key is a positive match
    assert (s.num_bits, s.group_size, s.symmetric, s.actorder) == (4, 128, False, "group")
    s = q.scheme_for(_expert(40))
    assert (s.num_bits, s.group_size, s.symmetric, s.actorder) == (4, 128, True, None)
    assert q.scheme_for(_expert(61)) is None
    names = [_expert(L, e, p) for L in (1, 25, 40, 61) for e in range(3) for p in ("gate_proj", "down_proj")]
    assert q.schemes_for(names) == [q.scheme_for(n) for n in names]
    assert q.scheme_for(_expert(5)) is q.scheme_for(_expert(6, 2, "down_proj"))  # one object per scheme


def test_modules_in_block_and_lm_head():
    qc = dict(QWEN15_MOE_A27B_CHAT_GPTQ_INT4, lm_head=True,
              modules_in_block_to_quantize=[["self_attn.q_proj", "self_attn.k_proj"], ["mlp.shared_expert.down_proj"]])
    q = parse_quantization_config(qc, P)
    assert q.scheme_for("model.layers.0.self_attn.q_proj") is not None
    assert q.scheme_for("model.layers.0.self_attn.o_proj") is None
    assert q.scheme_for("model.layers.0.mlp.shared_expert.down_proj") is not None
    assert q.scheme_for(_expert(0)) is not None  # the MoE method never consults the list
    assert q.vllm_head_scheme("lm_head") is None  # not in the list
    assert parse_quantization_config(dict(QWEN3_30B_A3B_GPTQ_INT4, lm_head=True), P).vllm_head_scheme("lm_head")


def test_channel_wise_drops_act_order_and_v2_is_its_own_form():
    q = parse_quantization_config(dict(QWEN3_30B_A3B_GPTQ_INT4, group_size=-1, desc_act=True,
                                       checkpoint_format="gptq_v2"), P)
    s = q.scheme_for(_expert(0))
    assert (s.group_size, s.strategy, s.actorder, s.format) == (-1, "channel", None, "gptq_v2")


@pytest.mark.parametrize("mutate,needle", [
    (dict(bits=5), "quantization_config.bits = 5"),
    (dict(checkpoint_format="marlin"), "quantization_config.checkpoint_format = 'marlin'"),
    (dict(group_size=0), "quantization_config.group_size = 0"),
    (dict(desc_act="yes"), "quantization_config.desc_act"),
    (dict(dynamic={r"+:.*experts.*": {"bits": 6}}), "dynamic['+:.*experts.*'].bits = 6"),
    (dict(dynamic={"+:(unclosed": {}}), "not a valid regex"),
    (dict(is_marlin_format=True), "is_marlin_format"),
])
def test_bad_gptq_config_names_the_key(mutate, needle):
    with pytest.raises(BadInput, match=needle.replace("[", r"\[").replace("(", r"\(").replace("+", r"\+")
                       .replace("*", r"\*").replace(".", r"\.")):
        parse_quantization_config(dict(QWEN3_30B_A3B_GPTQ_INT4, **mutate), P)


# -- the stored form against vLLM's helpers, and exact round trips ------------------------------------
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_gptq_stored_form_is_vllms_packing(bits):
    ref = vllm_reference.helpers()
    n, k, group = 64, 128, 32
    p = random_projection(n, k, bits, group, symmetric=False, act_order=False, seed=bits, zmin=1)
    codes_kn = p["codes"].t().contiguous()
    qweight = ref.pack_rows(codes_kn, bits, k, n)  # vLLM: GPTQ packs along K
    qzeros = ref.pack_cols((p["zeros"] - 1).t().contiguous(), bits, k // group, n)  # v1: zero - 1, along N
    scheme = parse_quantization_config(dict(QWEN3_30B_A3B_GPTQ_INT4, bits=bits, group_size=group, sym=False),
                                       P).scheme_for(_expert(0))
    fmt = formats.FORMATS["gptq"]
    canon = fmt.canonical({CODES: qweight, SCALES: p["scales"].t().contiguous(), ZERO_POINTS: qzeros,
                           G_IDX: p["g_idx"]}, scheme)
    assert torch.equal(unpack_bits(canon[CODES], bits, dim=1, size=k), p["codes"])
    assert torch.equal(unpack_bits(canon[ZERO_POINTS], bits, dim=0, size=n), p["zeros"])
    assert torch.equal(canon[SCALES], p["scales"])
    stored = fmt.stored_form(canon, scheme)
    assert torch.equal(stored[CODES], qweight) and torch.equal(stored[ZERO_POINTS], qzeros)
    assert torch.equal(ref.unpack_cols(stored[ZERO_POINTS], bits, k // group, n), (p["zeros"] - 1).t())


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("form", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("desc_act", [False, True])
def test_round_trip_exact(bits, sym, form, desc_act):
    n, k, group = 64, 128, 32
    p = random_projection(n, k, bits, group, symmetric=sym, act_order=desc_act, seed=bits * 7 + sym,
                          zmin=1 if form == "gptq" else 0)
    scheme = parse_quantization_config(dict(QWEN3_30B_A3B_GPTQ_INT4, bits=bits, group_size=group, sym=sym,
                                            desc_act=desc_act, checkpoint_format=form), P).scheme_for(_expert(0))
    fmt = formats.FORMATS["gptq"]
    stored = {{"qweight": CODES, "scales": SCALES, "qzeros": ZERO_POINTS, "g_idx": G_IDX}[s]: t
              for s, t in store(p, form, bits).items()}
    canon = fmt.canonical(stored, scheme)
    assert torch.equal(unpack_bits(canon[CODES], bits, dim=1, size=k), p["codes"])
    assert (ZERO_POINTS in canon) == (not sym)
    if not sym:
        assert torch.equal(unpack_bits(canon[ZERO_POINTS], bits, dim=0, size=n), p["zeros"])
    assert (G_IDX in canon) == desc_act
    back = fmt.stored_form(canon, scheme)
    for role in (CODES, SCALES, ZERO_POINTS, G_IDX):
        assert torch.equal(back[role], stored[role]), role
    again = fmt.canonical(back, scheme)
    assert all(torch.equal(again[r], canon[r]) for r in canon)


def _module_canonical(path: Path, module_role: tuple[int, str]) -> dict:
    ck = open_checkpoint(path)
    with TensorReader(ck.files) as r:
        return r.read_projection(ck.layers[0], *module_role)


@pytest.mark.parametrize("sym,desc_act", [(True, False), (False, True)])
def test_reader_gives_the_canonical_form(tmp_path, sym, desc_act):
    qc = dict(QWEN3_30B_A3B_GPTQ_INT4, group_size=32, sym=sym, desc_act=desc_act)
    path, logical = tiny(tmp_path / "ck", qc, form="gptq", symmetric=sym, act_order=desc_act)
    canon = _module_canonical(path, (1, "down"))
    p = logical["model.layers.0.mlp.experts.1.down_proj"]
    assert torch.equal(unpack_bits(canon[CODES], 4, dim=1, size=96), p["codes"])
    assert torch.equal(canon[SCALES], p["scales"])
    if not sym:
        assert torch.equal(unpack_bits(canon[ZERO_POINTS], 4, dim=0, size=64), p["zeros"])
    if desc_act:
        assert torch.equal(canon[G_IDX], p["g_idx"])


# -- bad input through the CLI: one line naming the tensor or key, exit 2, input untouched -----------
def _inspect(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "wna16ctl", "inspect", str(path), "--tp", "2"],
                          capture_output=True, text=True, timeout=120)


def _digest(path: Path) -> str:
    """The directory's files: small ones by content, the sparse header-only shards by size and time."""
    h = hashlib.sha256()
    for f in sorted(path.rglob("*")):
        st = f.stat()
        h.update(f.name.encode() + (f.read_bytes() if st.st_size < 1 << 20 else f"{st.st_size}:{st.st_mtime_ns}".encode()))
    return h.hexdigest()


def _expect_bad(path: Path, needle: str) -> None:
    before = _digest(path)
    res = _inspect(path)
    assert res.returncode == 2, (res.stdout, res.stderr)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], res.stderr
    assert _digest(path) == before


def test_header_only_gptq_inspects(tmp_path):
    ck = header_only(tmp_path / "ck", modelckpt.qwen3_30b_a3b(), QWEN3_30B_A3B_GPTQ_INT4)
    res = _inspect(ck)
    assert res.returncode in (0, 1) and "Traceback" not in res.stderr, res.stderr
    assert "format gptq" in res.stdout and "int4 g128 sym" in res.stdout


def test_quantize_config_json_beside_config(tmp_path):
    side = {k: v for k, v in QWEN15_MOE_A27B_CHAT_GPTQ_INT4.items() if k != "quant_method"}
    ck = header_only(tmp_path / "ck", modelckpt.qwen15_moe_a27b(), side, side_file=True)
    q = open_checkpoint(ck).config.quant
    assert q is not None and q.quant_method == "gptq" and q.raw == side
    (ck / "quantize_config.json").write_text(json.dumps(dict(side, bits=6)))
    _expect_bad(ck, "quantize_config.json: quantization_config.bits = 6")


@pytest.mark.parametrize("key,value,needle", [
    ("bits", 5, "quantization_config.bits = 5"),
    ("checkpoint_format", "gptq_v3", "quantization_config.checkpoint_format = 'gptq_v3'"),
])
def test_bad_config_via_cli(tmp_path, key, value, needle):
    ck = header_only(tmp_path / "ck", modelckpt.qwen3_30b_a3b(layers=1), dict(QWEN3_30B_A3B_GPTQ_INT4, **{key: value}))
    _expect_bad(ck, needle)


@pytest.mark.parametrize("suffix", ["qweight", "qzeros", "scales"])
def test_shape_disagreeing_with_config(tmp_path, suffix):
    path, _ = tiny(tmp_path / "ck", dict(QWEN3_30B_A3B_GPTQ_INT4, group_size=32), form="gptq")
    shard = path / "model.safetensors"
    tensors = load_file(str(shard))
    victim = f"model.layers.0.mlp.experts.1.up_proj.{suffix}"
    tensors[victim] = tensors[victim][:-1].contiguous()
    save_file(tensors, str(shard), metadata={"format": "pt"})
    _expect_bad(path, f"tensor {victim} is")


def test_g_idx_not_whole_groups(tmp_path):
    qc = dict(QWEN3_30B_A3B_GPTQ_INT4, group_size=32, desc_act=True)
    path, _ = tiny(tmp_path / "ck", qc, form="gptq", act_order=True)
    shard = path / "model.safetensors"
    tensors = load_file(str(shard))
    victim = "model.layers.0.mlp.experts.0.down_proj.g_idx"
    g = tensors[victim].clone()
    g[g == 0] = 1  # group 1 holds twice its columns, group 0 none
    tensors[victim] = g
    save_file(tensors, str(shard), metadata={"format": "pt"})
    before = _digest(path)
    ck = open_checkpoint(path)
    with TensorReader(ck.files) as r, pytest.raises(BadInput, match=f"tensor {victim}: group 0 holds 0 columns"):
        r.read_projection(ck.layers[0], 0, "down")
    assert _digest(path) == before


def test_hub_reader_fetches_quantize_config(tmp_path):
    from tests.hubserver import FakeHub
    from tests.sources.test_hub import wna16ctl

    side = {k: v for k, v in QWEN15_MOE_A27B_CHAT_GPTQ_INT4.items() if k != "quant_method"}
    ck = header_only(tmp_path / "ck", modelckpt.qwen15_moe_a27b(layers=1), side, side_file=True, shards=2)
    hub = FakeHub()
    try:
        hub.add("Qwen/Qwen1.5-MoE-A2.7B-Chat-GPTQ-Int4", ck)
        res = wna16ctl(hub, tmp_path / "hf", "inspect", "Qwen/Qwen1.5-MoE-A2.7B-Chat-GPTQ-Int4", "--tp", "2")
    finally:
        hub.close()
    assert res.returncode in (0, 1) and "Traceback" not in res.stderr, res.stderr
    assert "format gptq" in res.stdout and "int4 g128 sym" in res.stdout


@pytest.mark.parametrize("bits", [3, 4, 8])
@pytest.mark.parametrize("form", ["gptq", "gptq_v2"])
def test_symmetric_zero_points_checked_word_by_word(bits, form):
    """A symmetric projection's qzeros are compared with the packed midpoint word by word (the
    unpacking is left for the message); one zero point off is still refused, by value and place."""
    from wna16ctl.sources.formats.gptq import _stores_midpoint

    n, k, group = 64, 128, 32
    p = random_projection(n, k, bits, group, symmetric=True, act_order=False, seed=bits, zmin=1)
    scheme = parse_quantization_config(dict(QWEN3_30B_A3B_GPTQ_INT4, bits=bits, group_size=group,
                                            checkpoint_format=form), P).scheme_for(_expert(0))
    stored = {{"qweight": CODES, "scales": SCALES, "qzeros": ZERO_POINTS, "g_idx": G_IDX}[s]: t
              for s, t in store(p, form, bits).items()}
    assert _stores_midpoint(stored[ZERO_POINTS], bits, n, form)
    fmt = formats.FORMATS["gptq"]
    assert ZERO_POINTS not in fmt.canonical(stored, scheme)
    z = unpack_bits(stored[ZERO_POINTS], bits, dim=1, size=n)
    z[1, 5] ^= 1
    from wna16ctl.sources.formats.bits import pack_bits

    stored[ZERO_POINTS] = pack_bits(z, bits, dim=1)
    assert not _stores_midpoint(stored[ZERO_POINTS], bits, n, form)
    with pytest.raises(BadInput, match=r"stores \d+ at \[1, 5\], not the symmetric midpoint"):
        fmt.canonical(stored, scheme, {r: f"m.{r}" for r in (CODES, SCALES, ZERO_POINTS, G_IDX)})
