"""Reading tensor data: positioned reads into fresh buffers, one expert at a time.

`pread` instead of mmap keeps the resident set bounded by what the caller holds (mapped file pages
count towards RSS once touched), and a shard truncated after planning fails with a clear error
instead of a SIGBUS.  A reader may map instead (`TensorReader.mapped`: verify's round trip, whose
tensors live an expert long and whose bytes are mostly in the page cache already), which saves
copying every byte once more.  Legacy forms are normalised here, once, so the layout code sees a single
format: zero points as packed int32 [ceil(N/pf), G] codes, g_idx as int32 [K].
"""

from __future__ import annotations

import ctypes
import mmap
import os

import torch

from wna16ctl.sources.formats import CODES, G_IDX, SCALES, ZERO_POINTS
from wna16ctl.sources.formats.checks import check_g_idx  # re-exported: the readers' g_idx rule
from wna16ctl.sources.headers import TensorInfo
from wna16ctl.sources.raw import RawReader
from wna16ctl.sources.moe import ROLE_ORDER, MoELayer
from wna16ctl.errors import BadInput

from wna16ctl.dtypes import torch_dtype  # re-exported: the readers' name for it


def writable_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's storage (no numpy needed).

    The view keeps the tensor alive (through the ctypes array it is taken from).
    """
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("writable_view needs a contiguous CPU tensor")
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    array = (ctypes.c_char * nbytes).from_address(t.data_ptr())
    array._owner = t  # type: ignore[attr-defined]  # the memoryview holds `array`, `array` holds `t`
    return memoryview(array).cast("B")


def as_tensor(raw: torch.Tensor, st_dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Bytes (uint8) reinterpreted as a safetensors dtype and shape."""
    dtype = torch_dtype(st_dtype)
    if raw.numel() == 0:
        return torch.empty(shape, dtype=dtype)
    return raw.view(dtype).reshape(shape)


def dtype_from_name(name: str) -> torch.dtype:
    """`config.json`'s torch_dtype string ("bfloat16", "float16", ...) as a torch dtype."""
    d = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(d, torch.dtype):
        raise BadInput(f"config.json: torch_dtype {name!r} is not a torch dtype")
    return d


