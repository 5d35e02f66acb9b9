"""The `tpshard` command: a thin layer that parses options, calls the library, renders the result.

Human output goes to stderr through rich; `--json` puts machine output alone on stdout. A
TpshardError becomes its message and exit code; no user error prints a traceback.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import msgspec
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tpshard.errors import TpshardError
from tpshard.manifest import Options
from tpshard.topology import Topology

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Presharded tensor-parallel checkpoints: plan, split, check, verify.",
)
# Piped into a CI log, rich would wrap tables at 80 columns and cut tensor names.
err = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 200)

Model = Annotated[Path, typer.Argument(help="Hugging Face checkpoint folder (config.json + safetensors).")]
Tp = Annotated[int, typer.Option("--tp", help="Tensor-parallel size (world size).")]
AttnDp = Annotated[int, typer.Option("--attn-dp", help="Attention data-parallel replicas (SGLang --dp with --enable-dp-attention).")]
AttnCp = Annotated[int, typer.Option("--attn-cp", help="Attention context-parallel size.")]
Ep = Annotated[int, typer.Option("--ep", help="Expert-parallel size (SGLang --ep-size): routed experts in tp/ep-rank blocks, MoE-TP = tp / ep.")]
MoeDenseTp = Annotated[Optional[int], typer.Option("--moe-dense-tp", help="DeepSeek dense-layer MLP group (SGLang --moe-dense-tp-size): 1 = whole on every rank, or tp (default).")]
Pad = Annotated[bool, typer.Option("--pad/--no-pad", help="Zero-pad MLP dims the group does not divide (or refuse).")]
DpLmHead = Annotated[bool, typer.Option("--dp-lm-head", help="Shard lm_head over attn_tp instead of tp.")]
Json = Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")]
PadBlocks = Annotated[bool, typer.Option("--pad-blocks", help="FP8 block formats: zero-pad each rank's MLP shard to whole 128-blocks instead of refusing.")]
Workers = Annotated[Optional[int], typer.Option("--workers", help="I/O threads (default: from the CPU count).")]


def _options(pad: bool, dp_lm_head: bool, pad_blocks: bool = False) -> Options:
    return Options(pad=pad, dp_lm_head=dp_lm_head, pad_blocks=pad_blocks)


def _topology(tp: int, attn_dp: int, attn_cp: int, ep: int, moe_dense_tp: int | None) -> Topology:
    return Topology(tp=tp, attn_dp=attn_dp, attn_cp=attn_cp, ep=ep, moe_dense_tp=moe_dense_tp)


def _plan(model: Path, topology: Topology, options: Options):
    from tpshard.checkpoint import open_checkpoint
    from tpshard.plan import make_plan

    return make_plan(open_checkpoint(model), topology, options)


def _emit_json(obj) -> None:
    sys.stdout.buffer.write(msgspec.json.format(msgspec.json.encode(obj), indent=1) + b"\n")


def _table(title: str, rows: list[dict]) -> Table:
    table = Table(title=title, title_justify="left")
    for key in rows[0] if rows else []:
        table.add_column(key.replace("_", " "))
    for row in rows:
        table.add_row(*(str(v) for v in row.values()))
    return table


@app.command()
def plan(
    model: Model, tp: Tp = 1, attn_dp: AttnDp = 1, attn_cp: AttnCp = 1, ep: Ep = 1, moe_dense_tp: MoeDenseTp = None,
    pad: Pad = True, dp_lm_head: DpLmHead = False, pad_blocks: PadBlocks = False, json: Json = False,
) -> None:  # fmt: skip
    """Show what every rank will hold, before a byte is written."""
    from tpshard.report import human_bytes, kind_rows, rank_rows

    from tpshard.quant.shards import alignment_rows

    p = _plan(model, _topology(tp, attn_dp, attn_cp, ep, moe_dense_tp), _options(pad, dp_lm_head, pad_blocks))
    alignment = alignment_rows(p)  # quantized tensors: the pre-flight (misaligned cuts were refused above)
    if json:
        _emit_json({"plan": p, "by_kind": kind_rows(p), "by_rank": rank_rows(p), "alignment": alignment})
        return
    err.print(f"[bold]{model}[/] {p.model.architecture}, {p.topology.describe()}")
    err.print(_table("Per weight kind", kind_rows(p)))
    ranks = rank_rows(p)
    for row in ranks:
        row["bytes"] = human_bytes(row["bytes"])
        if "expert_bytes" in row:
            row["expert_bytes"] = human_bytes(row["expert_bytes"])
    err.print(_table("Per rank", ranks))
    if alignment:
        err.print(_table("Quantized tensors: cut, atom (pack unit / group / tile / block) and per-rank shape", alignment))
    unique = sum(f.size for f in p.files)
    err.print(f"{len(p.files)} distinct files, {human_bytes(unique)} written once (hard links share them between ranks)")
    for w in p.warnings:
        err.print(f"[yellow]warning:[/] {escape(w)}", soft_wrap=True)


@app.command()
def explain(
    model: Model, tp: Tp = 1, attn_dp: AttnDp = 1, attn_cp: AttnCp = 1, ep: Ep = 1, moe_dense_tp: MoeDenseTp = None,
    pad: Pad = True, dp_lm_head: DpLmHead = False, pad_blocks: PadBlocks = False,
    layer: Annotated[int, typer.Option("--layer", help="Decoder layer to walk through.")] = 0,
    json: Json = False,
) -> None:  # fmt: skip
    """Walk through one layer: segment, layer class and group, per-rank shape, disk slice, reduction."""
    from tpshard.report import explain_rows

    p = _plan(model, _topology(tp, attn_dp, attn_cp, ep, moe_dense_tp), _options(pad, dp_lm_head, pad_blocks))
    rows = explain_rows(p, layer)
    if not rows:
        mtp = f" + {p.model.num_nextn_predict_layers} MTP" if p.model.num_nextn_predict_layers else ""
        raise TpshardError(f"layer {layer} does not exist (the model has {p.model.num_layers}{mtp} layers)")
    if json:
        _emit_json(rows)
        return
    err.print(_table(f"Layer {layer} at {p.topology.describe()}", rows))


@app.command()
def split(
    model: Model,
    out: Annotated[Path, typer.Option("-o", "--out", help="Output folder (must not exist unless --force).")],
    tp: Tp = 1, attn_dp: AttnDp = 1, attn_cp: AttnCp = 1, ep: Ep = 1, moe_dense_tp: MoeDenseTp = None,
    pad: Pad = True, dp_lm_head: DpLmHead = False, pad_blocks: PadBlocks = False, workers: Workers = None,
    checksum: Annotated[str, typer.Option("--checksum", help="Tensor digests in the manifest: crc32 (fast) or sha256.")] = "crc32",
    ranks: Annotated[Optional[str], typer.Option("--ranks", help="Write only these ranks, e.g. 0-3 or 0,2,4.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output.")] = False,
    json: Json = False,
) -> None:  # fmt: skip
    """Read the checkpoint once and write each rank's presharded files plus the manifest."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    from tpshard.checkpoint import open_checkpoint
    from tpshard.report import human_bytes
    from tpshard.writer import split as do_split

    topology = _topology(tp, attn_dp, attn_cp, ep, moe_dense_tp)
    ckpt = open_checkpoint(model)
    total = sum(t.nbytes for t in ckpt.tensors.values())
    start = time.perf_counter()
    with Progress(
        "[progress.description]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
        console=err, transient=True, disable=json or not err.is_terminal,
    ) as progress:  # fmt: skip
        task = progress.add_task("splitting", total=total)
        manifest = do_split(
            ckpt, out, topology, msgspec.structs.replace(_options(pad, dp_lm_head, pad_blocks), checksum=checksum),
            workers=workers, force=force,
            ranks=parse_ranks(ranks), on_tensor=lambda n: progress.advance(task, n),
        )  # fmt: skip
    seconds = time.perf_counter() - start
    written = sum(f.size for f in manifest.files)
    summary = {
        "out": str(out), "ranks": list(manifest.written_ranks), "files": len(manifest.files),
        "bytes_read": total, "bytes_written": written, "seconds": round(seconds, 3),
    }  # fmt: skip
    if json:
        _emit_json(summary)
        return
    err.print(
        f"[green]split[/] {model} -> {out}: {len(manifest.written_ranks)} ranks, {len(manifest.files)} files,"
        f" read {human_bytes(total)}, wrote {human_bytes(written)} in {seconds:.2f} s"
    )
    for w in manifest.plan.warnings:
        err.print(f"[yellow]warning:[/] {escape(w)}", soft_wrap=True)


