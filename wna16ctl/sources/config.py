"""Tolerant parsing of `config.json`, and of its `quantization_config` through its format.

The format (`sources/formats/`, detected from `quant_method`) reads the config's groups and
ignore list into format-free schemes (`sources/scheme.py`).  A format with module rules of its own
(GPTQ's `dynamic`, AWQ's `modules_to_not_convert`, AutoRound's `extra_config`) resolves each
module's scheme itself (`InputFormat.resolver`); for compressed-tensors it is resolved here, by the
library's rules (`compressed_tensors.utils.match`): targets are ordered exact name < regex (`re:`
prefix, `re.match`) < class name, a module's scheme is that of its first matching target, `ignore`
removes a module.  tests/sources/test_config.py checks these rules against the library wherever
the library can parse.
"""

from __future__ import annotations

import re
import signal
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import compress
from pathlib import Path
from typing import Any, Callable, Iterator

from wna16ctl.dtypes import FLOAT_ST_OF_CONFIG
from wna16ctl.sources import formats
from wna16ctl.sources.architectures import architecture
from wna16ctl.sources.scheme import SchemeGroup, WeightScheme
from wna16ctl.errors import BadInput

# Class names a header-only reader can attribute to an expert projection (it is an nn.Linear;
# vLLM's LinearBase also answers to "Linear").
_LINEAR_CLASSES = ("Linear", "LinearBase")
_Group = SchemeGroup


@dataclass(frozen=True)
class QuantConfig:
    """The parts of `quantization_config` that decide tensor layouts."""

    quant_method: str
    format: str
    version: str | None
    groups: tuple[_Group, ...]
    ignore: tuple[str, ...]
    _matcher: "_Matcher" = field(repr=False, compare=False)
    source: str = field(default="config.json", compare=False)  # the file, for error messages
    # the file's `quantization_config` as written: the planner's method steps (`planning/methods/`)
    # run vLLM's own parsing of the format's keys on it; nothing else reads it
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    # the format's own resolution of module names (`InputFormat.resolver`); None: the targets above
    _format_resolve: Callable[[list[str]], list[WeightScheme | None]] | None = field(
        default=None, repr=False, compare=False)

    def scheme_for(self, module_name: str) -> WeightScheme | None:
        """The weight scheme of a Linear named `module_name`, or None if it is not quantized."""
        with _regex_budget(self.source):
            if self._format_resolve is not None:
                return self._format_resolve([module_name])[0]
            return _resolve(self, module_name)

    def vllm_head_scheme(self, module_name: str) -> WeightScheme | None:
        """The scheme vLLM gives the output projection (`lm_head`, a ParallelLMHead, not a
        LinearBase): a target must name it exactly or by regex, or be a substring of the class
        name "ParallelLMHead" (case-insensitive); the class target "Linear" is not one, so the
        usual `targets: ["Linear"]` leaves lm_head unquantized.  Ignore entries match exactly or
        by regex.  (vLLM 0.27-0.33 compressed_tensors.py: get_quant_method's ParallelLMHead branch
        and get_scheme_dict; compressed_tensors/utils.py: find_matched_target, should_ignore_layer.)
        A format with rules of its own answers for the head as for any module."""
        if self._format_resolve is not None:
            return self.scheme_for(module_name)
        for t in self.ignore:
            if t == module_name or (t.startswith("re:") and _regex(t[3:]).match(module_name)):
                return None
        targets: dict[str, WeightScheme | None] = {}
        for g in self.groups:  # later groups win for a repeated target, which keeps its first position
            for t in g.targets:
                targets[t] = g.scheme
        for t, scheme in targets.items():
            if t == module_name or (t.startswith("re:") and _regex(t[3:]).match(module_name)):
                return scheme
        for t, scheme in targets.items():
            if not t.startswith("re:") and t.lower() in "parallellmhead":
                return scheme
        return None

    def unsayable(self) -> str | None:
        """Why the config `convert` writes cannot say this config's per-module rules (its format
        decides, `InputFormat.unsayable`); None where it can."""
        return formats.of(self).unsayable(self.raw, Path(self.source))

    def schemes_for(self, module_names: list[str]) -> list[WeightScheme | None]:
        """`scheme_for` of many names at once (each regex runs once over all names)."""
        with _regex_budget(self.source):
            if self._format_resolve is not None:
                return self._format_resolve(list(module_names))
            return _resolve_many(self, module_names)


