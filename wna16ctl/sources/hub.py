"""Checkpoints and GSM8K samples on the Hugging Face Hub, through huggingface_hub.

`inspect ORG/NAME[@REVISION]` needs only `config.json`, the index and each shard's safetensors
header: the first two are ordinary cached Hub downloads (they land in the snapshot directory of
the Hugging Face cache, which then serves as the checkpoint's root), the headers are read by HTTP
range requests, many shards at once.  A header is tens of kB whatever the shard's size, so the
answer for a 600 GB checkpoint costs a few MB.  Fetched headers are cached beside the Hub cache
under the commit they belong to (a commit never changes), so a second run, also with
`HF_HUB_OFFLINE=1`, reads nothing from the network; shards already downloaded are read from disk.

`repack` and `verify` need the tensor data: they download the snapshot into the Hugging Face cache
and work on that directory.  `verify`'s default samples come last from the `openai/gsm8k`
dataset's test split (a parquet file, read with pyarrow, an optional extra).

huggingface_hub honours `HF_TOKEN`, `HF_ENDPOINT`, `HF_HOME`/`HF_HUB_CACHE`, `HF_HUB_OFFLINE`,
`HF_HUB_ETAG_TIMEOUT` and `HF_HUB_DOWNLOAD_TIMEOUT`; every failure becomes one `BadInput` line.
"""

from __future__ import annotations

import os
import re
import struct
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from wna16ctl.sources.headers import (
    MAX_HEADER, INDEX_NAME, SINGLE_NAME, ShardHeader, ShardList, locate_shards, read_shard_header,
    shard_header_from_bytes,
)
from wna16ctl.errors import BadInput, UsageError

if TYPE_CHECKING:
    from wna16ctl.sources import Checkpoint

GSM8K_REPO = "openai/gsm8k"
GSM8K_TEST_FILES = "main/test-*.parquet"
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# The first request of a header asks for this much: one round trip covers most shards' headers
# (huggingface_hub's own header parser asks for the same); the rest is fetched exactly.
_FIRST_RANGE = 100_000
_HEADER_THREADS = 16
_CACHE_MAGIC = b"wna16ctl-safetensors-header 1 "
# Weight formats a safetensors checkpoint repo may also carry, never needed here.
_SNAPSHOT_IGNORE = ["*.bin", "*.pt", "*.pth", "*.h5", "*.msgpack", "*.onnx", "*.gguf", "*.ckpt", "original/*"]


@dataclass(frozen=True)
class HubRef:
    """A model repository on the Hub and the revision asked for (None: the default branch)."""

    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo_id if self.revision is None else f"{self.repo_id}@{self.revision}"


def parse_ref(arg: str, revision: str | None = None) -> HubRef | None:
    """`arg` as a Hub reference `ORG/NAME[@REVISION]`, or None when it names a local path that
    exists; a missing path that cannot be a repo id is refused here, before any Hub request.
    `--revision` and an `@REVISION` suffix must agree."""
    if os.path.exists(arg):
        if revision is not None:
            raise UsageError(f"{arg}: --revision applies to a Hub repo id, and this is a local path")
        return None
    name, at, rev = arg.partition("@")
    if not _REPO_ID.fullmatch(name) or ".." in name or "--" in name or len(name) > 96:
        if revision is not None:
            raise UsageError(f"{arg}: not a local path nor a Hub repo id (ORG/NAME), which --revision needs")
        # a path that does not exist, and no repo id: the Hub is never asked
        raise BadInput(f"{arg}: no such local directory; check the path (a Hub repo id is ORG/NAME)")
    if at and not rev:
        raise UsageError(f"{arg}: empty revision after '@'; write ORG/NAME@REVISION or drop the '@'")
    if rev and revision is not None and rev != revision:
        raise UsageError(f"{arg}: names revision {rev!r} but --revision says {revision!r}; give one")
    return HubRef(name, rev or revision)


# -- errors --------------------------------------------------------------------------------------

