"""verify at the sizes users have: the exactness proof alone (`--no-numerics`), and memory that
does not grow with a layer's experts (counted, not timed: the dequantised expert weights alive when
a layer is judged)."""

from __future__ import annotations

import gc
import json
import weakref

import pytest
from click.testing import CliRunner

import wna16ctl
import wna16ctl.verification.checks as verify_mod
from tests.conftest import QUESTIONS
from tests.verification.test_checks import outputs, patch, read, rehash  # noqa: F401 - pytest fixtures, found by name
from tests.repacking.test_pipeline import ckpt, one_torch_thread  # noqa: F401 - pytest fixtures, found by name
from wna16ctl.cli import cli
from wna16ctl.verification.checks import NOT_RUN, verify_output


def test_no_numerics_proves_exactness_without_samples(outputs, tmp_path):
    """The exactness proof alone reads no samples (a missing file is no error), passes on a good
    output, and says the numerics did not run."""
    ck, out = outputs("g128")
    report = verify_output(ck, out, samples=tmp_path / "missing.jsonl", numerics=False)
    assert report.passed and report.ok("manifest") and report.ok("round_trip")
    numerics = report.check("numerics")
    assert numerics.status == NOT_RUN and not numerics.required and "--no-numerics" in numerics.reason
    assert report.numerics == [] and report.to_json()["numerics_asked"] is False
    assert report.experts_checked > 0


def test_no_numerics_still_finds_a_planted_fault(outputs, tmp_path):
    """A flipped nibble that a buggy repack re-hashed is found by the round trip alone."""
    import shutil

    ck, pristine = outputs("g128")
    out = tmp_path / "out"
    shutil.copytree(pristine, out)
    w2 = read(out, 1, "w2_weight_packed")
    w2.view(-1, w2.shape[-1])[2 * w2.shape[1] + 3, 17] ^= 0xF0  # expert 2, one nibble
    patch(out, 1, "w2_weight_packed", w2)
    rehash(out)
    report = verify_output(ck, out, numerics=False)
    assert not report.passed
    bad = report.by_check("round_trip")
    assert bad and all(f.expert == 2 for f in bad)


def test_cli_no_numerics_says_exactness_only(outputs):
    ck, out = outputs("g128")
    res = CliRunner().invoke(cli, ["verify", str(ck), str(out), "--no-numerics"])
    assert res.exit_code == 0, res.output
    assert "exactness only: numerics not run, --no-numerics" in res.output
    res = CliRunner().invoke(cli, ["verify", str(ck), str(out), "--no-numerics", "--json"])
    assert json.loads(res.output)["numerics_asked"] is False
    res = CliRunner().invoke(cli, ["verify", str(ck), str(out), "--no-numerics", "--e2e"])
    assert res.exit_code == 2 and "--no-numerics" in res.output


def test_reference_weights_are_not_kept_across_experts(outputs, monkeypatch):
    """When a layer's output is judged, the dequantised reference weights of its experts are no
    longer alive: the layer's memory does not grow with its experts (before, every expert's stayed
    until the layer was judged)."""
    made: list[weakref.ref] = []
    real_dequantize, real_judge = verify_mod._dequantize_kfirst, verify_mod.judge
    alive_at_judge: list[int] = []

    def dequantize(*args, **kwargs):
        t = real_dequantize(*args, **kwargs)
        made.append(weakref.ref(t))
        return t

    def judge(*args, **kwargs):
        gc.collect()
        alive_at_judge.append(sum(r() is not None for r in made))
        return real_judge(*args, **kwargs)

    monkeypatch.setattr(verify_mod, "_dequantize_kfirst", dequantize)
    monkeypatch.setattr(verify_mod, "judge", judge)
    ck, out = outputs("g128")
    report = verify_output(ck, out, samples=QUESTIONS, num_samples=8)
    assert report.passed
    experts = report.experts_checked
    assert experts >= 4 and len(made) >= 2 * experts  # every expert's weights were made
    assert alive_at_judge and max(alive_at_judge) <= 2, alive_at_judge


def test_pad_no_numerics_is_the_tensor_proof_alone(make_ckpt, tmp_path):
    from tests.padding.test_pad import SMALL

    src = make_ckpt(**SMALL)
    wna16ctl.pad(src, tmp_path / "p", to=256)
    proof = wna16ctl.verify(src, tmp_path / "p", numerics=False)
    assert proof.passed and proof.tensors_padded and proof.layers == []
    assert any(line.startswith("NOT RUN numerics: not asked (--no-numerics)") for line in proof.lines())
    assert proof.to_json()["numerics_asked"] is False


