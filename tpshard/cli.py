"""The `tpshard` command: a thin layer that parses options, calls the library, renders the result.

Tables and summaries go to stdout, progress, warnings and errors to stderr (tpshard.render);
`--json` puts machine output alone on stdout, an error as `{"error": ...}`. A TpshardError becomes
its message and exit code; no user error prints a traceback.
"""

# No `from __future__ import annotations` here, unlike the rest of the package: typer reads every
# command's annotations when the command line is parsed, and strings it must evaluate first made
# that 14 ms of every run instead of 7 (docs/performance.md).
import os
import signal
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import msgspec
import typer
from rich.markup import escape

from tpshard.errors import TopologyError, TpshardError, UsageError
from tpshard.manifest import Options
from tpshard.options import parse_ranks, parse_size
from tpshard.render import emit_json as _emit_json
from tpshard.render import byte_progress, err, plan_json_pieces, plural, show, step_progress
from tpshard.render import table as _table
from tpshard.topology import Topology

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Presharded tensor-parallel checkpoints: plan, split, check, verify.",
)

SplitTp = Annotated[Optional[int], typer.Option("--tp", help="Tensor-parallel size (world size); without it, one rank (said so).")]
Model = Annotated[Path, typer.Argument(help="Hugging Face checkpoint folder (config.json + safetensors).")]
Tp = Annotated[int, typer.Option("--tp", help="Tensor-parallel size (world size).")]
AttnDp = Annotated[int, typer.Option("--attn-dp", help="Attention data-parallel replicas (SGLang --attn-dp-size).")]
AttnCp = Annotated[int, typer.Option("--attn-cp", help="Attention context-parallel size.")]
Ep = Annotated[Optional[int], typer.Option("--ep", help="Expert-parallel size (SGLang --ep-size): routed experts in tp/ep-rank blocks, MoE-TP = tp / ep (default 1; tp with --moe-a2a-backend).")]
A2aBackend = Annotated[Optional[str], typer.Option("--moe-a2a-backend", help="SGLang --moe-a2a-backend the server will run (deepep, mooncake, ...): ep = tp, and shared experts whole on every rank where SGLang replicates them.")]
Dcp = Annotated[Optional[int], typer.Option("--dcp", help="SGLang --dcp-size (decode context parallelism), where the family's class reads it: Qwen3.5's K/V replicated over each DCP group; DeepSeek's weights unchanged.")]
DcpQ = Annotated[bool, typer.Option("--dcp-replicate-q-proj", help="SGLang --dcp-replicate-q-proj (DeepSeek MLA, with --dcp): recorded for the launch line; SGLang gathers the q projection after loading.")]
MoeDenseTp = Annotated[Optional[int], typer.Option("--moe-dense-tp", help="DeepSeek dense-layer MLP group (SGLang --moe-dense-tp-size): 1 = whole on every rank, or tp (default).")]
Pad = Annotated[bool, typer.Option("--pad/--no-pad", help="Zero-pad MLP dims the group does not divide (or refuse).")]
DpLmHead = Annotated[bool, typer.Option("--dp-lm-head", help="Shard lm_head over attn_tp instead of tp.")]
Json = Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")]
Pp = Annotated[Optional[int], typer.Option("--pp", help="Pipeline stages (world = pp x tp, rank = pp_rank x tp + tp_rank); layers split as --engine does unless --pp-layers.")]
PpLayers = Annotated[Optional[str], typer.Option("--pp-layers", help="Decoder layers per pipeline stage, e.g. 26,27,27 (give the server the same SGLANG_ or VLLM_PP_LAYER_PARTITION).")]
EngineOpt = Annotated[Optional[str], typer.Option("--engine", help="Pipeline stages as this engine builds them: sglang (default) or vllm (its default partition; lm_head on the last stage; a tied model's last stage holds the embedding).")]
PadBlocks = Annotated[bool, typer.Option("--pad-blocks", help="FP8 block formats: zero-pad each rank's MLP shard to whole 128-blocks instead of refusing.")]
Workers = Annotated[Optional[int], typer.Option("--workers", help="Copy workers: processes for split and check --source, threads elsewhere (default: from the CPU count).")]
EngineFormat = Annotated[Optional[str], typer.Option("--format", help="Engine sharded_state export: vllm or sglang (docs/deploy.md).")]
Checksum = Annotated[str, typer.Option("--checksum", help="Tensor digests in the manifest: crc32 (fast) or sha256.")]
Ranks = Annotated[Optional[str], typer.Option("--ranks", help="Write only these ranks, e.g. 0-3 or 0,2,4.")]
Force = Annotated[bool, typer.Option("--force", help="Replace an existing output.")]
MaxPartSize = Annotated[str, typer.Option("--max-part-size", help="Engine export: largest part file per rank, e.g. 5GiB, 500MB, 1048576.")]


