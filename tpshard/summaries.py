"""The human summary of a `verify` report (tpshard.verify.report), printed on stdout by the CLI:
the per-layer table (alike layers folded, tpshard.render.fold_layers), the tensors, stages and
model lines, the failures and the verdict."""

from __future__ import annotations

from pathlib import Path

from rich.markup import escape

from tpshard.render import fold_layers, plural, show, table
from tpshard.verify.report import VerifyReport, layer_rows


def show_verify(result: VerifyReport, out: Path, model: bool) -> None:
    every = layer_rows(result)
    tolerance = every[0]["tol"] if every else "-"
    title = f"verify {out}: {result.topology.describe()}, {result.backend} on {result.device}, {result.dtype}, tolerance {tolerance}"
    rows = fold_layers([{k: v for k, v in row.items() if k != "tol"} for row in every], "layer", largest=("max_abs", "max_rel"))
    show(table(title, rows, drop=("format", "inputs", "max_abs")))
    if result.tensors is not None:
        t = result.tensors
        show(
            f"tensors: {plural(t.files, 'rank file')} (a file linked into several rank folders counted in each) match their"
            f" checksums, {t.whole} whole copies match the source,"
            f" {t.padded} paddings are zero" + ("" if t.ok else f" -- {plural(len(t.problems), 'problem')}")
        )
    if result.stages:  # a list (pipeline stages, or --pp asked for): findings, or none
        show(f"stages: {plural(len(result.stages), 'problem')}")
    elif result.topology.pp > 1:
        show(
            f"stages: {result.topology.pp} pipeline stages (layers {','.join(map(str, result.topology.pp_layers))}),"
            " every tensor on the stage the engine builds it on"
        )
    if result.model is not None:
        m = result.model
        ranks = "every rank" if result.topology.pp == 1 else "every rank of the last stage, hidden states passed stage to stage"
        show(
            f"model {m.architecture} vs transformers ({plural(m.batches, 'batch', 'batches')} of {m.sequences}x{m.tokens} tokens, {ranks}):"
            f" max abs logit diff {m.max_abs:.3g} (rel {m.max_rel:.3g}), top-1 agreement {m.top1:.4f}, KL {m.kl:.3g}"
        )
    for line in result.failures():
        show(f"FAIL {line}", soft_wrap=True, markup=False, style="red")
    verdict = "[green]ok[/]" if result.ok else f"[red]{plural(len(result.failures()), 'failing check')}[/]"
    show(f"{verdict} {escape(str(out))}: {plural(len(result.layers), 'layer')}" + (" + model" if model else "") + f" in {result.seconds:.2f} s")
