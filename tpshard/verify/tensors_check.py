"""Every byte of every rank: checksums, whole copies against the source, zero padding.

The layer-level forward exercises the sharded weights, but some bytes never reach an output a
comparison sees: a replicated norm, the row-parallel bias held by group ranks other than 0 (only
group rank 0 adds it), a quantized layer's whole scales on ranks that are not compared, vocab
padding rows and padded K columns (a zero input meets them), the low bits of a float32 weight (far
below any tolerance). So each rank also, on its own files only:

1. checks every file it reads against the manifest's checksums (a flipped byte anywhere fails);
2. sends the digest of each whole copy it holds (ShardSpec.dim is None: norms, q/k norms, row
   biases, whole scales, input scales) to rank 0, which compares it with the same tensor of the
   source (bytes, after casting to the shard's dtype if it differs); a `value` spec (rewritten
   content, CT weight_shape) is compared with its recorded value on the rank; so too each cut of a
   tensor no runtime layer runs (layer_specs.no_runtime: a gated DeltaNet's conv1d, A_log,
   dt_bias), against the source's cut as the plan records it (pieces.shard_bytes);
3. checks that the `pad` entries at the end of every padded tensor (ShardSpec.pad along dim) are
   zero bytes.

Only rank 0 reads the source; the ranks send digests, not tensors.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import torch

from tpshard.manifest import Manifest
from tpshard.pieces import shard_bytes
from tpshard.rank import _TORCH_DTYPES
from tpshard.verify.layer_specs import no_runtime
from tpshard.verify.report import TensorsResult


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().flatten().view(torch.uint8).numpy())


def digest(t: torch.Tensor) -> int:
    return zlib.crc32(_bytes(t))


def _max_abs(t: torch.Tensor) -> float:
    return float(t.abs().max()) if t.is_floating_point() and t.numel() and t.element_size() > 1 else float("nan")


def rank_facts(out: str | Path, manifest: Manifest, rank: int, tensors) -> dict:
    """What rank `rank` sends to rank 0 about its own bytes (runs on that rank, its files only)."""
    from tpshard.check import check_rank_files

    plan = manifest.plan
    problems = [f"rank {rank}: {p.message}" for p in check_rank_files(out, manifest, [rank]).problems]
    whole: dict[str, tuple[int, str, float]] = {}  # name -> (crc32, dtype, max |x|)
    padded = 0
    for s in plan.rank_shards(rank):
        if no_runtime(s) and s.name not in whole:
            whole[s.name] = (digest(tensors[s.name]), s.dtype, _max_abs(tensors[s.name]))
        if s.name in whole or (s.dim is not None and not s.pad):
            continue
        try:
            t = tensors[s.name]
        except Exception as e:  # noqa: BLE001 - an unreadable file is this rank's finding, not a crash
            problems.append(f"{s.name} on rank {rank}: cannot be read ({type(e).__name__}: {e})")
            continue
        if s.dim is None:
            if s.value is not None:
                if [int(v) for v in t.flatten().tolist()] != list(s.value):
                    problems.append(f"{s.name} on rank {rank}: holds {t.flatten().tolist()}, the manifest records {list(s.value)}")
                continue
            whole[s.name] = (digest(t), s.dtype, _max_abs(t))
        elif s.pad:
            padded += 1
            tail = t.narrow(s.dim, t.shape[s.dim] - s.pad, s.pad)
            if any(_bytes(tail)):
                nonzero = int(torch.count_nonzero(tail.contiguous().flatten().view(torch.uint8)))
                problems.append(
                    f"{s.name} on rank {rank}: its {s.pad} padding entries along dim {s.dim} are not zero ({nonzero} nonzero bytes)"
                )
    return {"problems": problems, "whole": whole, "padded": padded, "files": len(plan.rank_files(rank))}


def judge_facts(manifest: Manifest, sent: list[dict], src) -> TensorsResult:
    """Rank 0: every rank's whole copies against the source; the ranks' own problems collected."""
    plan = manifest.plan
    source_of = {s.name: s.source for s in plan.shards}
    cut_of = {(s.name, r): s for s in plan.shards if no_runtime(s) for r in s.ranks}  # (name, rank) -> its cut
    result = TensorsResult()
    problems: dict[str, None] = {}
    wrong: dict[str, list[int]] = {}
    why: dict[str, str] = {}
    reference: dict[str, tuple[int, float]] = {}
    for rank, facts in enumerate(sent):
        result.files += facts["files"]
        result.padded += facts["padded"]
        for p in facts["problems"]:
            problems.setdefault(p)
        for name, (crc, dtype, max_abs) in facts["whole"].items():
            result.whole += 1
            cut = cut_of.get((name, rank))
            key = name if cut is None else (name, cut.group_rank)
            if key not in reference:
                t = src.raw(source_of[name])
                want = getattr(torch, _TORCH_DTYPES[dtype])
                t = t.to(want) if t.dtype != want else t
                if cut is not None:  # this rank's cut of the source, as the plan records it
                    piece = shard_bytes(np.frombuffer(_bytes(t), np.uint8), tuple(t.shape), cut.dim, cut, cut.segments)
                    t = torch.frombuffer(bytearray(piece), dtype=t.dtype)
                reference[key] = (digest(t), _max_abs(t))
            ref_crc, ref_max = reference[key]
            if crc != ref_crc:
                wrong.setdefault(name, []).append(rank)
                if ref_max == ref_max and max_abs == max_abs and ref_max:  # not NaN: a float tensor
                    why.setdefault(name, f"max |x| {max_abs:.4g}, the source's {ref_max:.4g} (x{max_abs / ref_max:.3g})")
    for name, ranks in wrong.items():
        detail = f": {why[name]}" if name in why else ""
        problems.setdefault(f"{name} on world ranks {ranks}: bytes differ from the source's {source_of[name]}{detail}")
    result.problems = list(problems)
    return result
