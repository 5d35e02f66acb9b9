"""Run the same tpshard commands with two source trees and compare everything they produce.

A change that should not change behaviour (a refactor, a speed-up) is proved by this script: every
command's exit code, stdout and stderr, and every file it writes (bytes, and which files are hard
links of one another) must be the same for both trees, over a broad set of checkpoints and
topologies: dense, attention DP, pipeline stages for both engines, MoE with EP, DeepSeek-V3 with
its MTP layer and its FP8 release, every quantized format of tests/quant_fixtures, exports,
reshard, merge, check in every mode, and refusals.

    python benchmarks/equivalence.py --base /path/to/old/tree --new . [--work /tmp/equiv] [--only llama]

Each tree is a checkout of this repository; its `tpshard` package is imported through PYTHONPATH,
in a fresh process per command, run from the work folder (so no checkout on the current directory
shadows it). The checkpoints are built once, with the tests' own builders of the --new tree, and
reused (--work keeps them). Timings ("in 1.23 s", "seconds") and the work folder's paths are
masked before comparing. Exit 0 when everything is the same, 1 with the first differences listed.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

CHECKPOINTS = {  # name -> (builder, kwargs): tests/checkpoints.py, tests/moe_configs.py, tests/quant_fixtures.py
    "llama": ("checkpoint", dict(arch="llama", max_shard_size="100KB")),
    "qwen2_tied": ("checkpoint", dict(arch="qwen2", tie_word_embeddings=True)),
    "qwen3": ("checkpoint", dict(arch="qwen3", head_dim=32)),
    "mistral": ("checkpoint", dict(arch="mistral", intermediate_size=100)),
    "qwen3_moe": ("moe", dict(kind="qwen3_moe")),
    "qwen2_moe": ("moe", dict(kind="qwen2_moe")),
    "mixtral": ("moe", dict(kind="mixtral")),
    "deepseek_v3": ("moe_mtp", dict(kind="deepseek_v3")),
    "deepseek_v2": ("checkpoint", dict(arch="deepseek_v2")),
    "deepseek_fp8": ("fp8_deepseek", {}),
}
QUANT = (
    "gptq", "gptq_act_order", "gptq_v2_3bit", "gptq_8bit_channel", "awq", "marlin", "fp8_block", "fp8_tensor",
    "ct_w4a16", "ct_w4a16_asym_actorder", "ct_w3a16", "ct_w8a16_channel", "ct_fp8", "ct_fp8_dynamic",
    "ct_fp8_block", "ct_nvfp4",
)  # fmt: skip


def cases() -> list[tuple[str, list[str]]]:
    """(case name, argv) in order; {M:name} is a checkpoint, {O:case} the output folder of a case."""
    c: list[tuple[str, list[str]]] = []

    def split(name, model, *args):
        c.append((name, ["split", "{M:%s}" % model, "-o", "{O:%s}" % name, *args]))
        c.append((name + ".check", ["check", "{O:%s}" % name, "--source", "{M:%s}" % model]))

    def plan(name, model, *args):
        c.append((name + ".plan", ["plan", "{M:%s}" % model, *args]))
        c.append((name + ".planjson", ["plan", "{M:%s}" % model, "--json", *args]))

    # dense
    split("llama8", "llama", "--tp", "8")
    split("llama8dp", "llama", "--tp", "8", "--attn-dp", "2")
    split("llama8sha", "llama", "--tp", "8", "--checksum", "sha256")
    split("llama2pp", "llama", "--tp", "2", "--pp", "2")
    split("llama2ppv", "llama", "--tp", "2", "--pp", "2", "--engine", "vllm")
    split("llama6", "llama", "--tp", "6")
    split("llama6nopad", "llama", "--tp", "6", "--no-pad")
    split("llama4lm", "llama", "--tp", "4", "--attn-dp", "2", "--dp-lm-head")
    plan("llama8dp", "llama", "--tp", "8", "--attn-dp", "2")
    plan("llama3", "llama", "--tp", "3")
    plan("llama16", "llama", "--tp", "16")
    c.append(("llama.explain", ["explain", "{M:llama}", "--tp", "8", "--attn-dp", "2", "--layer", "1"]))
    c.append(("llama.explainjson", ["explain", "{M:llama}", "--tp", "4", "--json"]))
    c.append(("llama8.checkplain", ["check", "{O:llama8}"]))
    c.append(("llama8.checkjson", ["check", "{O:llama8}", "--source", "{M:llama}", "--json"]))
    c.append(("llama2pp.checkpp", ["check", "{O:llama2pp}", "--pp", "2"]))
    c.append(("llama2pp.checkpp3", ["check", "{O:llama2pp}", "--pp", "3"]))
    split("qwen3dp", "qwen3", "--tp", "8", "--attn-dp", "2")
    split("qwen3pp", "qwen3", "--tp", "2", "--pp", "2", "--pp-layers", "1,1")
    split("qwen2tied", "qwen2_tied", "--tp", "4", "--pp", "2", "--engine", "vllm")
    split("qwen2tieds", "qwen2_tied", "--tp", "4", "--pp", "2")
    split("mistral4", "mistral", "--tp", "4")
    plan("qwen3dp", "qwen3", "--tp", "8", "--attn-dp", "4")
    # ranks + merge
    c.append(("llama8r01", ["split", "{M:llama}", "-o", "{O:llama8r01}", "--tp", "8", "--ranks", "0-3"]))
    c.append(("llama8r47", ["split", "{M:llama}", "-o", "{O:llama8r47}", "--tp", "8", "--ranks", "4-7"]))
    c.append(("llama8merge", ["merge", "{O:llama8r01}", "{O:llama8r47}", "-o", "{O:llama8merge}"]))
    c.append(("llama8merge.check", ["check", "{O:llama8merge}", "--source", "{M:llama}"]))
    # reshard
    c.append(("llama8to4", ["reshard", "{O:llama8}", "-o", "{O:llama8to4}", "--tp", "4", "--pp", "2"]))
    c.append(("llama8to4.from", ["check", "{O:llama8to4}", "--from", "{O:llama8}"]))
    c.append(("qwen3dpto2", ["reshard", "{O:qwen3dp}", "-o", "{O:qwen3dpto2}", "--tp", "2"]))
    # exports
    for fmt in ("vllm", "sglang"):
        c.append((f"llama8.{fmt}", ["export", "{O:llama8}", "--format", fmt, "-o", "{O:llama8%s}" % fmt]))
        c.append((f"llama8.{fmt}.check", ["check", "{O:llama8%s}" % fmt, "--source", "{M:llama}"]))
        c.append((f"llama8.{fmt}.from", ["check", "{O:llama8%s}" % fmt, "--from", "{O:llama8}"]))
    c.append(("qwen3dp.sglang", ["export", "{O:qwen3dp}", "--format", "sglang", "-o", "{O:qwen3dpsg}"]))
    c.append(("qwen3dp.sglang.check", ["check", "{O:qwen3dpsg}", "--source", "{M:qwen3}"]))
    c.append(("llama2pp.vllm", ["export", "{O:llama2ppv}", "--format", "vllm", "-o", "{O:llama2ppvx}"]))
    c.append(("llama2pp.vllm.check", ["check", "{O:llama2ppvx}", "--source", "{M:llama}"]))
    c.append(("llama4.splitvllm", ["split", "{M:llama}", "-o", "{O:llama4sv}", "--tp", "4", "--format", "vllm", "--max-part-size", "50KB"]))
    c.append(("llama4.splitvllm.check", ["check", "{O:llama4sv}", "--source", "{M:llama}"]))
    # MoE
    split("q3moe4ep", "qwen3_moe", "--tp", "4", "--ep", "4")
    split("q3moe8dp", "qwen3_moe", "--tp", "8", "--attn-dp", "2", "--ep", "2")
    split("q2moe4", "qwen2_moe", "--tp", "4")
    split("q2moe4dp", "qwen2_moe", "--tp", "4", "--attn-dp", "2", "--ep", "4")
    split("mixtral8", "mixtral", "--tp", "8", "--ep", "2")
    split("ds3", "deepseek_v3", "--tp", "8", "--attn-dp", "2", "--ep", "8")
    split("ds3dense1", "deepseek_v3", "--tp", "4", "--moe-dense-tp", "1", "--ep", "2")
    split("ds3pp", "deepseek_v3", "--tp", "2", "--pp", "2")
    split("ds2", "deepseek_v2", "--tp", "4", "--attn-dp", "2")
    split("dsfp8", "deepseek_fp8", "--tp", "2")
    split("dsfp8dp", "deepseek_fp8", "--tp", "4", "--attn-dp", "2", "--ep", "4", "--pad-blocks")
    plan("ds3", "deepseek_v3", "--tp", "8", "--attn-dp", "2", "--ep", "8")
    plan("dsfp8", "deepseek_fp8", "--tp", "4")
    plan("q3moe16", "qwen3_moe", "--tp", "16")
    c.append(("ds3.explain", ["explain", "{M:deepseek_v3}", "--tp", "8", "--attn-dp", "2", "--ep", "8", "--layer", "2"]))
    c.append(("ds3to4", ["reshard", "{O:ds3}", "-o", "{O:ds3to4}", "--tp", "4", "--ep", "4"]))
    c.append(("ds3to4.from", ["check", "{O:ds3to4}", "--from", "{O:ds3}"]))
    for name, model in (("q3moe4ep", "qwen3_moe"), ("mixtral8", "mixtral"), ("ds3", "deepseek_v3"), ("q2moe4", "qwen2_moe")):
        c.append((f"{name}.vllm", ["export", "{O:%s}" % name, "--format", "vllm", "-o", "{O:%svx}" % name]))
        c.append((f"{name}.vllm.check", ["check", "{O:%svx}" % name, "--source", "{M:%s}" % model]))
    c.append(("dsfp8.vllm", ["export", "{O:dsfp8}", "--format", "vllm", "-o", "{O:dsfp8vx}"]))
    # quantized
    for q in QUANT:
        split(f"{q}.2", f"q_{q}", "--tp", "2")
        split(f"{q}.8", f"q_{q}", "--tp", "8", "--attn-dp", "2")
        plan(f"{q}.4", f"q_{q}", "--tp", "4")
    # refusals
    c.append(("refuse.exists", ["split", "{M:llama}", "-o", "{O:llama8}", "--tp", "8"]))
    c.append(("refuse.tp0", ["split", "{M:llama}", "-o", "{O:tp0}", "--tp", "0"]))
    c.append(("refuse.nomodel", ["plan", "{W}/nothing-here", "--tp", "2"]))
    c.append(("refuse.checkwrong", ["check", "{O:llama8}", "--source", "{M:qwen3}"]))
    c.append(("refuse.ranks", ["split", "{M:llama}", "-o", "{O:badranks}", "--tp", "2", "--ranks", "5"]))
    return c


def build_checkpoints(work: Path, tree: Path) -> None:
    """The checkpoints of CHECKPOINTS and QUANT under work/ckpt, with `tree`'s test builders."""
    ckpt = work / "ckpt"
    todo = [n for n in list(CHECKPOINTS) + [f"q_{q}" for q in QUANT] if not (ckpt / n / "config.json").exists()]
    if not todo:
        return
    script = f"""
import sys
from pathlib import Path
sys.path.insert(0, {str(tree / 'tests')!r})
import checkpoints, moe_configs, quant_fixtures
table = {CHECKPOINTS!r}
ckpt = Path({str(ckpt)!r})
for name in {todo!r}:
    path = ckpt / name
    if name.startswith("q_"):
        quant_fixtures.write_quant_checkpoint(path, quant_fixtures.DEFAULT_SPECS[name[2:]], num_files=2)
        continue
    builder, kw = table[name]
    if builder == "checkpoint":
        arch = kw.pop("arch")
        checkpoints.make_checkpoint(path, arch, **kw)
    elif builder == "moe":
        moe_configs.make_moe_checkpoint(path, kw["kind"])
    elif builder == "moe_mtp":
        moe_configs.make_moe_checkpoint(path, kw["kind"])
        moe_configs.add_mtp_layer(path)
    else:
        moe_configs.make_fp8_deepseek(path)
"""
    env = dict(os.environ, PYTHONPATH=str(tree))
    subprocess.run([sys.executable, "-c", script], check=True, env=env, cwd=work)


