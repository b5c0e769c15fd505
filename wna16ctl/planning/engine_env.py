"""The engine's environment switches and its `--moe-backend` choice, as rules.

vLLM reads a few `VLLM_*` environment variables that decide which WNA16 backend a layer gets;
their defaults are part of what a release does, just like the rules in `rules.py`.  Each switch
is listed here with the releases that read it, its default there, how the engine parses its
value and where the release reads it.  `EngineSwitches` is what a user states on top of the
defaults (`--env NAME=VALUE`, `--moe-backend NAME`); the planners ask it for the value in force
in one release.

Facts were read in each release's `envs.py` and the backend-selection code of its wheel
(docs/vllm-releases.md); the conformance worker sets the same variables before it imports a
release, so the harness checks the planner's reading of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from wna16ctl.planning import rules


@dataclass(frozen=True)
class EnvSwitch:
    """One `VLLM_*` variable that gates a WNA16 backend, read from `since` on (until excluded)."""

    name: str
    kind: str  # "bool": bool(int(value)), as envs.py parses it; "list": comma-separated names
    default: str  # the value in force when the variable is unset (the release's envs.py default)
    since: str
    until: str | None
    gates: str  # "moe" or "linear": which planner reads it
    what: str  # our words: what the switch decides
    where: str  # the file/function of the release that reads it

    def read_in(self, version: str) -> bool:
        v = rules.version_key(version)
        return v >= rules.version_key(self.since) and (self.until is None or v < rules.version_key(self.until))


SWITCHES: tuple[EnvSwitch, ...] = (
    EnvSwitch("VLLM_USE_FLASHINFER_MOE_INT4", "bool", "0", "0.27.0", None, "moe",
              "FlashInfer's TRT-LLM int4 MoE backend is used only when this is 1: the backend's device check asks "
              "is_flashinfer_mxint4_moe_available(), which starts with this variable (default 0), so by default "
              "Blackwell layers go to the next backend (Marlin)",
              "quantization/utils/flashinfer_mxint4_moe.py: is_flashinfer_mxint4_moe_available; "
              "fused_moe/experts/trtllm_mxint4_moe.py: _supports_current_device"),
    EnvSwitch("VLLM_DISABLED_KERNELS", "list", "", "0.27.0", None, "linear",
              "linear kernel classes named here (comma-separated, e.g. MacheteLinearKernel) are skipped by "
              "choose_mp_linear_kernel, which then takes the next kernel that can implement the layer",
              "kernels/linear/__init__.py: choose_mp_linear_kernel"),
    EnvSwitch("VLLM_BATCH_INVARIANT", "bool", "0", "0.33.0", None, "linear",
              "with 1, compressed-tensors WNA16 linear layers choose no kernel: the packed weight is kept in the "
              "checkpoint layout, unpacked and multiplied by the batch-invariant matmul",
              "quantization/compressed_tensors/schemes/compressed_tensors_wNa16.py: CompressedTensorsWNA16"),
)
_BY_NAME = {s.name: s for s in SWITCHES}

# `--moe-backend`: the engine's own names (its MoEBackend literal) that its WNA16 MoE oracle maps
# to a WNA16 backend (`map_wna16_backend`), with the first release that maps each.
MOE_BACKEND_SINCE: dict[str, str] = {
    "triton": "0.27.0", "marlin": "0.27.0", "humming": "0.27.0", "flashinfer_trtllm": "0.27.0",
    "emulation": "0.27.0", "rdna3": "0.30.0",
}
MOE_BACKENDS: tuple[str, ...] = ("auto", *MOE_BACKEND_SINCE)


def wna16_moe_backends(version: str) -> list[str]:
    """The `--moe-backend` names release `version` maps for WNA16 MoE layers, in its mapping order."""
    return [n for n, since in MOE_BACKEND_SINCE.items() if rules.version_key(version) >= rules.version_key(since)]


def switch(name: str) -> EnvSwitch:
    return _BY_NAME[name]


def _check_value(sw: EnvSwitch, value: str) -> str:
    if sw.kind == "bool":
        try:
            int(value.strip())
        except ValueError:
            raise ValueError(f"--env {sw.name}={value!r}: vLLM reads this as an integer (0 or 1)") from None
    return value


def parse_env(items: Iterable[str] | dict[str, str] | None) -> tuple[tuple[str, str], ...]:
    """`NAME=VALUE` strings (or a mapping) -> sorted (name, value) pairs; ValueError on a name that
    gates no WNA16 backend in any known release, or a value the engine could not parse."""
    if not items:
        return ()
    pairs = list(items.items()) if isinstance(items, dict) else []
    if not isinstance(items, dict):
        for item in items:
            name, sep, value = str(item).partition("=")
            if not sep or not name.strip():
                raise ValueError(f"--env {item!r}: expected NAME=VALUE, e.g. VLLM_USE_FLASHINFER_MOE_INT4=1")
            pairs.append((name.strip(), value))
    out: dict[str, str] = {}
    for name, value in pairs:
        sw = _BY_NAME.get(name)
        if sw is None:
            raise ValueError(f"--env {name}: not a vLLM variable that gates a WNA16 backend in any known release "
                             f"(known: {', '.join(_BY_NAME)})")
        out[name] = _check_value(sw, str(value))
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class EngineSwitches:
    """What the user states about the engine beyond its release: environment overrides and the
    `--moe-backend` choice (`auto` lets the release's oracle pick)."""

    env: tuple[tuple[str, str], ...] = ()
    moe_backend: str = "auto"

    def __post_init__(self) -> None:
        if self.moe_backend not in MOE_BACKENDS:
            raise ValueError(f"--moe-backend {self.moe_backend!r} is not one of {', '.join(MOE_BACKENDS)}")

    def raw(self, name: str, version: str) -> str | None:
        """The variable's value as the release sees it (None where the release does not read it)."""
        sw = _BY_NAME[name]
        if not sw.read_in(version):
            return None
        return dict(self.env).get(name, sw.default)

    def flag(self, name: str, version: str) -> bool:
        value = self.raw(name, version)
        return bool(int(value)) if value not in (None, "") else False

    def names(self, name: str, version: str) -> list[str]:
        value = self.raw(name, version)
        return [] if not value else value.split(",")

    def to_json(self, version: str) -> dict[str, Any]:
        """Every switch with the value in force in `version` and where it came from."""
        given = dict(self.env)
        return {
            sw.name: {"value": self.raw(sw.name, version), "default": sw.default if sw.read_in(version) else None,
                      "source": ("not read by this release" if not sw.read_in(version) else
                                 "--env" if sw.name in given else "default"),
                      "gates": sw.gates}
            for sw in SWITCHES
        }


DEFAULT = EngineSwitches()


def make_switches(env: Iterable[str] | dict[str, str] | None = None, moe_backend: str | None = None) -> EngineSwitches:
    """The switches from `--env` items and `--moe-backend`; ValueError on bad input."""
    return EngineSwitches(parse_env(env), (moe_backend or "auto").strip().lower())
