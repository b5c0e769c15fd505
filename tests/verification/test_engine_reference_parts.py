"""The pure-Python parts of the reference-vs-engine tier (fast, default suite): the dequantised
checkpoint, the tolerance derivation, the judgement and the reading of the engine's captures."""

from __future__ import annotations

import json
from statistics import NormalDist

import pytest
import torch
from safetensors import safe_open

from wna16ctl.verification.engine_reference import (
    ReferenceRuns, engine_layer_outputs, gaussian_multiplier, judge_engine,
    logit_tolerance, routing_margin, routing_ties, write_dequantized_checkpoint)


def test_dequantized_checkpoint_holds_the_references_expert_weights(make_ckpt, tmp_path):
    from wna16ctl.demo import library_dequantize
    from wna16ctl.repacking.pipeline import RepackSettings, plan_repack
    from wna16ctl.sources import open_checkpoint
    from wna16ctl.sources.tensors import TensorReader
    from wna16ctl.verification.e2e import _ReferenceExperts

    ck = make_ckpt()
    out = write_dequantized_checkpoint(ck, tmp_path / "dense")
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == json.loads((ck / "config.json").read_text())["architectures"]
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        written = {k: f.get_tensor(k) for k in f.keys()}
    assert not [k for k in written if "weight_packed" in k or "weight_scale" in k or "weight_shape" in k]
    # bit-identical to what the e2e reference multiplies by (its per-rank w13 | w2 at TP 1) ...
    source = open_checkpoint(ck)
    jobs = plan_repack(ck, RepackSettings(tp=1)).jobs
    job = jobs[0]
    with TensorReader(source.files) as reader:
        reference = _ReferenceExperts(source, reader, job, torch.bfloat16, torch.device("cpu"))
    layer = job.layer
    inner = layer.intermediate_size
    for e, (w13, w2) in reference.ranks[0][1].items():
        assert torch.equal(written[layer.tensor_name(e, "gate", "weight")], w13[:, :inner].T)
        assert torch.equal(written[layer.tensor_name(e, "up", "weight")], w13[:, inner:].T)
        assert torch.equal(written[layer.tensor_name(e, "down", "weight")], w2.T)
    # ... and to compressed-tensors' own decompression of the same modules, rounded to bf16
    library = library_dequantize(ck)
    assert set(library) <= set(written) and len(library) == 3 * layer.num_experts * len(jobs)
    name = layer.tensor_name(3, "down", "weight")
    assert torch.equal(written[name], library[name].to(torch.bfloat16))
    # every other tensor as stored
    with safe_open(str(next(ck.glob("*.safetensors"))), framework="pt") as f:
        other = next(k for k in f.keys() if k.endswith("input_layernorm.weight"))
        assert torch.equal(written[other], f.get_tensor(other))
    with pytest.raises(FileExistsError):
        write_dequantized_checkpoint(ck, out)


def test_gaussian_multiplier_is_the_union_bound_quantile():
    assert gaussian_multiplier(1, 0.05) == pytest.approx(1.959964, abs=1e-5)
    z = gaussian_multiplier(16384, 1e-3)
    # P(|N(0,1)| > z) · comparisons = false alarm
    assert 2 * (1 - NormalDist().cdf(z)) * 16384 == pytest.approx(1e-3, rel=1e-6)
    assert gaussian_multiplier(100) < gaussian_multiplier(10_000)
    with pytest.raises(ValueError):
        gaussian_multiplier(0)


def test_logit_tolerance_is_z_times_the_rms_rounding_of_each_step():
    ref = [torch.zeros(3, 4)]
    low = [torch.tensor([[0.01, -0.01, 0.01, -0.01], [0.0, 0.0, 0.0, 0.02], [0.0, 0.0, 0.0, 0.0]])]
    tol, z = logit_tolerance(ref, low)
    assert z == pytest.approx(gaussian_multiplier(12))
    assert tol[0].tolist() == pytest.approx([z * 0.01, z * 0.01, 0.0])


def _runs(logits: torch.Tensor, tokens: list[int]) -> ReferenceRuns:
    return ReferenceRuns(prompts=[[1, 2]], tokens=[tokens], logits=[logits], model_dtype_logits=[logits])