def _hf() -> Any:
    """huggingface_hub, imported on first use (a few tenths of a second a local `inspect` need not pay).

    Only its top-level functions are reached through the package: it loads submodules lazily, so
    `errors`, `constants` and `utils` are imported by name where they are used, never read as
    attributes of the package (which they are not until something else imports them)."""
    import huggingface_hub

    _quiet_retries()
    return huggingface_hub


# huggingface_hub's own retry loop (5xx, 429, connection errors: five retries over ~23 s, or what
# Retry-After asks) logs a warning per attempt.  A failure is reported once, as one line naming the
# file and the fix (`hub_error`), so the per-attempt chatter is dropped.
_RETRY_CHATTER = ("Retrying in ", "Rate limited. Waiting", "thrown while requesting")


def _drop_retry_chatter(record: Any) -> bool:
    message = str(record.msg)
    return not (message.startswith(("Retrying in ", "Rate limited. Waiting", "HTTP Error "))
                or any(word in message for word in _RETRY_CHATTER))


def _quiet_retries() -> None:
    import logging

    log = logging.getLogger("huggingface_hub.utils._http")
    if _drop_retry_chatter not in log.filters:
        log.addFilter(_drop_retry_chatter)


def _offline() -> bool:
    _hf()
    from huggingface_hub import constants as c
    check = getattr(c, "is_offline_mode", None)
    return bool(check() if callable(check) else c.HF_HUB_OFFLINE)


def _is_a(e: BaseException, *names: str) -> bool:
    """Whether `e` is an instance of a class of one of `names` (httpx or httpx2, any version)."""
    return any(c.__name__ in names for c in type(e).__mro__)


