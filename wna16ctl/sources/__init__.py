"""Where checkpoints come from: a directory or a Hub repo, read from config and safetensors headers only.

* this package: `open_checkpoint` and `Checkpoint` (config, shards, MoE and linear layers), and the
  checkpoint's identity (`source_fingerprint`).
* `formats`: each input format (compressed-tensors first) behind one face, detected from its config;
  `scheme`: the format-free weight scheme they parse into.
* `config`, `headers`, `scan`, `tensors`, `raw`, `gidx`: the config forms, header reading and checks, tensor reads.
* `model`, `moe`: discovery of the model's dimensions, its MoE layers and its quantized linear layers.
* `hub`: the same from the Hugging Face Hub (headers only), and GSM8K from the Hub.
* `jsonfile`: JSON parsing with the limits every input file gets.
* `proposed`, `recipe`: an unquantized base seen as the checkpoint a proposed scheme or llm-compressor
  recipe would produce.

Knows what every known vLLM release builds from a checkpoint, alike in all of them (the linear
layers as it fuses them, its routing method, lm_head's scheme, the families' model facts), and no
rule that differs between releases: `planning` decides what a release does with what is read here.
"""

from __future__ import annotations

import gc
import hashlib
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from wna16ctl.sources.config import ModelConfig, QuantConfig, WeightScheme, read_model_config, require_shape_keys
from wna16ctl.sources._fork import split_map
from wna16ctl.sources.headers import (
    INDEX_NAME, CheckpointFiles, ShardHeader, ShardList, TensorInfo, assemble, locate_shards, read_shard_bytes,
    read_shard_header, shard_header_from_bytes,
)
from wna16ctl.sources.model import LinearLayer, ModelDims, find_linear_layers, is_mtp, model_dims
from wna16ctl.sources.moe import MoELayer, find_moe_layers
from wna16ctl.sources.header_digest import digest_header, native_header_scan_available
from wna16ctl.sources.scan import scan_digest, scan_shard, shard_header
from wna16ctl.errors import BadInput

__all__ = [
    "Checkpoint", "CheckpointFiles", "HeaderSource", "LinearLayer", "ModelConfig", "ModelDims", "MoELayer", "QuantConfig",
    "TensorInfo", "WeightScheme", "open_checkpoint",
]


@dataclass(frozen=True)
class HeaderSource:
    """Where the shard headers of a checkpoint directory come from.

    The directory always holds `config.json` (and the index, if any); the shards themselves may
    live elsewhere.  `locate` lists the shards, `read` returns one shard's checked header (through
    `headers.shard_header_from_bytes`, so every source yields the same objects); it may run in the
    forked scan worker.  The default reads the local files; `wna16ctl.sources.hub` serves headers it
    fetched by range request beforehand.
    """

    locate: Callable[[Path], ShardList] = locate_shards
    read: Callable[[Path], ShardHeader] = read_shard_header


LOCAL_FILES = HeaderSource()


@dataclass
class Checkpoint:
    root: Path
    config: ModelConfig
    files: CheckpointFiles
    layers: list[MoELayer]  # the decoder's MoE layers (MTP layers are apart: see `mtp_layers`)
    warnings: list[str] = field(default_factory=list)
    source: dict[str, str] | None = None  # a Hub checkpoint: repo_id, revision, commit
    # MoE layers of multi-token-prediction modules, which vLLM's decoder does not build
    mtp_layers: list[MoELayer] = field(default_factory=list)
    linear_layers: list[LinearLayer] = field(default_factory=list)  # quantized non-expert linears, as vLLM fuses them
    unplaced_linear: list[str] = field(default_factory=list)  # quantized modules wna16ctl cannot place

    @property
    def quantized_layers(self) -> list[MoELayer]:
        return [lay for lay in self.layers if lay.quantized]

    def require_wna16_moe(self) -> None:
        """Bad input unless some routed experts are quantized: a bf16 MoE or a dense model loads in
        vLLM as it is, and there is nothing here to plan or repack.  And unless config.json names
        the model's shape (`config.require_shape_keys`): vLLM builds what config.json says."""
        if self.quantized_layers:
            self.require_shape_keys()
            return
        if not self.layers:
            why = "no routed-expert MoE layers found"
        elif self.config.quant is None:
            why = "its routed experts are not quantized (config.json has no quantization_config)"
        else:
            why = "its routed experts are not quantized (no compressed-tensors scheme targets them)"
        raise BadInput(f"{self.root}: not a WNA16 MoE checkpoint: {why}; vLLM loads it without repacking, "
                       "and wna16ctl has nothing to plan")

    def require_shape_keys(self) -> None:
        """Bad input where config.json leaves out a key of the model's shape that vLLM reads
        (`config.require_shape_keys`), naming the experts the tensors hold where that is the key."""
        layers = self.layers or self.mtp_layers
        require_shape_keys(self.config, layers[0].num_experts if layers else None)

    @property
    def quantized_mtp_layers(self) -> list[MoELayer]:
        return [lay for lay in self.mtp_layers if lay.quantized]

    @property
    def dims(self) -> ModelDims:
        return model_dims(self.config)


