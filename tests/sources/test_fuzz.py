"""Property-based tests: mutated headers and hostile output-directory layouts.

For every generated case, inspect and repack exit 0, 1 or 2 (never an internal error), the input
tree is unchanged, nothing outside OUT changes except what wna16ctl can prove it wrote, and a
failed run leaves nothing behind.  Derandomized with a bounded number of examples, so the suite
stays deterministic and quick.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from tests.repacking.test_pipeline import one_torch_thread  # noqa: F401 - a pytest fixture, found by name
from wna16ctl.cli import cli
from wna16ctl.output.outdir import STAGE_MARKER, stage_marker

SMALL = dict(num_layers=1, num_experts=4, vocab_size=64)
FUZZ = settings(max_examples=int(os.environ.get("WNA16CTL_FUZZ_EXAMPLES", "40")), derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def tree(root: Path) -> dict[str, str]:
    """Every entry under `root`, links as links (never followed), files by content."""
    out: dict[str, str] = {}
    if not os.path.lexists(root):
        return out
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = p.relative_to(root).as_posix()
            if p.is_symlink():
                out[rel] = "link:" + os.readlink(p)
            elif p.is_dir():
                out[rel] = "dir"
            elif p.is_file():
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                out[rel] = "special"
    return out


def check_result(res) -> None:
    assert res.exit_code in (0, 1, 2), (res.exit_code, res.output, res.exception)
    assert "internal error" not in res.stderr, res.stderr
    assert "Traceback" not in res.output


@pytest.fixture(scope="module")
def source(make_ckpt):
    return make_ckpt(**SMALL)


# ---- header mutations ---------------------------------------------------------------------------------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


MUTATIONS = ["entry_field", "drop_field", "dtype", "shape", "offsets", "metadata", "duplicate_range", "rename",
             "length_prefix", "truncate", "append", "flip_header_byte", "flip_data_byte"]
PER_MUTATION = settings(FUZZ, max_examples=int(os.environ.get("WNA16CTL_FUZZ_EXAMPLES", "4")))


def mutate_shard(path: Path, kind: str, data) -> None:
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    names = sorted(k for k in header if k != "__metadata__")
    name = data.draw(st.sampled_from(names))
    e = header[name]
    if kind == "entry_field":
        e[data.draw(st.sampled_from(["dtype", "shape", "data_offsets", "extra"]))] = data.draw(JSON_VALUES)
    elif kind == "drop_field":
        del e[data.draw(st.sampled_from(sorted(e)))]
    elif kind == "dtype":
        e["dtype"] = data.draw(st.sampled_from(["I32", "I8", "BF16", "F16", "F32", "F64", "BOOL", "F4", "C64", "X"]))
    elif kind == "shape":
        e["shape"] = data.draw(st.lists(st.integers(-2, 2**33), max_size=4))
    elif kind == "offsets":
        a, b = e["data_offsets"]
        da, db = data.draw(st.integers(-16, 16)), data.draw(st.integers(-16, 16))
        e["data_offsets"] = [a + da, b + db]
    elif kind == "metadata":
        header["__metadata__"] = data.draw(JSON_VALUES)
    elif kind == "duplicate_range":
        other = data.draw(st.sampled_from(names))
        e["data_offsets"] = list(header[other]["data_offsets"])
    elif kind == "rename":
        header[name + data.draw(st.sampled_from(["x", ".0", "_"]))] = header.pop(name)
    if kind in ("length_prefix", "truncate", "append", "flip_header_byte", "flip_data_byte"):
        if kind == "length_prefix":
            raw[:8] = struct.pack("<Q", max(0, n + data.draw(st.integers(-64, 64))))
        elif kind == "truncate":
            del raw[data.draw(st.integers(0, len(raw) - 1)):]
        elif kind == "append":
            raw += bytes(data.draw(st.integers(1, 64)))
        elif kind == "flip_header_byte":
            i = 8 + data.draw(st.integers(0, n - 1))
            raw[i] ^= 1 << data.draw(st.integers(0, 7))
        else:
            i = 8 + n + data.draw(st.integers(0, len(raw) - 9 - n))
            raw[i] ^= 0xFF
        path.write_bytes(bytes(raw))
        return
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(raw[8 + n:]))


@pytest.mark.parametrize("kind", MUTATIONS)
@PER_MUTATION
@given(data=st.data())
def test_fuzz_header_mutations(source, tmp_path_factory, kind, data):
    work = Path(tempfile.mkdtemp(dir=tmp_path_factory.getbasetemp()))
    try:
        ck = work / "ck"
        shutil.copytree(source, ck)
        shard = data.draw(st.sampled_from(sorted(ck.glob("*.safetensors"))))
        mutate_shard(shard, kind, data)
        before = tree(ck)
        res = CliRunner().invoke(cli, ["inspect", str(ck), "--tp", "1,2"])
        check_result(res)
        out = work / "out"
        res = CliRunner().invoke(cli, ["repack", str(ck), "--tp", "2", "-o", str(out), "-q"])
        check_result(res)
        event(f"{kind}: repack exit {res.exit_code}")
        assert tree(ck) == before, "the checkpoint changed"
        left = sorted(p.name for p in work.iterdir())
        if res.exit_code == 0:
            assert left == ["ck", "out"] and (out / "wna16ctl.json").is_file()
        else:
            assert left == ["ck"], left  # nothing behind: no OUT, no staging
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---- output-directory layouts ---------------------------------------------------------------------------

# what may already be at OUT, at its staging name, at its previous-output name, and at the old lock name
STATES = ["absent", "empty_dir", "foreign_file_in_dir", "regular_file", "link_to_outside_dir", "link_loop",
          "our_output", "our_output_plus_foreign", "our_stage"]


def plant(path: Path, state: str, out: Path, outside: Path, our_output: Path) -> None:
    if state == "absent":
        return
    if state == "empty_dir":
        path.mkdir()
    elif state == "foreign_file_in_dir":
        path.mkdir()
        (path / "user.txt").write_text("keep me")
    elif state == "regular_file":
        path.write_text("keep me")
    elif state == "link_to_outside_dir":
        path.symlink_to(outside)
    elif state == "link_loop":
        path.symlink_to(path)
    elif state in ("our_output", "our_output_plus_foreign"):
        shutil.copytree(our_output, path)
        if state == "our_output_plus_foreign":
            (path / "rank-0" / "user.txt").write_text("keep me")
    elif state == "our_stage":
        path.mkdir()
        (path / STAGE_MARKER).write_bytes(stage_marker(out))


@FUZZ
@given(out_state=st.sampled_from(STATES), stage_state=st.sampled_from(STATES), old_state=st.sampled_from(STATES),
       lock_state=st.sampled_from(["absent", "regular_file"]), mode=st.sampled_from(["plain", "force", "resume"]))
@example(out_state="our_output_plus_foreign", stage_state="absent", old_state="absent", lock_state="absent",
         mode="resume")
@example(out_state="our_output", stage_state="our_stage", old_state="our_output", lock_state="regular_file",
         mode="force")
def test_fuzz_output_layouts(source, tmp_path_factory, out_state, stage_state, old_state, lock_state, mode):
    base = tmp_path_factory.getbasetemp() / "layouts-out"
    if not (base / "wna16ctl.json").exists():
        res = CliRunner().invoke(cli, ["repack", str(source), "--tp", "2", "-o", str(base), "-q"])
        assert res.exit_code == 0, res.output
    work = Path(tempfile.mkdtemp(dir=tmp_path_factory.getbasetemp()))
    try:
        outside = work / "outside"
        outside.mkdir()
        (outside / "precious.txt").write_text("outside OUT")
        out = work / "out"
        names = {"out": out, "stage": work / ".out.wna16ctl-partial", "old": work / ".out.wna16ctl-old",
                 "lock": work / ".out.wna16ctl-lock"}
        for key, state in (("out", out_state), ("stage", stage_state), ("old", old_state), ("lock", lock_state)):
            plant(names[key], state, out, outside, base)
        before = tree(work)
        src_before = tree(source)
        outside_before = tree(outside)
        foreign_before = {p: h for p, h in tree(work).items() if p.endswith("user.txt") or p in ("lock",)}
        args = ["repack", str(source), "--tp", "2", "-o", str(out), "-q"] + ([f"--{mode}"] if mode != "plain" else [])
        res = CliRunner().invoke(cli, args)
        check_result(res)
        event(f"repack exit {res.exit_code}")
        after = tree(work)
        assert tree(source) == src_before, "the checkpoint changed"
        assert tree(outside) == outside_before, "a file outside OUT changed"
        for rel, digest in foreign_before.items():  # nothing wna16ctl did not write is deleted
            assert after.get(rel) == digest, (rel, res.stderr)
        if lock_state == "regular_file":
            assert names["lock"].read_text() == "keep me"
        if res.exit_code == 0:
            assert (out / "wna16ctl.json").is_file() and not out.is_symlink()
            assert not os.path.lexists(names["stage"])
        else:  # a refused or failed run leaves exactly what was there
            assert after == before, res.stderr
    finally:
        shutil.rmtree(work, ignore_errors=True)