def _causes(e: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def _status(e: BaseException) -> int | None:
    response = getattr(e, "response", None)
    return getattr(response, "status_code", None)


def hub_error(e: BaseException, what: str, filename: str | None = None, *, model_arg: bool = False) -> BadInput:
    """The one-line error for a failure of huggingface_hub while getting `filename` of the
    repository `what` (`model_arg`: `what` is a command's CKPT argument, asked of the Hub because
    no local directory has that name: said first where the Hub did not answer whether the repo exists)."""
    _hf()
    from huggingface_hub import constants
    from huggingface_hub import errors as errs
    token_hint = "set HF_TOKEN to a token that can read it"
    if isinstance(e, errs.GatedRepoError):
        return BadInput(f"{what}: gated repository; accept its conditions on the Hub and {token_hint}")
    if isinstance(e, errs.RevisionNotFoundError):
        return BadInput(f"{what}: no such revision on the Hub; pass a branch, tag or commit hash that exists")
    if isinstance(e, errs.RepositoryNotFoundError):
        if _status(e) == 401:
            return BadInput(f"{what}: repository not found, or private (HTTP 401); check the id, or {token_hint}")
        local = " (nor a local directory of that name)" if model_arg else ""
        return BadInput(f"{what}: no such repository on the Hub{local}; check the id")
    if isinstance(e, getattr(errs, "RemoteEntryNotFoundError", errs.EntryNotFoundError)) and _status(e) == 404:
        return BadInput(f"{what}: has no {filename or 'such file'} at that revision")
    # Where the Hub did not say whether the repo exists, a CKPT argument may be a mistyped path:
    # that no local directory has its name comes first, and checking it is the first fix.
    check = "check the path, the connection" if model_arg else "check the connection"
    if model_arg:
        what = f"{what}: no such local directory; as a Hub repo id, {filename or 'its files'}"
    elif filename:
        what = f"{what}: {filename}"
    for cause in _causes(e):
        if _is_a(cause, "OfflineModeIsEnabled") or (_is_a(cause, "LocalEntryNotFoundError") and _offline()):
            return BadInput(f"{what}: not in the local Hugging Face cache and HF_HUB_OFFLINE is set; "
                            f"{'check the path, ' if model_arg else ''}unset HF_HUB_OFFLINE to download, or pass "
                            "a local directory")
        if _is_a(cause, "TimeoutException"):
            return BadInput(f"{what}: the Hub did not answer in time; {check} or raise "
                            "HF_HUB_ETAG_TIMEOUT / HF_HUB_DOWNLOAD_TIMEOUT (seconds)")
        if _is_a(cause, "ConnectError", "NetworkError", "ProxyError") or isinstance(cause, _Unreachable):
            return BadInput(f"{what}: cannot reach {constants.ENDPOINT} ({cause}); {check} or HF_ENDPOINT, "
                            "or set HF_HUB_OFFLINE=1 to use the local cache")
    status = next((st for st in map(_status, _causes(e)) if st is not None), None)
    if status in (401, 403):
        return BadInput(f"{what}: access denied (HTTP {status}); {token_hint}")
    if status is not None:
        return BadInput(f"{what}: the Hub answered HTTP {status}; try again later")
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return BadInput(f"{what}: {first}")


class _Unreachable(OSError):
    """The Hub's endpoint could not be connected to (`_probe`): no network, a name that does not
    resolve, a refused port."""


# Through a proxy, the proxy decides what is reachable: no direct connection is tried then.
_PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def _probe(ref: HubRef) -> None:
    """Before the first request for a CKPT argument that names no local directory: one TCP
    connection to the Hub's endpoint (within HF_HUB_ETAG_TIMEOUT), so that a Hub that cannot be
    reached is one line at once, not after huggingface_hub's retries (~25 s).  Skipped offline,
    through a proxy, and when the repo's config.json is cached (huggingface_hub then falls back to
    the cache when the Hub does not answer)."""
    import socket
    from urllib.parse import urlsplit

    hf = _hf()
    from huggingface_hub import constants

    if _offline() or any(os.environ.get(v) for v in _PROXY_VARS):
        return
    try:
        if isinstance(hf.try_to_load_from_cache(ref.repo_id, "config.json", revision=ref.revision), str):
            return
        url = urlsplit(constants.ENDPOINT)
        host, port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
    except ValueError:  # an id or endpoint huggingface_hub itself will refuse, in its own words
        return
    if not host:
        return
    try:
        socket.create_connection((host, port), timeout=float(constants.HF_HUB_ETAG_TIMEOUT)).close()
    except OSError as e:
        down = _Unreachable(e.errno, e.strerror) if e.errno is not None else _Unreachable(str(e) or "timed out")
        raise hub_error(down, str(ref), "config.json", model_arg=True) from None


@contextmanager
def _hub_errors(what: str, filename: str | None = None, *, model_arg: bool = False) -> Iterator[None]:
    try:
        yield
    except BadInput:
        raise
    except Exception as e:
        _hf()
        from huggingface_hub import errors as errs

        known = (errs.HfHubHTTPError, errs.LocalEntryNotFoundError, errs.OfflineModeIsEnabled,
                 getattr(errs, "HFValidationError", ValueError), OSError)
        if isinstance(e, known) or type(e).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore", "httpcore2"):
            raise hub_error(e, what, filename, model_arg=model_arg) from None
        raise


# -- inspect: config, index and headers ----------------------------------------------------------

def _download(ref: HubRef, filename: str, revision: str | None, *, first: bool = False, **kw: Any) -> Path:
    """One file of the repo into the cache; `first`: the first request for a CKPT argument."""
    with _hub_errors(str(ref), filename, model_arg=first):
        return Path(_hf().hf_hub_download(ref.repo_id, filename, revision=revision, **kw))


def _has_index(ref: HubRef, commit: str) -> bool:
    """Fetch the index into the snapshot; False when the repository has none (cached as such)."""
    hf = _hf()
    cached = hf.try_to_load_from_cache(ref.repo_id, INDEX_NAME, revision=commit)
    if isinstance(cached, str):
        return True
    if cached is not None:  # huggingface_hub remembers that the file does not exist at this commit
        return False
    try:
        _download(ref, INDEX_NAME, commit)
    except BadInput as e:
        if f"has no {INDEX_NAME}" in e.message:
            return False
        raise
    return True


def _fetch_side_configs(ref: HubRef, commit: str, config: Path) -> None:
    """Fetch a quantization config kept beside config.json (GPTQ's quantize_config.json) into the
    snapshot when config.json holds none; a repository without one is left as it is."""
    from wna16ctl.sources import formats
    from wna16ctl.sources.config import merge_text_config, quantization_config_of
    from wna16ctl.sources.jsonfile import JSONError, loads

    try:
        raw = loads(config.read_bytes())
    except (OSError, JSONError):
        return  # reading the checkpoint names what is wrong with config.json
    if not isinstance(raw, dict) or quantization_config_of(merge_text_config(raw)) is not None:
        return
    for name, _ in formats.SIDE_CONFIGS:
        try:
            _download(ref, name, commit)
            return
        except BadInput as e:
            if f"has no {name}" not in e.message:
                raise


def header_cache_dir() -> Path:
    """Where fetched headers are kept: beside huggingface_hub's cache (`$HF_HOME/wna16ctl/headers`)."""
    _hf()
    from huggingface_hub import constants

    return Path(constants.HF_HOME) / "wna16ctl" / "headers"


def _cache_path(repo_id: str, commit: str, filename: str) -> Path:
    return header_cache_dir() / ("models--" + repo_id.replace("/", "--")) / commit / filename


def _read_cached(path: Path) -> tuple[int, bytes] | None:
    try:
        blob = path.read_bytes()
    except OSError:
        return None
    line, nl, raw = blob.partition(b"\n")
    if not nl or not line.startswith(_CACHE_MAGIC) or len(raw) < 8:
        return None
    try:
        size = int(line[len(_CACHE_MAGIC):])
    except ValueError:
        return None
    return (size, raw) if len(raw) == 8 + struct.unpack("<Q", raw[:8])[0] else None


def _write_cached(path: Path, size: int, raw: bytes) -> None:
    """Atomically (a reader never sees half a header); a cache that cannot be written is skipped."""
    import tempfile  # only the Hub's header cache writes (a local checkpoint never does)

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(_CACHE_MAGIC + str(size).encode() + b"\n" + raw)
        os.replace(tmp, path)
    except OSError:
        pass


def _get_range(url: str, start: int, end: int, headers: dict[str, str], timeout: float | None,
               what: str | None = None) -> tuple[bytes, int]:
    """Bytes [start, end] of `url` and the file's total size, through huggingface_hub's HTTP
    session (proxies, user agent, redirects to the CDN).  The body is streamed and cut at `end`,
    so a server that ignores Range costs one header's worth of bytes, not the shard."""
    hf = _hf()
    from huggingface_hub.utils import get_session, hf_raise_for_status

    session = get_session()
    with session.stream("GET", url, headers={**headers, "Range": f"bytes={start}-{end}"}, timeout=timeout) as r:
        if r.status_code >= 400:
            r.read()
            hf_raise_for_status(r)
        total = None
        skip = 0
        if r.status_code == 206:
            m = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+|\*)", r.headers.get("Content-Range", "").strip())
            if m is None or int(m.group(1)) != start:
                raise BadInput(f"{what or url}: the server answered range {r.headers.get('Content-Range')!r} for "
                               f"bytes {start}-{end}; it does not serve byte ranges correctly")
            total = int(m.group(3)) if m.group(3) != "*" else None
        else:  # 200: the whole file from byte 0
            skip = start
            length = r.headers.get("Content-Length")
            total = int(length) if length and length.isdigit() else None
        want = end - start + 1
        got = bytearray()
        for chunk in r.iter_bytes():
            if skip:
                cut = min(skip, len(chunk))
                chunk, skip = chunk[cut:], skip - cut
            got += chunk
            if len(got) >= want:
                break
    if total is None:  # rare: ask for the size alone
        total = hf.get_hf_file_metadata(url, headers=headers).size
    return bytes(got[:want]), int(total)


