"""open_rank: one rank's tensors, read from its own folder the way an engine would."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

from tpshard.errors import OutputError
from tpshard.manifest import Manifest, rank_dir, read_manifest


class RankTensors(Mapping[str, "torch.Tensor"]):  # noqa: F821
    """HF tensor name -> this rank's tensor. Lazy: each access reads one tensor from its file."""

    def __init__(self, out_dir: Path, manifest: Manifest, rank: int):
        self.rank, self.manifest = rank, manifest
        self.folder = Path(out_dir) / rank_dir(rank)
        self._file_of = {s.name: s.file for s in manifest.plan.rank_shards(rank)}
        self._handles: dict[str, object] = {}

    def _handle(self, file: str):
        if file not in self._handles:
            path = self.folder / file
            if not path.is_file():
                raise OutputError(f"rank {self.rank}: {path} is missing")
            from safetensors import safe_open  # torch is imported only when tensors are read

            self._handles[file] = safe_open(path, framework="pt")
        return self._handles[file]

    def __getitem__(self, name: str):
        return self._handle(self._file_of[name]).get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)


def open_rank(out_dir: str | Path, rank: int) -> RankTensors:
    """Mapping from HF tensor name to rank `rank`'s tensor, for any rank of a tpshard output."""
    manifest = read_manifest(out_dir)
    if rank not in manifest.written_ranks:
        raise OutputError(f"{out_dir}: holds ranks {list(manifest.written_ranks)}, not rank {rank}")
    return RankTensors(Path(out_dir), manifest, rank)