class TensorReader(RawReader):
    """Reads tensors by name from a checkpoint's shards (one open descriptor per shard)."""

    def __enter__(self) -> "TensorReader":
        return self

    # Read by mapping the file instead of copying it (`map_bytes`): for a caller that reads
    # bytes the page cache holds and lets go of each tensor soon (verify's round trip).
    mapped = False

    def read_bytes(self, info: TensorInfo) -> torch.Tensor:
        """The tensor's bytes as a uint8 tensor (uninitialised storage filled by pread: a bytearray
        would zero-fill first what pread then overwrites)."""
        if self.mapped:
            return self.map_bytes(info)
        out = torch.empty(info.nbytes, dtype=torch.uint8)
        self.read_into(info, writable_view(out))
        return out

    def map_bytes(self, info: TensorInfo) -> torch.Tensor:
        """The tensor's bytes as a uint8 tensor over a private mapping of the file: no copy out of
        the page cache (`read_bytes` copies every byte once more).  The mapping lives as long as the
        tensor, and counts towards the resident set only as long, so the caller keeps few alive.
        A file shorter than the tensor is refused first; one truncated while mapped would end
        the process (SIGBUS), so only readers of files nothing else writes set `mapped`."""
        if info.nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        fd = self.fd(info.file)
        if os.fstat(fd).st_size < info.end:
            raise BadInput(
                f"{info.file}: ends before tensor {info.name} does (the shard was truncated or replaced "
                "after planning); restore the file and run again"
            )
        start = info.start - info.start % mmap.ALLOCATIONGRANULARITY
        m = mmap.mmap(fd, info.end - start, offset=start, access=mmap.ACCESS_COPY)
        if hasattr(m, "madvise"):  # read the range ahead, as one pread would
            m.madvise(mmap.MADV_WILLNEED)
        out = torch.frombuffer(m, dtype=torch.uint8, count=info.nbytes, offset=info.start - start)
        if self.hasher is not None:
            self.hasher.update(memoryview(m)[info.start - start:info.end - start])
        return out

    def read(self, name: str) -> torch.Tensor:
        info = self.files.info(name)
        return as_tensor(self.read_bytes(info), info.dtype, info.shape)

    def read_projection(self, layer: MoELayer, expert: int, role: str) -> dict[str, torch.Tensor]:
        """One expert projection in the canonical form the layout package expects (`sources.formats`):
        its stored tensors read by role, legacy forms normalised, then converted by its format."""
        s = layer.scheme
        assert s is not None
        name = lambda kind: layer.stored_name(expert, role, kind)  # noqa: E731 - this expert's and role's tensor names, for the lines below
        roles = layer.fmt.read_roles(s)
        if roles is not None:  # the format converts its stored tensors itself
            names = {r: name(r) for r in roles}
            stored = {r: self.read(n) for r, n in names.items() if n in self.files}
            if SCALES in stored:
                check_scales(stored[SCALES], names[SCALES])
            return layer.fmt.canonical(stored, s, names)
        out = {CODES: self.read(name(CODES)), SCALES: self.read(name(SCALES))}
        check_scales(out[SCALES], name(SCALES))
        n_rows = out[CODES].shape[0]
        groups = out[SCALES].shape[1]
        k = layer.hidden_size if role in ("gate", "up") else layer.intermediate_size
        if not s.symmetric:
            out[ZERO_POINTS] = self.zero_point(name(ZERO_POINTS), n_rows, groups, s.num_bits)
        if s.act_order:
            gname = name(G_IDX)
            if gname in self.files:
                g_idx = self.read(gname)
                check_g_idx(g_idx, gname, k, s.group_size)
                out[G_IDX] = g_idx.to(torch.int32)
            else:  # old writers skipped a g_idx that was never set: groups in column order
                out[G_IDX] = (torch.arange(k, dtype=torch.int32) // s.group_size).to(torch.int32)
        return layer.fmt.canonical(out, s)

    def read_expert(self, layer: MoELayer, expert: int) -> dict[str, dict[str, torch.Tensor]]:
        return {role: self.read_projection(layer, expert, role) for role in ROLE_ORDER}

    def zero_point(self, name: str, n_rows: int, groups: int, num_bits: int) -> torch.Tensor:
        """A projection's zero points, packed (a legacy unpacked one checked within the bit width)."""
        from wna16ctl.layout.packing import pack_codes

        offset = 1 << (num_bits - 1)
        if name not in self.files:  # old writers skipped all-zero zero points
            codes = torch.full((n_rows, groups), offset, dtype=torch.int32)
            return pack_codes(codes, num_bits, dim=0)
        zp = self.read(name)
        if zp.dtype == torch.int32 and zp.shape[0] != n_rows:
            return zp
        # Legacy (compressed-tensors <= 0.9.3): unpacked signed zero points [N, G].
        z = zp.to(torch.int64)
        bad = (z < -offset) | (z >= offset)
        if bool(bad.any()):
            where = [int(i) for i in bad.nonzero()[0]]
            raise BadInput(
                f"{self.files.shard_of(name).path}: tensor {name} holds zero point {int(z[tuple(where)])} at {where}, "
                f"outside the {num_bits}-bit range [{-offset}, {offset - 1}]; the checkpoint is corrupt"
            )
        return pack_codes(zp.to(torch.int32) + offset, num_bits, dim=0)


def check_scales(scale: torch.Tensor, name: str) -> None:
    """Scales must be finite: a NaN or Inf would be written into every rank and poison the layer."""
    finite = torch.isfinite(scale)
    if not bool(finite.all()):
        where = [int(i) for i in (~finite).nonzero()[0]]
        raise BadInput(f"tensor {name}: scale {float(scale[tuple(where)])} at {where} is not finite; "
                       "the checkpoint is corrupt (re-quantize or re-download it)")