def _fetch_header(repo_id: str, commit: str, filename: str) -> tuple[int, bytes]:
    """(file size, the file's first 8 + N bytes) of one safetensors file on the Hub."""
    hf = _hf()
    what = f"{repo_id}: {filename}"
    url = hf.hf_hub_url(repo_id, filename, revision=commit)
    from huggingface_hub import constants
    from huggingface_hub.utils import build_hf_headers

    headers = build_hf_headers()
    timeout = constants.HF_HUB_DOWNLOAD_TIMEOUT
    with _hub_errors(repo_id, filename):
        raw, size = _get_range(url, 0, _FIRST_RANGE - 1, headers, timeout, what)
        if len(raw) < 8:
            raise BadInput(f"{what}: truncated safetensors file ({size} bytes, no header length)")
        (n,) = struct.unpack("<Q", raw[:8])
        if n < 2 or n > MAX_HEADER or 8 + n > size:
            raise BadInput(f"{what}: header length {n} does not fit the file size {size}; "
                           "the file is truncated or not safetensors")
        if len(raw) < 8 + n:
            more, _ = _get_range(url, len(raw), 8 + n - 1, headers, timeout, what)
            raw += more
        if len(raw) < 8 + n:
            raise BadInput(f"{what}: the server sent {len(raw)} of the header's {8 + n} bytes")
    return size, raw[: 8 + n]