@pytest.mark.filterwarnings("ignore::FutureWarning")  # gc.get_objects meets torch's deprecated aliases
def test_pad_numerics_keep_one_expert_at_a_time(make_ckpt, tmp_path, monkeypatch):
    """The padding proof's numerics hold one expert's dequantised weights at a time: when the layer
    is judged, no expert weight (K-first w13 [H, 2I] or w2 [I, H], of either checkpoint) is alive
    (before, every routed expert's, of both checkpoints)."""
    import torch

    import wna16ctl.verification.bounds as bounds_mod
    from tests.padding.test_pad import SMALL

    h, i = SMALL["hidden_size"], SMALL["intermediate_size"]
    shapes = {(h, 2 * n) for n in (i, 256)} | {(n, h) for n in (i, 256)}
    alive_at_judge: list[int] = []
    real_judge = bounds_mod.judge

    def judge(*args, **kwargs):
        gc.collect()
        alive_at_judge.append(len({o.untyped_storage().data_ptr() for o in gc.get_objects()
                                   if isinstance(o, torch.Tensor) and o.dtype == torch.bfloat16
                                   and tuple(o.shape) in shapes}))  # views of one tensor count once
        return real_judge(*args, **kwargs)

    src = make_ckpt(**SMALL)
    wna16ctl.pad(src, tmp_path / "p", to=256)
    monkeypatch.setattr(bounds_mod, "judge", judge)
    proof = wna16ctl.verify(src, tmp_path / "p", samples=QUESTIONS, num_samples=4)
    assert proof.passed and proof.layers
    # the activations and the two outputs [T, H] may share a shape (3); the weights of 4 experts × 2
    # checkpoints kept would add 16
    assert alive_at_judge and max(alive_at_judge) <= 3, alive_at_judge


def test_report_says_what_the_numerics_covered(outputs):
    """The coverage of the numerics, in the JSON and on the screen: layers, experts, tokens."""
    ck, out = outputs("g128")
    res = CliRunner().invoke(cli, ["verify", str(ck), str(out), "--samples", str(QUESTIONS), "--num-samples", "4",
                                   "--json"])
    cov = json.loads(res.output)["numerics_coverage"]
    rows = json.loads(res.output)["numerics"]
    assert cov["layers"] == cov["layers_checked"] == len(rows) >= 1
    assert cov["experts_exercised"] == sum(r["experts_exercised"] for r in rows) > 0
    assert cov["tokens"] == sum(r["tokens"] for r in rows) > 0
    res = CliRunner().invoke(cli, ["verify", str(ck), str(out), "--samples", str(QUESTIONS), "--num-samples", "4"])
    assert (f"numerics covered {cov['layers']} of {cov['layers_checked']} MoE layer" in res.output
            and f"{cov['tokens']} tokens" in res.output), res.output


def _small_budget(monkeypatch, tokens: int, hidden: int) -> None:
    """A numerics memory budget that holds `tokens` tokens of one rank at a time at `hidden`."""
    import wna16ctl.verification.bounds as bounds_mod

    per = getattr(bounds_mod, "LAYER_BYTES_PER_ELEMENT", 56) + getattr(bounds_mod, "RANK_BYTES_PER_ELEMENT", 40)
    monkeypatch.setattr(bounds_mod, "NUMERICS_MEMORY", tokens * hidden * per, raising=False)


def test_numerics_tokens_are_capped_by_the_memory_budget(outputs, monkeypatch):
    """Past the budget the numerics run on fewer tokens (every expert still exercised) and say how
    many of the samples' tokens they left out; the layer still passes (before, every token ran)."""
    from wna16ctl.sources import open_checkpoint

    ck, out = outputs("g128")
    hidden = open_checkpoint(ck).quantized_layers[0].hidden_size
    full = verify_output(ck, out, samples=QUESTIONS, num_samples=8)
    assert full.passed and all(n.capped_tokens == 0 for n in full.numerics)
    cap = 40
    _small_budget(monkeypatch, cap, hidden)
    report = verify_output(ck, out, samples=QUESTIONS, num_samples=8)
    assert report.passed, [n.to_json() for n in report.numerics]
    for n, f in zip(report.numerics, full.numerics):
        assert n.tokens <= cap < f.tokens and n.capped_tokens > 0
        assert n.experts_exercised == n.num_experts
    assert "capped_tokens" in report.to_json()["numerics"][0]