_TEMP = re.compile(rb"tpshard-split-[a-z0-9_]{8}")
_TIME = re.compile(r"\d+(\.\d+)?\s+s\b|\"seconds\": ?[0-9.]+")


def run_tree(tree: Path, work: Path, label: str, only: str | None) -> Path:
    """Every case with `tree` on PYTHONPATH; returns the folder of its results."""
    res = work / label
    shutil.rmtree(res, ignore_errors=True)
    res.mkdir(parents=True)
    outs = work / "out"  # the same path for both trees: manifests record it
    shutil.rmtree(outs, ignore_errors=True)
    outs.mkdir()
    env = dict(os.environ, PYTHONPATH=str(tree), COLUMNS="200", TERM="dumb")
    for name, argv in cases():
        if only and not name.startswith(only):
            continue
        args = [_fill(a, work, outs) for a in argv]
        p = subprocess.run([sys.executable, "-m", "tpshard", *args], capture_output=True, text=True, env=env, cwd=work, timeout=600)
        text = f"rc {p.returncode}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}"
        text = _TIME.sub("T s", text.replace(str(outs), "{OUT}").replace(str(work), "{WORK}"))
        (res / f"{name}.txt").write_text(text)
    outs.rename(res / "out")
    return res


def _fill(arg: str, work: Path, outs: Path) -> str:
    arg = arg.replace("{W}", str(work))
    m = re.fullmatch(r"\{([MO]):([\w.]+)\}", arg)
    if not m:
        return arg
    return str(work / "ckpt" / m[2]) if m[1] == "M" else str(outs / m[2])


