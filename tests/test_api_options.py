"""The Python API mirrors the commands: every option of `inspect`, `repack` and `verify` is a
parameter of the function of the same name, and every parameter is an option, except the few
listed here with the reason."""

from __future__ import annotations

import inspect as pyinspect

import pytest

import wna16ctl
from wna16ctl.cli import cli

# Options that only shape what the command line prints: a function returns the result object.
CLI_ONLY = {
    "json_mode": "a function returns the result; its to_json() is what --json prints",
    "quiet": "a function prints nothing; progress is the `progress` callback",
    "debug": "a function raises the exception itself, traceback and all",
}
# Parameters that receive what the command line shows on stderr.
API_ONLY = {
    "progress": "the progress bars the command line draws",
    "notice": "the warnings the command line prints",
    "warn": "the warnings about the input the command line prints (hidden by --quiet)",
    "group": "a torchrun launch: the command line reads it from the environment",
}
# The command's argument names as the functions spell them.
RENAMED = {"ckpt": "path"}


def _cli_names(command: str) -> set[str]:
    params = cli.commands[command].params
    return {RENAMED.get(p.name, p.name) for p in params if p.name not in CLI_ONLY}


def _api_names(command: str) -> set[str]:
    return {n for n in pyinspect.signature(getattr(wna16ctl, command)).parameters if n not in API_ONLY}


@pytest.mark.parametrize("command", ["inspect", "repack", "verify"])
def test_every_option_is_a_parameter_and_back(command):
    cli_names, api_names = _cli_names(command), _api_names(command)
    assert cli_names - api_names == set(), f"options of `wna16ctl {command}` missing from wna16ctl.{command}()"
    assert api_names - cli_names == set(), f"parameters of wna16ctl.{command}() no option of `wna16ctl {command}` has"


@pytest.mark.parametrize("command", ["inspect", "repack", "verify"])
def test_defaults_agree(command):
    """A parameter's default is the option's default (after the option's own parsing of strings)."""
    signature = pyinspect.signature(getattr(wna16ctl, command)).parameters
    for p in cli.commands[command].params:
        name = RENAMED.get(p.name, p.name)
        if name not in signature or p.required or getattr(p, "is_flag", False) or p.multiple:
            continue
        default = signature[name].default
        if default is pyinspect.Parameter.empty:
            continue
        if p.default is None:
            assert default is None, (command, name)
        elif isinstance(default, (int, str)) and not isinstance(default, bool):
            assert str(default) == str(p.default) or name == "gpu", (command, name, default, p.default)


def test_the_lists_of_exceptions_name_real_options_and_parameters():
    every_option = {p.name for c in ("inspect", "repack", "verify") for p in cli.commands[c].params}
    assert set(CLI_ONLY) <= every_option
    every_parameter = {n for c in ("inspect", "repack", "verify")
                       for n in pyinspect.signature(getattr(wna16ctl, c)).parameters}
    assert set(API_ONLY) <= every_parameter