def _print_version(value: bool) -> None:
    if value:
        from tpshard.version import __version__

        show(f"tpshard {__version__}", markup=False)
        raise typer.Exit()


@app.callback()
def _tpshard(
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True, help="Print tpshard's version and exit.")] = False,
) -> None:
    """Presharded tensor-parallel checkpoints: plan, split, check, verify."""


def _options(pad: bool, dp_lm_head: bool, pad_blocks: bool = False) -> Options:
    return Options(pad=pad, dp_lm_head=dp_lm_head, pad_blocks=pad_blocks)


def _engine(engine: str | None, default: str = "sglang") -> str:
    engine = default if engine is None else engine
    if engine not in ("sglang", "vllm"):
        raise UsageError(f"--engine {engine}: choose sglang or vllm")
    return engine


def _topology(
    tp: int, attn_dp: int, attn_cp: int, ep: int | None, moe_dense_tp: int | None, pp: int | None = None,
    pp_layers: str | None = None, engine: str | None = None, a2a: str | None = None, dcp: int | None = None, qrep: bool = False, ckpt=None,
) -> Topology:  # fmt: skip
    """The topology asked for; with --pp / --pp-layers, the partition of the checkpoint's layers
    (the engine's default one unless --pp-layers). Without --ep, ep is 1, or tp under an all-to-all
    backend (SGLang sets it so); an --ep that contradicts the backend is Topology's refusal."""
    partition, engine = msgspec.UNSET, _engine(engine)
    if ep is None:
        ep = tp if a2a not in (None, "none") else 1
    if pp is not None or pp_layers is not None:
        from tpshard.checkpoint import model_info
        from tpshard.stages import resolve_partition

        partition = resolve_partition(model_info(ckpt).num_layers, pp, pp_layers, engine)
    try:
        return Topology(
            tp=tp, attn_dp=attn_dp, attn_cp=attn_cp, ep=ep, moe_dense_tp=moe_dense_tp, pp_layers=partition, engine=engine,
            moe_a2a_backend=msgspec.UNSET if a2a is None else a2a, dcp=msgspec.UNSET if dcp is None else dcp, dcp_replicate_q_proj=qrep,
        )  # fmt: skip
    except TopologyError as e:  # said in the options the user typed
        raise TopologyError(e.flags) from None


def _plan(model: Path, topology_args: tuple, options: Options):
    """The plan for `model`; topology_args are _topology's (the partition needs the checkpoint)."""
    from tpshard.checkpoint import open_checkpoint
    from tpshard.plan import make_plan

    ckpt = open_checkpoint(model)
    return make_plan(ckpt, _topology(*topology_args, ckpt=ckpt), options)


def _stage_lines(p) -> None:
    """plan: each pipeline stage's layers, and the partition the engine must be started with."""
    from tpshard.report import human_bytes, stage_rows
    from tpshard.stages import ENGINE_NAME, launch_hint

    rows = stage_rows(p)
    if not rows:
        return
    for row in rows:
        row["bytes_per_rank"] = human_bytes(row["bytes_per_rank"])
    engine = p.topology.placed_for
    show(_table(f"Pipeline stages ({ENGINE_NAME[engine]} placement)", rows, drop=("also", "layer_count")))
    show(launch_hint(engine, p.topology.pp_layers), markup=False, soft_wrap=True)


