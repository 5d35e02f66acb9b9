"""What `verify` found: per-layer and model-level results, their tolerances, report.json and junit.xml.

Plain msgspec structs, built on rank 0 and broadcast to every rank, so that under torchrun every
process knows the verdict (and exits with the same code). No torch here.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import msgspec
from msgspec import UNSET, UnsetType

from tpshard.topology import Topology

REPORT_FORMAT = "tpshard-verify-report"
REPORT_VERSION = 2  # 2: the `tensors` section (checksums, whole copies, padding)

# Layer level: error = max |tp - ref| over every output element, ref computed in float64 from the
# source tensors on rank 0. `max_rel` divides it by max |ref| of that layer (elementwise relative
# error is meaningless where an output crosses zero). A layer passes when max_rel <= the tolerance
# of the compute dtype. Measured at Llama-3-8B shapes, tp 8 and 16 (benchmarks/verify_tolerance.py,
# docs/verify.md): worst float32 5e-7, bfloat16 1.0e-2, float16 1.8e-3 (row layers at tp 16: one
# rounding per rank in the all-reduce); the tolerances keep >= 4x. A wrong shard gives 0.1 .. 10.
# Quantized layers use the same tolerances: their reference weight is the dequantized source
# (float32, as the ranks dequantize), so only the GEMM's accumulation order differs.
LAYER_TOLERANCE = {"float32": 1e-5, "bfloat16": 4e-2, "float16": 8e-3}

# Model level (always float32, TF32 off): logits of the TP decoder vs transformers' forward.
MODEL_TOLERANCE = {
    "max_rel": 1e-4,  # max |logit diff| / max |reference logit|
    "top1": 1.0,  # fraction of positions whose argmax agrees (must be all of them)
    "kl": 1e-6,  # mean over positions of KL(reference || tp), nats
}


class LayerResult(msgspec.Struct, kw_only=True):
    layer: str  # engine layer name, e.g. model.layers.0.self_attn.qkv_proj
    layer_class: str
    group: str  # group it reduces/gathers over, as the manifest records it
    pieces: list[str]  # q/k/v, gate/up, or [""]
    batches: int  # distinct inputs: 1 per group instance (attention DP replicas get their own)
    quant: str = ""  # quantized format of the weights (tpshard.quant.formats.LAYOUTS), "" = dense
    max_abs: float = 0.0
    max_rel: float = 0.0
    tolerance: float = 0.0
    problems: list[str] = []
    # Pipeline stages whose ranks ran the layer (left out of report.json without stages).
    stages: list[int] | UnsetType = UNSET

    @property
    def ok(self) -> bool:
        return not self.problems and self.max_rel <= self.tolerance


MAX_MESSAGES = 6  # a layer's problems listed one by one; past them, "... N more"


def sent_problems(sent: dict[int, dict]) -> dict[str, None]:
    """The problems the ranks sent (world rank -> message), each once, in the order they came: the
    ordered set a layer's comparison adds its own findings to."""
    problems: dict[str, None] = {}
    for msg in sent.values():
        for p in msg["problems"]:
            problems.setdefault(p)
    return problems


def conclude(result: LayerResult, problems: dict[str, None], findings: dict[str, list[int]], max_abs: float, scale: float) -> LayerResult:
    """`result` with its error against the reference (`scale`: the reference's largest magnitude) and
    its problems: each finding (diagnosis -> world ranks) once with its ranks, then MAX_MESSAGES kept."""
    for what, ranks in findings.items():
        problems.setdefault(f"{what} on world ranks {sorted(set(ranks))}")
    result.max_abs, result.max_rel = max_abs, max_abs / scale
    result.problems = list(problems)[:MAX_MESSAGES] + ([f"... {len(problems) - MAX_MESSAGES} more"] if len(problems) > MAX_MESSAGES else [])
    return result


class ModelResult(msgspec.Struct, kw_only=True):
    architecture: str
    batches: int  # one per attention-DP replica
    sequences: int  # per batch
    tokens: int  # per sequence
    max_abs: float = 0.0
    max_rel: float = 0.0
    top1: float = 0.0
    kl: float = 0.0
    tolerance: dict[str, float] = {}
    problems: list[str] = []

    @property
    def ok(self) -> bool:
        t = self.tolerance
        return not self.problems and self.max_rel <= t["max_rel"] and self.top1 >= t["top1"] and self.kl <= t["kl"]


class TensorsResult(msgspec.Struct, kw_only=True):
    """Every byte of every rank (tpshard.verify.tensors_check): checksums, whole copies, padding."""

    files: int = 0  # weight files checked against the manifest's checksums, over all ranks
    whole: int = 0  # whole copies (norms, row biases, whole scales) and cuts with no runtime layer (conv1d) compared with the source, over all ranks
    padded: int = 0  # padded tensors whose padding was checked to be zero, over all ranks
    problems: list[str] = []

    @property
    def ok(self) -> bool:
        return not self.problems


