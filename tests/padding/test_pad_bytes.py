"""The writer's byte-level padding (`padding.blocks`, no torch) gives exactly the tensor math's
(`padding.tensors.pad_tensor`) bytes: per tensor form directly, and through `pad` on checkpoints
of every packed form, bit for bit; and a failure or Ctrl-C while writing leaves nothing behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import wna16ctl
from wna16ctl.layout.packing import pack_codes
from wna16ctl.padding import blocks
from wna16ctl.padding.tensors import pad_tensor
from wna16ctl.planning.padding import PaddedModule
from wna16ctl.sources.config import WeightScheme
from wna16ctl.sources.tensors import writable_view

SMALL = dict(hidden_size=128, num_experts=4, num_layers=1, intermediate_size=128, num_shards=2)
_ST = {torch.int32: "I32", torch.int64: "I64", torch.int8: "I8", torch.bfloat16: "BF16", torch.float16: "F16",
       torch.float32: "F32"}


def _raw(t: torch.Tensor) -> bytes:
    return bytes(writable_view(t.contiguous()))


def _from_pieces(data: bytes, pad: blocks.TensorPadding) -> bytes:
    """The padded bytes as the writer lays them out: each original piece, then its added bytes."""
    out = bytearray()
    for r in range(pad.rows):
        out += data[r * pad.row_in:(r + 1) * pad.row_in]
        out += pad.last_tail if r == pad.rows - 1 else pad.tail
    return bytes(out)


def _scheme(bits: int, group: int, symmetric: bool = True) -> WeightScheme:
    return WeightScheme(num_bits=bits, group_size=group, symmetric=symmetric, strategy="group" if group > 0 else "channel",
                        actorder=None, format="pack-quantized")


def _codes(gen: torch.Generator, shape: tuple[int, ...], bits: int, dim: int) -> torch.Tensor:
    return pack_codes(torch.randint(0, 1 << bits, shape, generator=gen, dtype=torch.int32), bits, dim=dim)


def _cases():
    """(id, module, suffix, tensor, n_rows): every stored form padding meets, original values random."""
    g = torch.Generator().manual_seed(3)
    H, I, P = 96, 128, 256  # hidden 96: 12 words of 8 int4 codes, 3 of 4 int8 ... and 96 = 4·24
    for bits in (4, 8):
        pf = 32 // bits
        for group in (32, -1):
            s = _scheme(bits, group, symmetric=False)
            G = I // group if group > 0 else 1
            gate = PaddedModule("m.gate_proj", "gate", "routed", I, P, s)
            down = PaddedModule("m.down_proj", "down", "routed", I, P, s)
            tag = f"int{bits} g{group}"
            yield f"{tag} gate packed", gate, "weight_packed", _codes(g, (I, H), bits, 1), I
            yield f"{tag} down packed", down, "weight_packed", _codes(g, (H, I), bits, 1), H
            for dt in (torch.bfloat16, torch.float16, torch.float32):
                yield f"{tag} gate scale {dt}", gate, "weight_scale", torch.rand(I, H // abs(group) if group > 0 else 1, generator=g).to(dt), I
                yield f"{tag} down scale {dt}", down, "weight_scale", torch.rand(H, G, generator=g).to(dt), H
            yield f"{tag} gate zero point", gate, "weight_zero_point", _codes(g, (I, H // group if group > 0 else 1), bits, 0), I
            yield f"{tag} down zero point", down, "weight_zero_point", _codes(g, (H, G), bits, 0), H
            # a hidden size that leaves the packed zero point's last word partial
            odd = H + pf // 2
            yield f"{tag} down zero point, partial word", down, "weight_zero_point", _codes(g, (odd, G), bits, 0), odd
            # the legacy unpacked form: signed int8 [N, G]
            legacy = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (H, G), generator=g, dtype=torch.int8)
            yield f"{tag} down legacy zero point", down, "weight_zero_point", legacy, H
            legacy_gate = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (I, H // 32), generator=g, dtype=torch.int8)
            yield f"{tag} gate legacy zero point", gate, "weight_zero_point", legacy_gate, I
            if group > 0:
                for dt in (torch.int32, torch.int64):
                    g_idx = (torch.randperm(I, generator=g) // group).to(dt)
                    yield f"{tag} down g_idx {dt}", down, "weight_g_idx", g_idx, H
                    yield f"{tag} gate g_idx {dt} (unchanged)", gate, "weight_g_idx", (torch.arange(H) // group).to(dt), I
            for dt in (torch.int32, torch.int64):
                yield f"{tag} gate weight_shape {dt}", gate, "weight_shape", torch.tensor([I, H], dtype=dt), I
                yield f"{tag} down weight_shape {dt}", down, "weight_shape", torch.tensor([H, I], dtype=dt), H
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        gate = PaddedModule("m.gate_proj", "gate", "dense", I, P, None)
        down = PaddedModule("m.down_proj", "down", "dense", I, P, None)
        yield f"bare gate {dt}", gate, "weight", torch.randn(I, H, generator=g).to(dt), I
        yield f"bare down {dt}", down, "weight", torch.randn(H, I, generator=g).to(dt), H
        yield f"bare gate bias {dt}", gate, "bias", torch.randn(I, generator=g).to(dt), I
        yield f"bare down bias {dt} (unchanged)", down, "bias", torch.randn(H, generator=g).to(dt), H


CASES = {case[0]: case[1:] for case in _cases()}


@pytest.mark.parametrize("case", list(CASES))
def test_byte_padding_is_the_tensor_math(case):
    m, suffix, t, n_rows = CASES[case]
    expected = pad_tensor(m, suffix, t, n_rows).contiguous()
    pad = blocks.tensor_padding(m, suffix, tuple(t.shape), _ST[t.dtype], n_rows)
    if suffix == "weight_shape":  # rewritten from its values
        assert pad is None
        assert blocks.padded_weight_shape(m, _raw(t), _ST[t.dtype]) == _raw(expected)
        return
    assert pad is not None, "every form a planned padding meets is written without torch"
    assert expected.dtype == t.dtype
    assert _from_pieces(_raw(t), pad) == _raw(expected)


def test_forms_that_repack_a_partial_word_are_left_to_the_tensor_math():
    s = _scheme(4, 32)
    # a width that ends in a partial int32 word of codes: the down projection's codes are repacked
    down = PaddedModule("m.down_proj", "down", "routed", 100, 128, s)
    assert blocks.tensor_padding(down, "weight_packed", (96, 13), "I32", 96) is None
    # gate/up zero points packed along rows whose count does not fill the last word
    gate = PaddedModule("m.gate_proj", "gate", "routed", 100, 128, s)
    assert blocks.tensor_padding(gate, "weight_zero_point", (13, 3), "I32", 100) is None


def _tensors(path: Path) -> dict[str, tuple[str, torch.Tensor]]:
    """name -> (file, tensor) of every shard, in each file's data order."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, "pt") as r:
            for name in r.keys():
                out[name] = (f.name, r.get_tensor(name))
    return out


