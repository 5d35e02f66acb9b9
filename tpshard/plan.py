"""make_plan: the one pure function that decides what every rank holds.

Inputs are headers and config only (no tensor data, no torch.distributed). Every cut is one
narrow of one source tensor along one dim plus zero padding at its end; this covers column, row,
QKV with GQA replicas, merged gate/up, vocab padding and padding of non-divisible MLP dims.
`split` executes the result, `check` inverts it; nothing else derives a slicing rule.
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec

from tpshard.checkpoint import Checkpoint, model_info
from tpshard.completeness import check_complete
from tpshard.errors import PlanError
from tpshard.manifest import Kind, ModelInfo, Options, OutputFile, Plan, ShardSpec, pack_tensors
from tpshard.quant.config import read_quant_config
from tpshard.quant.formats import QuantSpec, alignment
from tpshard.quant import shards as qshards
from tpshard.rules import ARCHITECTURES, DROPPED, Matcher, Rule
from tpshard.safetensors_format import TensorInfo, build_header, nbytes_of
from tpshard.topology import GroupName, Topology


class Cut(NamedTuple):
    """One group rank's piece of a tensor: source[dim][start : start+length] then `pad` zeros."""

    group_rank: int
    start: int
    length: int
    pad: int


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def even_cuts(n: int, parts: int, per: int) -> list[Cut]:
    """`parts` pieces of `per` along a dim of size n; trailing pieces are zero-padded past n."""
    return [
        Cut(r, r * per, max(0, min(per, n - r * per)), per - max(0, min(per, n - r * per)))
        for r in range(parts)
    ]


def group_of(rule: Rule, options: Options) -> GroupName:
    if rule.role == "lm_head":
        return "attn_tp" if options.dp_lm_head else "tp"
    return {"attn": "attn_tp", "embed": "attn_tp", "mlp": "tp", "replicated": "replicated"}[rule.role]


def expected_shape(rule: Rule, model: ModelInfo) -> tuple[int, int] | None:
    """[out, in] of a dense linear/embedding weight according to config.json."""
    h, q, kv, i = model.hidden_size, model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim, model.intermediate_size
    match rule.layer_class, rule.piece, rule.role:
        case ("VocabParallelEmbedding" | "ParallelLMHead"), _, _:
            return (model.vocab_size, h)
        case "QKVParallelLinear", "q", _:
            return (q, h)
        case "QKVParallelLinear", ("k" | "v"), _:
            return (kv, h)
        case "MergedColumnParallelLinear", _, _:
            return (i, h)
        case "RowParallelLinear", _, "attn":
            return (h, q)
        case "RowParallelLinear", _, "mlp":
            return (h, i)
    return None


class _Cutting(NamedTuple):
    kind: Kind
    dim: int | None
    factor: int
    group_size: int
    cuts: list[Cut]


