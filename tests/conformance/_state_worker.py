"""Builds a model with an installed vLLM's own model and layer code on the meta device and prints
the sharded_state key contract of one TP rank: `python _state_worker.py CKPT[,CKPT...] TP RANK INIT_FILE`.
A checkpoint written `CKPT#ep` is built with expert parallelism (`--enable-expert-parallel`).

Runs in an environment where vLLM is installed (the engine venv).  Every rank of a TP size is one
process; they form a real gloo group (vLLM's own `init_distributed_environment` and
`initialize_model_parallel`), so each layer sees its true TP rank and size.  Parameters are created
on the meta device (no memory, no weights).  On the meta device every tensor has the same storage
address, so `ShardedStateLoader._filter_subtensors` cannot tell them apart: a key registered twice
is found by identity instead, keeping the smaller key as that function does.

With `--tree TREE` (a release's extracted sources, tests/conformance/vllm_release.py), that
release's Python code is imported instead of the installed one, with the stand-ins of _stubs.py
for its compiled modules, on vLLM's CPU platform.

Several checkpoints (comma-separated) are built one after the other in the same process and group:
importing a release costs far more than building a meta model, so one worker per release and rank
serves every architecture.

Prints one JSON line per checkpoint: {"vllm": version, "ckpt": the argument, "keys": {key: [shape, dtype]},
"experts": {routed-experts module: [the global experts of this rank, in its buffers' order]}}; the
experts come from the release's own placement (determine_expert_map with the strategy the built
layer settled on), recomputed off the meta device where the layer's map has no values.
"""

import json
import os
import sys
import traceback


def _use_release_tree(tree: str) -> None:
    import glob

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _stubs

    root = os.path.dirname(tree.rstrip("/"))
    with open(os.path.join(root, "extensions.txt")) as f:
        extensions = [line.strip() for line in f if line.strip()]
    meta = glob.glob(os.path.join(tree, "vllm-*.dist-info", "METADATA"))
    _stubs.install(tree, [os.path.join(root, "ct")], extensions, open(meta[0]).read() if meta else "")
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    platforms._current_platform = CpuPlatform()


def _mla_prefill_stand_in() -> None:
    """A CUDA wheel's MLA layer picks its prefill kernel wrapper (FlashAttention) while it is built;
    on the CPU platform that module does not import.  The wrapper is a plain object holding no
    parameter or buffer, so a stand-in leaves the key set unchanged."""
    try:
        import vllm.model_executor.layers.attention.mla_attention as mla
    except ImportError:
        return

    class PrefillStandIn:
        def __init__(self, *args, **kwargs):
            pass

    mla.get_mla_prefill_backend = lambda *args, **kwargs: PrefillStandIn


def _expert_maps_off_meta() -> None:
    """Under EP the expert map manager computes each rank's expert map at model build and logs it,
    which reads its values (torch.where): on the meta device that raises before 0.33.0, which builds
    the map on the CPU itself when the default device is meta.  The same is done here for every
    release; the map is a non-persistent buffer, so the key set is unchanged."""
    import torch

    try:
        from vllm.model_executor.layers.fused_moe.expert_map_manager import ExpertMapManager
    except ImportError:
        return
    calculate = ExpertMapManager._calculate_expert_maps

    def on_cpu(self):
        with torch.device("cpu"):
            calculate(self)

    ExpertMapManager._calculate_expert_maps = on_cpu


def _engine_config(entry: str, tp: int):
    from vllm.engine.arg_utils import EngineArgs

    ckpt, _, mode = entry.partition("#")
    return EngineArgs(model=ckpt, tensor_parallel_size=tp, dtype="bfloat16", enforce_eager=True,
                      skip_tokenizer_init=True, max_model_len=256,
                      enable_expert_parallel=mode == "ep").create_engine_config()


def main(ckpts: list[str], tp: int, rank: int, init_file: str, tree: str | None = None) -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if tree:
        _use_release_tree(tree)
    import torch  # noqa: F401 - torch first, as vLLM's own entry points import it

    import vllm
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader.utils import initialize_model

    if tree:
        _mla_prefill_stand_in()
    _expert_maps_off_meta()
    first = _engine_config(ckpts[0], tp)
    with set_current_vllm_config(first):
        init_distributed_environment(world_size=tp, rank=rank, local_rank=rank,
                                     distributed_init_method=f"file://{init_file}", backend="gloo")
        initialize_model_parallel(tensor_model_parallel_size=tp)
    for i, ckpt in enumerate(ckpts):
        try:
            keys, experts = _model_keys(first if i == 0 else _engine_config(ckpt, tp), set_current_vllm_config,
                                        initialize_model)
        except Exception:  # one architecture that does not build must not hide the others
            sys.stdout.write(json.dumps({"vllm": vllm.__version__, "ckpt": ckpt, "keys": None,
                                         "error": traceback.format_exc()[-2500:]}) + "\n")
            sys.stdout.flush()
            continue
        sys.stdout.write(json.dumps({"vllm": vllm.__version__, "ckpt": ckpt, "keys": keys, "experts": experts}) + "\n")
        sys.stdout.flush()


def _model_keys(config, set_current_vllm_config, initialize_model) -> tuple[dict, dict]:
    import torch

    with set_current_vllm_config(config):
        torch.set_default_dtype(config.model_config.dtype)  # as vLLM's loader does around model creation
        with torch.device("meta"):
            model = initialize_model(vllm_config=config)
    kept = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        if tensor.numel() == 0:
            continue  # the filter skips empty tensors
        ident = id(tensor)
        if ident not in kept or key < kept[ident][0]:
            kept[ident] = (key, tensor)
    keys = {key: [list(t.shape), str(t.dtype).replace("torch.", "")] for key, t in kept.values()}
    return keys, _local_experts(model)


def _local_experts(model) -> dict:
    """Each routed-experts module's global experts on this rank, local index order."""
    import torch
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    out = {}
    for name, module in model.named_modules():
        manager = getattr(module, "expert_map_manager", None)
        if manager is None or not name.endswith("routed_experts"):
            continue
        with torch.device("cpu"):
            count, expert_map, _ = determine_expert_map(manager.ep_size, manager.ep_rank, manager.global_num_experts,
                                                        manager.placement_strategy)
        if expert_map is None:
            out[name] = list(range(count))
        else:
            local = {int(g): int(i) for g, i in enumerate(expert_map.tolist()) if i >= 0}
            out[name] = sorted(local, key=local.__getitem__)
    return out


if __name__ == "__main__":
    args = sys.argv[1:]
    tree = None
    if args[0] == "--tree":
        tree, args = args[1], args[2:]
    main(args[0].split(","), int(args[1]), int(args[2]), args[3], tree)
