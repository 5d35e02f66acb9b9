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
from tpshard.errors import OutputError, UsageError
from tpshard.manifest import RankFile, rank_dir, read_rank_records
from tpshard.plan import file_header
from tpshard.safetensors_format import nbytes_of
from tpshard.topology import MAX_WORLD

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


def _arguments(who: str, out_dir, rank, verify) -> Path:
    """The output folder as a Path, once every argument is of the kind a loader takes; UsageError
    naming the argument otherwise (a rank given as "1" would be formatted into a folder name or
    read as a rank the output does not hold)."""
    try:
        path = os.fspath(out_dir)
    except TypeError:
        path = None
    if not isinstance(path, str):  # bytes paths too: the manifest names files as text
        raise UsageError(f"{who}: out_dir must be a folder path (str or os.PathLike), got {out_dir!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < MAX_WORLD:
        raise UsageError(f"{who}: rank must be an integer from 0 to {MAX_WORLD - 1}, got {rank!r}")
    if not isinstance(verify, bool):
        raise UsageError(f"{who}: verify must be True or False, got {verify!r}")
    return Path(path)


def _rank_files(out_dir: Path, rank: int) -> list[_RankFile]:
    records = read_rank_records(out_dir, rank)
    if rank not in records.written_ranks:
        raise OutputError(f"{out_dir}: holds ranks {list(records.written_ranks)}, not rank {rank}")
    folder = out_dir / rank_dir(rank)
    if folder.is_symlink() or not folder.is_dir():
        raise OutputError(f"{folder} is missing or not a folder of the output")
    return [_RankFile(folder, rank, f, records.checksum) for f in records.files]


class RankTensors(Mapping[str, "torch.Tensor"]):  # noqa: F821
    """
    HF tensor name -> this rank's tensor, read lazily: each access reads one tensor from its file
    (and, with verify, checks the file on first use and the tensor's digest on every read).

    A context manager: leaving the `with` block (or close()) releases the open files; a tensor read
    after that opens its file again. Made by tpshard.open_rank.
    """

    _files: list[_RankFile] | tuple = ()  # what close() releases, even when __init__ refused its arguments

    def __init__(self, out_dir: str | Path, rank: int, *, verify: bool = True):
        out_dir = _arguments("open_rank", out_dir, rank, verify)
        self.out_dir, self.rank, self.verify = out_dir, rank, verify
        self.folder = out_dir / rank_dir(rank)
        with paused():
            self._files = _rank_files(out_dir, rank)
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

    def __repr__(self) -> str:
        return f"<RankTensors out={str(self.out_dir)!r} rank={self.rank} tensors={len(self._where)}>"

    def close(self) -> None:
        """Close the rank's open files (a later read opens its file again)."""
        for f in self._files:
            f.close()

    def __enter__(self) -> RankTensors:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

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
    """
    Opens one rank of a tpshard output: a mapping from HF tensor name to that rank's tensor, each
    read from the rank's own files when it is accessed.

    Args:
        out_dir (`str` or `os.PathLike`):
            The output folder `tpshard split` wrote (its tpshard-manifest.json and rank-NNNNN folders).
        rank (`int`):
            The world rank, from 0 (pp_rank * tp + tp_rank with pipeline stages).
        verify (`bool`, *optional*, defaults to `True`):
            Check every tensor's digest against the manifest as it is read; `False` skips the digests
            (for an output `tpshard check` proved already). File sizes and headers are compared with
            the plan either way (docs/format.md, "Loading").

    Returns:
        `RankTensors`: a read-only mapping of `torch.Tensor`s, and a context manager that closes the files.

    Raises UsageError for an argument of the wrong kind, OutputError for a broken output (naming the
    file and the tensor).

    Example:

    ```python
    import tpshard

    with tpshard.open_rank("out", 0) as tensors:
        q = tensors["model.layers.0.self_attn.q_proj.weight"]
    ```
    """
    return RankTensors(out_dir, rank, verify=verify)


def load_rank(out_dir: str | Path, rank: int, *, verify: bool = True) -> dict:
    """
    Loads every tensor of one rank of a tpshard output into memory, each tensor in memory of its
    own, copied from a memory map of each of the rank's files: no slicing, no reading of other ranks'
    bytes. Verified as open_rank verifies.

    Args:
        out_dir (`str` or `os.PathLike`):
            The output folder `tpshard split` wrote.
        rank (`int`):
            The world rank, from 0.
        verify (`bool`, *optional*, defaults to `True`):
            Check every tensor's digest against the manifest; `False` skips the digests only.

    Returns:
        `Dict[str, torch.Tensor]`: HF tensor name -> this rank's tensor.

    Example:

    ```python
    import tpshard

    state_dict = tpshard.load_rank("out", 0)  # then model.load_state_dict(state_dict) on rank 0
    ```
    """
    import mmap

    out_dir = _arguments("load_rank", out_dir, rank, verify)
    tensors = {}
    kinds: dict[tuple, tuple] = {}
    with paused():
        for f in _rank_files(out_dir, rank):
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
