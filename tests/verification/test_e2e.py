"""`verify --e2e`: greedy generation with the source experts and with the repacked ones.

Small demos (hidden 128, 4 experts, one MoE layer, a GSM8K-trained tokenizer) and short runs
(2 prompts × 8 tokens) keep this file fast; the faults are planted in the repacked output the way
a buggy repack would write them (manifest hashes rewritten to match)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import wna16ctl.verification.e2e as e2e_mod
from tests.verification import faults
from tests.conftest import ACT_ORDER_RELEASE, MIXTRAL_NAMES_RELEASE, QUESTIONS, QUESTIONS_ALONE
from tests.verification.test_checks import patch, read, rehash
from wna16ctl.sources import open_checkpoint
from wna16ctl.sources.tensors import TensorReader
from wna16ctl.cli import cli
from wna16ctl.verification.e2e import E2EOptions, gsm8k_answer
from wna16ctl.layout.marlin import marlin_permute_scales, marlin_unpermute_scales
from wna16ctl.layout.packing import pack_codes, unpack_codes
from wna16ctl.layout.rank import build_expert_tensors
from wna16ctl.repacking.pipeline import RepackSettings, plan_repack, run_repack
from wna16ctl.verification.checks import verify_output

pytest.importorskip("transformers")

SMALL = dict(num_layers=1, num_experts=4, hidden_size=128, intermediate_size=128, group_size=32,
             vocab_size=320, tokenizer=True)
OPTS = E2EOptions(prompts=2, max_new_tokens=8)
FAST = E2EOptions(prompts=1, max_new_tokens=4)  # a fault is judged at every block call: one short prompt shows it
H, I = 128, 128


@pytest.fixture(scope="module")
def outputs(make_ckpt, tmp_path_factory):
    """(spec name, settings name) -> (checkpoint, pristine repack output)."""
    made: dict[tuple[str, str], tuple[Path, Path]] = {}
    specs = {
        "qwen3": SMALL,
        "g128": dict(SMALL, hidden_size=256, intermediate_size=256, group_size=128),  # I_p == group_size
        "mixtral": dict(SMALL, arch="mixtral"),
        "qwen2_moe": dict(SMALL, arch="qwen2_moe"),
        "deepseek_v3": dict(SMALL, arch="deepseek_v3", num_layers=2),
        "actorder": dict(SMALL, actorder="group"),
        "asym": dict(SMALL, symmetric=False),
        "mixtral_asym": dict(SMALL, arch="mixtral", symmetric=False),
        "qwen3_16e": dict(SMALL, num_experts=16),  # some experts are rarely routed
        "int8": dict(SMALL, num_bits=8),
    }
    # act-order is in the specs: plan for the newest release that still loads it
    settings = {"tp2": RepackSettings(tp=2, vllm=ACT_ORDER_RELEASE),
                "ep2": RepackSettings(tp=2, ep=True, vllm=ACT_ORDER_RELEASE)}

    def get(spec: str, setting: str = "tp2") -> tuple[Path, Path]:
        if (spec, setting) not in made:
            ck = make_ckpt(**specs[spec])
            out = tmp_path_factory.mktemp(f"e2e-{spec}-{setting}") / "out"
            chosen = settings[setting]
            if specs[spec].get("arch") == "mixtral":
                chosen = dataclasses.replace(chosen, vllm=MIXTRAL_NAMES_RELEASE)
            run_repack(plan_repack(ck, chosen), out)
            made[spec, setting] = (ck, out)
        return made[spec, setting]

    return get


def copy_output(out: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "out"
    shutil.copytree(out, dst)
    return dst


def e2e(ck: Path, out: Path, opts: E2EOptions = OPTS, samples: Path = QUESTIONS_ALONE):
    report = verify_output(ck, out, samples=samples, num_samples=4, e2e=opts)
    assert report.e2e is not None
    return report


def assert_caught(report) -> None:
    """The fault fails the e2e check by itself: MoE block outputs outside their rounding interval."""
    res = report.e2e
    assert not report.passed and res.status == "FAIL", res.to_json()
    assert res.block_violations > 0 and res.max_error_over_bound > 1
    bad = next(lay for lay in res.layers if lay.violations)
    assert bad.layer in res.reason and "outside the rounding interval" in res.reason
    doc = res.to_json()
    assert doc["block_violations"] == res.block_violations and doc["status"] == "FAIL"
    print(f"caught: {res.block_violations} elements out, max error {res.max_error_over_bound:.3g} × the bound")


# ---- correct repacks agree token for token ----------------------------------------------------------------


@pytest.mark.parametrize("setting", ["tp2", "ep2"])
def test_correct_repack_agrees(outputs, setting):
    report = e2e(*outputs("qwen3", setting))
    res = report.e2e
    assert report.passed and res.status == "pass", res.to_json()
    assert len(res.prompts) == 2 and res.tokens_generated == res.tokens_agreeing > 0
    assert res.model == "Qwen3MoeForCausalLM" and res.prompt_form.startswith("zero-shot")  # the questions alone
    assert "on the CPU emulation" in res.kernel and "v2 ×" in res.kernel  # the kernel source ran, not the twin
    assert res.block_violations == 0 and res.max_error_over_bound <= 1
    (lay,) = res.layers
    assert lay.calls >= 2 and lay.exact_elements > 0 and lay.elements > lay.exact_elements
    ex = res.to_json()["experts_exercised"]
    assert ex["exercised"] == ex["experts"] == 4 and ex["routed"] + ex["forced"] == 4
    for c in res.prompts:
        assert c.first_divergence is None and c.reference_tokens == c.candidate_tokens
        assert len(c.max_abs_dlogit) == len(c.bound) == len(c.kl) == len(c.reference_tokens)
        assert all(b > 0 for b in c.bound)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "deepseek_v3", "actorder", "asym", "int8"])
def test_other_architectures_and_schemes_agree(outputs, arch):
    report = e2e(*outputs(arch), E2EOptions(prompts=1, max_new_tokens=6))
    res = report.e2e
    assert report.passed and res.status == "pass", res.to_json()
    assert res.tokens_generated == res.tokens_agreeing > 0


def test_chat_template_prompts(outputs, tmp_path):
    ck, out = outputs("qwen3")
    other = tmp_path / "ck"
    shutil.copytree(ck, other)
    cfg_path = other / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = ("{% for m in messages %}<|begin_of_text|>{{ m['content'] }}\n{% endfor %}"
                            "{% if add_generation_prompt %}Answer:{% endif %}")
    cfg_path.write_text(json.dumps(cfg))
    report = verify_output(other, out, samples=QUESTIONS, num_samples=4, e2e=E2EOptions(prompts=1, max_new_tokens=4))
    res = report.e2e
    assert res.status == "pass" and res.prompt_form == "chat template", res.to_json()
    few_shot = e2e_mod._build_prompts(ck, QUESTIONS, 1, 320)
    assert few_shot.form.startswith("few-shot")
    assert 0 < res.prompts[0].prompt_tokens < len(few_shot.ids[0]) / 2  # the question alone, no worked examples


# ---- planted faults ---------------------------------------------------------------------------------------


def _expert_use(ck: Path, out: Path, monkeypatch, samples: Path = QUESTIONS_ALONE, opts: E2EOptions = OPTS) -> torch.Tensor:
    """How often the reference run routes to each expert (counted on a pristine run)."""
    counts = torch.zeros(64, dtype=torch.long)
    real = e2e_mod._ReferenceExperts.__call__

    def counting(self, a, ids, w):
        counts.add_(torch.bincount(ids.reshape(-1).cpu(), minlength=64))
        return real(self, a, ids, w)

    monkeypatch.setattr(e2e_mod._ReferenceExperts, "__call__", counting)
    assert e2e(ck, out, opts, samples=samples).passed
    monkeypatch.setattr(e2e_mod._ReferenceExperts, "__call__", real)
    return counts


def test_flipped_nibble_in_frequently_routed_expert_w13(outputs, tmp_path, monkeypatch):
    ck, pristine = outputs("qwen3")
    expert = int(_expert_use(ck, pristine, monkeypatch).argmax())
    out = copy_output(pristine, tmp_path)
    # A buggy repack flips the top bit of one gate_proj code: the one whose group has the largest
    # scale in rank 0's rows (a flip of 8 quantisation steps there moves the weight most).
    job = plan_repack(ck, RepackSettings(tp=2)).jobs[0]
    spec = job.specs[0]
    c = open_checkpoint(ck)
    with TensorReader(c.files) as reader:
        ex = reader.read_expert(c.layers[0], expert)
    scale = ex["gate"]["weight_scale"][: spec.intermediate_per_partition].float()
    row, group = divmod(int(scale.argmax()), scale.shape[1])
    codes = unpack_codes(ex["gate"]["weight_packed"], 4, dim=1)
    codes[row, group * 32] ^= 8
    ex["gate"]["weight_packed"] = pack_codes(codes, 4, dim=1)
    bad = build_expert_tensors(ex, spec, expert_id=expert, scale_dtype=torch.bfloat16)
    w13 = read(out, 0, "w13_weight_packed")
    assert (w13[expert] != bad["w13_weight_packed"]).sum() == 1  # one word, one nibble
    w13[expert] = bad["w13_weight_packed"]
    patch(out, 0, "w13_weight_packed", w13)
    rehash(out)
    assert_caught(e2e(ck, out, FAST))


def test_swapped_w2_scale_groups(outputs, tmp_path):
    ck, pristine = outputs("qwen3")
    out = copy_output(pristine, tmp_path)
    s = read(out, 1, "w2_weight_scale")  # [E, I_p / 32 = 2 groups, H]
    assert s.shape[1] == 2
    s[:, [0, 1]] = s[:, [1, 0]].clone()
    patch(out, 1, "w2_weight_scale", s)
    rehash(out)
    assert_caught(e2e(ck, out, FAST))


def test_w13_scales_with_engine_size_k_quirk(outputs, tmp_path):
    # vllm PR #50196: size_k = I_p (128) == group_size gives the grouped w13 scales the
    # channel-wise permutation
    ck, pristine = outputs("g128")
    out = copy_output(pristine, tmp_path)
    p, gs, h = 128, 128, 256
    for r in range(2):
        s = read(out, r, "w13_weight_scale")
        quirk = torch.stack([marlin_permute_scales(marlin_unpermute_scales(s[e], h, 2 * p, gs), p, 2 * p, gs)
                             for e in range(s.shape[0])])
        assert not quirk.equal(s)
        patch(out, r, "w13_weight_scale", quirk)
    rehash(out)
    assert_caught(e2e(ck, out, FAST))


# ---- the four faults a fixed bound missed: each fails e2e by itself ------------------------------------------



def test_zero_point_off_by_one_asymmetric_mixtral(outputs, tmp_path):
    ck, pristine = outputs("mixtral_asym")
    out = copy_output(pristine, tmp_path)
    faults.zero_point_off_by_one(ck, out, RepackSettings(tp=2, vllm=MIXTRAL_NAMES_RELEASE))
    assert_caught(e2e(ck, out, FAST))


def test_flipped_code_in_rarely_routed_expert(outputs, tmp_path, monkeypatch):
    # The few-shot prompts (4× the tokens of the questions alone): a one-step flip moves an output by
    # less than its rounding interval for most tokens, and the rare expert must see enough of them.
    ck, pristine = outputs("qwen3_16e")
    use = _expert_use(ck, pristine, monkeypatch, samples=QUESTIONS, opts=FAST)[:16]
    rare = int(torch.where(use > 0, use, 1 << 40).argmin())
    assert use[rare] < use.sum() / 32  # rarely routed: under half its fair share
    out = copy_output(pristine, tmp_path)
    faults.flipped_code(ck, out, RepackSettings(tp=2, vllm=ACT_ORDER_RELEASE), rare)
    assert_caught(e2e(ck, out, FAST, samples=QUESTIONS))


def test_swapped_marlin_scale_columns(outputs, tmp_path):
    ck, pristine = outputs("qwen3")
    out = copy_output(pristine, tmp_path)
    faults.swapped_scale_columns(ck, out, RepackSettings(tp=2, vllm=ACT_ORDER_RELEASE))
    assert_caught(e2e(ck, out, FAST))


def test_w13_gate_up_half_swap(outputs, tmp_path):
    ck, pristine = outputs("qwen3")
    out = copy_output(pristine, tmp_path)
    faults.gate_up_swapped(ck, out, RepackSettings(tp=2, vllm=ACT_ORDER_RELEASE))
    assert_caught(e2e(ck, out, FAST))


def _never_route(monkeypatch, expert: int, instead: int) -> None:
    """Every run (reference, candidate, bound) routes `expert`'s slots to `instead`."""
    real = e2e_mod._ExpertsModule.forward

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return real(self, hidden_states, torch.where(top_k_index == expert, instead, top_k_index), top_k_weights)

    monkeypatch.setattr(e2e_mod._ExpertsModule, "forward", forward)