def test_numerics_map_large_allocations(outputs, monkeypatch):
    """A verify with numerics has malloc map its large blocks (`checks.map_large_allocations`, held
    by the next test); the exactness proof alone leaves malloc as it is."""
    calls: list[int] = []
    monkeypatch.setattr(verify_mod, "map_large_allocations", lambda: calls.append(1) or True)
    ck, out = outputs("g128")
    assert verify_output(ck, out, numerics=False).passed and not calls
    assert verify_output(ck, out, samples=QUESTIONS, num_samples=2).passed and calls == [1]


# In a new process: a 24 MiB block freed, then an 8 MiB block allocated, touched and freed with a
# small block allocated after it; prints the KiB the free gave back to the system.
_GIVEN_BACK = """
import sys
import torch
from wna16ctl.verification.checks import map_large_allocations

def anon_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))

if sys.argv[1] == "mapped":
    assert map_large_allocations()
big = torch.ones(24 << 20, dtype=torch.uint8)
del big
block = torch.ones(8 << 20, dtype=torch.uint8)
pin = torch.ones(4096, dtype=torch.uint8)
held = anon_kib()
del block
print(held - anon_kib())
"""


def test_large_blocks_freed_go_back_once_mapped():
    """With `map_large_allocations`, a freed block of a few MiB goes back to the system even after
    a larger one was freed.  glibc's default raises the size it maps from to the largest mapped
    block freed: the numerics' blocks of a few MiB then came from its heaps, where the freed ones
    stayed resident, and verify's resident set grew from layer to layer."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    if "CS_GNU_LIBC_VERSION" not in os.confstr_names or not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"):
        pytest.skip("glibc's malloc only")
    env = {**os.environ, "PYTHONPATH": str(Path(wna16ctl.__file__).resolve().parents[1])}

    def given_back(how: str) -> int:
        res = subprocess.run([sys.executable, "-c", _GIVEN_BACK, how], capture_output=True, text=True, env=env,
                             timeout=300)
        assert res.returncode == 0, res.stderr
        return int(res.stdout.split()[-1])

    if given_back("default") >= 7 << 10:
        pytest.skip("this malloc gives the block back by default")
    assert given_back("mapped") >= 7 << 10


def test_numerics_hold_one_rank_partial_at_a_time(outputs, monkeypatch):
    """At the token cap the ranks' partial intervals are built one rank at a time: never more than
    the all-reduced sum and one rank's alive (before, every rank's and the sum: 3 at TP 2)."""
    import wna16ctl.verification.bounds as bounds_mod
    from wna16ctl.sources import open_checkpoint

    ck, out = outputs("g128")
    hidden = open_checkpoint(ck).quantized_layers[0].hidden_size
    _small_budget(monkeypatch, 40, hidden)
    made: list[weakref.ref] = []
    most = [0]
    real_init = bounds_mod.IntervalSum.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        made.append(weakref.ref(self))
        gc.collect()
        most[0] = max(most[0], sum(r() is not None for r in made))

    monkeypatch.setattr(bounds_mod.IntervalSum, "__init__", init)
    report = verify_output(ck, out, samples=QUESTIONS, num_samples=8)
    assert report.passed and len(made) >= 3
    assert most[0] <= 2, most[0]


def test_marlin_candidate_reads_a_slab_of_experts_at_a_time(outputs, monkeypatch):
    """The numerics' GEMM reads a rank's stacked tensors a slab of experts at a time (here one
    expert), never the whole rank layer (before: every tensor whole)."""
    from wna16ctl.sources.tensors import TensorReader

    ck, out = outputs("g128")
    monkeypatch.setattr(verify_mod, "SLAB_BYTES", 1, raising=False)
    experts_per_read: list[float] = []
    real = TensorReader.read_bytes

    def read_bytes(self, info):
        full = self.files.info(info.name) if info.name in self.files else None
        if full is not None and str(out) in str(info.file) and full.shape and full.shape[0] > 1 \
                and info.name.rsplit(".", 1)[-1].startswith(("w13_", "w2_")):
            experts_per_read.append((info.end - info.start) / (full.nbytes // full.shape[0]))
        return real(self, info)

    monkeypatch.setattr(TensorReader, "read_bytes", read_bytes)
    report = verify_output(ck, out, samples=QUESTIONS, num_samples=8)
    assert report.passed and experts_per_read
    assert max(experts_per_read) == 1, max(experts_per_read)


def test_numerics_figures_do_not_depend_on_the_slabs_running_ahead(outputs, monkeypatch):
    """With two cores the next slab's GEMMs run while this slab's references are built; the figures
    are those of every step in turn: each layer's errors, bounds and margins bit for bit."""
    import dataclasses

    import wna16ctl.native.emulated as emulated_mod

    ck, out = outputs("g128")
    monkeypatch.setattr(verify_mod, "SLAB_BYTES", 1, raising=False)  # a slab per expert: many ahead
    monkeypatch.setattr(emulated_mod, "usable_cores", lambda: 2)
    monkeypatch.setattr(verify_mod, "SLABS_AHEAD", 0)
    in_turn = verify_output(ck, out, samples=QUESTIONS, num_samples=8)
    monkeypatch.setattr(verify_mod, "SLABS_AHEAD", 1)
    ahead = verify_output(ck, out, samples=QUESTIONS, num_samples=8)
    assert ahead.passed and in_turn.passed and ahead.numerics
    assert [dataclasses.asdict(n) for n in ahead.numerics] == [dataclasses.asdict(n) for n in in_turn.numerics]