@app.command()
def plan(
    model: Model, tp: Tp = 1, attn_dp: AttnDp = 1, attn_cp: AttnCp = 1, ep: Ep = None, moe_a2a_backend: A2aBackend = None, moe_dense_tp: MoeDenseTp = None,
    pp: Pp = None, pp_layers: PpLayers = None, engine: EngineOpt = None, dcp: Dcp = None, dcp_replicate_q_proj: DcpQ = False,
    pad: Pad = True, dp_lm_head: DpLmHead = False, pad_blocks: PadBlocks = False, json: Json = False,
) -> None:  # fmt: skip
    """Show what every rank will hold, before a byte is written."""
    from tpshard.quant.shards import alignment_rows
    from tpshard.report import human_bytes, kind_rows, rank_rows, stage_rows

    p = _plan(model, (tp, attn_dp, attn_cp, ep, moe_dense_tp, pp, pp_layers, engine, moe_a2a_backend, dcp, dcp_replicate_q_proj), _options(pad, dp_lm_head, pad_blocks))
    alignment = alignment_rows(p)  # quantized tensors: the pre-flight (misaligned cuts were refused above)
    if json:
        out = {"plan": p, "by_kind": kind_rows(p), "by_rank": rank_rows(p), "alignment": alignment}
        if p.topology.pp > 1:
            from tpshard.stages import PARTITION_ENV, partition_value

            out |= {"stages": stage_rows(p), "partition_env": {PARTITION_ENV[p.topology.placed_for]: partition_value(p.topology.pp_layers)}}
        sys.stdout.buffer.writelines(plan_json_pieces(out, p))
        return
    from tpshard.report import attn_coordinates_used, topology_text

    show(f"[bold]{escape(str(model))}[/] {p.model.architecture}, {escape(topology_text(p))}", soft_wrap=True)
    for w in p.warnings:  # before the tables they explain
        err.print(f"[yellow]warning:[/] {escape(w)}", soft_wrap=True)
    _stage_lines(p)
    show(_table("Per weight kind", kind_rows(p), drop=("layer_class", "distinct", "source_shape")))
    ranks = rank_rows(p)
    for row in ranks:
        row["bytes"] = human_bytes(row["bytes"])
        if "expert_bytes" in row:
            row["expert_bytes"] = human_bytes(row["expert_bytes"])
        if not attn_coordinates_used(p):  # attention follows tp: these coordinates place nothing
            for key in ("attn_dp", "attn_cp", "attn_tp"):
                del row[key]
    show(_table("Per rank", ranks, drop=("attn_cp", "files", "tensors", "expert_bytes")))
    if alignment:
        show(_table("Quantized tensors: cut, atom (pack unit / group / tile / block) and per-rank shape", alignment, drop=("step", "format")))
    unique = sum(f.size for f in p.files)
    show(f"{len(p.files)} distinct files, {human_bytes(unique)} written once (hard links share them between ranks)")


@app.command()
def explain(
    model: Model, tp: Tp = 1, attn_dp: AttnDp = 1, attn_cp: AttnCp = 1, ep: Ep = None, moe_a2a_backend: A2aBackend = None, moe_dense_tp: MoeDenseTp = None,
    pp: Pp = None, pp_layers: PpLayers = None, engine: EngineOpt = None, dcp: Dcp = None, dcp_replicate_q_proj: DcpQ = False,
    pad: Pad = True, dp_lm_head: DpLmHead = False, pad_blocks: PadBlocks = False,
    layer: Annotated[int, typer.Option("--layer", help="Decoder layer to walk through.")] = 0,
    json: Json = False,
) -> None:  # fmt: skip
    """Walk through one layer: segment, layer class and group, per-rank shape, disk slice, reduction."""
    from tpshard.report import explain_rows

    p = _plan(model, (tp, attn_dp, attn_cp, ep, moe_dense_tp, pp, pp_layers, engine, moe_a2a_backend, dcp, dcp_replicate_q_proj), _options(pad, dp_lm_head, pad_blocks))
    rows = explain_rows(p, layer)
    if not rows:
        mtp = f" + {p.model.num_nextn_predict_layers} MTP" if p.model.num_nextn_predict_layers else ""
        raise TpshardError(f"layer {layer} does not exist (the model has {p.model.num_layers}{mtp} layers)")
    if json:
        _emit_json(rows)
        return
    where = ""
    if p.topology.pp > 1:
        from tpshard.stages import stage_of_layer

        stage = p.topology.pp - 1 if layer >= p.model.num_layers else stage_of_layer(p.topology.pp_layers, layer)
        ranks = p.topology.stage_ranks(stage)
        where = f", pipeline stage {stage} (ranks {ranks[0]}-{ranks[-1]})"
    from tpshard.report import topology_text

    show(f"{escape(topology_text(p))}", soft_wrap=True)  # a line of its own: a table's title wraps at the table's width
    show(_table(f"Layer {layer}{where}", rows, drop=("reduction", "layer")))


