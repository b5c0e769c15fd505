"""The native checking header reader (kernels/header_scan.cpp, `sources.header_digest`) against
the Python reader, which defines what is accepted, and against the safetensors library.

Whatever the native reader accepts, the Python reader must accept with the same names, metadata,
entries and expert groups; whatever the Python reader refuses, the native reader must not accept.
The ordinary headers writers produce must be accepted (else the fast path would never run and
these tests could not fail)."""

from __future__ import annotations

import json
import sys
import random
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wna16ctl.errors import BadInput
from wna16ctl.sources import header_digest
from wna16ctl.sources.headers import shard_header_from_bytes
from wna16ctl.sources.jsonfile import JSONError, loads
from wna16ctl.sources.scan import _expert_groups

pytestmark = pytest.mark.skipif(not header_digest.native_header_scan_available(),
                                reason="native header reader unavailable (no g++ or WNA16CTL_NO_NATIVE set)")

SETTINGS = settings(max_examples=250, derandomize=True, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])

BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "I16": 16, "F16": 16, "BF16": 16, "I32": 32, "F32": 32,
        "I64": 64, "F64": 64, "F4": 4, "F6_E2M3": 6}
NAMES = [
    "model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.gate.weight",
    "model.layers.0.self_attn.q_proj.weight_packed", "model.layers.0.self_attn.q_proj.weight_scale",
    "model.layers.1.mlp.experts.0.gate_proj.weight_packed", "model.layers.1.mlp.experts.0.gate_proj.weight_scale",
    "model.layers.1.mlp.experts.0.gate_proj.weight_shape", "model.layers.1.mlp.experts.1.gate_proj.weight_packed",
    "model.layers.1.mlp.experts.1.gate_proj.weight_scale", "model.layers.1.mlp.experts.10.down_proj.weight_packed",
    "model.layers.1.block_sparse_moe.experts.3.w2.weight_zero_point", "x.experts.y", "a.experts.b.c",
    ".experts.", "experts.0.w1.weight", "model.layers.1.mlp.experts.x1.up_proj.weight_packed",
    "model.layers.1.mlp.experts.0,1.up_proj.weight_packed", "模型.experts.0.w1.weight", "naïve", "a\\u0041",
    "a\\\"b", "", "a\nb", "a\\nb", "__metadata__",
]


def python_read(size: int, blob: bytes):
    """The Python reader's verdict: (entries, metadata) or None when it refuses."""
    try:
        sh = shard_header_from_bytes(Path("/x/model.safetensors"), size, blob)
    except BadInput:
        return None
    return sh.entries, sh.metadata


def check_agreement(size: int, blob: bytes) -> bool:
    """Assert the two readers agree on one header; True when the native reader accepted it."""
    digest = header_digest.digest_header(size, blob)
    ref = python_read(size, blob)
    if digest is None:
        return False
    assert ref is not None, f"native accepted a header the Python reader refuses: {blob[:300]!r}"
    entries, meta = ref
    assert digest.names == list(entries)
    assert digest.sorted_names == b"\n".join(sorted(n.encode() for n in entries))
    assert digest.metadata == meta
    assert digest.plain == {n: e for n, e in entries.items() if ".experts." not in n}
    assert digest.groups == _expert_groups(entries)
    return True


def header_bytes(tensors: list[tuple[str, str, list[int]]], meta: dict | None = None, *, indent=None,
                 sort: bool = True, order_offsets: list[int] | None = None) -> tuple[int, bytes]:
    """A well-formed header over these tensors (data offsets tiling the data section) and its file size."""
    header: dict = {}
    if meta is not None:
        header["__metadata__"] = meta
    pos = 0
    order = order_offsets if order_offsets is not None else range(len(tensors))
    spans = {}
    for i in order:
        name, dt, shape = tensors[i]
        n = 1
        for d in shape:
            n *= d
        nbytes = n * BITS[dt] // 8
        spans[name] = [pos, pos + nbytes]
        pos += nbytes
    items = sorted(tensors) if sort else tensors
    for name, dt, shape in items:
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": spans[name]}
    blob = json.dumps(header, indent=indent, ensure_ascii=False).encode()
    return 8 + len(blob) + pos, blob