REGEX_BUDGET_S = 10.0  # per batch of names; ordinary targets take milliseconds


class _RegexTimeout(Exception):
    pass


@contextmanager
def _regex_budget(source: str) -> Iterator[None]:
    """Bound the time target/ignore regexes may take (Python's `re` backtracks without limit: a
    pattern like `(a+)+$` needs 2^n steps).  SIGALRM interrupts the matcher; main thread only."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer") \
            or signal.getitimer(signal.ITIMER_REAL)[0] > 0:
        yield
        return

    def on_alarm(signum: int, frame: Any) -> None:
        raise _RegexTimeout

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, REGEX_BUDGET_S)
    try:
        yield
    except _RegexTimeout:
        patterns = ", ".join(f"'re:{p}'" for p in _CURRENT_PATTERN[-1:])
        raise BadInput(
            f"{source}: matching quantization_config targets/ignore against the module names took more than "
            f"{REGEX_BUDGET_S:g} s (catastrophic backtracking in {patterns or 'a re: pattern'}); simplify the "
            "pattern (no nested quantifiers such as (a+)+)"
        ) from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


_CURRENT_PATTERN: list[str] = []  # the pattern being matched, named when the budget runs out


@dataclass(frozen=True)
class ModelConfig:
    """`config.json` facts the planner and verifier need."""

    path: Path
    raw: dict[str, Any]
    model_type: str
    architectures: tuple[str, ...]
    hidden_size: int
    moe_intermediate_size: int | None
    num_experts: int | None
    num_experts_per_tok: int | None
    num_hidden_layers: int | None
    torch_dtype: str
    quant: QuantConfig | None


def _expect(cond: bool, path: Path, what: str) -> None:
    if not cond:
        raise BadInput(f"{path}: {what}")


def parse_quantization_config(qc: Any, path: Path, default_method: str | None = None) -> QuantConfig:
    """Parse a `quantization_config` object (raises BadInput naming `path` on nonsense);
    `default_method`: the quant_method of a config file that names none (quantize_config.json)."""
    fmt = formats.detect(qc, path, default_method)
    parsed = fmt.parse_config(qc, path)
    groups, ignore = parsed.groups, parsed.ignore
    # Later groups win for a repeated target (the library builds an OrderedDict).
    by_target: dict[str, WeightScheme | None] = {}
    for g in groups:
        for t in g.targets:
            by_target[t] = g.scheme
    ordered = tuple(sorted(by_target.items(), key=lambda kv: ("re:" in kv[0], kv[0])))
    for t, _ in ordered:
        if t.startswith("re:"):
            _compile(t[3:], path)
    for t in ignore:
        if str(t).startswith("re:"):
            _compile(str(t)[3:], path)
    return QuantConfig(
        source=str(path),
        quant_method=parsed.quant_method,
        format=parsed.format,
        version=parsed.version,
        groups=groups,
        ignore=ignore,
        _matcher=_build_matcher(ordered, ignore),
        raw=dict(qc),
        _format_resolve=fmt.resolver(parsed, qc, path),
    )


@lru_cache(maxsize=4096)
def _regex(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


def _compile(pattern: str, path: Path) -> None:
    try:
        _regex(pattern)
    except re.error as e:
        raise BadInput(f"{path}: quantization_config has an invalid regex 're:{pattern}': {e}") from None


def _resolve(qc: QuantConfig, name: str) -> WeightScheme | None:
    m = qc._matcher
    if name in m.ignore_exact or m.ignore_class or any(r.match(name) for r in m.ignore_regex):
        return None
    # names (exact, then regex in sorted order) before classes, exactly like match_targets()
    if name in m.exact:
        return m.exact[name]
    for r, scheme in m.regex:
        _CURRENT_PATTERN[:] = [r.pattern]
        if r.match(name):
            return scheme
    return m.class_scheme


def _resolve_many(qc: QuantConfig, names: list[str]) -> list[WeightScheme | None]:
    """`_resolve` of every name, with each regex run over all names by one C-level `map` (a
    Kimi-K2-sized checkpoint resolves ~10^5 expert module names)."""
    m = qc._matcher
    if m.ignore_class:
        return [None] * len(names)
    out: list[WeightScheme | None] = [m.class_scheme] * len(names)
    decided = [False] * len(names)
    if not (m.ignore_exact.isdisjoint(names) and m.exact.keys().isdisjoint(names)):
        for i, n in enumerate(names):
            if n in m.ignore_exact:
                out[i], decided[i] = None, True
            elif n in m.exact:
                out[i], decided[i] = m.exact[n], True
    every = range(len(names))
    for r in m.ignore_regex:
        _CURRENT_PATTERN[:] = [r.pattern]
        for i in compress(every, map(r.match, names)):
            out[i], decided[i] = None, True
    for r, scheme in m.regex:
        _CURRENT_PATTERN[:] = [r.pattern]
        for i in compress(every, map(r.match, names)):
            if not decided[i]:
                out[i], decided[i] = scheme, True
    return out


@dataclass(frozen=True)
class _Matcher:
    """Targets and ignores split by kind, so resolving 100k expert names stays cheap."""

    exact: dict[str, WeightScheme | None]
    regex: tuple[tuple[re.Pattern[str], WeightScheme | None], ...]
    class_scheme: WeightScheme | None
    ignore_exact: frozenset[str]
    ignore_regex: tuple[re.Pattern[str], ...]
    ignore_class: bool


def _build_matcher(ordered: tuple[tuple[str, WeightScheme | None], ...], ignore: tuple[str, ...]) -> _Matcher:
    exact: dict[str, WeightScheme | None] = {}
    regex: list[tuple[re.Pattern[str], WeightScheme | None]] = []
    class_scheme: WeightScheme | None = None
    seen_class = False
    for target, scheme in ordered:
        if target.startswith("re:"):
            regex.append((_regex(target[3:]), scheme))
        elif target in _LINEAR_CLASSES:
            if not seen_class:
                class_scheme, seen_class = scheme, True
        else:
            exact.setdefault(target, scheme)
    return _Matcher(
        exact=exact,
        regex=tuple(regex),
        class_scheme=class_scheme,
        ignore_exact=frozenset(t for t in ignore if not t.startswith("re:")),
        ignore_regex=tuple(_regex(t[3:]) for t in ignore if t.startswith("re:")),
        ignore_class=any(t in _LINEAR_CLASSES for t in ignore),
    )


_MAX_DIM = 1 << 40  # no model dimension or count comes near this; larger is a corrupt config

# Scale dtypes of WNA16 MoE layers: the model dtype, in which vLLM keeps the scales.  float32
# is accepted (the Triton kernel and the checkpoint allow it) but the Marlin kernels and
# verify's MoE GEMM run float16/bfloat16 only.
SCALE_DTYPES = ("float16", "bfloat16", "float32")
SCALE_ST_DTYPES = FLOAT_ST_OF_CONFIG  # as safetensors names them
_DTYPE_ALIASES = {"half": "float16", "fp16": "float16", "bf16": "bfloat16", "float": "float32", "fp32": "float32"}



def _first_int(raw: dict[str, Any], path: Path, *keys: str) -> int | None:
    """The first of `keys` present, as a positive integer (BadInput naming the key otherwise)."""
    for k in keys:
        if k not in raw or raw[k] is None:
            continue
        v = raw[k]
        if not isinstance(v, int) or isinstance(v, bool):
            raise BadInput(f"{path}: {k} = {_short(v)} is not an integer; write it as a JSON number")
        if not 0 < v <= _MAX_DIM:
            raise BadInput(f"{path}: {k} = {_short(v)} is out of range (must be a positive integer)")
        return v
    return None


def _short(v: Any) -> str:
    text = repr(v) if not isinstance(v, int) or v.bit_length() < 256 else f"an integer of {len(str(v))} digits"
    return text if len(text) <= 60 else text[:57] + "..."


def scale_dtype_name(value: Any, path: Path) -> str:
    """`torch_dtype` as one of SCALE_DTYPES (BadInput for anything else)."""
    name = str(value).removeprefix("torch.").lower() if isinstance(value, str) else None
    name = _DTYPE_ALIASES.get(name, name) if name is not None else None
    if name not in SCALE_DTYPES:
        raise BadInput(
            f"{path}: torch_dtype = {_short(value)} is not a dtype WNA16 MoE scales can have "
            f"({', '.join(SCALE_DTYPES)}); set the model's float dtype"
        )
    return name


def _check_routing_fields(raw: dict[str, Any], path: Path, num_experts: int | None) -> None:
    """Fields verify's router reads: numbers of the right kind, groups that divide the experts."""
    eps = raw.get("rms_norm_eps")
    if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1):
        raise BadInput(f"{path}: rms_norm_eps = {_short(eps)} is not a small positive number")
    factor = raw.get("routed_scaling_factor")
    if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0):
        raise BadInput(f"{path}: routed_scaling_factor = {_short(factor)} is not a positive number")
    n_group = _first_int(raw, path, "n_group")
    topk_group = _first_int(raw, path, "topk_group")
    if n_group is not None and num_experts is not None and num_experts % n_group:
        raise BadInput(f"{path}: n_group = {n_group} does not divide the {num_experts} experts; "
                       "the routed experts are split into equal groups")
    if topk_group is not None and n_group is not None and topk_group > n_group:
        raise BadInput(f"{path}: topk_group = {topk_group} exceeds n_group = {n_group}")


