"""Tiny Qwen3-MoE checkpoints quantized by the real quantizers (AutoRound, GPTQModel).

Run in the quantizer venv (scripts/quantizer_venv.sh), never in the project's:

    python tests/quantizers/write_checkpoints.py OUT [VARIANT ...]

writes OUT/float (the random-init float model, its byte-level tokenizer; OUT/float-tp2 for the
TP2_VARIANTS) and OUT/<variant> for each variant named (all of ALL_VARIANTS when none is), each
finished folder renamed into place at the end,
so a folder that exists is complete.  Everything is local: the model is built from a config with a
fixed seed, the tokenizer from the byte alphabet, the calibration text generated here.

The shape is chosen so that the intermediate size (96, three groups of 32) does not split into
whole groups at TP 2 and 4: the tensor-parallel rules have something to refuse.  TP2_VARIANTS
have intermediate size 128, which loads at TP 2.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

# The tools' settings, made in the tools' own process (`main`): pytest imports this module for the
# variants' names, and an offline switch set in its environment would reach every Hub test after.
TOOL_ENV = {"GPTQMODEL_CPU_WORKERS": "2", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}

SEED = 0
MODEL = {
    "hidden_size": 128,
    "moe_intermediate_size": 96,
    "intermediate_size": 192,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
SEQLEN = 32
NSAMPLES = 16
ITERS = 8  # AutoRound's sign-gradient steps per block: enough to run its real tuning path, kept short

# variant -> (tool, settings); the AutoRound ones name the export format, the GPTQModel ones the
# checkpoint format.  Group 32 everywhere (the intermediate size is three groups).
VARIANTS: dict[str, dict] = {
    "autoround-gptq-sym4": {"tool": "auto-round", "format": "auto_gptq", "bits": 4, "group_size": 32, "sym": True},
    "autoround-awq-asym4": {"tool": "auto-round", "format": "auto_awq", "bits": 4, "group_size": 32, "sym": False},
    "autoround-own-sym4": {"tool": "auto-round", "format": "auto_round", "bits": 4, "group_size": 32, "sym": True},
    "gptqmodel-gptq-actorder-sym4": {"tool": "gptqmodel", "format": "gptq", "bits": 4, "group_size": 32, "sym": True,
                                     "desc_act": True},
    "gptqmodel-gptqv2-asym8": {"tool": "gptqmodel", "format": "gptq_v2", "bits": 8, "group_size": 32, "sym": False,
                               "desc_act": False},
}


# Variants of a second shape, whose intermediate size (128: 64 per rank at TP 2, a whole number of
# Marlin tiles and groups) loads at TP 2, for the commands that write per-rank shards.  They are
# quantized from their own float model (FLOAT_DIRS) and kept out of VARIANTS, whose tests are
# about the first shape.
TP2_MODEL = MODEL | {"moe_intermediate_size": 128}
TP2_VARIANTS: dict[str, dict] = {
    "gptqmodel-gptq-actorder-sym4-tp2": {"tool": "gptqmodel", "format": "gptq", "bits": 4, "group_size": 32,
                                         "sym": True, "desc_act": True, "shape": "tp2"},
    "autoround-awq-asym4-tp2": {"tool": "auto-round", "format": "auto_awq", "bits": 4, "group_size": 32,
                                "sym": False, "shape": "tp2"},
}
ALL_VARIANTS = VARIANTS | TP2_VARIANTS
FLOAT_DIRS = {None: "float", "tp2": "float-tp2"}  # a variant's "shape" -> its float model's folder
SHAPES = {None: MODEL, "tp2": TP2_MODEL}


def calibration_text(count: int = NSAMPLES) -> list[str]:
    """Short English-like sentences, long enough in bytes for SEQLEN tokens each."""
    import random

    rng = random.Random(SEED)
    words = ("the experts route every token through two of four small networks while the router "
             "learns which weights matter most for each group of columns in a matrix").split()
    return [" ".join(rng.choice(words) for _ in range(24)) for _ in range(count)]


def write_tokenizer(out: Path) -> int:
    """A byte-level tokenizer with no merges (one token per byte plus end-of-text): no download, and
    every text encodes.  Returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    vocab["<|endoftext|>"] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", model_max_length=MODEL["max_position_embeddings"])
    fast.save_pretrained(out)
    return len(vocab)