def _header_from_raw(path: Path, what: str, size: int, raw: bytes) -> ShardHeader:
    """The same ShardHeader `read_shard_header` makes from the local file's first 8 + N bytes
    (the same checks: what the safetensors library refuses is refused here too)."""
    return shard_header_from_bytes(path, size, raw[8:])


def _prefetch_headers(ref: HubRef, commit: str, root: Path, paths: list[Path]) -> dict[Path, tuple[int, bytes]]:
    """(size, first 8 + N bytes) of every shard that is neither downloaded nor in the header
    cache, fetched in parallel and written to the cache; kept in memory too (the scan worker
    inherits it) in case the cache cannot be written."""
    todo: list[Path] = []
    for p in paths:
        # downloaded before (the snapshot links it to its blob), or fetched by an earlier run
        if not p.is_file() and _read_cached(_cache_path(ref.repo_id, commit, p.relative_to(root).as_posix())) is None:
            todo.append(p)
    if not todo:
        return {}
    if _offline():
        raise BadInput(f"{ref.repo_id}: the header of {todo[0].relative_to(root).as_posix()} is not in the local "
                       "cache and HF_HUB_OFFLINE is set; run once online, or unset HF_HUB_OFFLINE")

    def fetch(p: Path) -> tuple[int, bytes]:
        rel = p.relative_to(root).as_posix()
        size, raw = _fetch_header(ref.repo_id, commit, rel)
        _write_cached(_cache_path(ref.repo_id, commit, rel), size, raw)
        return size, raw

    with ThreadPoolExecutor(min(_HEADER_THREADS, len(todo))) as pool:
        return dict(zip(todo, pool.map(fetch, todo)))


def _hub_header_reader(ref: HubRef, commit: str, root: Path,
                       fetched: dict[Path, tuple[int, bytes]]) -> Callable[[Path], ShardHeader]:
    """The HeaderSource reader: downloaded shard, else the fetched or cached header bytes."""
    def read(p: Path) -> ShardHeader:
        if p.is_file():
            return read_shard_header(p)
        rel = p.relative_to(root).as_posix()
        hit = fetched.get(p) or _read_cached(_cache_path(ref.repo_id, commit, rel))
        if hit is None:  # the cache changed under us: fetch it now
            hit = _fetch_header(ref.repo_id, commit, rel)
        return _header_from_raw(p, f"{ref.repo_id}: {rel}", *hit)

    return read