@app.command()
def split(
    model: Model,
    out: Annotated[Path, typer.Option("-o", "--out", help="Output folder (must not exist unless --force).")],
    tp: SplitTp = None, attn_dp: AttnDp = 1, attn_cp: AttnCp = 1, ep: Ep = None, moe_a2a_backend: A2aBackend = None, moe_dense_tp: MoeDenseTp = None,
    pp: Pp = None, pp_layers: PpLayers = None, engine: EngineOpt = None, dcp: Dcp = None, dcp_replicate_q_proj: DcpQ = False,
    pad: Pad = True, dp_lm_head: DpLmHead = False, pad_blocks: PadBlocks = False, workers: Workers = None,
    checksum: Checksum = "crc32", ranks: Ranks = None, force: Force = False,
    format: EngineFormat = None, max_part_size: MaxPartSize = "5GiB",
    json: Json = False,
) -> None:  # fmt: skip
    """Read the checkpoint once and write each rank's presharded files plus the manifest.

    With --format vllm|sglang, OUT is the engine export instead: the tpshard output is written
    beside it (hidden), exported, and removed (with --pp, --format vllm places the stages as vLLM
    does unless --engine says otherwise)."""
    if tp is None:  # a one-rank output is rarely what a user without --tp meant: say it
        err.print("[yellow]note:[/] no --tp given: writing one rank (tp 1); give --tp N for N ranks", soft_wrap=True)
        tp = 1
    if format is not None:
        if ranks is not None:
            raise TpshardError("--ranks and --format: an engine export needs every rank; split --ranks, merge, then tpshard export")
        engine = _engine(engine, format if format in ("sglang", "vllm") else "sglang")
        max_bytes = parse_size(max_part_size)
    from tpshard.checkpoint import open_checkpoint
    from tpshard.report import human_bytes, topology_text
    from tpshard.writer import split as do_split

    ckpt = open_checkpoint(model)
    topology = _topology(tp, attn_dp, attn_cp, ep, moe_dense_tp, pp, pp_layers, engine, moe_a2a_backend, dcp, dcp_replicate_q_proj, ckpt)
    start = time.perf_counter()
    if format is not None:
        from tpshard.export import split_and_export

        options = _options(pad, dp_lm_head, pad_blocks)  # the checksum is checked as the split starts, after export's refusals
        with byte_progress(f"splitting for {format}", 0, quiet=json) as advance:
            manifest = split_and_export(
                ckpt, out, topology, format, options, max_part_bytes=max_bytes, workers=workers, force=force, checksum=checksum,
                on_bytes=advance, on_total=lambda n: advance(0, n),
            )  # fmt: skip
        return _export_summary(manifest, out, time.perf_counter() - start, json)
    total = sum(t.nbytes for t in ckpt.tensors.values())
    with byte_progress("splitting", total, quiet=json) as advance:
        manifest = do_split(
            ckpt, out, topology, msgspec.structs.replace(_options(pad, dp_lm_head, pad_blocks), checksum=checksum),
            workers=workers, force=force, ranks=parse_ranks(ranks), on_tensor=advance,
        )  # fmt: skip
    seconds = time.perf_counter() - start
    written = sum(f.size for f in manifest.written_files)
    summary = {"out": str(out), "ranks": list(manifest.written_ranks), "files": len(manifest.written_files), "bytes_read": total, "bytes_written": written, "seconds": round(seconds, 3)}
    _report_written(manifest, summary, json, (
        f"[green]split[/] {escape(str(model))} -> {escape(str(out))} ({topology_text(manifest.plan, parts=False)}): {plural(len(manifest.written_ranks), 'rank')},"
        f" {plural(len(manifest.written_files), 'distinct file')},"
        f" read {human_bytes(total)}, wrote {human_bytes(written)} in {seconds:.2f} s"
    ))  # fmt: skip


def _report_written(manifest, summary: dict, json: bool, headline: str) -> None:
    """split and reshard: the summary as JSON, or the headline, the plan's warnings and, with
    pipeline stages, how the server must be started."""
    if json:
        _emit_json(summary)
        return
    show(headline)
    for w in manifest.plan.warnings:
        err.print(f"[yellow]warning:[/] {escape(w)}", soft_wrap=True)
    from tpshard.report import server_hints

    for line in server_hints(manifest.plan.topology, manifest.plan.model.architecture):  # the server options this layout needs
        show(line, markup=False, soft_wrap=True)


