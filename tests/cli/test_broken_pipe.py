"""`wna16ctl ... | head`: the reader of stdout goes away; the command exits 1 without a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# a command body that writes far more than a pipe holds, while its reader reads a few bytes only
_WRITER = """
import sys
import wna16ctl.cli as cli

def body(*args, **kwargs):
    for _ in range(100):
        sys.stdout.write("x" * 100_000)
    sys.stdout.flush()

cli.cli.main = body
cli.main()
"""


def test_a_closed_stdout_ends_the_command_quietly() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # deprecation warnings as errors: no API that a later click release removes may be on this path
    writer = subprocess.Popen([sys.executable, "-W", "error::DeprecationWarning", "-c", _WRITER],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert writer.stdout is not None and writer.stderr is not None
    assert writer.stdout.read(10) == b"x" * 10
    writer.stdout.close()
    err = writer.stderr.read().decode()
    assert writer.wait(timeout=60) == 1
    assert err == ""