def _data_order(path: Path) -> list[str]:
    names = []
    for f in sorted(path.glob("*.safetensors")):
        raw = f.read_bytes()
        header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
        header.pop("__metadata__", None)
        names += sorted(header, key=lambda n: header[n]["data_offsets"][0])
    return names


def _legacy_zero_points(src: Path, dst: Path) -> Path:
    from tests.sources.test_legacy_forms import _rewrite
    from wna16ctl.layout.packing import unpack_codes

    def unpack_zp(tensors):
        for name in [n for n in tensors if n.endswith("weight_zero_point")]:
            n_rows = tensors[name.replace("weight_zero_point", "weight_packed")].shape[0]
            tensors[name] = (unpack_codes(tensors[name], 4, dim=0, size=n_rows) - 8).to(torch.int8)
        return tensors

    return _rewrite(src, dst, unpack_zp)


def _f32_scales(src: Path, dst: Path) -> Path:
    from tests.sources.test_legacy_forms import _rewrite

    return _rewrite(src, dst, lambda ts: {k: v.float() if k.endswith("weight_scale") else v for k, v in ts.items()})


# checkpoint -> how it is padded (pad's keyword arguments)
FORMS = {
    "int4 sym group": (dict(SMALL), dict(tp=2, vllm="0.32.0")),
    "int4 asym group": (dict(SMALL, symmetric=False), dict(to=256)),
    "int8 sym group": (dict(SMALL, num_bits=8), dict(tp=2, vllm="0.32.0")),
    "int8 asym act-order group": (dict(SMALL, num_bits=8, symmetric=False, actorder="group"), dict(to=384)),
    "int4 act-order static": (dict(SMALL, actorder="static"), dict(tp=2, vllm="0.32.0")),
    "int4 act-order group": (dict(SMALL, actorder="group"), dict(tp=2, vllm="0.29.0")),
    "int4 channel-wise": (dict(SMALL, group_size=-1), dict(to=192)),
    "int4 asym channel-wise": (dict(SMALL, group_size=-1, symmetric=False), dict(to=192)),
    "qwen2 shared expert and dense": (dict(arch="qwen2_moe", quantize_mlp=True, **{**SMALL, "hidden_size": 256}),
                                      dict(tp=4, vllm="0.32.0")),
    "deepseek shared experts, dense MLP": (dict(arch="deepseek_v3", quantize_mlp=True,
                                                **{**SMALL, "hidden_size": 256, "num_layers": 2}),
                                           dict(tp=4, vllm="0.32.0")),
    "mixtral": (dict(arch="mixtral", **SMALL), dict(to=256)),
    "legacy unpacked zero points": ("legacy", dict(to=256)),
    "float32 scales": ("f32", dict(to=256)),
}