def experts_header(layers=2, experts=4, zp=False, sort=True):
    tensors = [("model.embed_tokens.weight", "BF16", [16, 64]), ("model.norm.weight", "BF16", [64])]
    for layer in range(layers):
        for e in range(experts):
            for proj, (n, k) in (("gate_proj", (32, 64)), ("up_proj", (32, 64)), ("down_proj", (64, 32))):
                m = f"model.layers.{layer}.mlp.experts.{e}.{proj}"
                tensors += [(f"{m}.weight_packed", "I32", [n, k // 8]), (f"{m}.weight_scale", "BF16", [n, k // 32]),
                            (f"{m}.weight_shape", "I64", [2])]
                if zp:
                    tensors.append((f"{m}.weight_zero_point", "I32", [n // 8, k // 32]))
        tensors.append((f"model.layers.{layer}.mlp.gate.weight", "BF16", [experts, 64]))
    return tensors


# -- the ordinary forms are accepted, with the Python reader's results ------------------------------

@pytest.mark.parametrize("indent", [None, 2])
@pytest.mark.parametrize("zp", [False, True])
def test_ordinary_headers_are_accepted_with_the_same_results(indent, zp):
    size, blob = header_bytes(experts_header(zp=zp), {"format": "pt"}, indent=indent)
    assert check_agreement(size, blob)


def test_unsorted_names_and_shuffled_offsets_are_accepted():
    tensors = experts_header()
    order = list(range(len(tensors)))
    random.Random(3).shuffle(order)
    size, blob = header_bytes(tensors, None, sort=False, order_offsets=order)
    assert check_agreement(size, blob)


def test_a_header_written_by_the_safetensors_library_is_accepted(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    tensors = {"b.weight": torch.zeros(3, 5, dtype=torch.bfloat16), "a.experts.0.w1.weight_packed": torch.zeros(4, 2, dtype=torch.int32),
               "a.experts.1.w1.weight_packed": torch.zeros(4, 2, dtype=torch.int32), "c": torch.zeros(0, dtype=torch.float32),
               "d": torch.zeros((), dtype=torch.float64)}
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt", "note": "é\n\"quoted\""})
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert check_agreement(len(raw), raw[8:8 + n])
    digest = header_digest.digest_header(len(raw), raw[8:8 + n])
    assert sorted(digest.names) == sorted(tensors)


# -- generated and mutated headers: never accepted unless the Python reader accepts ----------------

name_st = st.one_of(st.sampled_from(NAMES), st.text(min_size=0, max_size=12))
tensor_st = st.tuples(name_st, st.sampled_from(sorted(BITS) + ["Q4", "bf16"]),
                      st.lists(st.integers(min_value=0, max_value=6), max_size=3))


@SETTINGS
@given(tensors=st.lists(tensor_st, max_size=8), meta=st.one_of(st.none(), st.dictionaries(st.text(max_size=4), st.text(max_size=4))),
       indent=st.sampled_from([None, 1]), sort=st.booleans(), data=st.data())
def test_generated_headers_agree(tensors, meta, indent, sort, data):
    # names must be distinct for json.dumps to write each; repeats are made by the mutations below
    tensors = list({t[0]: t for t in tensors}.values())
    try:
        size, blob = header_bytes(tensors, meta, indent=indent, sort=sort)
    except KeyError:  # an unknown dtype: write it with any byte count
        header = {n: {"dtype": d, "shape": s, "data_offsets": [0, 0]} for n, d, s in tensors}
        size, blob = 8 + len(json.dumps(header)), json.dumps(header).encode()
    check_agreement(size, blob)
    # the file one byte shorter or longer than the data section
    check_agreement(size + data.draw(st.sampled_from([-1, 1])), blob)


MUTATIONS = [
    (b'"data_offsets"', b'"data_offsets" '), (b'"dtype": "I32"', b'"dtype": "I32", "dtype": "I32"'),
    (b'"shape": [', b'"shape": [-0, '), (b'"shape": [', b'"shape": [01, '), (b'"shape": [', b'"shape": [1.0, '),
    (b'"shape": [', b'"shape": [true, '), (b'"data_offsets": [0', b'"data_offsets": [0.0'), (b"[0, ", b"[-1, "), (b'"BF16"', b'"bf16"'),
    (b'"BF16"', b'"BF\\u0031\\u0036"'), (b'"format"', b'"form\\u0061t"'), (b"{", b"{ "), (b"}", b"} "),
    (b"}", b"}}"), (b'"pt"', b"1"), (b'"pt"', b"null"), (b'"dtype"', b'"extra": 1, "dtype"'),
    (b'"model.norm.weight"', b'"model.embed_tokens.weight"'), (b"{", b"\xef\xbb\xbf{"), (b'"pt"', b'"\xc3\x28"'),
    (b'"pt"', b'"\xed\xa0\x80"'), (b'"pt"', b'"\xf4\x90\x80\x80"'), (b'"pt"', b'"\xe0\x80\xaf"'), (b'"pt"', b'"p\tt"'),
    (b'"pt"', b'"\\x"'), (b"model.norm.weight", b"model.norm\\u002eweight"), (b"[64]", b"[64, 1]"), (b"[64]", b"[63]"),
    (b"[2]", b"[]"), (b", ", b",\n\t\r "), (b'{"__metadata__": {"format": "pt"}, ', b'{"__metadata__": null, '),
    (b'{"__metadata__": {"format": "pt"}, ', b'{"__metadata__": {"format": "pt"}, "__metadata__": {}, '),
]


@pytest.mark.parametrize("old,new", MUTATIONS, ids=[f"m{i}" for i in range(len(MUTATIONS))])
@pytest.mark.parametrize("where", ["first", "last"])
def test_mutated_headers_agree(old, new, where):
    size, blob = header_bytes(experts_header(layers=1, experts=2), {"format": "pt"})
    assert check_agreement(size, blob)
    at = blob.find(old) if where == "first" else blob.rfind(old)
    assert at >= 0, old
    mutated = blob[:at] + new + blob[at + len(old):]
    check_agreement(size + len(mutated) - len(blob), mutated)
    check_agreement(size, mutated)


@SETTINGS
@given(data=st.data())
def test_random_byte_changes_agree(data):
    size, blob = header_bytes(experts_header(layers=1, experts=2), {"format": "pt"})
    raw = bytearray(blob)
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.sampled_from(b'0123456789{}[]",: \\-.etrufalsnIBF\x00\x80\xff'))
    check_agreement(size, bytes(raw))


def test_expert_shapes_that_differ_make_a_group_without_a_shape():
    tensors = experts_header(layers=1, experts=3)
    tensors = [(n, d, [33, 8]) if n.endswith("experts.1.gate_proj.weight_packed") else (n, d, s) for n, d, s in tensors]
    size, blob = header_bytes(tensors)
    assert check_agreement(size, blob)
    groups = header_digest.digest_header(size, blob).groups
    packed = [g for g in groups if g[1] == "gate_proj" and g[2] == "weight_packed"]
    assert packed[0][5] is None and packed[0][3] == ["0", "1", "2"]


# -- the index ----------------------------------------------------------------------------------

def python_index(blob: bytes):
    """The index as the Python reader parses it (`_index_weight_map` less its path checks, which
    `locate_shards` applies to both readers' file names)."""
    try:
        index = loads(blob)
    except JSONError:
        return None
    wm = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wm, dict) or not wm or not all(isinstance(v, str) for v in wm.values()):
        return None
    out: dict[str, list[bytes]] = {}
    for name, rel in wm.items():
        out.setdefault(rel, []).append(name.encode())
    return {rel: b"\n".join(sorted(names)) for rel, names in out.items()}


def check_index(blob: bytes) -> bool:
    native = header_digest.digest_index(blob)
    if native is None:
        return False
    ref = python_index(blob)
    assert ref is not None, f"native accepted an index the Python reader refuses: {blob[:300]!r}"
    if native != ref or list(native) != list(ref):
        # the one allowed difference: a name given to two files is listed under both (json.loads
        # keeps the last); no set of shards matches that, so `assemble` falls back (see below)
        seen: dict[bytes, int] = {}
        for names in native.values():
            for n in names.split(b"\n"):
                seen[n] = seen.get(n, 0) + 1
        assert max(seen.values()) > 1, (native, ref)
    return True


def test_an_ordinary_index_is_accepted():
    wm = {f"model.layers.{i}.w{j}": f"model-0000{i % 3 + 1}-of-00003.safetensors" for i in range(20) for j in range(3)}
    for indent in (None, 2):
        blob = json.dumps({"metadata": {"total_size": 123, "nested": [1, -2.5e3, {"a": None}, True]}, "weight_map": wm},
                          indent=indent).encode()
        assert check_index(blob)


INDEX_MUTATIONS = [
    (b'"total_size": 123', b'"total_size": NaN'), (b'"total_size": 123', b'"total_size": 0123'),
    (b'"total_size": 123', b'"total_size": 1e'), (b'"total_size": 123', b'"total_size": "\\q"'),
    (b'"a.w0": "f1"', b'"a.w0": "f1", "a.w0": "f1"'), (b'"a.w0": "f1"', b'"a.w0": "f1", "a.w0": "f2"'),
    (b'"a.w0": "f1"', b'"a.w0": 1'), (b'"a.w0": "f1"', b'"a.w0": "f\\u0031"'), (b'"weight_map": {', b'"weight_map": {}, "x": {'),
    (b'"weight_map"', b'"weight_map": {}, "weight_map"'), (b"}}", b"}} x"), (b'"a.w0"', b'"a\\u002ew0"'),
    (b'"total_size": 123', b'"total_size": ' + b"[" * 70 + b"]" * 70),
]


@pytest.mark.parametrize("old,new", INDEX_MUTATIONS, ids=[f"i{i}" for i in range(len(INDEX_MUTATIONS))])
def test_mutated_indexes_agree(old, new):
    blob = json.dumps({"metadata": {"total_size": 123}, "weight_map": {"a.w0": "f1", "a.w1": "f2", "b": "f1"}}).encode()
    assert check_index(blob)
    assert old in blob, old
    check_index(blob.replace(old, new, 1))


@SETTINGS
@given(wm=st.dictionaries(name_st, st.sampled_from(["f1", "f2", "é", ""]), max_size=6), data=st.data())
def test_generated_indexes_agree(wm, data):
    blob = bytearray(json.dumps({"weight_map": wm}, ensure_ascii=data.draw(st.booleans())).encode())
    check_index(bytes(blob))
    if blob:
        blob[data.draw(st.integers(0, len(blob) - 1))] = data.draw(st.sampled_from(b'{}[]",: \\0'))
        check_index(bytes(blob))


# -- inspect as a whole: the same output and the same errors with and without the native reader --

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import synthetic_headers  # noqa: E402 - after the sys.path set-up above


def _edit_index(d: Path, fn) -> None:
    p = d / "model.safetensors.index.json"
    index = json.loads(p.read_text())
    fn(index["weight_map"])
    p.write_text(json.dumps(index))


def _edit_header(path: Path, old: bytes, new: bytes) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    blob = raw[8:8 + n]
    assert old in blob, old
    blob = blob.replace(old, new, 1)
    data = raw[8 + n:]
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def _shard(d: Path, i: int) -> Path:
    return sorted(d.glob("*.safetensors"))[i]


E1 = "model.layers.1.mlp.experts.1.gate_proj.weight_packed"
CASES = {
    "ordinary": None,
    "index assigns a tensor to another shard": lambda d: _edit_index(d, lambda wm: wm.update({E1: _shard(d, 2).name})),
    "index lacks a tensor": lambda d: _edit_index(d, lambda wm: wm.pop(E1)),
    "index names a tensor no shard holds": lambda d: _edit_index(d, lambda wm: wm.update({"ghost.weight": _shard(d, 0).name})),
    "index gives a name to two files": lambda d: (d / "model.safetensors.index.json").write_text(
        (d / "model.safetensors.index.json").read_text().replace('"weight_map": {', f'"weight_map": {{"{E1}": "{_shard(d, 2).name}", ', 1)),
    "an expert tensor of the wrong shape": lambda d: _edit_header(_shard(d, 0), f'"{E1}":{{"dtype":"I32","shape":[32,8]'.encode(),
                                                                  f'"{E1}":{{"dtype":"I32","shape":[32,4]'.encode()),
    "an escaped name (Python reads that shard)": lambda d: _edit_header(_shard(d, 0), b'"model.norm.weight"', b'"model.norm\\u002eweight"')
    if b"model.norm.weight" in _shard(d, 0).read_bytes() else _edit_header(_shard(d, 0), b'"format"', b'"form\\u0061t"'),
    "a tensor in two shards": lambda d: _edit_header(_shard(d, 1), b'{"__metadata__":{"format":"pt"},',
                                                    b'{"__metadata__":{"format":"pt"},"' + E1.encode() + b'":{"dtype":"I32","shape":[0],"data_offsets":[0,0]},'),
}


@pytest.mark.parametrize("case", list(CASES))
def test_inspect_is_the_same_with_and_without_the_native_reader(case, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from wna16ctl.cli import cli

    d = synthetic_headers.write(tmp_path / "ck", layers=3, experts=4, hidden=64, inter=32, gs=32, shards=3, vocab=16)
    if CASES[case] is not None:
        CASES[case](d)
    else:  # the fast path is taken: every shard and the index are accepted natively
        for shard in d.glob("*.safetensors"):
            raw = shard.read_bytes()
            (n,) = struct.unpack("<Q", raw[:8])
            assert header_digest.digest_header(len(raw), raw[8:8 + n]) is not None
        assert header_digest.digest_index((d / "model.safetensors.index.json").read_bytes()) is not None
    results = []
    for no_native in ("", "1"):
        monkeypatch.setenv("WNA16CTL_NO_NATIVE", no_native)
        res = CliRunner().invoke(cli, ["inspect", str(d), "--tp", "1,2", "--json"])
        results.append((res.exit_code, res.stdout, res.stderr))
    assert results[0] == results[1]
    # json.loads keeps the last of a repeated name, here the right file
    loads_fine = ("ordinary", "an escaped name (Python reads that shard)", "index gives a name to two files")
    assert results[0][0] in ((0, 1) if case in loads_fine else (2,)), results[0]


def test_a_repeated_name_whose_first_copy_lacks_keys_is_refused(tmp_path):
    """`{"a": {}, "a": {...}}`: json.loads keeps the second, the safetensors library refuses the file."""
    blob = b'{"a": {}, "a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}'
    path = tmp_path / "m.safetensors"
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + b"xy")
    with pytest.raises(BadInput, match="names 'a' twice"):
        shard_header_from_bytes(path, 8 + len(blob) + 2, blob)
    assert header_digest.digest_header(8 + len(blob) + 2, blob) is None
    safetensors = pytest.importorskip("safetensors")
    with pytest.raises(Exception):
        with safetensors.safe_open(str(path), "numpy"):
            pass