def test_judge_engine_accepts_rounding_and_near_ties_only():
    ref = torch.tensor([[1.0, 0.0, -1.0], [0.50, 0.49, 0.0]])  # step 1: a near-tie (margin 0.01)
    runs = _runs(ref, [0, 0])
    tol = [torch.tensor([0.02, 0.02])]
    small = ref + torch.tensor([[0.01, -0.01, 0.0], [-0.006, 0.006, 0.0]])  # step 1 flips: a near-tie
    [ok] = judge_engine(runs, [small], [[0, 1]], tol)
    assert ok.passed and ok.worst_ratio == pytest.approx(0.5, rel=1e-4)
    assert [d["step"] for d in ok.teacher_forced_divergences] == [1] and ok.teacher_forced_divergences[0]["near_tie"]
    assert ok.greedy_first_divergence == 1
    [far] = judge_engine(runs, [ref + torch.tensor([[0.0, 0.05, 0.0], [0.0, 0.0, 0.0]])], [[0, 0]], tol)
    assert not far.passed and far.worst_ratio == pytest.approx(2.5, rel=1e-4)
    # a flip at a clear preference (margin 0.1 against a tolerance of 0.02) is no near-tie
    clear = torch.tensor([[1.0, 0.9, 0.0], [0.5, 0.49, 0.0]])
    [flip] = judge_engine(_runs(clear, [0, 0]), [clear + torch.tensor([[0.0, 0.11, 0.0], [0.0, 0.0, 0.0]])],
                          [[1, 0]], tol)
    assert not flip.passed and not flip.teacher_forced_divergences[0]["near_tie"]
    # the engine's own greedy run may diverge only where its teacher-forced argmax does, or at a
    # near-tie of the reference between its token and the engine's (the decode path rounds otherwise)
    [late] = judge_engine(runs, [ref], [[0, 2]], tol)
    assert not late.passed and not late.greedy_divergence["near_tie"]
    assert late.greedy_divergence["reference_margin"] == pytest.approx(0.5)
    [decoded] = judge_engine(runs, [ref], [[0, 1]], tol)
    assert decoded.passed and not decoded.teacher_forced_divergences
    assert decoded.greedy_divergence == {"step": 1, "reference": 0, "engine": 1, "near_tie": True,
                                         "reference_margin": pytest.approx(0.01), "tolerance": pytest.approx(0.02)}
    with pytest.raises(ValueError):
        judge_engine(runs, [ref[:1]], [[0, 0]], tol)


def test_a_step_at_a_routing_near_tie_is_reported_not_judged():
    ref = torch.tensor([[1.0, 0.9, 0.0], [1.0, 0.0, 0.0]])
    runs = _runs(ref, [0, 0])
    jump = ref + torch.tensor([[0.0, 0.2, 0.0], [0.0, 0.0, 0.0]])  # another expert at step 0
    tol = [torch.tensor([0.02, 0.02])]
    [judged] = judge_engine(runs, [jump], [[1, 0]], tol)
    assert not judged.passed
    [tie] = judge_engine(runs, [jump], [[1, 0]], tol, [{0: [1]}])
    assert tie.passed and tie.routing_tie_steps[0]["layers"] == [1]
    assert tie.routing_tie_steps[0]["max_abs_dlogit"] == pytest.approx(0.2, rel=1e-4)
    assert tie.teacher_forced_divergences[0]["routing_tie"] and tie.max_abs_dlogit == 0.0
    # with the reference's other routing outcome of that step, the step is judged against it
    [alt] = judge_engine(runs, [jump], [[1, 0]], tol, [{0: [1]}], [{0: [jump[0] + 0.01]}])
    assert alt.passed and alt.routing_tie_steps[0]["closest_outcome_dlogit"] == pytest.approx(0.01, rel=1e-3)
    assert alt.worst_step == 0 and alt.worst_ratio == pytest.approx(0.5, rel=1e-3)
    [wrong] = judge_engine(runs, [jump], [[1, 0]], tol, [{0: [1]}], [{0: [jump[0] + 0.1]}])
    assert not wrong.passed
    # the other steps are still judged
    [still] = judge_engine(runs, [jump + torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.05, 0.0]])], [[1, 0]], tol, [{0: [1]}])
    assert not still.passed and still.worst_step == 1


class _Router(torch.nn.Module):
    pass