def _source(make_ckpt, tmp_path: Path, form: str) -> Path:
    spec = FORMS[form][0]
    if spec == "legacy":
        return _legacy_zero_points(make_ckpt(**SMALL, symmetric=False), tmp_path / "legacy")
    if spec == "f32":
        return _f32_scales(make_ckpt(**SMALL, symmetric=False), tmp_path / "f32")
    return make_ckpt(**spec)


def _expected_equals_written(src: Path, out: Path, options: dict) -> int:
    """Every tensor of `out` is, bit for bit, the tensor math applied to the original (or the
    original where nothing is padded), in the original's files and data order; returns how many
    tensors were padded."""
    plan = wna16ctl.pad(src, None, dry_run=True, **options)
    before, after = _tensors(src), _tensors(out)
    assert list(after) == list(before) and _data_order(out) == _data_order(src)
    padded = 0
    for name, (file, t) in before.items():
        module, _, suffix = name.rpartition(".")
        m = plan.modules.get(module)
        if m is None:
            expected = t
        else:
            rows = before.get(f"{module}.weight_packed", before.get(f"{module}.weight"))[1].shape[0]
            expected = pad_tensor(m, suffix, t, rows)
            padded += expected.shape != t.shape
        got_file, got = after[name]
        assert got_file == file, name
        assert got.dtype == expected.dtype and tuple(got.shape) == tuple(expected.shape), name
        assert _raw(got) == _raw(expected), name
    return padded


@pytest.mark.parametrize("form", list(FORMS))
def test_pad_writes_the_tensor_math_bit_for_bit(make_ckpt, tmp_path, form):
    src = _source(make_ckpt, tmp_path, form)
    options = FORMS[form][1]
    wna16ctl.pad(src, tmp_path / "p", **options)
    assert _expected_equals_written(src, tmp_path / "p", options) > 0


def test_shards_written_at_once_are_the_bytes_of_one_at_a_time(make_ckpt, tmp_path, monkeypatch):
    import wna16ctl.padding.write as write

    src = make_ckpt(**{**SMALL, "num_layers": 2, "num_shards": 4})
    monkeypatch.setattr(write, "producers", lambda n_files: 1)
    one = wna16ctl.pad(src, tmp_path / "one", tp=2, vllm="0.32.0")
    monkeypatch.setattr(write, "producers", lambda n_files: min(3, n_files))  # whatever the cores here
    several = wna16ctl.pad(src, tmp_path / "several", tp=2, vllm="0.32.0")
    assert one["files"] == several["files"] and len(one["files"]) >= 5  # 4 shards, config, index
    for rel in one["files"]:
        assert (tmp_path / "one" / rel).read_bytes() == (tmp_path / "several" / rel).read_bytes(), rel