@app.command()
def check(
    out: Annotated[Path, typer.Argument(help="A tpshard output folder.")],
    source: Annotated[Optional[Path], typer.Option("--source", help="The checkpoint it was split from: enables bit-exact reassembly.")] = None,
    workers: Workers = None,
    json: Json = False,
) -> None:  # fmt: skip
    """Checksums, alignment checks and (with --source) bit-exact reassembly. Exit 1 on any mismatch."""
    from tpshard.check import check as do_check
    from tpshard.report import human_bytes

    start = time.perf_counter()
    report = do_check(out, source, workers=workers)
    seconds = time.perf_counter() - start
    if json:
        _emit_json({"ok": report.ok, "seconds": round(seconds, 3), **msgspec.to_builtins(report)})
    else:
        for p in report.problems:
            err.print(f"FAIL [{p.check}] {p.message}", soft_wrap=True, markup=False, style="red")
        if report.omitted:
            err.print(f"FAIL ... and {report.omitted} more problems", style="red")
        what = f"{report.files_checked} files ({human_bytes(report.bytes_checked)})"
        if source:
            what += f", {report.tensors_reassembled} source tensors reassembled bit-exact"
        if report.ok:
            err.print(f"[green]ok[/] {out}: {what} in {seconds:.2f} s")
        else:
            err.print(f"[red]{len(report.problems)} problem(s)[/] in {out} ({what})")
    if not report.ok:
        raise typer.Exit(1)


