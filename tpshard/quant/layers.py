"""The quantized cut: each tensor of a checkpoint's quantized linears, cut per rank from its layer's cut.

What this file is: `QuantLayers`, which the plan (tpshard.plan.make) hands every quantized tensor
and which answers with the tensor's kind, made from its per-rank records once per kind of tensor,
as the plan cuts a dense weight once per kind with `tpshard.plan.dense.cut_tensor`. The layer is
cut in its logical [N, K] coordinates by the dense rules (`LogicalLayer`: same groups, heads,
replicas, padding); here that cut is checked against the format's units (pack words, groups,
Marlin tiles, FP8 blocks), re-cut to whole blocks under --pad-blocks, and converted for each
on-disk tensor of the format into one narrow of one physical dim, a whole copy or a rewritten
value (tpshard.quant.shards). Refusals are collected over the whole checkpoint, so that `finish`
names every misaligned (tensor, rank) and every missing tensor at once; what only engine kernels
need is a warning.

What it is not: no dense rule (which dim, which group: tpshard.plan.dense), no config parsing
(tpshard.quant.config), no file layout, no bytes.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import msgspec

from tpshard.cuts import Cutting, even_cuts
from tpshard.errors import PlanError
from tpshard.quant.formats import QuantSpec, alignment
from tpshard.quant.shards import (
    ENGINE_MULTIPLES, PAD_BLOCK_FORMATS, engine_warnings, expected_physical_shape, fp4_expert_blocks, group_findings,
    misalignment_message, misalignments, moe_engine_note, pad_blocks_per, physical_cut,
)  # fmt: skip
from tpshard.safetensors_format import TensorInfo
from tpshard.topology import GroupName, Topology

_LAYER_OR_EXPERT = re.compile(r"\.\d+\.")
_BLOCK_FORMATS = ("fp8_block", "ct_fp8_block")  # block_n-scaled rows

K = TypeVar("K")


@dataclass(frozen=True, eq=False)
class LogicalLayer:
    """One kind of quantized linear [n, k] as the dense rules cut it, in logical coordinates.

    The plan makes one per kind of layer (class, role, piece, N, K) and hands the same object out
    for every module of that kind, so it is compared (and hashed) by identity."""

    layer_class: str
    piece: str
    padded: bool  # a plain MLP linear, which --pad-blocks may zero-pad to whole blocks
    n: int
    k: int
    cutting: Cutting  # along N (dim 0) or K (dim 1); dim None: whole
    group: GroupName  # "replicated" when whole
    # The engine's merged partitions per rank, where the engine checks each against an FP8 block
    # (tpshard.arch.base.PARTITIONS); () = the rank's rows are checked as one range.
    partitions: tuple[int, ...] = ()


class QuantLayers(Generic[K]):
    """Specs of quantized linears: the layer's logical cut (dense rules) converted per tensor.

    `layer_of(module, info, qspec, rule)` is the plan's: the LogicalLayer of a module, asked once
    per module (after its first tensor's suffix is known to the format, so that a tensor the format
    has not is refused first, as such); `rule` is the plan's, passed through. `make_kind(records)`
    makes the plan's kind of a tensor from its per-rank records (dicts of ShardSpec fields).
    Collects alignment errors over the whole checkpoint, so that `finish` refuses once with every
    (tensor, rank, misalignment), and engine-kernel warnings.
    """

    def __init__(
        self, topology: Topology, pad_blocks: bool, layer_of: Callable[[str, TensorInfo, QuantSpec, object], LogicalLayer],
        make_kind: Callable[[list[dict]], K],
    ):  # fmt: skip
        self.topology, self.pad_blocks = topology, pad_blocks
        self.layer_of, self.make_kind = layer_of, make_kind
        self.layers: dict[str, tuple[LogicalLayer, Cutting, list]] = {}  # module -> (layer, its cutting, aligned cuts or [])
        self.suffixes: dict[str, tuple[QuantSpec, set[str]]] = {}
        self.fits: dict[tuple[LogicalLayer, QuantSpec], tuple] = {}  # -> _fit(...)
        self.errors: list[tuple[str, str]] = []  # (tensor, message)
        self.engine = group_findings()
        self.moe_notes: set[str] = set()  # what SGLang's FusedMoE refuses for these experts (warnings)
        self.kinds: dict[tuple, K] = {}

    def _layer(self, module: str, info: TensorInfo, qspec: QuantSpec, rule: object, ep_slot: int | None):
        if module in self.layers:
            return self.layers[module]
        layer = self.layer_of(module, info, qspec, rule)
        # Every module of one kind of layer fits the format alike: worked out once.
        key = (layer, qspec)
        if key not in self.fits:
            self.fits[key] = self._fit(layer, qspec)
        cutting, bad, pad_hint = self.fits[key]
        if layer.layer_class == "FusedMoE" and (note := moe_engine_note(qspec)):
            self.moe_notes.add(note)
        cuts = cutting.cuts
        if cutting.dim is not None:
            full = _cut_extent(layer, cutting)
            by_role: dict[str, tuple] = {}
            for role, c, step, atom in bad:
                ranks = self.topology.ranks_of(layer.group, c.group_rank, cutting.factor, ep_slot)
                by_role.setdefault(role.suffix, (role, step, atom, []))[3].append((c, ranks))
            for role, step, atom, cut_ranks in by_role.values():
                self.errors.append((f"{module}.{role.suffix}", misalignment_message(
                    module, qspec, role, cut_ranks, step, atom, cutting.dim, full, layer.group, cutting.group_size, pad_hint,
                )))  # fmt: skip
            self._engine_check(module, qspec, layer, cutting)
            if layer.partitions and qspec.format in _BLOCK_FORMATS and not bad:
                self._partition_check(module, qspec, layer)
            if bad:
                cuts = []  # refused in finish(); no spec is made from a misaligned cut
        self.layers[module] = (layer, cutting, cuts)
        return self.layers[module]

    def _partition_check(self, module: str, qspec: QuantSpec, layer: LogicalLayer) -> None:
        bn = qspec.block[0]
        off = [p for p in layer.partitions if p % bn]
        if off:
            self.errors.append((f"{module}.weight", (
                f"{module}: {qspec.format} with block_n {bn}, and SGLang loads it into a merged layer whose per-rank"
                f" partitions are {list(layer.partitions)} rows over {layer.group} ({off[0]} % {bn} = {off[0] % bn}):"
                f" its FP8 block method refuses this (layers/quantization/fp8.py L600-610, 'output_partition_size"
                f" = {off[0]} is not divisible by weight quantization block_n = {bn}'); choose a smaller attention"
                " tp (--attn-dp) or keep this module bf16 (modules_to_not_convert), as the releases do"
            )))

    def _fit(self, layer: LogicalLayer, qspec: QuantSpec):
        """(cutting, misalignments, --pad-blocks hint) of a layer in this format: the dense rules'
        cutting, or under --pad-blocks its re-cut to whole blocks."""
        cutting = layer.cutting
        if cutting.segments and cutting.group_size == 1:  # one rank holds every segment whole: one run
            cutting = cutting._replace(kind="column", segments=(), cuts=even_cuts(layer.n, 1, layer.n))
        bad, pad_hint = [], ""
        if cutting.dim is not None:
            n, k = layer.n, layer.k
            full = _cut_extent(layer, cutting)
            roles = qspec.roles()
            bad = misalignments(qspec, roles, cutting.dim, full, cutting.cuts)
            # A segmented cut is in units of the segments' gcd: whole blocks of each rank's slice of every
            # segment (checked here) put every segment boundary on a block too.
            if not bad and qspec.format == "dsv4_fp4" and layer.layer_class == "FusedMoE":
                bad = fp4_expert_blocks(qspec, cutting.dim, cutting.cuts)
            if bad and qspec.format in PAD_BLOCK_FORMATS and layer.padded:
                atom = alignment(qspec, n, k)[cutting.dim]
                per = pad_blocks_per(qspec, full, cutting.group_size, atom)
                if self.pad_blocks:
                    cutting = cutting._replace(cuts=even_cuts(full, cutting.group_size, per))
                    bad = misalignments(qspec, roles, cutting.dim, full, cutting.cuts)
                else:
                    pad_hint = f" Pass --pad-blocks to zero-pad each rank to {per} ({per // atom} blocks)."
            elif bad and layer.layer_class == "FusedMoE":
                pad_hint = (
                    f" SGLang's FusedMoE refuses it too: choose --ep so that moe_tp = tp / ep leaves whole"
                    f" {bad[0][3]}-blocks of the expert intermediate size {full} per rank."
                )
        return cutting, bad, pad_hint

    def _engine_check(self, module: str, qspec: QuantSpec, layer: LogicalLayer, cutting: Cutting) -> None:
        if qspec.format not in ENGINE_MULTIPLES or cutting.dim is None:
            return
        kernel, n_mult, k_mult = ENGINE_MULTIPLES[qspec.format]
        per = cutting.cuts[0].length + cutting.cuts[0].pad
        n_r, k_r = (per, layer.k) if cutting.dim == 0 else (layer.n, per)
        g = self.topology.group_size(layer.group)
        for nk, size, mult in (("N", n_r, n_mult), ("K", k_r, k_mult)):
            if size % mult:
                self.engine[(qspec.format, kernel, nk, size, mult, layer.layer_class, layer.group, g)].append(module)

    def kind(
        self, name: str, info: TensorInfo, module: str, suffix: str, qspec: QuantSpec, rule: object,
        ep_slot: int | None = None, stages: tuple[int, ...] | None = None,
    ) -> K:  # fmt: skip
        """The kind of the quantized tensor `name` (`module`.`suffix`, as on disk)."""
        try:
            role = qspec.role(suffix)
        except KeyError:
            have = [r.suffix for r in qspec.roles()]
            raise PlanError(
                f"{name}: config.json quantizes {module} as {qspec.format} ({qspec.bits}-bit), whose tensors are"
                f" {', '.join(have)}; '{suffix}' is not one of them (is the module left unquantized? see docs/quantization.md)"
            ) from None
        layer, cutting, cuts = self._layer(module, info, qspec, rule, ep_slot)
        n, k = layer.n, layer.k
        self.suffixes.setdefault(module, (qspec, set()))[1].add(suffix)
        if role.dtype is not None and info.dtype != role.dtype:
            raise PlanError(f"{name}: dtype {info.dtype} on disk; {qspec.format} stores {suffix} as {role.dtype}")
        want = _expected_physical_shape(qspec, role, info.shape, n, k)
        if want != info.shape:
            raise PlanError(
                f"{name}: shape {list(info.shape)} on disk, but a {qspec.format} {qspec.bits}-bit layer"
                f" [N={n}, K={k}] (group {qspec.group_size}) stores {suffix} as {list(want)}"
            )
        # Every expert and layer of one kind cuts alike.
        key = (layer, qspec, suffix, info.dtype, info.shape, ep_slot, stages, bool(cuts))
        if key not in self.kinds:
            self.kinds[key] = self.make_kind(self._records(info, qspec, role, layer, cutting, cuts, ep_slot, stages))
        return self.kinds[key]

    def _records(self, info, qspec, role, layer, cutting, cuts, ep_slot, stages) -> list[dict]:
        """The per-rank records of one kind of quantized tensor, without its names."""
        n, k, group = layer.n, layer.k, layer.group
        base = dict(
            layer_class=layer.layer_class, piece=layer.piece, dtype=info.dtype,
            source_shape=info.shape, quant=qspec.format, logical_dim=cutting.dim, logical_size=(n, k)[cutting.dim or 0],
            ep_slot=ep_slot,
        )  # fmt: skip

        def whole() -> dict:
            factor = self.topology.group_size(group)
            return dict(
                base, kind="replicated", shape=info.shape, dim=None, start=0, length=info.shape[0] if info.shape else 1,
                pad=0, group=group, factor=factor, group_rank=0, group_size=1,
                ranks=self.topology.ranks_of(group, 0, factor, ep_slot, stages),
            )  # fmt: skip

        if cutting.dim is None:
            return [whole()]
        if not cuts:
            return []
        out = []
        for c in cuts:
            per_rank = dict(
                base, kind=cutting.kind, group=group, factor=cutting.factor, group_rank=c.group_rank,
                group_size=cutting.group_size, ranks=self.topology.ranks_of(group, c.group_rank, cutting.factor, ep_slot, stages),
                logical_start=c.start, logical_length=c.length, logical_pad=c.pad,
            )  # fmt: skip
            units = sum(cutting.segments) or 1  # a segmented cut holds its slice of each segment
            if role.rewrite_shape:  # CT weight_shape: the rank's own [N_r, K] / [N, K_r]
                value = [n, k]
                value[cutting.dim] = (c.length + c.pad) * units
                out.append(dict(per_rank, shape=info.shape, dim=None, start=0, length=info.shape[0], pad=0, value=tuple(value)))
                continue
            phys = _physical_cut(qspec, role, cutting.dim, _cut_extent(layer, cutting), c)
            if phys is None:
                return [dict(whole(), logical_dim=None)]
            dim, start, length, pad, ratio, atom, step = phys
            shape = list(info.shape)
            shape[dim] = (length + pad) * units
            segments = {"segments": cutting.segments} if cutting.segments else {}
            out.append(dict(
                per_rank, shape=tuple(shape), dim=dim, start=start, length=length, pad=pad,
                step=step, ratio=(ratio.numerator, ratio.denominator), atom=atom, **segments,
            ))  # fmt: skip
        return out

    def builtins(self) -> dict[str, dict]:
        """Plan.quant_layers: each quantized module's spec as plain data, converted once per distinct spec."""
        plain: dict[QuantSpec, dict] = {}
        out = {}
        for module, (spec, _) in sorted(self.suffixes.items()):
            if spec not in plain:
                plain[spec] = msgspec.to_builtins(spec)
            out[module] = plain[spec]
        return out

    def finish(self) -> list[str]:
        """Refuse misaligned cuts (all of them, with numbers); otherwise the engine-kernel warnings."""
        missing = []
        needs: dict[QuantSpec, set[str]] = {}  # a few specs, ~46k modules in DeepSeek-V3
        for module, (qspec, have) in self.suffixes.items():
            if qspec not in needs:
                needs[qspec] = {r.suffix for r in qspec.roles()}
                if qspec.format in ("gptq", "gptq_v2") and not qspec.desc_act:
                    needs[qspec].discard("g_idx")  # optional without act order; engines regenerate it
            if not have >= needs[qspec]:
                missing += [f"{module}.{s}" for s in sorted(needs[qspec] - have)]
        if missing:
            raise PlanError(f"quantized tensors missing from the checkpoint: {', '.join(missing[:6])}" + (f" and {len(missing) - 6} more" if len(missing) > 6 else ""))
        if self.errors:
            # One line per kind of tensor (layer and expert numbers masked): a MoE model repeats each
            # misalignment for every expert of every layer.
            kinds: dict[str, list[str]] = {}
            for name, message in self.errors:
                kinds.setdefault(_LAYER_OR_EXPERT.sub(".N.", name), []).append(message)
            lines = [m[0] + (f" (and {len(m) - 1} more like it in other layers/experts)" if len(m) > 1 else "") for m in kinds.values()]
            shown = "\n  ".join(lines[:12])
            more = f"\n  ... and {len(lines) - 12} more kinds" if len(lines) > 12 else ""
            raise PlanError(
                f"{len(self.errors)} quantized tensor cut(s) do not align at {self.topology.describe()}; nothing was written:\n  {shown}{more}"
            )
        return engine_warnings(self.engine) + [f"{n}; the split is exact" for n in sorted(self.moe_notes)]


def _cut_extent(layer: LogicalLayer, cutting: Cutting) -> int:
    """The logical extent the cuts index: the cut dim's size, or a segmented cut's unit (each
    segment holds segments[i] units of it; Qwen3.5's in_proj_qkv: [q | k | v] of K, K, V rows)."""
    full = (layer.n, layer.k)[cutting.dim or 0]
    return full // sum(cutting.segments) if cutting.segments else full


# The same quantized cut recurs for every expert and layer; Fraction arithmetic is worth caching.
_expected_physical_shape = functools.lru_cache(maxsize=4096)(expected_physical_shape)
_physical_cut = functools.lru_cache(maxsize=16384)(physical_cut)