def source_fingerprint(ck: Checkpoint) -> str:
    """The checkpoint's identity: sha256 over config.json, the index and every shard's name, size and header bytes.

    Headers pin every tensor's name, dtype, shape and offsets; the data itself is not hashed
    (that would cost a full read of the checkpoint) — verify checks the data bit for bit.
    """
    h = hashlib.sha256()
    h.update(b"config.json\0" + (ck.root / "config.json").read_bytes())
    if ck.files.index_path is not None:
        h.update(INDEX_NAME.encode() + b"\0" + ck.files.index_path.read_bytes())
    for sh in sorted(ck.files.shards, key=lambda s: s.path.name):
        with open(sh.path, "rb") as f:
            header = f.read(sh.data_start)
        h.update(f"{sh.path.name}\0{sh.size}\0".encode() + header)
    return h.hexdigest()


@contextmanager
def _no_cyclic_gc():
    """Pause the cyclic garbage collector: parsing ~10^5 header entries allocates millions of
    containers, which triggers collections that find nothing (they halve header parsing time)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _scan_checkpoint(root: Path, config: ModelConfig, intermediate: int,
                     headers: HeaderSource) -> tuple[CheckpointFiles, list[MoELayer]]:
    """Map: decode and check each shard's header; reduce: per MoE layer.

    Local shards go through the native checking reader when there is one (`header_digest`), one
    after another: it leaves too little work to be worth a second process (measured).  Without it
    (and for headers from another source, e.g. the Hub), the Python reader runs, and on large
    checkpoints more than half of the shards are handled by a forked worker, which sends back
    names and per-layer summaries only while this process reads the index.  That split starts
    from the directory's `*.safetensors` files so that it need not wait for the index; if the
    index turns out to name other files, everything is redone from the index's list.
    """
    parent = os.getpid()
    local = headers is LOCAL_FILES
    native = local and native_header_scan_available()

    def scan(p: Path) -> dict:
        return scan_shard(str(p), config, intermediate, keep_entries=os.getpid() == parent, header=headers.read(p))

    def scan_native(p: Path) -> dict:
        size, blob = read_shard_bytes(p)
        digest = digest_header(size, blob)
        if digest is not None:
            found = scan_digest(str(p), size, 8 + len(blob), digest, config, intermediate)
            if found is not None:
                return found
        # not accepted natively, or out of the ordinary: the Python reader decides and says why
        return scan_shard(str(p), config, intermediate, keep_entries=True, header=shard_header_from_bytes(p, size, blob))

    guess = sorted(root.glob("*.safetensors")) if local and not native and (root / INDEX_NAME).is_file() else None
    scans = None
    if native:
        where = locate_shards(root)
        # the shards in the order the forked scan gives them (the directory's, when it holds just
        # the index's files): the order of `files.names()`, and so of repack's output, stays put
        listed = sorted(root.glob("*.safetensors"))
        try:
            same = {p.resolve() for p in where.paths} == {p.resolve() for p in listed}
        except (OSError, RuntimeError):  # a link loop: reading the shard says so, with its name
            same = False
        scans = [scan_native(p) for p in (listed if same else where.paths)]
    elif guess:
        try:
            # this process reads the index after its part, while the worker is still at work: the
            # worker takes 60% of the shards
            scans, where = split_map(scan, guess, use_marshal=True, child_share=0.6,
                                     extra=lambda: locate_shards(root), extra_in_parent=True)
        except BadInput:
            where = locate_shards(root)  # maybe a stray file: redo from the index
        if scans is not None and {p.resolve() for p in where.paths} != {p.resolve() for p in guess}:
            scans = None
    else:
        where = headers.locate(root)
    if scans is None:
        scans, _ = split_map(scan, where.paths, use_marshal=True)
    files = assemble(where, [shard_header(s) for s in scans])
    files.reread = headers.read
    return files, find_moe_layers(files, config, scans, intermediate)


def open_checkpoint(path: str | os.PathLike[str], headers: HeaderSource = LOCAL_FILES,
                    config: ModelConfig | None = None) -> Checkpoint:
    """Config, headers and MoE layers of the checkpoint at `path` (BadInput when unusable).

    `config`: the config to use instead of `path`'s config.json (a proposed quantization, `proposed`)."""
    root = Path(path)
    with _no_cyclic_gc():
        config = read_model_config(root) if config is None else config
        intermediate = config.moe_intermediate_size
        if intermediate is None:  # shapes decide: read every header first
            where = headers.locate(root)
            files = assemble(where, [headers.read(p) for p in where.paths])
            layers = find_moe_layers(files, config)
        else:
            files, layers = _scan_checkpoint(root, config, intermediate, headers)
    mtp = [lay for lay in layers if is_mtp(lay.prefix, config.num_hidden_layers)]
    if mtp:
        layers = [lay for lay in layers if not is_mtp(lay.prefix, config.num_hidden_layers)]
    linear, unplaced = find_linear_layers(files, config)
    warnings = [w for lay in layers for w in lay.warnings]
    if config.quant is None:
        warnings.append(f"{root / 'config.json'}: no quantization_config; the experts are not quantized")
    if config.torch_dtype == "float32":
        warnings.append(f"{root / 'config.json'}: torch_dtype float32: vLLM's Marlin MoE kernels (and verify's MoE GEMM) "
                        "run float16/bfloat16 only; the Triton layout accepts float32 scales")
    return Checkpoint(root=root, config=config, files=files, layers=layers, warnings=warnings, mtp_layers=mtp,
                      linear_layers=linear, unplaced_linear=unplaced)