@app.command()
def reshard(
    old: Annotated[Path, typer.Argument(help="An existing tpshard output (every rank written).")],
    out: Annotated[Path, typer.Option("-o", "--out", help="New output folder (must not exist unless --force).")],
    tp: Tp = 1, attn_dp: AttnDp = 1, attn_cp: AttnCp = 1, ep: Ep = None, moe_a2a_backend: A2aBackend = None, moe_dense_tp: MoeDenseTp = None,
    pp: Pp = None, pp_layers: PpLayers = None, engine: EngineOpt = None, dcp: Dcp = None, dcp_replicate_q_proj: DcpQ = False,
    pad: Pad = True, dp_lm_head: DpLmHead = False, pad_blocks: PadBlocks = False, workers: Workers = None,
    checksum: Checksum = "crc32", ranks: Ranks = None, force: Force = False,
    json: Json = False,
) -> None:  # fmt: skip
    """Write the split for another topology from an existing output, without the source checkpoint.

    The result is byte for byte what split of the source would write (prove it with check NEW --from OLD)."""
    from tpshard.check.output_source import open_output_source
    from tpshard.publish import check_output_path
    from tpshard.report import human_bytes, topology_text
    from tpshard.reshard import reshard as do_reshard
    from tpshard.workers import check_workers

    start = time.perf_counter()
    check_output_path(out, [old])  # before OLD is read through
    src = open_output_source(old, workers=check_workers(workers))
    topology = _topology(tp, attn_dp, attn_cp, ep, moe_dense_tp, pp, pp_layers, engine, moe_a2a_backend, dcp, dcp_replicate_q_proj, src.checkpoint)
    options = msgspec.structs.replace(_options(pad, dp_lm_head, pad_blocks), checksum=checksum)
    with byte_progress("resharding", sum(t.nbytes for t in src.checkpoint.tensors.values()), quiet=json) as advance:
        manifest = do_reshard(src, out, topology, options, workers=workers, force=force, ranks=parse_ranks(ranks), on_tensor=advance)
    seconds = time.perf_counter() - start
    written = sum(f.size for f in manifest.written_files)
    summary = {"from": str(old), "out": str(out), "ranks": list(manifest.written_ranks), "files": len(manifest.written_files), "bytes_written": written, "seconds": round(seconds, 3)}
    _report_written(manifest, summary, json, (
        f"[green]resharded[/] {escape(str(old))} ({topology_text(src.manifest.plan, parts=False)}) -> {escape(str(out))} ({topology_text(manifest.plan, parts=False)}):"
        f" {plural(len(manifest.written_ranks), 'rank')}, {plural(len(manifest.written_files), 'distinct file')}, wrote {human_bytes(written)} in {seconds:.2f} s"
    ))  # fmt: skip


@app.command()
def check(
    out: Annotated[Path, typer.Argument(help="A tpshard output folder, or an engine export (tpshard export).")],
    source: Annotated[Optional[Path], typer.Option("--source", help="The checkpoint it was split from: enables bit-exact reassembly.")] = None,
    from_output: Annotated[Optional[Path], typer.Option("--from", help="The tpshard output it was resharded from, when the source is gone: checked itself, then every tensor reassembled from it compared bit for bit.")] = None,
    workers: Workers = None,
    pp: Annotated[Optional[int], typer.Option("--pp", help="The pipeline stages the server will run: the output must be split for them.")] = None,
    pp_layers: Annotated[Optional[str], typer.Option("--pp-layers", help="The layer partition the server will run (its SGLANG_ or VLLM_PP_LAYER_PARTITION; the output's engine is in its manifest).")] = None,
    json: Json = False,
) -> None:  # fmt: skip
    """Checksums, alignment checks and (with --source) bit-exact reassembly. Exit 1 on any mismatch.

    With --pp (and --pp-layers), also that the output was split for the stages the server will
    build: --pp alone means the default partition of the engine the output was placed for."""
    from tpshard.check import check as do_check
    from tpshard.report import human_bytes

    start = time.perf_counter()
    shown = err.is_terminal and not json  # the total costs a read of the headers: only for a bar someone sees
    with byte_progress("checking", _check_total(out, source) if shown else 0, quiet=not shown) as advance:
        report = do_check(out, source, workers=workers, pp=pp, pp_layers=pp_layers, from_output=from_output, on_bytes=advance)
    seconds = time.perf_counter() - start
    if json:
        _emit_json({"ok": report.ok, "seconds": round(seconds, 3), **msgspec.to_builtins(report)})
    else:
        for p in report.problems:
            show(f"FAIL [{p.check}] {p.message}", soft_wrap=True, markup=False, style="red")
        if report.omitted:
            show(f"FAIL ... and {plural(report.omitted, 'more problem')}", style="red")
        what = f"{plural(report.files_checked, 'distinct file')} ({human_bytes(report.bytes_checked)})"
        if report.ok:
            if source:
                what += f", {report.tensors_reassembled} source tensors reassembled bit-exact"
            elif from_output:
                what += f", {report.tensors_reassembled} source tensors reassembled from {from_output} bit-exact"
            show(f"[green]ok[/] {escape(str(out))}: {what} in {seconds:.2f} s")
        else:  # never "bit-exact" beside a failure
            total = len(report.problems) + report.omitted
            show(f"[red]{plural(total, 'problem')}[/] in {escape(str(out))} ({what} checked): NOT verified")
    if not report.ok:
        raise typer.Exit(1)