# Keys that name the checkpoint itself, not its language model: a multimodal or wrapper config
# keeps its own values for these when the nested text config is merged in.
_OWN_KEYS = ("architectures", "model_type", "quantization_config", "compression_config", "torch_dtype", "dtype")


def merge_text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The config with a nested `text_config` / `language_config` merged in (Kimi-K2.5, Qwen3.5).

    The language model's sizes come from the nested config (as vLLM's `hf_text_config`), but the
    checkpoint's architecture, model_type, dtype and quantization stay those of the top level,
    which is what vLLM dispatches on.  A nested key the top level lacks is still taken."""
    for sub in ("text_config", "language_config"):
        nested = raw.get(sub)
        if isinstance(nested, dict) and "hidden_size" not in raw:
            merged = {**raw, **nested}
            for key in _OWN_KEYS:
                if raw.get(key) is not None:
                    merged[key] = raw[key]
            merged["text_model_type"] = nested.get("model_type")
            return merged
    return raw


# Keys of the model's shape every family of the architecture table has: vLLM builds the model from
# them, and a config.json without one gets transformers' default for the family, whatever the tensors
# hold (the experts' count is named per family: `Architecture.experts_field`).
SHAPE_KEYS = ("num_hidden_layers", "num_attention_heads")


def missing_shape_key(config: ModelConfig) -> str | None:
    """The first key of the model's shape (the number of routed experts under the family's name,
    then SHAPE_KEYS) that `config` lacks, for a family of the architecture table; None when all are
    there, or for a family the table does not hold (its names are not known)."""
    arch = architecture(config.model_type)
    if arch is None:
        return None
    keys = ((arch.experts_field,) if arch.experts_field else ()) + SHAPE_KEYS
    return next((k for k in keys if config.raw.get(k) is None), None)


def require_shape_keys(config: ModelConfig, experts_in_tensors: int | None) -> None:
    """BadInput naming the first missing key of `missing_shape_key` (with the tensors' count of
    experts where that is the key): the planner must not read from the tensors what the engine
    takes from transformers' defaults."""
    key = missing_shape_key(config)
    if key is None:
        return
    arch = architecture(config.model_type)
    held = (f" instead of the {experts_in_tensors} experts the tensors hold; add \"{key}\": {experts_in_tensors}"
            if arch is not None and key == arch.experts_field and experts_in_tensors else
            f" instead of the checkpoint's; add {key}")
    raise BadInput(f"{config.path}: {key} is missing; vLLM would build the {config.model_type} model with "
                   f"transformers' default{held}")