def test_unrouted_expert_is_run_on_the_forced_pass(outputs, tmp_path, monkeypatch):
    ck, pristine = outputs("qwen3")
    _never_route(monkeypatch, 3, 0)
    res = e2e(ck, pristine, FAST).e2e
    assert res.status == "pass", res.to_json()
    (lay,) = res.layers
    assert 3 not in lay.routed and lay.forced == [3] and lay.exercised == 4
    assert res.to_json()["experts_exercised"]["per_layer"][lay.layer]["forced"] == [3]
    # a fault in that expert is seen by the forced pass alone
    out = copy_output(pristine, tmp_path)
    faults.flipped_code(ck, out, RepackSettings(tp=2, vllm=ACT_ORDER_RELEASE), 3)
    res = e2e(ck, out, FAST).e2e
    (lay,) = res.layers
    assert res.status == "FAIL" and lay.forced_violations == lay.violations > 0, res.to_json()
    assert lay.first_violation == "forced routing"


# ---- the token criterion and the score ------------------------------------------------------------------------


def _logits(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def test_divergence_at_a_near_tie_passes_with_its_figures():
    plain = _logits([[3.0, 1.0, 0.0], [2.0, 1.99, 0.0]])
    cand = _logits([[3.0, 1.0, 0.0], [1.99, 2.0, 0.0]])
    c = e2e_mod.compare_runs(0, 5, [0, 0], plain, cand, torch.tensor([0.01, 0.01]))
    assert c.first_divergence == 1 and c.near_tie and c.passed
    assert c.reference_top2_margin == pytest.approx(0.01, abs=1e-6) and c.candidate_tokens == [0, 1]


def test_divergence_with_a_clear_margin_fails():
    plain = _logits([[3.0, 1.0, 0.0], [2.0, 1.5, 0.0]])
    cand = _logits([[3.0, 1.0, 0.0], [1.0, 2.0, 0.0]])
    c = e2e_mod.compare_runs(0, 5, [0, 0], plain, cand, torch.tensor([0.01, 0.01]))
    assert c.first_divergence == 1 and not c.near_tie and not c.passed
    assert c.reference_top2_margin == pytest.approx(0.5) and c.agree_prefix == 1


def _scored(ref: str | None, cand: str | None, gold: str | None):
    c = e2e_mod.PromptComparison(0, 1, [1], [1], 1, 1, None, [0.0], [0.0], [0.1])
    c.reference_answer, c.candidate_answer, c.gold_answer = ref, cand, gold
    return c


def test_score_is_not_meaningful_when_the_reference_rarely_answers():
    s = e2e_mod.score_summary([_scored(None, None, "3"), _scored(None, None, "4"), _scored("7", "7", "5")])
    assert not s["meaningful"] and "1 of 3" in s["note"]
    assert s["both_answered"] == 1 and s["answers_agree"] == 1.0  # "no answer" = "no answer" is not agreement
    assert s["prompts_with_gold_answer"] == 3 and s["reference_answered"] == s["candidate_answered"] == 1


def test_score_counts_agreement_only_where_both_answered():
    s = e2e_mod.score_summary([_scored("3", "3", "3"), _scored("4", None, "4"), _scored("5", "6", None)])
    assert s["meaningful"] and s["both_answered"] == 2 and s["answers_agree"] == 0.5
    assert s["reference_exact_match"] == 1.0 and s["candidate_exact_match"] == 0.5


def test_without_g_plus_plus_e2e_is_not_run(outputs, monkeypatch):
    import wna16ctl.native.emulated as emulated

    ck, out = outputs("qwen3")
    monkeypatch.setattr(emulated, "_state", {})
    monkeypatch.setattr(emulated, "find_cxx", lambda: None)
    report = e2e(ck, out, FAST)
    assert report.e2e.status == "not run" and "no C++ compiler" in report.e2e.reason
    assert not report.passed


# ---- not run ----------------------------------------------------------------------------------------------


def test_unsupported_architecture_is_not_run(outputs, tmp_path):
    ck, out = outputs("qwen3")
    other = tmp_path / "ck"
    shutil.copytree(ck, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["model_type"] = "olmoe"
    (other / "config.json").write_text(json.dumps(cfg))
    report = e2e(other, out)
    assert report.e2e.status == "not run" and not report.passed
    assert "'olmoe' is not supported for --e2e" in report.e2e.reason
    assert "\n" not in report.e2e.reason


def test_part_output_gives_not_run_never_null(outputs, tmp_path):
    ck, _ = outputs("qwen3")
    part = tmp_path / "part"
    run_repack(plan_repack(ck, RepackSettings(tp=2)), part, ranks=[1])
    report = e2e(ck, part, FAST)
    assert report.e2e.status == "not run" and "needs every rank" in report.e2e.reason
    assert report.to_json()["e2e"]["status"] == "not run" and not report.passed


def test_missing_transformers_is_one_line_exit_2(outputs, monkeypatch):
    ck, out = outputs("qwen3")
    monkeypatch.setitem(sys.modules, "transformers", None)
    res = CliRunner().invoke(cli, ["verify", str(ck), str(out), "--samples", str(QUESTIONS_ALONE), "--e2e"])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "pip install 'wna16ctl[e2e]'" in lines[0] and "Traceback" not in res.output


def test_a_bad_checkpoint_is_named_before_missing_transformers(outputs, tmp_path, monkeypatch):
    """The inputs in the order a user fixes them (docs/verify.md): a broken checkpoint or output is
    said first, then what the environment lacks for --e2e."""
    ck, out = outputs("qwen3")
    monkeypatch.setitem(sys.modules, "transformers", None)
    not_ckpt = tmp_path / "not-a-checkpoint"
    not_ckpt.mkdir()
    res = CliRunner().invoke(cli, ["verify", str(not_ckpt), str(out), "--samples", str(QUESTIONS_ALONE), "--e2e"])
    assert res.exit_code == 2 and "config.json" in res.stderr and "wna16ctl[e2e]" not in res.stderr, res.stderr
    res = CliRunner().invoke(cli, ["verify", str(ck), str(tmp_path / "no-output"), "--samples", str(QUESTIONS_ALONE),
                                   "--e2e"])
    assert res.exit_code == 2 and "no-output" in res.stderr and "wna16ctl[e2e]" not in res.stderr, res.stderr


# ---- CLI ----------------------------------------------------------------------------------------------------


def test_cli_e2e_json_and_rendering(outputs):
    ck, out = outputs("qwen3")
    args = ["verify", str(ck), str(out), "--samples", str(QUESTIONS_ALONE), "--num-samples", "4",
            "--e2e", "--prompts", "1", "--max-new-tokens", "4", "--score"]
    res = CliRunner().invoke(cli, args + ["--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    e = doc["e2e"]
    assert doc["passed"] and e["status"] == "pass" and e["agreement"] == 1.0
    assert e["tokens_generated"] == 4 and len(e["prompts"]) == 1
    assert set(e["score"]) >= {"reference_exact_match", "candidate_exact_match"}
    first = json.loads(QUESTIONS_ALONE.read_text(encoding="utf-8").splitlines()[0])
    assert e["prompts"][0]["gold_answer"] == first["answer"].split("#### ")[-1]  # the first question's answer
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    assert "end to end" in res.stdout and "4/4 tokens agree" in res.stdout


def test_without_e2e_the_key_is_null(outputs):
    ck, out = outputs("qwen3")
    res = CliRunner().invoke(cli, ["verify", str(ck), str(out), "--samples", str(QUESTIONS_ALONE), "--num-samples", "4",
                                   "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["e2e"] is None


def test_e2e_options_without_e2e_are_a_usage_error(outputs):
    ck, out = outputs("qwen3")
    res = CliRunner().invoke(cli, ["verify", str(ck), str(out), "--prompts", "2", "--score"])
    assert res.exit_code == 2 and "--prompts, --score only apply with --e2e" in res.stderr, res.output


@pytest.mark.parametrize("text,number", [
    ("so 5 + 3 = 8\n#### 8", "8"), ("#### 1,250", "1250"), ("the answer is 42.", "42"), ("x 3.50 y", "3.5"),
    ("no digits", None), ("", None),
])
def test_gsm8k_answer(text, number):
    assert gsm8k_answer(text) == number


def test_rank_partials_round_each_rank_before_the_all_reduce():
    """TP 2 of a row-parallel layer: each rank's partial is rounded to bf16, then the partials are
    summed. 256 + 1 on rank 0 rounds to 256 (a tie, to even) and the sum 256 + 1 again to 256,
    where TP 1 rounds the exact 258 to itself."""
    from wna16ctl.verification.e2e import _RankPartials

    linear = torch.nn.Linear(4, 1, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        linear.weight.fill_(1)
    x = torch.tensor([[256.0, 1.0, 1.0, 0.0]], dtype=torch.bfloat16)
    with torch.no_grad():
        assert float(_RankPartials(linear, 1)(x)) == 258
        assert float(_RankPartials(linear, 2)(x)) == 256
    with pytest.raises(Exception, match="does not split into 3 ranks"):
        _RankPartials(linear, 3)