def _check_total(out: Path, source: Path | None) -> int:
    """The bytes check's progress counts (tpshard.check's on_bytes): the source's tensors, or the
    output's distinct files; 0 (no bar) for an engine export or an unreadable manifest, which
    check itself reports."""
    try:
        if source is not None:
            from tpshard.checkpoint import open_checkpoint

            return sum(t.nbytes for t in open_checkpoint(source).tensors.values())
        from tpshard.manifest import read_manifest

        return sum(f.size for f in read_manifest(out).written_files)
    except (TpshardError, OSError):
        return 0


@app.command()
def verify(
    out: Annotated[Path, typer.Argument(help="A tpshard output folder (every rank written; under torchrun, this node's ranks).")],
    source: Annotated[Path, typer.Option("--source", help="The checkpoint it was split from: the reference (read by rank 0 only).")],
    model: Annotated[bool, typer.Option("--model", help="Also run the TP decoder and compare logits with transformers.")] = False,
    backend: Annotated[str, typer.Option("--backend", help="auto, nccl or gloo (auto: NCCL with a GPU per rank, else gloo; announced).")] = "auto",
    device: Annotated[str, typer.Option("--device", help="auto, cuda or cpu: where gloo ranks compute (auto: the GPUs if any).")] = "auto",
    dtype: Annotated[str, typer.Option("--dtype", help="Layer-level compute dtype: float32, bfloat16 or float16.")] = "float32",
    tokens: Annotated[int, typer.Option("--tokens", help="Rows of each random layer input; sequence length for --model.")] = 16,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random inputs.")] = 0,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds for the whole launch and for any one collective.")] = 1800.0,
    torchrun: Annotated[Optional[str], typer.Option("--torchrun", help="Run under torchrun with these options (quoted, e.g. \"--nproc-per-node 8\") and exit with verify's code.")] = None,
    report: Annotated[Optional[Path], typer.Option("--report", help="Write the report as JSON here.")] = None,
    junit: Annotated[Optional[Path], typer.Option("--junit", help="Write JUnit XML here, for CI systems.")] = None,
    json: Json = False,
    pp: Annotated[Optional[int], typer.Option("--pp", help="The pipeline stages the server will run: the output must be split for them.")] = None,
    pp_layers: Annotated[Optional[str], typer.Option("--pp-layers", help="The layer partition the server will run (its SGLANG_PP_LAYER_PARTITION).")] = None,
) -> None:  # fmt: skip
    """Load the shards into tensor-parallel layers and compare their outputs with the source. Exit 1 on any mismatch.

    Spawns one process per rank, or runs in place under torchrun (rank 0 reports). Exit codes: 0 ok,
    1 mismatch, 2 bad input, 3 a rank crashed or hung; under plain torchrun every failure reads 1,
    so use --torchrun "OPTIONS" (or check --report's "ok")."""
    from tpshard.verify.run import under_torchrun

    if torchrun is not None and not under_torchrun():
        _verify_torchrun(torchrun, out)
        return
    if not under_torchrun():
        _verify_here(out, source, model, backend, device, dtype, tokens, seed, timeout, report, junit, json, pp, pp_layers)
        return
    # Under torchrun: every rank leaves with its verdict written (for --torchrun) and at once, without
    # tearing down a process group a failed peer may still hold.
    from tpshard.verify.verdict import write_verdict

    rank = int(os.environ.get("RANK", "0"))
    try:
        ok = _verify_here(out, source, model, backend, device, dtype, tokens, seed, timeout, report, junit, json, pp, pp_layers)
        code, message = (0, "") if ok else (1, f"{out}: verify found mismatches (see rank 0's report)")
    except TpshardError as e:
        code, message = e.exit_code, (str(e) if getattr(e, "every_rank", False) else f"rank {rank}: {e}")
        if rank == 0 or not getattr(e, "every_rank", False):
            err.print(f"[red]error:[/] {escape(message)}", soft_wrap=True)
    except Exception as e:  # noqa: BLE001 - a crash on this rank: say which, and where
        import traceback

        where = traceback.extract_tb(e.__traceback__)[-1]
        code, message = 3, f"rank {rank} crashed: {type(e).__name__}: {e} ({where.filename}:{where.lineno})"
        err.print(f"[red]error:[/] {escape(message)}", soft_wrap=True)
    write_verdict(code, message)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _verify_here(out, source, model, backend, device, dtype, tokens, seed, timeout, report, junit, json, pp, pp_layers) -> bool:
    from tpshard.verify import verify as do_verify
    from tpshard.verify import write_junit, write_report
    from tpshard.summaries import show_verify
    from tpshard.verify.report import encode_report

    with step_progress("verify", quiet=json or int(os.environ.get("RANK", "0")) != 0) as step:

        def announce(line: str) -> None:
            err.print(line, style="bold", markup=False)
            step("every rank loading its shards, then the layers" + (" and the model" if model else "") + " against the source")

        def layers_done(done: int, total: int) -> None:  # rank 0's count: each layer judged, then the model
            step("layers" + (", then the model," if model else "") + " against the source", done, total, "steps" if model else "layers")

        step("reading the manifest and the source")
        result = do_verify(
            out, source, model=model, backend=backend, device=device, dtype=dtype, tokens=tokens, seed=seed,
            timeout_s=timeout, announce=announce, pp=pp, pp_layers=pp_layers, on_progress=layers_done,
        )  # fmt: skip
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun only rank 0 speaks and writes
        if report:
            write_report(result, report)
        if junit:
            write_junit(result, junit)
        if json:
            sys.stdout.buffer.write(encode_report(result))
        else:
            show_verify(result, out, model)
    if not result.ok and not os.environ.get("RANK"):
        raise typer.Exit(1)
    return result.ok


