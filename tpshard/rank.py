"""Reading one rank's tensors from its own folder: lazily (open_rank) or all at once (load_rank).

Both verify by default what they hand back against the manifest: each file is a plain file of the
rank's folder (no link out of it), of the size the plan gives, whose safetensors header is the one
the plan gives (so no tensor is renamed, reordered, reshaped or moved), and every tensor's bytes have
the digest the manifest records (crc32 or sha256, `split --checksum`): another rank's file or a
flipped byte is an OutputError naming the file and the tensor, never data. `verify=False` skips the
digests (the size and header are still compared: they cost nothing) for callers that ran
`tpshard check` on this output already. Only the rank's own records are built from the manifest.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path

from tpshard.digest import new_hash
from tpshard.errors import OutputError
from tpshard.manifest import Manifest, OutputFile, ShardSpec, rank_dir, read_manifest
from tpshard.plan import spec_layout
from tpshard.safetensors_format import nbytes_of

# safetensors dtype -> torch dtype name, for tensors made from raw file bytes
_TORCH_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu", "I64": "int64", "I32": "int32", "I16": "int16",
    "I8": "int8", "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
}  # fmt: skip


class _RankFile:
    """One of the rank's files: its specs in data order, offsets, planned header, open descriptor."""

    def __init__(self, folder: Path, rank: int, record: OutputFile, specs: list[ShardSpec], manifest: Manifest):
        self.record, self.specs, self.rank = record, specs, rank
        self.path = folder / record.name
        self.header, self.offsets = spec_layout(specs)
        self.algorithm = manifest.options.checksum
        self.fd = -1
        if not record.checksum or len(record.digests) != len(specs):
            raise OutputError(f"rank {rank}: the manifest has no digests for {record.name}")

    def open(self) -> int:
        """Open the file after checking it is a plain file of the right size with the planned header."""
        where = f"rank {self.rank}: {self.path}"
        try:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except FileNotFoundError:
            raise OutputError(f"{where} is missing") from None
        except OSError as e:  # ELOOP: a symbolic link, which tpshard never writes
            raise OutputError(f"{where} cannot be opened as a plain file of the output ({e.strerror})") from None
        try:
            st = os.fstat(fd)
            planned = len(self.header) + sum(nbytes_of(s.dtype, s.shape) for s in self.specs)
            if not stat.S_ISREG(st.st_mode):
                raise OutputError(f"{where} is not a regular file")
            if st.st_size != self.record.size or planned != self.record.size:
                raise OutputError(f"{where}: {st.st_size} bytes, the manifest says {self.record.size} and its plan {planned}")
            head = os.pread(fd, len(self.header), 0)
            if head != self.header:
                raise OutputError(f"{where}: {self._header_difference(head)}")
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        return fd

    def _header_difference(self, head: bytes) -> str:
        """Which tensor's entry first differs from the plan's (a renamed, reordered or reshaped tensor)."""
        def entries(raw: bytes) -> list:
            try:
                body = json.loads(raw[8:])
                body.pop("__metadata__", None)
                return sorted(body.items(), key=lambda kv: kv[1]["data_offsets"][0])
            except (ValueError, TypeError, KeyError, AttributeError, IndexError):
                return []

        got, want = entries(head), entries(self.header)
        for i, (w_name, w) in enumerate(want):
            if i >= len(got) or got[i] != (w_name, w):
                held = f"holds {got[i][0]} {got[i][1]['dtype']}{got[i][1]['shape']}" if i < len(got) else "holds nothing"
                return f"header differs from the plan at tensor {w_name} (planned {w['dtype']}{w['shape']} at data offset {w['data_offsets'][0]}; the file {held} there)"
        return "header differs from the plan (not the file the manifest describes)"

    def digest_ok(self, i: int, data) -> bool:
        h = new_hash(self.algorithm)
        h.update(data)
        return h.digest().hex() == self.record.digests[i]

    def check_digest(self, i: int, data) -> None:
        if not self.digest_ok(i, data):
            self.digest_error(i)

    def digest_error(self, i: int):
        raise OutputError(
                f"rank {self.rank}: {self.path}: tensor {self.specs[i].name} does not match its {self.algorithm}"
                " in the manifest (a flipped byte, or another rank's file)"
            )

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _rank_files(out_dir: Path, manifest: Manifest, rank: int) -> list[_RankFile]:
    if rank not in manifest.written_ranks:
        raise OutputError(f"{out_dir}: holds ranks {list(manifest.written_ranks)}, not rank {rank}")
    folder = out_dir / rank_dir(rank)
    if folder.is_symlink() or not folder.is_dir():
        raise OutputError(f"{folder} is missing or not a folder of the output")
    by_file: dict[str, list[ShardSpec]] = {}
    for s in manifest.plan.rank_shards(rank):
        by_file.setdefault(s.file, []).append(s)
    return [_RankFile(folder, rank, f, by_file.get(f.name, []), manifest) for f in manifest.plan.rank_files(rank)]


