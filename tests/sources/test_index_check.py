"""The index against the shard headers (`headers.assemble`): the fast check (one lookup per name)
accepts exactly what the name-by-name check accepts, and a disagreement is one line naming it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from wna16ctl.errors import BadInput
from wna16ctl.sources.headers import INDEX_NAME, assemble, locate_shards, read_shard_header

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import synthetic_headers


@pytest.fixture()
def ck(tmp_path):
    return synthetic_headers.write(tmp_path / "ck", layers=3, experts=4, hidden=64, inter=32, shards=3, vocab=16)


def _assemble(root: Path):
    where = locate_shards(root)
    return assemble(where, [read_shard_header(p) for p in where.paths])


def _edit_index(root: Path, edit) -> None:
    doc = json.loads((root / INDEX_NAME).read_text())
    edit(doc["weight_map"])
    (root / INDEX_NAME).write_text(json.dumps(doc))


def test_a_consistent_index_passes(ck):
    assert len(_assemble(ck)) == len(json.loads((ck / INDEX_NAME).read_text())["weight_map"])


def test_a_tensor_assigned_to_the_wrong_shard_is_named(ck):
    files = sorted(p.name for p in ck.glob("*.safetensors"))
    moved = {}

    def move(wm):
        name = next(n for n, f in wm.items() if f == files[0])
        wm[name] = files[1]
        moved["name"] = name

    _edit_index(ck, move)
    with pytest.raises(BadInput, match=f"names tensor {moved['name']} in {files[1]}, but {files[1]} does not hold it"):
        _assemble(ck)


def test_a_tensor_the_index_does_not_name_is_named(ck):
    gone = {}

    def drop(wm):
        gone["name"] = name = next(n for n in wm if n.endswith("experts.2.up_proj.weight_scale"))
        del wm[name]

    _edit_index(ck, drop)
    with pytest.raises(BadInput, match=f"holds tensor {gone['name']}, which the index does not name"):
        _assemble(ck)