def cut_tensor(
    name: str, info: TensorInfo, rule: Rule, param: str, topology: Topology, model: ModelInfo, options: Options
) -> _Cutting:
    """How one tensor is cut over its layer's group: the load contract of one weight."""
    group = group_of(rule, options)
    g = topology.group_size(group)
    shape = info.shape
    cls = rule.layer_class

    expected = expected_shape(rule, model)
    if expected and param == "weight" and shape != expected:
        raise PlanError(f"{name}: shape {list(shape)} on disk, but config.json implies {list(expected)}")
    if expected and param == "bias" and shape != (expected[0],):
        raise PlanError(f"{name}: shape {list(shape)} on disk, but config.json implies [{expected[0]}]")

    def whole(kind: Kind) -> _Cutting:
        length = shape[0] if shape else 1
        # factor = group size: every rank of the group holds the one replica
        return _Cutting(kind, None, g, 1, [Cut(0, 0, length, 0)])

    if cls == "Replicated":
        return whole("replicated")
    if cls == "RowParallelLinear" and param == "bias":
        return whole("row_bias")
    if param not in ("weight", "bias"):
        raise PlanError(f"{name}: no rule for parameter '{param}' of {cls} {rule.layer}")

    if cls in ("VocabParallelEmbedding", "ParallelLMHead"):
        v = shape[0]
        v_pad = ceil_div(v, options.vocab_multiple) * options.vocab_multiple
        if v_pad % g:
            raise PlanError(
                f"{name}: vocab {v} padded to {v_pad} (multiple of {options.vocab_multiple}) does not"
                f" divide over the {group} group of {g} ranks"
            )
        return _Cutting("vocab", 0, 1, g, even_cuts(v, g, v_pad // g))

    if cls == "QKVParallelLinear":
        if model.num_heads % g:
            raise PlanError(
                f"{name}: {model.num_heads} attention heads do not divide over the {group} group of {g} ranks"
            )
        if rule.piece == "q":
            per = model.num_heads // g * model.head_dim
            return _Cutting("qkv_q", 0, 1, g, even_cuts(shape[0], g, per))
        kv = model.num_kv_heads
        if g % kv and kv % g:
            raise PlanError(
                f"{name}: {kv} kv heads and the {group} group of {g} ranks: neither divides the other,"
                " so kv heads can be neither split nor replicated evenly"
            )
        head_rows = shape[0] // kv  # v_head_dim may differ from head_dim
        if g >= kv:  # each rank holds 1 kv head; `g // kv` consecutive ranks share it
            return _Cutting(f"qkv_{rule.piece}", 0, g // kv, kv, even_cuts(shape[0], kv, head_rows))  # type: ignore[arg-type]
        return _Cutting(f"qkv_{rule.piece}", 0, 1, g, even_cuts(shape[0], g, kv // g * head_rows))  # type: ignore[arg-type]

    if cls in ("MergedColumnParallelLinear", "ColumnParallelLinear", "RowParallelLinear"):
        kind: Kind = {"MergedColumnParallelLinear": "merged", "ColumnParallelLinear": "column"}.get(cls, "row")  # type: ignore[assignment]
        dim = 1 if kind == "row" else 0
        n = shape[dim]
        if n % g:
            if not (options.pad and rule.role == "mlp"):
                hint = " (pass --pad to zero-pad it)" if rule.role == "mlp" else ""
                raise PlanError(f"{name}: dim {dim} of size {n} does not divide over the {group} group of {g} ranks{hint}")
            return _Cutting(kind, dim, 1, g, even_cuts(n, g, ceil_div(n, g)))
        return _Cutting(kind, dim, 1, g, even_cuts(n, g, n // g))

    raise PlanError(f"{name}: layer class {cls} has no load rule")


def make_plan(ckpt: Checkpoint, topology: Topology, options: Options | None = None) -> Plan:
    """Every distinct per-rank tensor of the split, and the files that will hold them."""
    options = options or Options()
    model = model_info(ckpt)
    rules = ARCHITECTURES.get(model.architecture)
    if rules is None:
        raise PlanError(
            f"architecture {model.architecture} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}"
            " (docs/architectures.md says how to add one)"
        )
    matcher = Matcher(rules)
    warnings: list[str] = []
    if model.tie_word_embeddings:
        warnings.append(
            "lm_head is tied to model.embed_tokens (no lm_head.weight on disk): engines reuse the"
            f" embedding shard, over the {group_of(Rule('', 'VocabParallelEmbedding', 'embed', ''), options)} group"
        )

    specs: list[dict] = []
    unknown: list[str] = []
    ranks_of: dict[tuple, tuple[int, ...]] = {}  # (group, group rank, factor) -> world ranks, computed once
    quant = read_quant_config(ckpt.path, ckpt.config)
    check_complete(model, ckpt.config, ckpt.tensors, lambda m: quant is not None and quant.spec_for(m, True) is not None)
    qlayers = _QuantLayers(topology, model, options)
    # Source order by (file, offset): the writer then reads each file front to back.
    for name, info in sorted(ckpt.tensors.items(), key=lambda kv: (kv[1].file, kv[1].begin)):
        if DROPPED.fullmatch(name):
            warnings.append(f"{name}: dropped (engines recompute it)")
            continue
        module, _, param = name.rpartition(".")
        found = matcher.match(module)
        if found is None:
            unknown.append(name)
            continue
        rule, layer = found
        qspec = quant.spec_for(module, rule.layer_class in _LINEAR) if quant else None
        if qspec is not None and param != "bias":
            specs.extend(qlayers.specs(name, info, module, param, qspec, rule, layer))
            continue
        cutting = cut_tensor(name, info, rule, param, topology, model, options)
        group = group_of(rule, options) if cutting.kind != "replicated" else "replicated"
        for cut in cutting.cuts:
            shape = list(info.shape)
            if cutting.dim is not None:
                shape[cutting.dim] = cut.length + cut.pad
            key = (group, cut.group_rank, cutting.factor)
            if key not in ranks_of:
                ranks_of[key] = topology.ranks_of(*key)
            specs.append(
                dict(
                    name=name,
                    source=name,
                    layer=layer,
                    layer_class=rule.layer_class,
                    piece=rule.piece,
                    kind=cutting.kind,
                    dtype=info.dtype,
                    source_shape=info.shape,
                    shape=tuple(shape),
                    dim=cutting.dim,
                    start=cut.start,
                    length=cut.length,
                    pad=cut.pad,
                    group=group,
                    factor=cutting.factor,
                    group_rank=cut.group_rank,
                    group_size=cutting.group_size,
                    ranks=ranks_of[key],
                )
            )
    if unknown:
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise PlanError(
            f"no {model.architecture} rule covers {', '.join(unknown[:5])}{more}; tpshard never"
            " replicates a tensor it does not understand"
        )
    warnings.extend(qlayers.finish())
    pad_notes = sorted({f"{s['layer_class']} {s['name'].rsplit('.', 3)[-2]}" for s in specs if s["pad"] and s["kind"] != "vocab"})
    if pad_notes:
        warnings.append(f"zero-padded to divide: {', '.join(pad_notes)}")

    layouts: dict[str, tuple[bytes, list[int]]] = {}
    files = _layout_files(specs, topology, options, layouts)
    plan = Plan(
        topology=topology,
        options=options,
        model=model,
        tensors=pack_tensors(specs, files),
        files=tuple(files),
        warnings=tuple(warnings),
        quant_layers={m: msgspec.to_builtins(q) for m, (q, _) in sorted(qlayers.suffixes.items())},
    )
    plan.__dict__["_layouts"] = layouts  # the headers laid out below, so that Plan.layout need not redo them
    return plan


_LINEAR = ("QKVParallelLinear", "MergedColumnParallelLinear", "ColumnParallelLinear", "RowParallelLinear", "ParallelLMHead")


class _QuantLayers:
    """Specs of quantized linears: the layer's logical cut (dense rules) converted per tensor.

    Collects alignment errors over the whole checkpoint, so that `finish` refuses once with every
    (tensor, rank, misalignment), and engine-kernel warnings.
    """

    def __init__(self, topology: Topology, model: ModelInfo, options: Options):
        self.topology, self.model, self.options = topology, model, options
        self.layers: dict[str, tuple] = {}  # module -> (logical cutting, n, k, misaligned suffixes)
        self.suffixes: dict[str, tuple[QuantSpec, set[str]]] = {}
        self.errors: list[str] = []
        self.engine = qshards.group_findings()

    def _layer(self, module: str, info: TensorInfo, qspec: QuantSpec, rule: Rule, layer: str):
        if module in self.layers:
            return self.layers[module]
        shape = expected_shape(rule, self.model)
        if shape is None:
            raise PlanError(f"{module}: quantized ({qspec.format}), but {rule.layer_class} has no quantized load rule")
        n, k = shape
        logical = msgspec.structs.replace(info, shape=(n, k))
        cutting = cut_tensor(f"{module}.weight", logical, rule, "weight", self.topology, self.model, self.options)
        cuts = [qshards.LogicalCut(*c) for c in cutting.cuts]
        group = group_of(rule, self.options)
        if cutting.dim is not None:
            full = (n, k)[cutting.dim]
            roles = qspec.roles()
            bad = qshards.misalignments(qspec, roles, cutting.dim, full, cuts)
            pad_hint = ""
            if bad and qspec.format in qshards.PAD_BLOCK_FORMATS and rule.role == "mlp":
                atom = alignment(qspec, n, k)[cutting.dim]
                per = qshards.pad_blocks_per(qspec, full, cutting.group_size, atom)
                if self.options.pad_blocks:
                    cuts = [qshards.LogicalCut(*c) for c in even_cuts(full, cutting.group_size, per)]
                    cutting = cutting._replace(cuts=[Cut(*c) for c in cuts])
                    bad = qshards.misalignments(qspec, roles, cutting.dim, full, cuts)
                else:
                    pad_hint = f" Pass --pad-blocks to zero-pad each rank to {per} ({per // atom} blocks)."
            by_role: dict[str, tuple] = {}
            for role, c, step, atom in bad:
                ranks = self.topology.ranks_of(group, c.group_rank, cutting.factor)
                by_role.setdefault(role.suffix, (role, step, atom, []))[3].append((c, ranks))
            for role, step, atom, cut_ranks in by_role.values():
                self.errors.append(qshards.misalignment_message(
                    module, qspec, role, cut_ranks, step, atom, cutting.dim, full, group, cutting.group_size, pad_hint,
                ))  # fmt: skip
            self._engine_check(module, qspec, rule, group, cutting, n, k)
            if bad:
                cuts = []  # refused in finish(); no spec is made from a misaligned cut
        self.layers[module] = (cutting, cuts, n, k, group)
        return self.layers[module]

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

    def specs(self, name: str, info: TensorInfo, module: str, suffix: str, qspec: QuantSpec, rule: Rule, layer: str) -> list[dict]:
        try:
            role = qspec.role(suffix)
        except KeyError:
            have = [r.suffix for r in qspec.roles()]
            raise PlanError(
                f"{name}: config.json quantizes {module} as {qspec.format} ({qspec.bits}-bit), whose tensors are"
                f" {', '.join(have)}; '{suffix}' is not one of them (is the module left unquantized? see docs/quantization.md)"
            ) from None
        cutting, cuts, n, k, group = self._layer(module, info, qspec, rule, layer)
        self.suffixes.setdefault(module, (qspec, set()))[1].add(suffix)
        if role.dtype is not None and info.dtype != role.dtype:
            raise PlanError(f"{name}: dtype {info.dtype} on disk; {qspec.format} stores {suffix} as {role.dtype}")
        want = qshards.expected_physical_shape(qspec, role, info.shape, n, k)
        if want != info.shape:
            raise PlanError(
                f"{name}: shape {list(info.shape)} on disk, but a {qspec.format} {qspec.bits}-bit layer"
                f" [N={n}, K={k}] (group {qspec.group_size}) stores {suffix} as {list(want)}"
            )
        base = dict(
            name=name, source=name, layer=layer, layer_class=rule.layer_class, piece=rule.piece, dtype=info.dtype,
            source_shape=info.shape, quant=qspec.format, logical_dim=cutting.dim, logical_size=(n, k)[cutting.dim or 0],
        )  # fmt: skip
        whole = dict(
            base, kind="replicated", shape=info.shape, dim=None, start=0, length=info.shape[0] if info.shape else 1,
            pad=0, group=group, factor=self.topology.group_size(group), group_rank=0, group_size=1,
            ranks=self.topology.ranks_of(group, 0, self.topology.group_size(group)),
        )  # fmt: skip
        if cutting.dim is None:
            return [whole]
        if not cuts:
            return []
        out = []
        for c in cuts:
            per_rank = dict(
                base, kind=cutting.kind, group=group, factor=cutting.factor, group_rank=c.group_rank,
                group_size=cutting.group_size, ranks=self.topology.ranks_of(group, c.group_rank, cutting.factor),
                logical_start=c.start, logical_length=c.length, logical_pad=c.pad,
            )  # fmt: skip
            if role.rewrite_shape:  # CT weight_shape: the rank's own [N_r, K] / [N, K_r]
                value = [n, k]
                value[cutting.dim] = c.length + c.pad
                out.append(dict(per_rank, shape=info.shape, dim=None, start=0, length=info.shape[0], pad=0, value=tuple(value)))
                continue
            phys = qshards.physical_cut(qspec, role, cutting.dim, (n, k)[cutting.dim], c)
            if phys is None:
                return [dict(whole, logical_dim=None)]
            dim, start, length, pad, ratio, atom, step = phys
            shape = list(info.shape)
            shape[dim] = length + pad
            out.append(dict(
                per_rank, shape=tuple(shape), dim=dim, start=start, length=length, pad=pad,
                step=step, ratio=(ratio.numerator, ratio.denominator), atom=atom,
            ))  # fmt: skip
        return out

    def finish(self) -> list[str]:
        """Refuse misaligned cuts (all of them, with numbers); otherwise the engine-kernel warnings."""
        missing = []
        for module, (qspec, have) in self.suffixes.items():
            need = {r.suffix for r in qspec.roles()} - have
            if qspec.format in ("gptq", "gptq_v2") and not qspec.desc_act:
                need.discard("g_idx")  # optional without act order; engines regenerate it
            missing += [f"{module}.{s}" for s in sorted(need)]
        if missing:
            raise PlanError(f"quantized tensors missing from the checkpoint: {', '.join(missing[:6])}" + (f" and {len(missing) - 6} more" if len(missing) > 6 else ""))
        if self.errors:
            shown = "\n  ".join(self.errors[:8])
            more = f"\n  ... and {len(self.errors) - 8} more" if len(self.errors) > 8 else ""
            raise PlanError(
                f"{len(self.errors)} quantized tensor cut(s) do not align at {self.topology.describe()}; nothing was written:\n  {shown}{more}"
            )
        return qshards.engine_warnings(self.engine)


def file_header(tensors: list[tuple[str, str, tuple[int, ...]]]) -> tuple[bytes, list[int]]:
    """The header of an output file; {"format": "pt"} is what transformers expects to find."""
    return build_header(tensors, {"format": "pt"})


def spec_layout(specs: list[ShardSpec]) -> tuple[bytes, list[int]]:
    """Header bytes and each tensor's absolute data offset in a file holding `specs` in order."""
    return file_header([(s.name, s.dtype, s.shape) for s in specs])


def _file_label(spec: dict, topology: Topology) -> str:
    if len(spec["ranks"]) == topology.world_size:
        return "common"
    # Without attention DP attn_tp is the tp group itself: name it so.
    group = "tp" if topology.span(spec["group"]) == topology.tp else spec["group"]
    label = group if spec["factor"] == 1 else f"{group}-x{spec['factor']}"
    return f"{label}-{spec['group_rank']:03d}-of-{spec['group_size']:03d}"


def _layout_files(specs: list[dict], topology: Topology, options: Options, layouts: dict) -> list[OutputFile]:
    """Group specs by the set of ranks holding them (one file set each), split into parts by size.

    Sets `spec["file"]` in place and each file's (header, offsets) in `layouts`. Tensors keep source
    order inside a file.
    """
    by_ranks: dict[tuple[int, ...], list[dict]] = {}
    for spec in specs:
        by_ranks.setdefault(spec["ranks"], []).append(spec)
    files: list[OutputFile] = []
    for ranks, members in by_ranks.items():
        label = _file_label(members[0], topology)
        parts: list[list[dict]] = [[]]
        size = 0
        for spec in members:
            nbytes = nbytes_of(spec["dtype"], spec["shape"])
            if parts[-1] and size + nbytes > options.max_file_bytes:
                parts.append([])
                size = 0
            parts[-1].append(spec)
            size += nbytes
        for p, part in enumerate(parts):
            suffix = f"-part-{p + 1:05d}-of-{len(parts):05d}" if len(parts) > 1 else ""
            name = f"model-{label}{suffix}.safetensors"
            header, offsets = layouts[name] = file_header([(s["name"], s["dtype"], s["shape"]) for s in part])
            for s in part:
                s["file"] = name
            files.append(
                OutputFile(
                    name=name,
                    ranks=ranks,
                    size=len(header) + sum(nbytes_of(s["dtype"], s["shape"]) for s in part),
                )
            )
    return files