def tree_listing(root: Path) -> list[str]:
    """Every file under root (hidden ones too): path, size, sha256, and its hard-link group."""
    lines, inodes = [], {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for f in sorted(filenames):
            p = Path(dirpath, f)
            st = p.lstat()
            rel = p.relative_to(root)
            if p.is_symlink():
                lines.append(f"{rel} -> {os.readlink(p)}")
                continue
            group = inodes.setdefault((st.st_dev, st.st_ino), str(rel))
            data = p.read_bytes()
            if f == "tpshard-export.json":  # split --format records its temporary folder's random name
                data = _TEMP.sub(b"tpshard-split-TEMP", data)
            digest = hashlib.sha256(data).hexdigest()
            lines.append(f"{rel} {st.st_size} {digest} link:{group}")
    return lines


def compare(a: Path, b: Path) -> list[str]:
    diffs = []
    for fa in sorted(a.glob("*.txt")):
        fb = b / fa.name
        if not fb.exists() or fa.read_text() != fb.read_text():
            diffs.append(f"{fa.stem}: output differs ({fa} vs {fb})")
    la, lb = tree_listing(a / "out"), tree_listing(b / "out")
    sa, sb = set(la), set(lb)
    diffs += [f"only in base: {x}" for x in sorted(sa - sb)[:40]]
    diffs += [f"only in new: {x}" for x in sorted(sb - sa)[:40]]
    return diffs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, required=True, help="the tree whose outputs are the reference")
    ap.add_argument("--new", type=Path, default=Path("."), help="the tree under test (default: this checkout)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/tpshard-equiv"), help="checkpoints and results (kept)")
    ap.add_argument("--only", help="run only the cases whose name starts with this")
    ap.add_argument("--reuse-base", action="store_true", help="keep the base results of an earlier run")
    a = ap.parse_args()
    base, new, work = a.base.resolve(), a.new.resolve(), a.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    build_checkpoints(work, new)
    n = len([1 for name, _ in cases() if not a.only or name.startswith(a.only)])
    print(f"{n} commands per tree", file=sys.stderr)
    ra = work / "base" if a.reuse_base and (work / "base").exists() else run_tree(base, work, "base", a.only)
    rb = run_tree(new, work, "new", a.only)
    diffs = compare(ra, rb)
    for d in diffs[:80]:
        print(d)
    print(f"{'same' if not diffs else 'DIFFERENT'}: {n} commands, {len(tree_listing(rb / 'out'))} files")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
