"""Reading one rank's tensors from its own folder: lazily (open_rank) or all at once (load_rank).

Both verify by default what they hand back against the manifest: each file is a plain file of the
rank's folder (no link out of it), of the size the plan gives, whose safetensors header is the one
the plan gives (so no tensor is renamed, reordered, reshaped or moved), and every tensor's bytes have
the digest the manifest records (crc32 or sha256, `split --checksum`): another rank's file or a
flipped byte is an OutputError naming the file and the tensor, never data. `verify=False` skips the
digests (the size and header are still compared: they cost nothing) for callers that ran
`tpshard check` on this output already.

Neither builds the whole plan: tpshard.manifest.read_rank_records decodes the fields that place bytes
and lays out the rank's own files only (a 90,000-tensor manifest is ~30 MB), and the headers are
laid out when a file is first opened.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path

from tpshard.collector import paused
from tpshard.digest import tensor_digest
from tpshard.errors import OutputError
from tpshard.manifest import RankFile, rank_dir, read_rank_records
from tpshard.plan import file_header
from tpshard.safetensors_format import nbytes_of

# safetensors dtype -> torch dtype name, for tensors made from raw file bytes
_TORCH_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu", "I64": "int64", "I32": "int32", "I16": "int16",
    "I8": "int8", "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
}  # fmt: skip


class _RankFile:
    """One of the rank's files: its tensors in data order, offsets, planned header, open descriptor."""

    def __init__(self, folder: Path, rank: int, file: RankFile, algorithm: str):
        self.record, self.members, self.rank = file.record, file.members, rank
        self.path = folder / file.record.name
        self.algorithm = algorithm
        self.fd = -1
        self._layout: tuple[bytes, list[int]] | None = None
        if not self.record.checksum or not self.record.digests:
            raise OutputError(f"rank {rank}: the manifest has no digests for {self.record.name}")

    @property
    def layout(self) -> tuple[bytes, list[int]]:
        """The planned header and each tensor's data offset (laid out when the file is first opened)."""
        if self._layout is None:
            self._layout = file_header(self.members)
        return self._layout

    def open(self) -> int:
        """Open the file after checking it is a plain file of the right size with the planned header."""
        where = f"rank {self.rank}: {self.path}"
        header, offsets = self.layout
        try:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except FileNotFoundError:
            raise OutputError(f"{where} is missing") from None
        except OSError as e:  # ELOOP: a symbolic link, which tpshard never writes
            raise OutputError(f"{where} cannot be opened as a plain file of the output ({e.strerror})") from None
        try:
            st = os.fstat(fd)
            planned = offsets[-1] + nbytes_of(*self.members[-1][1:]) if self.members else len(header)
            if not stat.S_ISREG(st.st_mode):
                raise OutputError(f"{where} is not a regular file")
            if st.st_size != self.record.size or planned != self.record.size:
                raise OutputError(f"{where}: {st.st_size} bytes, the manifest says {self.record.size} and its plan {planned}")
            head = os.pread(fd, len(header), 0)
            if head != header:
                raise OutputError(f"{where}: {self._header_difference(head, header)}")
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        return fd

    @staticmethod
    def _header_difference(head: bytes, header: bytes) -> str:
        """Which tensor's entry first differs from the plan's (a renamed, reordered or reshaped tensor)."""
        def entries(raw: bytes) -> list:
            try:
                body = json.loads(raw[8:])
                body.pop("__metadata__", None)
                return sorted(body.items(), key=lambda kv: kv[1]["data_offsets"][0])
            except (ValueError, TypeError, KeyError, AttributeError, IndexError):
                return []

        got, want = entries(head), entries(header)
        for i, (w_name, w) in enumerate(want):
            if i >= len(got) or got[i] != (w_name, w):
                held = f"holds {got[i][0]} {got[i][1]['dtype']}{got[i][1]['shape']}" if i < len(got) else "holds nothing"
                return f"header differs from the plan at tensor {w_name} (planned {w['dtype']}{w['shape']} at data offset {w['data_offsets'][0]}; the file {held} there)"
        return "header differs from the plan (not the file the manifest describes)"

    def check_digest(self, i: int, data) -> None:
        if tensor_digest(self.algorithm, data) != self.record.digest(i, self.algorithm):
            raise OutputError(
                f"rank {self.rank}: {self.path}: tensor {self.members[i][0]} does not match its {self.algorithm}"
                " in the manifest (a flipped byte, or another rank's file)"
            )

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _rank_files(out_dir: Path, rank: int) -> list[_RankFile]:
    records = read_rank_records(out_dir, rank)
    if rank not in records.written_ranks:
        raise OutputError(f"{out_dir}: holds ranks {list(records.written_ranks)}, not rank {rank}")
    folder = out_dir / rank_dir(rank)
    if folder.is_symlink() or not folder.is_dir():
        raise OutputError(f"{folder} is missing or not a folder of the output")
    return [_RankFile(folder, rank, f, records.checksum) for f in records.files]


