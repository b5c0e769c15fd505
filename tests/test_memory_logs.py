"""docs/memory.md's comparison with users' vLLM start-up logs stays true: every row of both tables
(starts that logged their KV cache size, starts that stopped at the cache check) is recomputed from
its own columns (the model's config, TP, --kv-cache-dtype and the log's available KV memory) through
the library, and its "ours" and "error" columns must be what the library gives."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests import modelckpt as m
from tests.conftest import REPO_ROOT
from wna16ctl.dtypes import ST_SIZES
from wna16ctl.planning.kvcache import kv_cache, kv_dtype_bytes
from wna16ctl.planning.memory import model_st_dtype
from wna16ctl.sources import open_checkpoint

DOC = REPO_ROOT / "docs" / "memory.md"
GIB = 1 << 30


def qwen3_1_7b_attention(layers: int = 2) -> dict:
    """Qwen/Qwen3-1.7B's attention as its published config.json gives it (28 layers, 16 query heads,
    8 KV heads of 128, bfloat16) on a Qwen3-MoE header copy: the KV cache depends on nothing else."""
    return dict(m.qwen3_30b_a3b(layers), num_attention_heads=16, num_key_value_heads=8, head_dim=128)


def qwen3_8b_attention(layers: int = 2) -> dict:
    """Qwen/Qwen3-8B's config.json: 36 layers, 32 query heads, 8 KV heads of head_dim 128, bfloat16."""
    return dict(m.qwen3_30b_a3b(layers), num_attention_heads=32, num_key_value_heads=8, head_dim=128)


def qwen3_14b_attention(layers: int = 2) -> dict:
    """Qwen/Qwen3-14B's config.json: 40 layers, 40 query heads, 8 KV heads of head_dim 128, bfloat16."""
    return dict(m.qwen3_30b_a3b(layers), num_attention_heads=40, num_key_value_heads=8, head_dim=128)


def qwen3_vl_30b_a3b_attention(layers: int = 2) -> dict:
    """Qwen/Qwen3-VL-30B-A3B-Instruct's text_config: 48 layers, 32 query heads, 4 KV heads of head_dim
    128, the attention of Qwen3-30B-A3B (the vision tower holds no KV cache)."""
    return m.qwen3_30b_a3b(layers)


def _no_head_dim(config: dict, **attention) -> dict:
    """A published config that gives no head_dim: the library derives it as hidden_size / heads."""
    out = dict(config, **attention)
    out.pop("head_dim")
    return out


def qwen2_7b_attention(layers: int = 2) -> dict:
    """Qwen/Qwen2-7B-Instruct's config.json: 28 layers, hidden 3584, 28 query heads (head_dim 128), 4 KV
    heads, bfloat16; its sliding_window 131072 is off (use_sliding_window false), so every layer is full."""
    return _no_head_dim(m.qwen3_30b_a3b(layers), hidden_size=3584, num_attention_heads=28,
                        num_key_value_heads=4, sliding_window=131072, use_sliding_window=False)


def llama3_1_8b_attention(layers: int = 2) -> dict:
    """meta-llama/Llama-3.1-8B-Instruct's config.json: 32 layers, hidden 4096, 32 query heads (head_dim
    128), 8 KV heads, bfloat16, no sliding window."""
    return _no_head_dim(m.qwen3_30b_a3b(layers), hidden_size=4096, num_attention_heads=32, num_key_value_heads=8)


def llava_v1_6_mistral_7b_attention(layers: int = 2) -> dict:
    """llava-hf/llava-v1.6-mistral-7b-hf's text_config (Mistral-7B-Instruct-v0.2): 32 layers, hidden 4096,
    32 query heads (head_dim 128), 8 KV heads, sliding_window null; the file says float16, 2 bytes as
    bfloat16 is (the vision tower holds no KV cache)."""
    return _no_head_dim(m.qwen3_30b_a3b(layers), hidden_size=4096, num_attention_heads=32,
                        num_key_value_heads=8, sliding_window=None)


