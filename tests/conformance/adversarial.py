"""Adversarial checkpoints with the verdicts of each vLLM release's own code, pinned.

Each fixture is a conformance case (ckptcase.py writes it as config.json + safetensors headers);
`PINNED[fixture][release][tp]` is `[stage, backend]` as the release's code decided it in the
conformance worker (stage null: the layer loads).  tests/planning/test_adversarial.py checks the
planner against the pins without any wheel; the conformance test checks the pins against the
releases themselves where their sources are cached.  Regenerate with

    python -m tests.conformance.adversarial --write
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

# Qwen3-30B-A3B's expert sizes unless a fixture says otherwise
_BASE = {"hidden_size": 2048, "intermediate_size": 768, "num_experts": 8, "num_bits": 4, "group_size": 128,
         "group_size_null": False, "symmetric": True, "actorder": None, "strategy": "group", "ep": False,
         "gpu": "sm90", "env": {}, "moe_backend": "auto", "extra_groups": []}


def _actorder_group(targets: list[str]) -> dict[str, Any]:
    return {"targets": targets, "weights": {"num_bits": 4, "strategy": "group", "group_size": 128, "actorder": "group",
                                            "symmetric": True, "group_size_null": False}}


FIXTURES: dict[str, dict[str, Any]] = {
    "int8_channel": dict(_BASE, num_bits=8, strategy="channel", group_size=-1),
    "asym_g64": dict(_BASE, symmetric=False, group_size=64),
    "h192_channel": dict(_BASE, hidden_size=192, strategy="channel", group_size=-1),
    "actorder_true": dict(_BASE, actorder=True),
    "actorder_dynamic": dict(_BASE, actorder="dynamic"),
    "actorder_static": dict(_BASE, actorder="static"),
    "attention_only_actorder": dict(_BASE, extra_groups=[_actorder_group([r"re:.*self_attn.*"])]),
    "unmatched_actorder_group": dict(_BASE, extra_groups=[_actorder_group([r"re:.*visual.*"])]),
    "g32_i1536": dict(_BASE, group_size=32, intermediate_size=1536, hidden_size=7168),
    "kimi_sm100": dict(_BASE, group_size=32, intermediate_size=2048, hidden_size=7168, gpu="sm100"),
    "kimi_sm100_flashinfer": dict(_BASE, group_size=32, intermediate_size=2048, hidden_size=7168, gpu="sm100",
                                  env={"VLLM_USE_FLASHINFER_MOE_INT4": "1"}),
}
TPS = (1, 2, 4, 8, 16)
PINS_FILE = Path(__file__).with_name("adversarial_pins.json")


def case(name: str, tp: int) -> dict[str, Any]:
    return dict(FIXTURES[name], tp=tp)


def pins() -> dict[str, dict[str, dict[str, list]]]:
    return json.loads(PINS_FILE.read_text())


def vllm_verdict(version: str, name: str, tp: int) -> list:
    from tests.conformance import vllm_release

    out = vllm_release.vllm_outcome(version, case(name, tp))
    return [out["stage"], out["backend"] if out["stage"] is None else None]


def main(argv: list[str]) -> int:
    from tests.conformance import vllm_release

    if argv != ["--write"]:
        print(__doc__)
        return 2
    result: dict[str, dict[str, dict[str, list]]] = {n: {} for n in FIXTURES}
    for version in vllm_release.RELEASES:
        vllm_release.release_sources(version)
        for name in FIXTURES:
            result[name][version] = {str(tp): vllm_verdict(version, name, tp) for tp in TPS}
        vllm_release.close_worker(version)
        print(f"vLLM {version}: pinned", flush=True)
    PINS_FILE.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