def _verify_torchrun(options: str, out: Path) -> None:
    """Re-run this very command under torchrun with `options`, and exit with verify's own code
    (a world that is not `out`'s is refused first, in one line)."""
    import shlex

    from tpshard.verify.verdict import refuse_torchrun_world, run_under_torchrun

    refuse_torchrun_world(out, shlex.split(options))

    argv = sys.argv[sys.argv.index("verify") + 1 :]
    rest, skip = [], False
    for arg in argv:  # this command's arguments, less --torchrun and its value
        if skip:
            skip = False
        elif arg == "--torchrun":
            skip = True
        elif not arg.startswith("--torchrun="):
            rest.append(arg)
    code, message = run_under_torchrun(shlex.split(options), rest)
    if code:
        err.print(f"[red]verify under torchrun: exit {code}[/] {escape(message)}", soft_wrap=True)
    raise typer.Exit(code)


@app.command()
def merge(
    parts: Annotated[list[Path], typer.Argument(help="Outputs of `split --ranks` for different ranks of one split.")],
    out: Annotated[Path, typer.Option("-o", "--out", help="Merged output folder.")],
    force: Force = False,
    json: Json = False,
) -> None:
    """Join outputs written for different ranks (split --ranks on several nodes) into one."""
    from tpshard.merge import merge as do_merge
    from tpshard.merge import missing_ranks

    with step_progress(f"merging {plural(len(parts), 'part')}", quiet=json) as step:
        step("checking the parts")
        manifest = do_merge(parts, out, force=force, on_rank=lambda done, total: step("linking", done, total, "ranks"))
    missing = missing_ranks(manifest)
    if json:
        _emit_json({"out": str(out), "parts": len(parts), "ranks": list(manifest.written_ranks), "missing_ranks": missing})
        return
    show(f"[green]merged[/] {plural(len(parts), 'part')} -> {escape(str(out))}: ranks {list(manifest.written_ranks)}")
    if missing:  # a merge in steps is allowed; verify and export need every rank
        err.print(f"[yellow]warning:[/] ranks {missing} of {manifest.topology.world_size} are in none of the parts: merge them in before verify or export", soft_wrap=True)