class RankTensors(Mapping[str, "torch.Tensor"]):  # noqa: F821
    """HF tensor name -> this rank's tensor. Lazy: each access reads one tensor from its file
    (and, with verify, checks the file on first use and the tensor's digest on every read)."""

    def __init__(self, out_dir: Path, rank: int, *, verify: bool = True):
        self.rank, self.verify = rank, verify
        self.folder = Path(out_dir) / rank_dir(rank)
        self._files: list[_RankFile] = []  # for close() when the manifest or the rank is refused
        with paused():
            self._files = _rank_files(Path(out_dir), rank)
            self._where = {m[0]: (f, i) for f in self._files for i, m in enumerate(f.members)}
        self._kinds: dict[tuple, tuple] = {}  # (dtype, shape) -> _tensor_kind

    def __getitem__(self, name: str):
        f, i = self._where[name]
        fd = f.fd if f.fd >= 0 else f.open()
        _, dtype, shape = f.members[i]
        kind = self._kinds.get((dtype, shape))
        if kind is None:
            kind = self._kinds[(dtype, shape)] = _tensor_kind(dtype, shape)
        n, torch_dtype, view = kind
        data = bytearray(n)
        if n and os.preadv(fd, [data], f.layout[1][i]) != n:
            raise OutputError(f"rank {self.rank}: {f.path}: tensor {name} is cut short")
        if self.verify:
            f.check_digest(i, data)
        return _tensor(data, torch_dtype, view)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def close(self) -> None:
        for f in self._files:
            f.close()

    def __del__(self) -> None:
        self.close()


def _tensor_kind(dtype: str, shape: tuple[int, ...]):
    """(bytes, torch dtype, view arguments) of a tensor; view None: the flat buffer is the tensor."""
    import torch  # only when tensors are read

    view = None if len(shape) == 1 else shape if shape else ((),)
    return nbytes_of(dtype, shape), getattr(torch, _TORCH_DTYPES[dtype]), view


def _tensor(data: bytearray, torch_dtype, view):
    """A tensor that owns `data` (nothing else views it), reinterpreted as `view` of `torch_dtype`."""
    import torch

    if not data:
        return torch.empty(view if view is not None else (0,), dtype=torch_dtype)
    flat = torch.frombuffer(data, dtype=torch_dtype)
    # view(*ints) parses its arguments about twice as fast as view(tuple): a MoE rank has ~90k tensors
    return flat if view is None else flat.view(*view)


def open_rank(out_dir: str | Path, rank: int, *, verify: bool = True) -> RankTensors:
    """Mapping from HF tensor name to rank `rank`'s tensor, for any rank of a tpshard output.

    verify=False skips the per-tensor digests (for outputs `tpshard check` proved already); file
    sizes and headers are compared with the plan either way."""
    return RankTensors(Path(out_dir), rank, verify=verify)


def load_rank(out_dir: str | Path, rank: int, *, verify: bool = True) -> dict:
    """Every tensor of rank `rank`, each in memory of its own, copied from a memory map of each of
    the rank's files: no slicing, no reading of other ranks' bytes. Verified as open_rank."""
    import mmap

    tensors = {}
    kinds: dict[tuple, tuple] = {}
    with paused():
        for f in _rank_files(Path(out_dir), rank):
            fd = f.open()
            try:
                with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mm:
                    view = memoryview(mm)
                    try:
                        for i, ((name, dtype, shape), offset) in enumerate(zip(f.members, f.layout[1])):
                            kind = kinds.get((dtype, shape))
                            if kind is None:
                                kind = kinds[(dtype, shape)] = _tensor_kind(dtype, shape)
                            n, torch_dtype, as_view = kind
                            # One copy per tensor, into a buffer the tensor then owns: fewer torch calls than
                            # a copy into torch.empty, and torch calls are most of the cost of small tensors.
                            data = bytearray(view[offset : offset + n])
                            if verify:
                                f.check_digest(i, data)
                            tensors[name] = _tensor(data, torch_dtype, as_view)
                    finally:
                        view.release()  # no view may outlive the map
            finally:
                f.close()
    return tensors
