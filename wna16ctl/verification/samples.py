"""Where verify's questions come from (torch-free: `verify --help` states the order from here).

`SAMPLE_SEARCH_ORDER` is the one statement of the order; `resolve_samples` follows it, and the
docs that state it are checked against it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from wna16ctl.errors import BadInput

SHARED_ENV = "WNA16CTL_SHARED"
SAMPLES_ENV = "WNA16CTL_SAMPLES"
GSM8K_TEST = Path("data") / "gsm8k" / "test.jsonl"  # inside a shared data folder
DEMO_QUESTIONS = "demo_questions.jsonl"  # written by `wna16ctl demo` beside its tokenizer

# Where verify's questions come from when --samples is not given, first match wins.  The one
# statement of the order: the code below follows it, `verify --help` and every doc that states it
# are checked against it (tests/test_samples_order.py).
SAMPLE_SEARCH_ORDER: tuple[str, ...] = (
    "`--samples FILE` (`samples=` in the Python API): a `.jsonl` or `.parquet` file with a `question` field",
    f"`${SAMPLES_ENV}`: such a file",
    f"`${SHARED_ENV}/{GSM8K_TEST.as_posix()}` (set but missing is an error, not a fallback)",
    f"`shared/{GSM8K_TEST.as_posix()}` beside the repository (a checkout, not a wheel install)",
    "the test split of the `openai/gsm8k` dataset in the Hugging Face cache, downloaded when online",
    f"a demo checkpoint's own `{DEMO_QUESTIONS}` (word problems `wna16ctl demo` generates for its tokenizer), "
    "after one line saying GSM8K was not found",
)


def sample_search_order_markdown() -> str:
    """The search order as the numbered Markdown list every doc carries."""
    return "\n".join(f"{i}. {step}" for i, step in enumerate(SAMPLE_SEARCH_ORDER, 1))


def repository_shared_dir() -> Path | None:
    """The `shared/` folder beside the repository this package runs from (a checkout, not a
    wheel install: there the folder beside site-packages means nothing)."""
    repo = Path(__file__).resolve().parents[2]
    if not (repo / "pyproject.toml").is_file() or not (repo / "wna16ctl" / "__init__.py").is_file():
        return None
    shared = repo.parent / "shared"
    return shared if shared.is_dir() else None


def samples_label(path: str | os.PathLike[str]) -> str:
    """What the report calls the questions in `path`: the demo's own, GSM8K's, or the file's name
    (a user's file that is not GSM8K must not be reported as GSM8K)."""
    p = Path(path)
    if p.name == DEMO_QUESTIONS:
        return "the demo's generated questions"
    if "gsm8k" in str(p).lower():
        return "GSM8K"
    return p.name


def resolve_samples(samples: str | os.PathLike[str] | None, checkpoint: str | os.PathLike[str] | None = None,
                    notice: Callable[[str], None] | None = None) -> str | os.PathLike[str]:
    """Where verify's questions come from: SAMPLE_SEARCH_ORDER, first match wins.

    `checkpoint` (a local directory) enables the last step, a demo checkpoint's own questions;
    `notice` receives the one line saying GSM8K was not found when that step is taken.  With
    nothing found, one line naming the ways (BadInput)."""
    if samples is not None:
        return samples
    env_file = os.environ.get(SAMPLES_ENV)
    if env_file:
        if not Path(env_file).is_file():
            raise BadInput(f"{SAMPLES_ENV}={env_file}: no such file; point it at a .jsonl or .parquet file with a "
                           "'question' field, unset it, or pass --samples FILE")
        return Path(env_file)
    env = os.environ.get(SHARED_ENV)
    if env is not None:
        root = Path(env)
        if not root.is_dir():
            raise BadInput(f"{SHARED_ENV}={env}: no such directory; point it at a folder holding {GSM8K_TEST}, "
                           "unset it, or pass --samples FILE")
        path = root / GSM8K_TEST
        if not path.is_file():
            raise BadInput(f"{path}: missing ({SHARED_ENV}={env}); pass --samples FILE or fix {SHARED_ENV}")
        return path
    shared = repository_shared_dir()
    if shared is not None and (shared / GSM8K_TEST).is_file():
        return shared / GSM8K_TEST
    from wna16ctl.sources.hub import gsm8k_test_file

    try:
        return gsm8k_test_file()
    except BadInput as e:
        demo = Path(checkpoint) / DEMO_QUESTIONS if checkpoint is not None else None
        if demo is None or not demo.is_file():
            raise
        if notice is not None:
            notice(f"GSM8K not found ({e.message.removeprefix('no GSM8K samples: ').split(';')[0]}); using the demo's "
                   f"generated questions in {demo}; give GSM8K with --samples FILE or ${SAMPLES_ENV}")
        return demo