@app.command("export")
def export_cmd(
    out: Annotated[Path, typer.Argument(help="A tpshard output folder (every rank written).")],
    dest: Annotated[Path, typer.Option("-o", "--out", help="Export folder (must not exist unless --force).")],
    format: Annotated[str, typer.Option("--format", help="vllm or sglang: the engine whose --load-format sharded_state reads it.")],
    max_part_size: MaxPartSize = "5GiB", workers: Workers = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing export.")] = False,
    json: Json = False,
) -> None:  # fmt: skip
    """Write the per-rank files an engine's sharded_state loader reads, from a tpshard output."""
    from tpshard.export import export
    from tpshard.export.writer import export_total

    start = time.perf_counter()
    shown = err.is_terminal and not json  # the total costs a read of the manifest: only for a bar someone sees
    with byte_progress(f"exporting for {format}", export_total(out) if shown else 0, quiet=not shown) as advance:
        manifest = export(out, dest, format, max_part_bytes=parse_size(max_part_size), workers=workers, force=force, on_bytes=advance)
    _export_summary(manifest, dest, time.perf_counter() - start, json)


def _export_summary(manifest, dest: Path, seconds: float, json: bool) -> None:
    import shlex

    from tpshard.export.launch import launch_line
    from tpshard.report import human_bytes

    written = sum(f.size for f in manifest.files)
    tp, pp = manifest.from_.topology.tp, manifest.from_.topology.pp
    env = dict(manifest.env) if manifest.env else {}
    launch = launch_line(manifest, dest)  # the exported layout's every flag, paths quoted
    if json:
        summary = {"out": str(dest), "engine": manifest.engine, "tp": tp, "files": len(manifest.files), "bytes_written": written, "seconds": round(seconds, 3), "launch": launch}
        if pp > 1:
            summary |= {"pp": pp, "env": env}
        _emit_json(summary)
        return
    show(f"[green]export[/] {manifest.engine} -> {dest}: tp {tp}" + (f" x pp {pp}" if pp > 1 else "") + f", {plural(len(manifest.files), 'file')}, wrote {human_bytes(written)} in {seconds:.2f} s")
    for k, v in env.items():
        show(f"the server must be started with {k}={v} (the stages' layers; recorded in the export's manifest)", markup=False, soft_wrap=True)
    doc = "docs/pipeline.md" if pp > 1 else "docs/deploy.md"
    show(f"check with: tpshard check {shlex.quote(str(dest))} --source MODEL; launch with: {launch} ({doc})", markup=False, soft_wrap=True)


# Exit codes (docs/reliability.md): 0 ok, 1 check/verify found a mismatch, 2 a fault the user can fix
# (input, options, output folder, I/O such as a full or read-only disk), 130 interrupted (Ctrl-C).
EXIT_INTERRUPTED = 130


def _fail(message: str, code: int, markup: str = "[red]error:[/] ") -> None:
    """The one line of a fault on stderr and, under --json, `{"error": ..., "exit_code": ...}` alone on
    stdout, so a script reading the JSON sees why there is no result; then exit with `code`."""
    err.print(f"{markup}{escape(message)}", soft_wrap=True)
    if "--json" in sys.argv[1:]:
        _emit_json({"error": message, "exit_code": code})
    sys.exit(code)


def main() -> None:
    from tpshard.collector import frozen_at_exit, one_arena

    one_arena()
    frozen_at_exit()
    try:
        code = app(standalone_mode=False)
    except TpshardError as e:
        _fail(str(e), e.exit_code)
    except (KeyboardInterrupt, typer.Abort):
        code = EXIT_INTERRUPTED
    except OSError as e:  # the library names its own I/O faults; this is the net under them
        where = f" ({e.filename})" if e.filename else ""
        _fail(f"{e.strerror or e}{where}", 2)
    except Exception as e:
        if hasattr(e, "show") and hasattr(e, "exit_code"):  # click's usage errors (typer vendors click)
            e.show()
            if "--json" in sys.argv[1:]:
                _emit_json({"error": e.format_message(), "exit_code": e.exit_code})
            sys.exit(e.exit_code)
        raise
    if code == EXIT_INTERRUPTED:  # typer >= 0.2x turns Ctrl-C into this exit code by itself, silently
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C does not cut the message short
        _fail("stopped; anything staged was removed, existing outputs are as they were", code, "[red]interrupted[/]: ")
    sys.exit(code if isinstance(code, int) else 0)
