"""Quantized linears of a checkpoint: the layer's logical cut (dense rules) converted per tensor.

What it is not: no dense rule (tpshard.plan.dense), no file layout.
"""

from __future__ import annotations

import functools
import re

import msgspec

from tpshard.arch import Rule
from tpshard.errors import PlanError
from tpshard.cuts import even_cuts
from tpshard.plan.dense import PADDED_ROLES, Layout, cut_tensor, expected_shape, group_of
from tpshard.plan.kinds import TensorKind
from tpshard.quant.formats import QuantSpec, alignment
from tpshard.quant import shards as qshards
from tpshard.safetensors_format import TensorInfo

_LAYER_OR_EXPERT = re.compile(r"\.\d+\.")


class QuantLayers:
    """Specs of quantized linears: the layer's logical cut (dense rules) converted per tensor.

    Collects alignment errors over the whole checkpoint, so that `finish` refuses once with every
    (tensor, rank, misalignment), and engine-kernel warnings.
    """

    def __init__(self, ctx: Layout):
        self.ctx = ctx
        self.topology, self.model, self.options = ctx.topology, ctx.model, ctx.options
        self.layers: dict[str, tuple] = {}  # module -> (logical cutting, n, k, misaligned suffixes)
        self.suffixes: dict[str, tuple[QuantSpec, set[str]]] = {}
        self.cuttings: dict[tuple, tuple] = {}  # (layer kind, n, k, format) -> _logical_cut(...)
        self.errors: list[tuple[str, str]] = []  # (tensor, message)
        self.engine = qshards.group_findings()
        self.kinds: dict[tuple, TensorKind] = {}

    def _layer(self, module: str, info: TensorInfo, qspec: QuantSpec, rule: Rule, layer: str, ep_slot: int | None):
        if module in self.layers:
            return self.layers[module]
        shape = expected_shape(rule, self.model)
        if shape is None:
            raise PlanError(f"{module}: quantized ({qspec.format}), but {rule.layer_class} has no quantized load rule")
        n, k = shape
        # Every expert (and every layer) of one kind cuts the same way: work it out once.
        key = (rule.layer_class, rule.role, rule.piece, n, k, qspec)
        if key not in self.cuttings:
            self.cuttings[key] = self._logical_cut(module, info, qspec, rule, n, k)
        cutting, cuts, group, bad, pad_hint = self.cuttings[key]
        if cutting.dim is not None:
            full = (n, k)[cutting.dim]
            by_role: dict[str, tuple] = {}
            for role, c, step, atom in bad:
                ranks = self.topology.ranks_of(group, c.group_rank, cutting.factor, ep_slot)
                by_role.setdefault(role.suffix, (role, step, atom, []))[3].append((c, ranks))
            for role, step, atom, cut_ranks in by_role.values():
                self.errors.append((f"{module}.{role.suffix}", qshards.misalignment_message(
                    module, qspec, role, cut_ranks, step, atom, cutting.dim, full, group, cutting.group_size, pad_hint,
                )))  # fmt: skip
            self._engine_check(module, qspec, rule, group, cutting, n, k)
            if bad:
                cuts = []  # refused in finish(); no spec is made from a misaligned cut
        self.layers[module] = (cutting, cuts, n, k, group)
        return self.layers[module]

    def _logical_cut(self, module: str, info: TensorInfo, qspec: QuantSpec, rule: Rule, n: int, k: int):
        """(cutting, logical cuts, group, misalignments, --pad-blocks hint) of a layer [n, k]."""
        logical = msgspec.structs.replace(info, shape=(n, k))
        cutting = cut_tensor(f"{module}.weight", logical, rule, "weight", self.ctx)
        cuts = cutting.cuts
        group = group_of(rule, self.ctx) if cutting.dim is not None else "replicated"
        bad, pad_hint = [], ""
        if cutting.dim is not None:
            full = (n, k)[cutting.dim]
            roles = qspec.roles()
            bad = qshards.misalignments(qspec, roles, cutting.dim, full, cuts)
            if bad and qspec.format in qshards.PAD_BLOCK_FORMATS and rule.role in PADDED_ROLES:
                atom = alignment(qspec, n, k)[cutting.dim]
                per = qshards.pad_blocks_per(qspec, full, cutting.group_size, atom)
                if self.options.pad_blocks:
                    cuts = even_cuts(full, cutting.group_size, per)
                    cutting = cutting._replace(cuts=cuts)
                    bad = qshards.misalignments(qspec, roles, cutting.dim, full, cuts)
                else:
                    pad_hint = f" Pass --pad-blocks to zero-pad each rank to {per} ({per // atom} blocks)."
            elif bad and rule.layer_class == "FusedMoE":
                pad_hint = (
                    f" SGLang's FusedMoE refuses it too: choose --ep so that moe_tp = tp / ep leaves whole"
                    f" {bad[0][3]}-blocks of the expert intermediate size {full} per rank."
                )
        return cutting, cuts, group, bad, pad_hint

    def _engine_check(self, module, qspec, rule, group, cutting, n, k) -> None:
        if qspec.format not in qshards.ENGINE_MULTIPLES or cutting.dim is None:
            return
        kernel, n_mult, k_mult = qshards.ENGINE_MULTIPLES[qspec.format]
        per = cutting.cuts[0].length + cutting.cuts[0].pad
        n_r, k_r = (per, k) if cutting.dim == 0 else (n, per)
        g = self.topology.group_size(group)
        for nk, size, mult in (("N", n_r, n_mult), ("K", k_r, k_mult)):
            if size % mult:
                self.engine[(qspec.format, kernel, nk, size, mult, rule.layer_class, group, g)].append(module)

    def kind(
        self, name: str, info: TensorInfo, module: str, suffix: str, qspec: QuantSpec, rule: Rule, layer: str,
        ep_slot: int | None = None, stages: tuple[int, ...] | None = None,
    ) -> TensorKind:  # fmt: skip
        try:
            role = qspec.role(suffix)
        except KeyError:
            have = [r.suffix for r in qspec.roles()]
            raise PlanError(
                f"{name}: config.json quantizes {module} as {qspec.format} ({qspec.bits}-bit), whose tensors are"
                f" {', '.join(have)}; '{suffix}' is not one of them (is the module left unquantized? see docs/quantization.md)"
            ) from None
        cutting, cuts, n, k, group = self._layer(module, info, qspec, rule, layer, ep_slot)
        self.suffixes.setdefault(module, (qspec, set()))[1].add(suffix)
        if role.dtype is not None and info.dtype != role.dtype:
            raise PlanError(f"{name}: dtype {info.dtype} on disk; {qspec.format} stores {suffix} as {role.dtype}")
        want = _expected_physical_shape(qspec, role, info.shape, n, k)
        if want != info.shape:
            raise PlanError(
                f"{name}: shape {list(info.shape)} on disk, but a {qspec.format} {qspec.bits}-bit layer"
                f" [N={n}, K={k}] (group {qspec.group_size}) stores {suffix} as {list(want)}"
            )
        # Every expert and layer of one kind cuts alike (TensorKind).
        key = (rule.layer_class, rule.role, rule.piece, n, k, qspec, suffix, info.dtype, info.shape, ep_slot, stages, bool(cuts))
        if key not in self.kinds:
            self.kinds[key] = TensorKind(self._records(info, qspec, role, rule, cutting, cuts, n, k, group, ep_slot, stages), self.topology)
        return self.kinds[key]

    def _records(self, info, qspec, role, rule, cutting, cuts, n, k, group, ep_slot, stages) -> list[dict]:
        """The per-rank records of one kind of quantized tensor, without its names."""
        base = dict(
            layer_class=rule.layer_class, piece=rule.piece, dtype=info.dtype,
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
            if role.rewrite_shape:  # CT weight_shape: the rank's own [N_r, K] / [N, K_r]
                value = [n, k]
                value[cutting.dim] = c.length + c.pad
                out.append(dict(per_rank, shape=info.shape, dim=None, start=0, length=info.shape[0], pad=0, value=tuple(value)))
                continue
            phys = _physical_cut(qspec, role, cutting.dim, (n, k)[cutting.dim], c)
            if phys is None:
                return [dict(whole(), logical_dim=None)]
            dim, start, length, pad, ratio, atom, step = phys
            shape = list(info.shape)
            shape[dim] = length + pad
            out.append(dict(
                per_rank, shape=tuple(shape), dim=dim, start=start, length=length, pad=pad,
                step=step, ratio=(ratio.numerator, ratio.denominator), atom=atom,
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
        return qshards.engine_warnings(self.engine)


# The same quantized cut recurs for every expert and layer; Fraction arithmetic is worth caching.
_expected_physical_shape = functools.lru_cache(maxsize=4096)(qshards.expected_physical_shape)
_physical_cut = functools.lru_cache(maxsize=16384)(qshards.physical_cut)
