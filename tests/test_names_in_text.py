"""Files named in comments, docstrings and docs exist: a name left behind by a move misleads the
next reader more than no name at all."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_NAMED = re.compile(r"(?<![\w/.-])((?:[\w-]+/)*[\w-]+\.(?:py|cu|cuh|cpp|h|md|sh))\b")
# The names checked: paths under one of this repository's folders or sub-packages, and bare file
# CUDA sources. Paths elsewhere (vLLM's `fused_moe/oracle/int_wna16.py`, `kernels/linear/`,
# system headers, vLLM's bare module names) stand for other projects' files. checkpoint/ is the
# sources/ sub-package's earlier name, still worth catching.
_OUR_FOLDERS = ("wna16ctl/", "checkpoint/", "tests/", "bench/", "scripts/", "docs/", "planning/", "sources/", "layout/",
                "repacking/", "output/", "verification/", "native/", "integrations/", "emu/")


def _checked(name: str) -> bool:
    if "/" not in name:  # a bare .py name is as often vLLM's as ours; kernel sources are ours
        return name.endswith((".cu", ".cuh"))
    if name.startswith("kernels/"):  # ours are files directly in kernels/ or kernels/emu/
        return name.count("/") == 1 or name.startswith("kernels/emu/")
    return name.startswith(_OUR_FOLDERS)


def named_files(text: str) -> set[str]:
    return set(_NAMED.findall(text))


def _ours() -> tuple[set[str], set[str]]:
    files = [p.relative_to(REPO).as_posix() for p in REPO.rglob("*")
             if p.is_file() and not {".git", ".venv", "build"} & set(p.relative_to(REPO).parts)]
    return set(files), {f.rsplit("/", 1)[-1] for f in files}


def stale_names(paths: list[Path]) -> list[str]:
    files, basenames = _ours()
    stale = []
    for path in paths:
        for name in sorted(named_files(path.read_text(errors="replace"))):
            base = name.rsplit("/", 1)[-1]
            if not _checked(name) or base in basenames and ("/" not in name or any(f.endswith(name) for f in files)):
                continue
            stale.append(f"{path.relative_to(REPO)}: {name}")
    return stale


def test_every_file_named_in_the_package_kernels_and_docs_exists():
    paths = [*REPO.glob("wna16ctl/**/*.py"), *REPO.glob("kernels/**/*.*"), *REPO.glob("docs/*.md"),
             REPO / "README.md", REPO / "Makefile"]
    stale = stale_names([p for p in paths if p.suffix in {".py", ".cu", ".cuh", ".cpp", ".h", ".md", ""}])
    assert not stale, "named but not in the tree:\n" + "\n".join(stale)


def test_the_check_sees_a_stale_name(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("see `planning/linear_plan.py`, `moe_gemm_v9.cu` and wna16ctl/planning/rules.py and planning/nowhere.py\n")
    doc_in_repo = REPO / "build" / "names-check.md"
    doc_in_repo.parent.mkdir(exist_ok=True)
    doc_in_repo.write_text(doc.read_text())
    try:
        assert stale_names([doc_in_repo]) == ["build/names-check.md: moe_gemm_v9.cu",
                                              "build/names-check.md: planning/linear_plan.py",
                                              "build/names-check.md: planning/nowhere.py"]
    finally:
        doc_in_repo.unlink()