def test_e2e_refused_with_the_figure_when_memory_cannot_hold_it(outputs, make_ckpt, tmp_path, monkeypatch):
    """--e2e holds every MoE layer's experts dequantised (and the model's other weights in fp32):
    where the machine's available memory cannot hold that, verify refuses before any work, in one
    line with the figures, exit 2 (before, it started and ran out of memory); with enough it starts."""
    pytest.importorskip("transformers")
    import wna16ctl.verification.e2e as e2e_mod
    from tests.padding.test_pad import SMALL
    from wna16ctl.sources import open_checkpoint

    ck, out = outputs("g128")
    need, experts, rest = e2e_mod.e2e_memory(open_checkpoint(ck), __import__("torch").bfloat16)
    assert need == experts + rest and experts > 0 and rest > 0
    monkeypatch.setattr(e2e_mod, "available_memory", lambda: need - 1)
    started: list[str] = []
    monkeypatch.setattr(verify_mod, "_verify_checks", lambda *a, **k: started.append("checks"))
    res = CliRunner().invoke(cli, ["verify", str(ck), str(out), "--e2e", "--samples", str(QUESTIONS)])
    assert res.exit_code == 2 and not started, res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "--e2e needs about" in lines[0] and "GiB available" in lines[0], res.output
    src = make_ckpt(**SMALL)
    wna16ctl.pad(src, tmp_path / "p", to=256)
    monkeypatch.setattr(e2e_mod, "available_memory", lambda: 1 << 20)
    res = CliRunner().invoke(cli, ["verify", str(src), str(tmp_path / "p"), "--e2e", "--samples", str(QUESTIONS)])
    assert res.exit_code == 2 and "--e2e needs about" in res.output, res.output


def test_a_cap_below_two_tokens_per_expert_still_exercises_every_expert():
    """Where the token cap cannot give every expert two tokens (384 experts, 390 tokens at the
    Kimi-K2 width), each idle expert gets one, so that none goes unexercised."""
    import torch

    from wna16ctl.verification import activations

    class Layer:  # what `route` reads of a MoE layer
        num_experts, hidden_size, norm, router, router_bias, block = 384, 16, None, "r", None, "b"

    class Reader:
        def read(self, name):
            return torch.zeros(384, 16)  # a router that routes every token to the same experts

    class Ck:
        class config:  # stands for Checkpoint.config: the attributes route reads
            raw: dict = {}
            num_experts_per_tok = 8
            model_type = "qwen3_moe"
        root = "ck"

    routing = activations.route(Ck, Reader(), Layer, torch.randn(4096, 16), max_tokens=390)
    assert routing.x.shape[0] <= 390
    assert set(routing.topk_ids.reshape(-1).tolist()) >= set(range(384))