def test_producers_follow_the_cores_and_the_shards(monkeypatch):
    import wna16ctl.padding.write as write

    monkeypatch.setattr(write.os, "sched_getaffinity", lambda pid: {0})
    assert write.producers(8) == 1
    monkeypatch.setattr(write.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert write.producers(8) == write.PRODUCERS and write.producers(1) == 1


def test_the_tensor_math_fallback_writes_the_same_bytes(make_ckpt, tmp_path, monkeypatch):
    # every tensor through the fallback (the form `blocks` leaves to the tensor math) gives the
    # same checkpoint as the byte-level path
    src = make_ckpt(**SMALL, symmetric=False, actorder="group")
    wna16ctl.pad(src, tmp_path / "fast", to=256)
    monkeypatch.setattr(blocks, "tensor_padding", lambda *a: None)
    wna16ctl.pad(src, tmp_path / "slow", to=256)
    for f in sorted(os.listdir(tmp_path / "fast")):
        if f != "wna16ctl.json":  # names the output directory
            assert (tmp_path / "fast" / f).read_bytes() == (tmp_path / "slow" / f).read_bytes(), f
    assert _expected_equals_written(src, tmp_path / "slow", dict(to=256)) > 0


def test_a_tensor_larger_than_one_piece_is_written_in_pieces(make_ckpt, tmp_path, monkeypatch):
    import wna16ctl.padding.write as write

    src = make_ckpt(**SMALL, symmetric=False)
    # a down projection's rows (128 of 64 + 64 bytes, int4) in pieces of 5 rows, its last piece shorter
    monkeypatch.setattr(write, "ROWS_BYTES", 5 * 128)
    wna16ctl.pad(src, tmp_path / "p", to=256)
    assert _expected_equals_written(src, tmp_path / "p", dict(to=256)) > 0


def test_a_write_that_fails_leaves_nothing_behind(make_ckpt, tmp_path, monkeypatch):
    from wna16ctl.errors import OutputError
    from wna16ctl.output import filestream

    src = make_ckpt(**SMALL)
    real = os.pwrite
    calls = []

    def full_disk(fd, data, offset):
        calls.append(1)
        if len(calls) == 2:  # the second shard's block
            raise OSError(28, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(filestream.os, "pwrite", full_disk)
    with pytest.raises(OutputError, match="No space left"):
        wna16ctl.pad(src, tmp_path / "p", tp=2, vllm="0.32.0")
    assert len(calls) >= 2
    assert sorted(os.listdir(tmp_path)) == []  # no OUT, no staging directory


def test_ctrl_c_while_writing_leaves_nothing_behind(make_ckpt, tmp_path, monkeypatch):
    import time

    import wna16ctl.padding.write as write
    from wna16ctl import interrupts

    src = make_ckpt(**SMALL)
    real = write._read_rows_into
    calls = []

    def interrupted(*args, **kwargs):  # Ctrl-C while the down projections are read
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)
            # the main thread records it (a producer thread may get here first on a busy machine)
            deadline = time.monotonic() + 10
            while not interrupts._pending and time.monotonic() < deadline:
                time.sleep(0.001)
        return real(*args, **kwargs)

    monkeypatch.setattr(write, "_read_rows_into", interrupted)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # a test runner's worker may ignore it
    try:
        with pytest.raises(KeyboardInterrupt):
            wna16ctl.pad(src, tmp_path / "p", tp=2, vllm="0.32.0")
    finally:
        signal.signal(signal.SIGINT, previous)
    # raised at each producer's next tensor: nothing more read but what another producer had under way
    assert 2 <= len(calls) <= 1 + write.producers(2)
    assert sorted(os.listdir(tmp_path)) == []


def test_pad_does_not_import_torch(make_ckpt, tmp_path):
    import subprocess
    import sys

    src = make_ckpt(**SMALL)
    code = ("import sys, wna16ctl; wna16ctl.pad(sys.argv[1], sys.argv[2], tp=2, vllm='0.32.0'); "
            "print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code, str(src), str(tmp_path / "p")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
    shutil.rmtree(tmp_path / "p")


def test_allocate_reserves_a_new_files_blocks_and_keeps_it_zero(tmp_path):
    from wna16ctl.output.filestream import allocate

    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
    try:
        os.ftruncate(fd, 4 << 20)
        sparse = os.fstat(fd).st_blocks * 512
        allocate(fd, 4 << 20)
        st = os.fstat(fd)
        if st.st_blocks * 512 == sparse:
            pytest.skip(f"the filesystem of {tmp_path} does not allocate with fallocate")
        assert sparse < 4 << 20 <= st.st_blocks * 512 and st.st_size == 4 << 20
        assert os.pread(fd, 4 << 20, 0) == bytes(4 << 20)
    finally:
        os.close(fd)


def test_a_shard_truncated_after_planning_is_one_line_and_nothing_is_left(make_ckpt, tmp_path, monkeypatch):
    import wna16ctl.padding.write as write
    from wna16ctl.errors import BadInput

    src = shutil.copytree(make_ckpt(**SMALL), tmp_path / "src")
    shard = sorted(src.glob("*.safetensors"))[-1]
    real = write._planned_files

    def then_truncated(plan):
        files = real(plan)
        os.truncate(shard, shard.stat().st_size // 2)  # replaced by a shorter file after planning
        return files

    monkeypatch.setattr(write, "_planned_files", then_truncated)
    with pytest.raises(BadInput) as e:
        wna16ctl.pad(src, tmp_path / "p", tp=2, vllm="0.32.0")
    assert shard.name in e.value.message and "\n" not in e.value.message
    assert sorted(os.listdir(tmp_path)) == ["src"]