def write_float_model(out: Path, shape: dict = MODEL) -> None:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    stage = out.with_name(out.name + ".partial")
    shutil.rmtree(stage, ignore_errors=True)
    vocab_size = write_tokenizer(stage)
    torch.manual_seed(SEED)
    config = Qwen3MoeConfig(vocab_size=vocab_size, eos_token_id=vocab_size - 1, pad_token_id=vocab_size - 1,
                            bos_token_id=vocab_size - 1, torch_dtype="float16", **shape)
    model = Qwen3MoeForCausalLM(config).to(torch.float16)
    model.save_pretrained(stage)
    stage.rename(out)


def quantize_autoround(float_dir: Path, out: Path, variant: dict) -> None:
    from auto_round import AutoRound
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(float_dir, dtype="float16")
    tokenizer = AutoTokenizer.from_pretrained(float_dir)
    rounder = AutoRound(model, tokenizer, bits=variant["bits"], group_size=variant["group_size"],
                        sym=variant["sym"], dataset=calibration_text(), iters=ITERS, nsamples=NSAMPLES,
                        seqlen=SEQLEN, batch_size=4, device_map="cpu", seed=SEED,
                        enable_torch_compile=False)  # compiling costs a minute on two cores and saves nothing here
    rounder.quantize_and_save(str(out), format=variant["format"])
    # AutoRound writes into a folder it names after the model and scheme (float-w4g32/): lift it up
    (written,) = [p for p in out.iterdir() if p.is_dir()]
    for path in written.iterdir():
        path.rename(out / path.name)
    written.rmdir()


def quantize_gptqmodel(float_dir: Path, out: Path, variant: dict) -> None:
    from gptqmodel import GPTQModel, QuantizeConfig
    from transformers import AutoTokenizer

    config = QuantizeConfig(bits=variant["bits"], group_size=variant["group_size"], sym=variant["sym"],
                            desc_act=variant["desc_act"], format=variant["format"], offload_to_disk=False,
                            pack_impl="original")  # the block packer is a C++ extension built on first use: minutes
    model = GPTQModel.load(str(float_dir), config, device="cpu")
    tokenizer = AutoTokenizer.from_pretrained(float_dir)
    calibration = [tokenizer(text, truncation=True, max_length=SEQLEN) for text in calibration_text()]
    model.quantize([{"input_ids": c["input_ids"], "attention_mask": c["attention_mask"]} for c in calibration],
                   batch_size=4)
    model.save(str(out))


def write_variant(root: Path, name: str) -> None:
    variant = ALL_VARIANTS[name]
    out = root / name
    if out.is_dir():
        return
    stage = root / (name + ".partial")
    shutil.rmtree(stage, ignore_errors=True)
    quantize = quantize_autoround if variant["tool"] == "auto-round" else quantize_gptqmodel
    quantize(root / FLOAT_DIRS[variant.get("shape")], stage, variant)
    (stage / "variant.json").write_text(json.dumps(variant, indent=1, sort_keys=True) + "\n")
    stage.rename(out)


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: write_checkpoints.py OUT [VARIANT ...]", file=sys.stderr)
        return 2
    root = Path(argv[0])
    root.mkdir(parents=True, exist_ok=True)
    names = argv[1:] or list(ALL_VARIANTS)
    unknown = [n for n in names if n not in ALL_VARIANTS]
    if unknown:
        print(f"write_checkpoints.py: unknown variant {unknown[0]}; known: {', '.join(ALL_VARIANTS)}", file=sys.stderr)
        return 2
    for shape in {ALL_VARIANTS[n].get("shape") for n in names}:
        if not (root / FLOAT_DIRS[shape]).is_dir():
            write_float_model(root / FLOAT_DIRS[shape], SHAPES[shape])
    for name in names:
        write_variant(root, name)
    return 0


if __name__ == "__main__":
    for key, value in TOOL_ENV.items():  # before the tools are imported (they read it then)
        os.environ.setdefault(key, value)
    sys.exit(main(sys.argv[1:]))