# config name in the table -> (config builder, family, decoder layers of the published config)
CONFIGS = {
    "qwen3_1_7b_attention": (qwen3_1_7b_attention, m.qwen3_moe, 28),
    "qwen3_8b_attention": (qwen3_8b_attention, m.qwen3_moe, 36),
    "qwen3_14b_attention": (qwen3_14b_attention, m.qwen3_moe, 40),
    "qwen3_30b_a3b": (m.qwen3_30b_a3b, m.qwen3_moe, 48),
    "qwen3_vl_30b_a3b_attention": (qwen3_vl_30b_a3b_attention, m.qwen3_moe, 48),
    "qwen2_7b_attention": (qwen2_7b_attention, m.qwen3_moe, 28),
    "llama3_1_8b_attention": (llama3_1_8b_attention, m.qwen3_moe, 32),
    "llava_v1_6_mistral_7b_attention": (llava_v1_6_mistral_7b_attention, m.qwen3_moe, 32),
    "qwen3_235b_a22b": (m.qwen3_235b_a22b, m.qwen3_moe, 94),
    "kimi_k2_thinking": (m.kimi_k2_thinking, m.deepseek_v3, 61),
    "qwen3_coder_480b_a35b": (m.qwen3_coder_480b_a35b, m.qwen3_moe, 62),
}
SECTION = "## Against real start-up logs"


def _tables() -> list[list[dict[str, str]]]:
    """Every table of the section, each a list of rows keyed by its own header."""
    section = DOC.read_text().split(SECTION)[1]
    tables: list[list[str]] = [[]]
    for ln in section.splitlines():
        if ln.startswith("|"):
            tables[-1].append(ln)
        elif tables[-1]:
            tables.append([])
    out = []
    for lines in (t for t in tables if t):
        header = [c.strip() for c in lines[0].strip("|").split("|")]
        out.append([dict(zip(header, (c.strip() for c in ln.strip("|").split("|")))) for ln in lines[2:]])
    return out


def _table(n: int) -> list[dict[str, str]]:
    tables = _tables() if SECTION in DOC.read_text() else []
    return tables[n] if len(tables) > n else []


def _rows() -> list[dict[str, str]]:
    return _table(0)


def _stopped_rows() -> list[dict[str, str]]:
    return _table(1)


def _checkpoint(name: str, root: Path):
    """A header-only copy of the published config: tensors of two layers (the cache is sized from
    the config), the config's own decoder layer count."""
    build, family, layers = CONFIGS[name]
    config = build(layers=2)
    out = m.write(root / name, config, family(config, config.get("quantization_config")))
    written = json.loads((out / "config.json").read_text())
    written["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(written))
    return open_checkpoint(out)


def test_the_table_has_its_cases():
    """At least ten logged starts, each with its source (the goal the comparison is held to)."""
    rows = _rows()
    assert len(rows) >= 10 and all(r["source"].startswith("https://") for r in rows)


def _kv(row: dict[str, str], tmp_path: Path):
    config = re.search(r"\((\w+)\)", row["model (config)"]).group(1)
    ck = _checkpoint(config, tmp_path)
    st = model_st_dtype(ck)
    kv = kv_cache(ck, int(row["TP"]), kv_dtype_bytes(row["--kv-cache-dtype"], st), ST_SIZES[st])
    assert kv.unknown is None
    return kv


def _error(ours: int, logged: int) -> str:
    return f"{(ours - logged) / logged * 100:+.2f}%"


@pytest.mark.parametrize("row", _rows(), ids=lambda r: r["#"])
def test_each_row_is_what_the_library_computes(row, tmp_path):
    kv = _kv(row, tmp_path)
    ours = kv.tokens_in(int(float(row["Available KV cache memory (GiB)"]) * GIB))
    assert int(row["ours"]) == ours
    logged = int(row["GPU KV cache size: logged"])
    assert row["error"] == _error(ours, logged)
    assert abs(ours - logged) / logged <= 0.05  # the goal: within 5 % where the log gives the settings


def test_the_stopped_starts_have_their_table():
    rows = _stopped_rows()
    assert len(rows) >= 2 and all(r["source"].startswith("https://") for r in rows)


@pytest.mark.parametrize("row", _stopped_rows(), ids=lambda r: r["#"])
def test_each_stopped_start_is_what_the_library_computes(row, tmp_path):
    """The KV cache one sequence of --max-model-len needs, and the largest length the logged memory
    holds in whole blocks (vLLM's "estimated maximum model length")."""
    kv = _kv(row, tmp_path)
    max_len = int(re.search(r"\d+", row["--max-model-len"]).group(0))
    needed = f"{kv.sequence_bytes(max_len) / GIB:.2f}"
    assert row["needed: ours"] == needed == row["KV cache needed (GiB): logged"]
    ours = kv.tokens_in(int(float(row["available KV cache memory (GiB)"]) * GIB))
    logged = int(row["estimated maximum model length: logged"])
    assert int(row["length: ours"]) == ours
    assert row["error"] == _error(ours, logged)
    assert abs(ours - logged) / logged <= 0.05