@app.command()
def verify(
    out: Annotated[Path, typer.Argument(help="A tpshard output folder (every rank written).")],
    source: Annotated[Path, typer.Option("--source", help="The checkpoint it was split from: the reference.")],
    model: Annotated[bool, typer.Option("--model", help="Also run the TP decoder and compare logits with transformers.")] = False,
    backend: Annotated[Optional[str], typer.Option("--backend", help="nccl or gloo (default: nccl with a GPU per rank, else gloo).")] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="Layer-level compute dtype: float32, bfloat16 or float16.")] = "float32",
    tokens: Annotated[int, typer.Option("--tokens", help="Rows of each random layer input; sequence length for --model.")] = 16,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random inputs.")] = 0,
    report: Annotated[Optional[Path], typer.Option("--report", help="Write the report as JSON here.")] = None,
    junit: Annotated[Optional[Path], typer.Option("--junit", help="Write JUnit XML here, for CI systems.")] = None,
    json: Json = False,
) -> None:  # fmt: skip
    """Load the shards into tensor-parallel layers and compare their outputs with the source. Exit 1 on any mismatch.

    Spawns one process per rank, or runs in place under torchrun (rank 0 reports)."""
    import os

    from tpshard.verify import verify as do_verify
    from tpshard.verify import write_junit, write_report
    from tpshard.verify.report import encode_report, layer_rows

    result = do_verify(out, source, model=model, backend=backend, dtype=dtype, tokens=tokens, seed=seed)
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun only rank 0 speaks and writes
        if report:
            write_report(result, report)
        if junit:
            write_junit(result, junit)
        if json:
            sys.stdout.buffer.write(encode_report(result))
        else:
            title = f"verify {out}: {result.topology.describe()}, {result.backend}, {result.dtype}, tolerance {layer_rows(result)[0]['tol'] if result.layers else '-'}"
            err.print(_table(title, [{k: v for k, v in row.items() if k != "tol"} for row in layer_rows(result)]))
            if result.model is not None:
                m = result.model
                err.print(
                    f"model {m.architecture} vs transformers ({m.batches} batches of {m.sequences}x{m.tokens} tokens):"
                    f" max abs logit diff {m.max_abs:.3g} (rel {m.max_rel:.3g}), top-1 agreement {m.top1:.4f}, KL {m.kl:.3g}"
                )
            for line in result.failures():
                err.print(f"FAIL {line}", soft_wrap=True, markup=False, style="red")
            verdict = "[green]ok[/]" if result.ok else f"[red]{len(result.failures())} failing check(s)[/]"
            err.print(f"{verdict} {out}: {len(result.layers)} layers" + (" + model" if model else "") + f" in {result.seconds:.2f} s")
    if not result.ok:
        raise typer.Exit(1)


@app.command()
def merge(
    parts: Annotated[list[Path], typer.Argument(help="Outputs of `split --ranks` for different ranks of one split.")],
    out: Annotated[Path, typer.Option("-o", "--out", help="Merged output folder.")],
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output.")] = False,
) -> None:
    """Join outputs written for different ranks (split --ranks on several nodes) into one."""
    from tpshard.merge import merge as do_merge

    manifest = do_merge(parts, out, force=force)
    err.print(f"[green]merged[/] {len(parts)} parts -> {out}: ranks {list(manifest.written_ranks)}")


def parse_ranks(text: str | None) -> list[int] | None:
    """'0-3,6' -> [0, 1, 2, 3, 6]."""
    if text is None:
        return None
    ranks: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            ranks.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise TpshardError(f"--ranks {text!r}: expected a list like 0-3 or 0,2,4") from None
    return sorted(ranks)


def main() -> None:
    try:
        app()
    except TpshardError as e:
        err.print(f"[red]error:[/] {escape(str(e))}", soft_wrap=True)
        sys.exit(e.exit_code)