def test_pad_numerics_copy_weights_a_slab_at_a_time(make_ckpt, tmp_path, monkeypatch):
    """The padding proof's numerics never make a float64, fp32 or int32 tensor of an expert's
    projection's size: the weights are dequantised a slab of rows at a time and upcast for the
    GEMMs and their bounds a slab of columns at a time (`bounds.column_slabs`), so their memory
    does not grow with the expert (before, float64 copies of the whole w13 and w2 and the int32
    codes of the whole projection).  Counted over every op's output, not timed."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    import wna16ctl.padding.proof as proof_mod
    import wna16ctl.verification.bounds as bounds_mod
    import wna16ctl.verification.budget as budget_mod

    hidden, inter = 512, 384
    wide = (torch.float64, torch.float32, torch.int32, torch.int64)
    largest: list[tuple[int, str]] = []

    class Largest(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.dtype in wide:
                    largest.append((t.numel(), f"{func} {t.dtype} {list(t.shape)}"))
            return out

    real = proof_mod._check_numerics

    def check_numerics(*args, **kwargs):
        with Largest():
            return real(*args, **kwargs)

    src = make_ckpt(num_layers=1, hidden_size=hidden, intermediate_size=inter, num_experts=4)
    wna16ctl.pad(src, tmp_path / "p", to=512, tp=2)
    monkeypatch.setattr(proof_mod, "_check_numerics", check_numerics)
    for mod in (bounds_mod, budget_mod):
        monkeypatch.setattr(mod, "SLAB_BYTES", 64 << 10)
    proof = wna16ctl.verify(src, tmp_path / "p", samples=QUESTIONS, num_samples=1)
    assert proof.passed and proof.layers and largest
    # one projection is inter × hidden elements, a slab (64 KiB) a twenty-fourth of it in float64;
    # the largest left are the tokens' own ([T, H], an expert's [S, 2I])
    assert max(largest)[0] <= inter * hidden // 2, sorted(largest)[-3:]


def test_rank_files_are_hashed_in_step_with_the_round_trip(ckpt, tmp_path, monkeypatch):
    """The output is read from disk once: each rank file is hashed through the layer about to be
    round-tripped and at most the next one, so that the round trip's reads find those bytes in the
    page cache (before: every file was hashed whole before the first expert was read, and the
    output read from disk twice once larger than the cache).  The digests are still the files':
    the manifest check passes, and a changed byte is still its finding."""
    import os

    from wna16ctl.output.writer import InOrderDigest
    from wna16ctl.repacking.pipeline import RepackSettings, plan_repack, run_repack
    from tests.conftest import ACT_ORDER_RELEASE

    ck = ckpt(num_layers=3, num_experts=4, vocab_size=64)
    out = tmp_path / "out"
    run_repack(plan_repack(ck, RepackSettings(vllm=ACT_ORDER_RELEASE, tp=2)), out)
    hashed: dict[str, int] = {}  # file -> bytes hashed so far
    seen: list[tuple[object, dict[str, int], dict[str, int]]] = []  # (job, what was hashed, its tensors' ends)
    real_through, real_layer = InOrderDigest.hash_through, verify_mod._verify_layer

    def through(self, end):
        real_through(self, end)
        key = os.path.realpath(self.path)
        hashed[key] = max(hashed.get(key, 0), self.pos)

    def ends(job, ranks) -> dict[str, int]:
        got: dict[str, int] = {}
        for rf in ranks.values():
            for n in job.tensor_names:
                info = rf.files.info(f"{job.layer.prefix}.{n}")
                key = os.path.realpath(info.file)
                got[key] = max(got.get(key, 0), info.end)
        return got

    def layer(ck_, reader, job, ranks, *args, **kwargs):
        seen.append((job, dict(hashed), ends(job, ranks)))
        return real_layer(ck_, reader, job, ranks, *args, **kwargs)

    monkeypatch.setattr(InOrderDigest, "hash_through", through)
    monkeypatch.setattr(verify_mod, "_verify_layer", layer)
    report = verify_output(ck, out, numerics=False)
    assert report.passed and report.files_checked > 0
    assert len(seen) == 3
    for i, (job, at_start, own) in enumerate(seen):
        ahead = seen[i + 1][2] if i + 1 < len(seen) else own
        for key, end in own.items():
            assert at_start.get(key, 0) >= end, f"{job.layer.prefix}: {key} not hashed through the layer"
            assert at_start[key] <= max(end, ahead.get(key, end)), f"{job.layer.prefix}: {key} hashed too far ahead"
    # a byte changed in the middle layer's tensors, with the manifest left as it was
    job, _, own = seen[1]
    path, end = next(iter(own.items()))
    with open(path, "r+b") as f:
        f.seek(end - 1)
        b = f.read(1)
        f.seek(end - 1)
        f.write(bytes([b[0] ^ 0x01]))
    monkeypatch.undo()
    report = verify_output(ck, out, numerics=False)
    changed = [f for f in report.by_check("manifest") if "differs from the manifest" in f.message]
    assert not report.passed and len(changed) == 1 and os.path.basename(path) in changed[0].message
    assert report.findings[0] is changed[0]  # where the manifest check puts it: before the round trip's