class VerifyReport(msgspec.Struct, kw_only=True):
    format: str = REPORT_FORMAT
    version: int = REPORT_VERSION
    out_dir: str
    source: str
    topology: Topology
    backend: str
    device: str  # device of rank 0's layers: cpu or cuda:N
    dtype: str  # layer-level compute dtype
    seed: int
    tokens: int
    tensors: TensorsResult | None = None
    layers: list[LayerResult] = []
    model: ModelResult | None = None
    problems: list[str] = []  # not tied to one layer (a launch, a missing rank folder)
    # Pipeline stages: tensors the manifest puts on other stages than the engine builds them on
    # (tpshard.check's stage check); left out of report.json without stages.
    stages: list[str] | UnsetType = UNSET
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return (
            not self.problems and all(r.ok for r in self.layers) and (self.model is None or self.model.ok)
            and (self.tensors is None or self.tensors.ok) and not self.stages
        )  # fmt: skip

    def failures(self) -> list[str]:
        """One line per failing check, naming the layer: what the CLI prints and CI shows."""
        lines = list(self.problems)
        lines += [f"stages: {p}" for p in self.stages or ()]
        if self.tensors is not None:
            lines += [f"tensors: {p}" for p in self.tensors.problems]
        for r in self.layers:
            if not r.ok:
                why = "; ".join(r.problems) or f"max rel error {r.max_rel:.3g} > {r.tolerance:g}"
                what = f"{r.layer_class}, {r.quant}" if r.quant else r.layer_class
                lines.append(f"{r.layer} ({what}): {why}")
        if self.model is not None and not self.model.ok:
            m, t = self.model, self.model.tolerance
            why = "; ".join(m.problems) or (
                f"max rel logit error {m.max_rel:.3g} (tol {t['max_rel']:g}), top-1 agreement {m.top1:.4f}"
                f" (need {t['top1']:g}), KL {m.kl:.3g} (tol {t['kl']:g})"
            )
            lines.append(f"model ({m.architecture} vs transformers): {why}")
        return lines


def layer_rows(report: VerifyReport) -> list[dict]:
    rows = []
    for r in report.layers:
        row = dict(
            layer=r.layer.removeprefix("model."), cls=r.layer_class.replace("ParallelLinear", "").replace("Parallel", ""),
            group=r.group,
        )  # fmt: skip
        if r.stages is not UNSET:  # pipeline stages: which stages ran it
            row["stages"] = ",".join(map(str, r.stages))
        row.update(
            format=r.quant or "-", inputs=r.batches, max_abs=f"{r.max_abs:.2g}", max_rel=f"{r.max_rel:.2g}",
            tol=f"{r.tolerance:g}", result="ok" if r.ok else "FAIL",
        )  # fmt: skip
        rows.append(row)
    return rows


_encoder = msgspec.json.Encoder(order="sorted")


def encode_report(report: VerifyReport) -> bytes:
    data = msgspec.to_builtins(report)
    data["ok"] = report.ok
    return msgspec.json.format(_encoder.encode(data), indent=1) + b"\n"


def write_report(report: VerifyReport, path: str | Path) -> None:
    Path(path).write_bytes(encode_report(report))


def write_junit(report: VerifyReport, path: str | Path) -> None:
    """JUnit XML as CI systems read it: one test case per layer, one for the model, one for launch."""
    suite = ET.Element("testsuite", name="tpshard.verify", time=f"{report.seconds:.3f}")
    cases = 0
    failures = 0

    def case(classname: str, name: str, failure: str | None, detail: str) -> None:
        nonlocal cases, failures
        cases += 1
        tc = ET.SubElement(suite, "testcase", classname=classname, name=name)
        if failure is not None:
            failures += 1
            ET.SubElement(tc, "failure", message=failure).text = detail
        else:
            ET.SubElement(tc, "system-out").text = detail

    if report.problems:
        case("tpshard.verify", "launch", "; ".join(report.problems), "\n".join(report.problems))
    if report.stages is not UNSET:
        detail = "every tensor on the stages the engine builds it on"
        case("tpshard.verify", "stages", "; ".join(report.stages) if report.stages else None, "\n".join([*report.stages, detail]))
    if report.tensors is not None:
        t = report.tensors
        detail = f"{t.files} files checksummed, {t.whole} whole copies vs the source, {t.padded} paddings zero"
        case("tpshard.verify", "tensors", "; ".join(t.problems) if t.problems else None, "\n".join([*t.problems, detail]))
    for r in report.layers:
        fmt = f" ({r.quant})" if r.quant else ""
        detail = f"{r.layer_class}{fmt} over {r.group}: max abs {r.max_abs:.3g}, max rel {r.max_rel:.3g}, tolerance {r.tolerance:g}"
        why = "; ".join(r.problems) or f"max rel error {r.max_rel:.3g} > {r.tolerance:g}"
        case("tpshard.verify.layers", r.layer, None if r.ok else why, detail if r.ok else f"{why}\n{detail}")
    if report.model is not None:
        m = report.model
        detail = f"max abs {m.max_abs:.3g}, max rel {m.max_rel:.3g}, top-1 {m.top1:.4f}, KL {m.kl:.3g}"
        case("tpshard.verify.model", m.architecture, None if m.ok else (report.failures()[-1]), detail)
    suite.set("tests", str(cases))
    suite.set("failures", str(failures))
    suite.set("errors", "0")
    root = ET.Element("testsuites")
    root.append(suite)
    ET.indent(root)
    Path(path).write_bytes(ET.tostring(root, encoding="utf-8", xml_declaration=True) + b"\n")