def quantization_config_of(raw: dict[str, Any]) -> Any:
    """`quantization_config`, else the legacy `compression_config` key (vLLM reads both)."""
    qc = raw.get("quantization_config")
    return raw.get("compression_config") if qc is None else qc


def side_quantization_config(ckpt: Path) -> QuantConfig | None:
    """The quantization config of a file beside config.json (GPTQ's quantize_config.json), for a
    config.json without one; None when there is none."""
    from wna16ctl.sources.headers import read_regular_file
    from wna16ctl.sources.jsonfile import JSONError, loads

    for name, method in formats.SIDE_CONFIGS:
        path = ckpt / name
        if not path.is_file():
            continue
        try:
            qc = loads(read_regular_file(path, name, limit=64 << 20))
        except JSONError as e:
            raise BadInput(f"{path}: not valid JSON ({e})") from None
        return parse_quantization_config(qc, path, method)
    return None


def read_model_config(ckpt: Path) -> ModelConfig:
    """Read and check `CKPT/config.json` (raises BadInput with the file named)."""
    path = ckpt / "config.json"
    from wna16ctl.sources.headers import read_regular_file
    from wna16ctl.sources.jsonfile import JSONError, loads

    try:
        text = read_regular_file(path, "config.json", limit=64 << 20)
    except FileNotFoundError:
        raise BadInput(f"{path}: not found; point wna16ctl at a Hugging Face checkpoint directory") from None
    try:
        raw = loads(text)
    except JSONError as e:
        raise BadInput(f"{path}: not valid JSON ({e})") from None
    _expect(isinstance(raw, dict), path, "must hold a JSON object")
    raw = merge_text_config(raw)
    hidden = _first_int(raw, path, "hidden_size", "d_model")
    if hidden is None:
        raise BadInput(f"{path}: hidden_size is missing")
    qc_raw = quantization_config_of(raw)
    quant = parse_quantization_config(qc_raw, path) if qc_raw is not None else side_quantization_config(ckpt)
    archs = raw.get("architectures") or []
    model_type = str(raw.get("model_type", ""))
    # Mixtral calls its expert width `intermediate_size`; the MoE families with shared or
    # dense MLPs keep that name for the dense MLP and use `moe_intermediate_size`: for these a
    # missing `moe_intermediate_size` is read from the tensors (sources/architectures.py).
    width_keys: tuple[str, ...] = ("moe_intermediate_size", "expert_intermediate_size")
    arch = architecture(model_type)
    if arch is None or not arch.separate_expert_width:
        width_keys += ("intermediate_size",)
    num_experts = _first_int(raw, path, "num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
    top_k = _first_int(raw, path, "num_experts_per_tok", "moe_topk")
    if top_k is not None and num_experts is not None and top_k > num_experts:
        raise BadInput(f"{path}: num_experts_per_tok = {top_k} exceeds the {num_experts} experts")
    if top_k is None and isinstance(raw.get("top_k"), int) and not isinstance(raw.get("top_k"), bool):
        top_k = raw["top_k"] if raw["top_k"] > 0 else None
    _check_routing_fields(raw, path, num_experts)
    raw_dtype = raw.get("torch_dtype") if raw.get("torch_dtype") is not None else raw.get("dtype")
    return ModelConfig(
        path=path,
        raw=raw,
        model_type=model_type,
        architectures=tuple(str(a) for a in archs) if isinstance(archs, list) else (),
        hidden_size=hidden,
        moe_intermediate_size=_first_int(raw, path, *width_keys),
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        num_hidden_layers=_first_int(raw, path, "num_hidden_layers", "n_layers"),
        torch_dtype=scale_dtype_name(raw_dtype, path) if raw_dtype is not None else "bfloat16",
        quant=quant,
    )