def open_hub_checkpoint(ref: HubRef) -> "Checkpoint":
    """The checkpoint of a Hub model repo from its config, index and shard headers only.

    Its root is the snapshot directory of the Hugging Face cache, so the result is the one
    `open_checkpoint` gives on the downloaded repository, plus `source`.
    """
    from wna16ctl.sources import HeaderSource, open_checkpoint

    _probe(ref)
    config = _download(ref, "config.json", ref.revision, first=True)
    root = config.parent  # <cache>/models--org--name/snapshots/<commit>
    commit = root.name
    _fetch_side_configs(ref, commit, config)
    indexed = _has_index(ref, commit)

    # with an index, the shards are the ones it names; without, a Hub safetensors repo has exactly one
    where = locate_shards(root) if indexed else ShardList(root, [root / SINGLE_NAME])

    def locate(r: Path) -> ShardList:
        return where if r == root else locate_shards(r)

    if all(p.is_file() for p in where.paths):  # the whole repository is in the cache: read it from disk
        ck = open_checkpoint(root)
    else:
        try:
            fetched = _prefetch_headers(ref, commit, root, where.paths)
        except BadInput as e:
            if not indexed and f"has no {SINGLE_NAME}" in e.message:
                raise BadInput(f"{ref}: has neither {INDEX_NAME} nor {SINGLE_NAME}; not a safetensors checkpoint "
                               "wna16ctl can read from the Hub (download it and inspect the directory)") from None
            raise
        ck = open_checkpoint(root, HeaderSource(locate=locate, read=_hub_header_reader(ref, commit, root, fetched)))
    ck.source = {"repo_id": ref.repo_id, "revision": ref.revision or "main", "commit": commit}
    return ck


# -- repack / verify: the whole snapshot ---------------------------------------------------------

def download_checkpoint(ref: HubRef, *, quiet: bool = False) -> Path:
    """Download (or find in the cache) the repository's files `repack`/`verify` use; the snapshot path.

    Progress bars are huggingface_hub's, on stderr."""
    hf = _hf()
    if quiet:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    _probe(ref)
    with _hub_errors(str(ref), model_arg=True):
        path = Path(hf.snapshot_download(ref.repo_id, revision=ref.revision, ignore_patterns=_SNAPSHOT_IGNORE))
    if not (path / "config.json").is_file():
        raise BadInput(f"{ref}: has no config.json; not a model checkpoint repository")
    return path


# -- verify's default samples --------------------------------------------------------------------

def gsm8k_test_file() -> Path:
    """The test split of the `openai/gsm8k` dataset (its `main` config) as a cached parquet file.

    The last of verify's default sample sources; offline and not cached, the message names the
    others."""
    hf = _hf()
    others = ("pass --samples FILE.jsonl (a 'question' per line), set WNA16CTL_SAMPLES to such a file or "
              "WNA16CTL_SHARED to a folder with data/gsm8k/test.jsonl")
    try:
        folder = Path(hf.snapshot_download(GSM8K_REPO, repo_type="dataset", allow_patterns=[GSM8K_TEST_FILES]))
    except Exception as e:  # every failure is one line naming the other sources
        reason = hub_error(e, f"{GSM8K_REPO} (dataset)", GSM8K_TEST_FILES).message
        if _offline():
            reason = f"{GSM8K_REPO} (dataset): not in the local Hugging Face cache and HF_HUB_OFFLINE is set"
        raise BadInput(f"no GSM8K samples: {reason}; {others}, or run once online") from None
    files = sorted(folder.glob(GSM8K_TEST_FILES))
    if not files:
        raise BadInput(f"{GSM8K_REPO} (dataset): has no {GSM8K_TEST_FILES}; {others}")
    return files[0]

def resolve_local(arg: str, revision: str | None, *, quiet: bool = False) -> tuple[str, HubRef | None]:
    """`repack`/`verify`'s CKPT as a local directory: itself, or the downloaded Hub snapshot."""
    ref = parse_ref(arg, revision)
    return (arg, None) if ref is None else (str(download_checkpoint(ref, quiet=quiet)), ref)