def test_routing_margin_of_softmax_and_grouped_sigmoid_routers():
    logits = torch.tensor([[3.0, 2.0, 1.9, 0.0], [1.0, 1.0, 0.0, -1.0]])
    chosen = torch.tensor([[0, 1], [1, 0]])
    assert routing_margin(_Router(), logits, chosen).tolist() == pytest.approx([0.1, 1.0])
    # measured against a selection the scores no longer make: negative
    assert float(routing_margin(_Router(), logits, torch.tensor([[0, 2], [0, 1]]))[0]) == pytest.approx(-0.1)
    # DeepSeek-V3: sigmoid + bias, two groups of two, one group chosen
    grouped = _Router()
    grouped.e_score_correction_bias = torch.zeros(4)
    grouped.num_group = 2
    logits = torch.tensor([[2.0, 1.0, 0.0, -2.0]])
    margin = routing_margin(grouped, logits, torch.tensor([[0, 1]]))
    s = logits.sigmoid()[0]
    # only the chosen group's experts are selected, so the group margin decides
    assert float(margin) == pytest.approx(float((s[0] + s[1]) - (s[2] + s[3])))


def test_the_other_routing_of_a_tied_token():
    from wna16ctl.verification.engine_reference import _swapped_routing

    router = _Router()
    logits = torch.tensor([3.0, 2.0, 1.99, 0.0])
    selected, weights = _swapped_routing(router, logits, torch.zeros(2), torch.tensor([0, 1]))
    assert selected.tolist() == [0, 2]
    p = logits.softmax(-1)
    assert weights.tolist() == pytest.approx((p[[0, 2]] / p[[0, 2]].sum()).tolist())  # renormalised (Mixtral)
    router.norm_topk_prob = False  # Qwen2-MoE: the raw softmax share
    _, weights = _swapped_routing(router, logits, torch.zeros(2), torch.tensor([0, 1]))
    assert weights.tolist() == pytest.approx(p[[0, 2]].tolist())
    grouped = _Router()
    grouped.e_score_correction_bias = torch.zeros(4)
    grouped.num_group, grouped.norm_topk_prob, grouped.routed_scaling_factor = 2, True, 2.5
    # top-2 fills its one chosen group: the tie can only be between groups, which is not recomputed
    assert _swapped_routing(grouped, torch.tensor([2.0, 1.0, 0.0, -2.0]), torch.zeros(2), torch.tensor([0, 1])) is None
    grouped.num_group = 1
    selected, weights = _swapped_routing(grouped, torch.tensor([2.0, 1.0, 0.99, -2.0]), torch.zeros(2), torch.tensor([0, 1]))
    s = torch.tensor([2.0, 0.99]).sigmoid()
    assert selected.tolist() == [0, 2] and weights.tolist() == pytest.approx((2.5 * s / s.sum()).tolist())


def test_routing_ties_threshold_from_the_model_dtype_run():
    margins = torch.tensor([[0.5, 0.0005, 0.3, 0.2]])  # one layer, four steps
    moved = margins + torch.tensor([[0.0002, -0.0002, 0.0002, -0.0002]])
    runs = ReferenceRuns(prompts=[[1]], tokens=[[0, 0, 0, 0]], logits=[torch.zeros(4, 3)],
                         model_dtype_logits=[torch.zeros(4, 3)], margins=[margins], model_dtype_margins=[moved])
    ties, z = routing_ties(runs)
    assert z == pytest.approx(gaussian_multiplier(4))
    assert ties == [{1: [0]}]  # 0.0005 < z · 0.0002 (z = 3.66); 0.2 is not


def test_engine_layer_outputs_sum_the_residual_of_a_vllm_decoder_layer(tmp_path):
    h, r = torch.randn(3, 4), torch.randn(3, 4)
    torch.save({"output": h, "residual": r}, tmp_path / "model.layers.0.pt")
    torch.save({"output": h}, tmp_path / "model.layers.0.self_attn.pt")
    torch.save({"output": r}, tmp_path / "model.layers.0.block_sparse_moe.pt")
    torch.save({"output": h, "residual": r}, tmp_path / "model.norm.pt")
    torch.save({"output": h[:, :2]}, tmp_path / "model.layers.0.block_sparse_moe.gate.pt")
    got = engine_layer_outputs(tmp_path)
    assert set(got) == {"layers.0.stream", "layers.0.attention", "layers.0.moe", "layers.0.router", "norm"}
    assert torch.equal(got["layers.0.stream"], h + r)
    assert torch.equal(got["layers.0.moe"], r) and torch.equal(got["norm"], h)