class RankTensors(Mapping[str, "torch.Tensor"]):  # noqa: F821
    """HF tensor name -> this rank's tensor. Lazy: each access reads one tensor from its file
    (and, with verify, checks the file on first use and the tensor's digest on every read)."""

    def __init__(self, out_dir: Path, manifest: Manifest, rank: int, *, verify: bool = True):
        self.rank, self.manifest, self.verify = rank, manifest, verify
        self.folder = Path(out_dir) / rank_dir(rank)
        self._files = _rank_files(Path(out_dir), manifest, rank)
        self._where = {s.name: (f, i) for f in self._files for i, s in enumerate(f.specs)}

    def __getitem__(self, name: str):
        import torch  # only when tensors are read

        f, i = self._where[name]
        fd = f.fd if f.fd >= 0 else f.open()
        s = f.specs[i]
        n = nbytes_of(s.dtype, s.shape)
        data = bytearray(n)
        if n and os.preadv(fd, [data], f.offsets[i]) != n:
            raise OutputError(f"rank {self.rank}: {f.path}: tensor {name} is cut short")
        if self.verify:
            f.check_digest(i, data)
        dtype = getattr(torch, _TORCH_DTYPES[s.dtype])
        if not n:
            return torch.empty(s.shape, dtype=dtype)
        return torch.frombuffer(data, dtype=dtype).reshape(s.shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def close(self) -> None:
        for f in self._files:
            f.close()

    def __del__(self) -> None:
        self.close()


def open_rank(out_dir: str | Path, rank: int, *, verify: bool = True) -> RankTensors:
    """Mapping from HF tensor name to rank `rank`'s tensor, for any rank of a tpshard output.

    verify=False skips the per-tensor digests (for outputs `tpshard check` proved already); file
    sizes and headers are compared with the plan either way."""
    return RankTensors(Path(out_dir), read_manifest(out_dir), rank, verify=verify)


def load_rank(out_dir: str | Path, rank: int, *, verify: bool = True) -> dict:
    """Every tensor of rank `rank`, copied into memory the process owns, from a memory map of each
    of the rank's files: no slicing, no reading of other ranks' bytes. Verified as open_rank."""
    import mmap

    import torch

    tensors = {}
    for f in _rank_files(Path(out_dir), read_manifest(out_dir), rank):
        fd = f.open()
        try:
            # A copy per tensor from a private map measured fastest here: faster than read() into one
            # buffer, whose fresh pages fault inside the kernel's copy.
            with mmap.mmap(fd, 0, access=mmap.ACCESS_COPY) as mm:
                view = memoryview(mm)
                try:
                    for i, (s, offset) in enumerate(zip(f.specs, f.offsets)):
                        dtype = getattr(torch, _TORCH_DTYPES[s.dtype])
                        n = nbytes_of(s.dtype, s.shape)
                        if verify:
                            piece = view[offset : offset + n]
                            ok = f.digest_ok(i, piece)
                            piece.release()  # no view may outlive the map
                            if not ok:
                                f.digest_error(i)
                        t = torch.empty(s.shape, dtype=dtype)
                        if n:
                            mapped = torch.frombuffer(mm, dtype=torch.uint8, offset=offset, count=n)
                            t.reshape(-1).view(torch.uint8).copy_(mapped)  # reshape of a fresh tensor is a view
                            del mapped  # the map closes only once no tensor views it
                        tensors[s.name] = t
                finally:
                    view.release()
        finally:
            f.close()
    return tensors
