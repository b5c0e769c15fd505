"""A shard header checked and summarised in native code (kernels/header_scan.cpp): inspect's fast path.

`headers.shard_header_from_bytes` builds one dict per tensor and checks the safetensors rules in
Python; on a Kimi-K2-sized checkpoint (2×10^5 tensors) that is most of what `inspect` costs.  The
native reader accepts a header only when it can prove it valid under the same rules, and then
returns what `scan.scan_digest` needs: the names, the entries of non-expert tensors, and the expert
tensors grouped per (prefix, projection, suffix) with their distinct dtypes and common shape.

Anything it does not accept -- an error, or only an unusual spelling -- returns None here, and the
Python reader decides and words the error.  Without a C++ compiler (or with WNA16CTL_NO_NATIVE=1)
every header takes the Python path, with the same results.
"""

from __future__ import annotations

import ctypes
import json
from dataclasses import dataclass

# (prefix, projection, suffix, expert numbers as written, distinct dtypes, the shape all share or None)
Group = tuple[str, str, str, list[str], list[str], "list[int] | None"]


@dataclass(frozen=True)
class HeaderDigest:
    names: list[str]  # every tensor, in header order
    sorted_names: bytes  # the names sorted bytewise, joined by "\n" (compared with the index's)
    metadata: dict[str, str]
    plain: dict[str, dict]  # the entries of tensors whose name lacks ".experts."
    groups: list[Group] | None  # None: some expert tensor's name does not split in four parts


def _library():
    """The header-scan library, or None (no compiler, or WNA16CTL_NO_NATIVE set: read per call,
    so the switch works at any time); `native.build` builds it on first use and keeps it."""
    from wna16ctl.native.build import header_scan_lib

    return header_scan_lib()


def native_header_scan_available() -> bool:
    return _library() is not None


def _call(fn_name: str, blob: bytes, *args: int, cap: int) -> memoryview | None:
    """The output of a native scan of `blob` (a view of the written bytes), or None (no library,
    or not accepted)."""
    lib = _library()
    if lib is None:
        return None
    fn = getattr(lib, fn_name)
    out_len = ctypes.c_int64(0)
    while True:
        # a bytearray's zeroed pages are only touched where the library writes (a ctypes buffer
        # would be cleared in full)
        out = bytearray(cap)
        rc = fn(blob, len(blob), *args, (ctypes.c_char * cap).from_buffer(out), cap, ctypes.byref(out_len))
        if rc != 2:
            break
        cap *= 2  # not reached for real inputs: the bounds below hold
    return memoryview(out)[: out_len.value] if rc == 0 else None


def digest_header(size: int, blob: bytes) -> HeaderDigest | None:
    """The digest of a header (`blob`: the JSON after the 8-byte length, of a file of `size`
    bytes), or None when the native reader is unavailable or does not accept it."""
    # output: the names twice (≤ 2 × input), the non-expert entries and the groups (≤ input each)
    raw = _call("wna16_header_scan", blob, size - 8 - len(blob), cap=4 * len(blob) + 4096)
    if raw is None:
        return None
    n = int.from_bytes(raw[:8], "little")
    text = str(raw[8:8 + n], "utf-8")
    at = 16 + n
    sorted_names = bytes(raw[at:at + n])
    info = json.loads(bytes(raw[at + n:]))
    meta = info["metadata"]
    return HeaderDigest(
        names=text.split("\n") if text else [],
        sorted_names=sorted_names,
        metadata=meta if meta is not None else {},
        plain=info["plain"],
        groups=None if info["ungrouped"] else [(p, j, s, e.split(","), d, sh) for p, j, s, e, d, sh in info["groups"]],
    )


def digest_index(blob: bytes) -> dict[str, bytes] | None:
    """A shard index's files, in first-seen order, each with the names the index assigns to it
    (sorted bytewise, joined by "\n"); None when the native reader is unavailable or does not
    accept the index (the Python reader then decides)."""
    # output: each name once plus 8 bytes and the file name per file, less than the input
    raw = _call("wna16_index_scan", blob, cap=len(blob) + 4096)
    if raw is None:
        return None
    count = int.from_bytes(raw[:8], "little")
    at = 8
    files: dict[str, bytes] = {}
    for _ in range(count):
        n = int.from_bytes(raw[at:at + 8], "little")
        rel = str(raw[at + 8:at + 8 + n], "utf-8")
        at += 8 + n
        m = int.from_bytes(raw[at:at + 8], "little")
        files[rel] = bytes(raw[at + 8:at + 8 + m])
        at += 8 + m
    return files
