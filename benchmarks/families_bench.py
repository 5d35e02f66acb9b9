"""Split one or two real-dimension layers of each newer MoE family against `cp -r` of the same files.

    python benchmarks/families_bench.py [--cases gpt-oss,glm] [--runs 3] [--gib 3] [--json out.json]

Issues 24-26's performance target: `tpshard split` <= 1.2 x `cp -r` and peak RSS <= 150 MB, side by
side in one run. Cases: gpt-oss-120b, GLM-4.5, MiniMax-M2, a Qwen3.5-MoE hybrid pair, DeepSeek-V4-Flash,
a Kimi-K2 layer, a Llama-4 Maverick MoE layer (experts fused [E, H, 2I]: each --tp 8 rank's gate and
up halves are strided slices of every row). Each case writes a checkpoint of the family's real names, dtypes and shapes
(transformers' own model class built on the meta device from the release's dims, its tensor names
as transformers' save_pretrained writes them -- DeepSeek-V4 in the release's native names, as
tests/v4_checkpoint.py maps them), random bits streamed into safetensors files, and a config.json.

The layers are at real dims; what is scaled down, and said in the header line of each case:
- the routed experts: a real layer is 7-34 GB (Kimi-K2: 384 experts of 88 MB), so each case keeps
  the largest multiple of 8 (for --ep 8) of experts that fits its checkpoint in `--gib` (default 3);
  `--experts N` forces a count (each case keeps at most its real one); `--sizes` prints what each
  case would keep and its size, writing nothing. At the real counts the layers are big: Qwen3.5's
  pair at 512 experts is 25 GiB (12.5 GiB of routed experts per layer; `--gib 25` or `--experts
  512`), Maverick's layer at 128 is 31 GiB; the run refuses a checkpoint whose copy would not fit
  the disk beside it, and warns when source + output exceed the RAM (the page cache cannot hold
  them: cp -r and the splits then read from the disk, and the comparison is of disk speed);
- the vocabulary: embedding and lm_head at the real vocab (129k-248k) would be 1-4.7 GB of the 3,
  cut as plain rows (cp speed); `--vocab` (default 32768; 0 = the real one) sizes them.

Cases, each in a fresh child after a sync, alternated round by round (split_bench.measure: wall
time plus the timed sync after it, user + system CPU, GNU time's peak RSS, sampled anonymous RSS,
the 1-minute load average): `cp -r` of the checkpoint, then each split topology of the case.
`--profile` also runs each split once under cProfile and prints its top functions (stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent / "tests"))  # v4_checkpoint: the release's V4 names

from moe_bench import nbytes, write_random_checkpoint  # noqa: E402
from split_bench import against_cp, alternate, drop, meminfo, warm  # noqa: E402

Item = tuple[str, str, tuple[int, ...]]
TP8, EP8 = ["--tp", "8"], ["--tp", "8", "--ep", "8"]


@dataclass
class Case:
    arch: str  # config.json's architectures[0]
    config: Callable[[int, int, bool], object]  # (experts, vocab, tiny) -> transformers config
    experts_key: str  # the config field holding the routed expert count
    topologies: list[list[str]]
    fp32: tuple[str, ...] = ()  # name suffixes the release keeps in fp32 (routers, biases)
    note: str = ""
    keep: str = ""  # a name prefix: the model's other tensors (a vision tower) are not written


def _cfg(cls: str, real: dict, tiny: dict, experts_key: str):
    def make(experts: int, vocab: int, small: bool):
        import transformers

        fields = {**real, **(tiny if small else {})}
        fields[experts_key] = experts
        if vocab:
            fields["vocab_size"] = vocab
        return getattr(transformers, cls)(**fields)

    return make


TINY = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=16)
TINY_MOE = dict(TINY, moe_intermediate_size=32)

# gpt-oss-120b (its config.json; GptOssConfig's defaults are the same dims): every layer sparse,
# experts fused [E, H, 2I] gate/up interleaved on the last dim: tp 8 without EP cuts every expert
# row into 8 strided pieces. bf16 (the release's MXFP4 is not split by main yet); EP is refused
# for bf16 fused experts (tpshard/arch/gpt_oss.py).
GPT_OSS = Case(
    "GptOssForCausalLM",
    _cfg("GptOssConfig", dict(num_hidden_layers=1, layer_types=["sliding_attention"], tie_word_embeddings=False),
         dict(TINY, intermediate_size=96), "num_local_experts"),
    "num_local_experts", [TP8, [*TP8, "--attn-dp", "2"]],
)  # fmt: skip

# GLM-4.5 (zai-org/GLM-4.5 config.json): hidden 5120, 96 heads of 128 over 8 kv heads, q/k/v bias,
# qk norm, 160 experts of 1536 + 1 shared; one MoE layer (first_k_dense_replace 0). bf16.
GLM = Case(
    "Glm4MoeForCausalLM",
    _cfg("Glm4MoeConfig", dict(
        hidden_size=5120, num_attention_heads=96, num_key_value_heads=8, head_dim=128, intermediate_size=12288,
        moe_intermediate_size=1536, n_shared_experts=1, num_hidden_layers=1, first_k_dense_replace=0, n_group=1,
        topk_group=1, use_qk_norm=True, attention_bias=True, routed_scaling_factor=2.5, num_nextn_predict_layers=0,
    ), dict(TINY_MOE, intermediate_size=96), "n_routed_experts"),
    "n_routed_experts", [TP8, [*EP8, "--attn-dp", "2"]], fp32=("mlp.gate.weight", "e_score_correction_bias"),
)  # fmt: skip

# MiniMax-M2 (MiniMaxM2Config's defaults are the release's): hidden 3072, 48 heads of 128 over 8,
# 256 experts of 1536, q/k norms cut by heads. No attention DP in SGLang's class for it here.
MINIMAX = Case(
    "MiniMaxM2ForCausalLM",
    _cfg("MiniMaxM2Config", dict(
        num_hidden_layers=1, use_qk_norm=True, qk_norm_type="per_layer", scoring_func="sigmoid", use_routing_bias=True,
        rotary_dim=64,
    ), dict(TINY, intermediate_size=32, rotary_dim=8), "num_local_experts"),
    "num_local_experts", [TP8, EP8], fp32=("e_score_correction_bias",),
)  # fmt: skip

# Qwen3.5-397B-A17B (its text config): hidden 4096, 512 experts of 1024 + a shared expert of 1024;
# layer 0 gated DeltaNet (16 key heads of 128, 64 value heads of 128), layer 1 gated full attention
# (32 heads of 256 over 2 kv heads).
QWEN35 = Case(
    "Qwen3_5MoeForCausalLM",
    _cfg("Qwen3_5MoeTextConfig", dict(
        hidden_size=4096, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        num_attention_heads=32, num_key_value_heads=2, head_dim=256, moe_intermediate_size=1024,
        shared_expert_intermediate_size=1024, linear_num_key_heads=16, linear_num_value_heads=64,
        linear_key_head_dim=128, linear_value_head_dim=128, num_experts_per_tok=10,
    ), dict(TINY_MOE, head_dim=8, shared_expert_intermediate_size=48, linear_num_key_heads=8, linear_num_value_heads=16,
            linear_key_head_dim=4, linear_value_head_dim=4), "num_experts"),
    "num_experts", [TP8, [*EP8, "--attn-dp", "2"]],
)  # fmt: skip

# DeepSeek-V4-Flash (DeepseekV4Config's defaults): hidden 4096, 64 heads of 512, q_lora 1024,
# o_groups 8, 256 experts of 2048 + 1 shared, hc_mult 4; layer 0 compress ratio 4 (compressor +
# indexer) and hash-routed (tid2eid), layer 1 ratio 128. bf16 (the release is FP8 + FP4 experts).
V4_RATIOS, V4_TYPES = [4, 128], ["compressed_sparse_attention", "heavily_compressed_attention"]
DSV4 = Case(
    "DeepseekV4ForCausalLM",
    _cfg("DeepseekV4Config", dict(
        num_hidden_layers=2, layer_types=V4_TYPES, mlp_layer_types=["hash_moe", "moe"], num_nextn_predict_layers=0,
    ), dict(TINY_MOE, num_key_value_heads=1, head_dim=32, q_lora_rank=32, o_groups=8, o_lora_rank=16, index_n_heads=4,
            index_head_dim=16, index_topk=4, sliding_window=8, hc_mult=2, partial_rotary_factor=0.25), "n_routed_experts"),
    "n_routed_experts", [TP8, [*EP8, "--attn-dp", "2"]],
)  # fmt: skip

# Kimi-K2 (moonshotai/Kimi-K2-Instruct config.json: DeepseekV3ForCausalLM): hidden 7168, 64 heads
# (MLA q_lora 1536, kv_lora 512), 384 experts of 2048 + 1 shared; one MoE layer. bf16.
KIMI = Case(
    "DeepseekV3ForCausalLM",
    _cfg("DeepseekV3Config", dict(
        hidden_size=7168, num_attention_heads=64, num_key_value_heads=64, moe_intermediate_size=2048,
        n_shared_experts=1, num_hidden_layers=1, first_k_dense_replace=0, n_group=1, topk_group=1,
        num_nextn_predict_layers=0, routed_scaling_factor=2.827,
    ), dict(TINY_MOE, num_key_value_heads=8, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16, intermediate_size=96), "n_routed_experts"),
    "n_routed_experts", [TP8, [*EP8, "--attn-dp", "2"]], fp32=("e_score_correction_bias",),
)  # fmt: skip



# Llama-4 Maverick (meta-llama/Llama-4-Maverick-17B-128E-Instruct's text_config): hidden 5120, 40
# heads of 128 over 8 kv heads, 128 experts of 8192 (top 1) fused in the checkpoint as
# `feed_forward.experts.gate_up_proj` [E, H, 2I] ([gate | up] halves: at --tp 8 each rank's gate and
# up slices are two strided pieces of every row) and `down_proj` [E, I, H], a shared expert of 8192,
# the router. Llama4ForConditionalGeneration's names (`language_model.*`, what tpshard/arch/llama4.py
# splits), the vision tower not written, as in ModelOpt's text-only exports (tpshard refuses it).
# One layer with interleave_moe_layer_step 1: the release's step 2 makes its layer 0 dense; its
# MoE layers have these names and shapes. bf16, as released.
def _llama4_config(experts: int, vocab: int, small: bool):
    import transformers

    text = dict(
        hidden_size=5120, num_attention_heads=40, num_key_value_heads=8, head_dim=128, intermediate_size=8192,
        intermediate_size_mlp=16384, num_hidden_layers=1, interleave_moe_layer_step=1, num_experts_per_tok=1,
        use_qk_norm=False, max_position_embeddings=1048576, tie_word_embeddings=False, num_local_experts=experts,
    )  # fmt: skip
    if small:  # and a tiny vision tower, which transformers' save_pretrained writes in the smoke test
        text |= dict(TINY, intermediate_size=32, intermediate_size_mlp=48)
    if vocab:
        text["vocab_size"] = vocab
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, image_size=28,
                  patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32) if small else None  # fmt: skip
    return transformers.Llama4Config(text_config=text, vision_config=vision, tie_word_embeddings=False)


LLAMA4 = Case(
    "Llama4ForConditionalGeneration", _llama4_config, "num_local_experts", [TP8, [*EP8, "--attn-dp", "2"]],
    keep="language_model.",
)  # fmt: skip

CASES = {"gpt-oss": GPT_OSS, "glm": GLM, "minimax": MINIMAX, "qwen3.5": QWEN35, "dsv4": DSV4, "kimi": KIMI, "llama4": LLAMA4}
REAL_EXPERTS = {"gpt-oss": 128, "glm": 160, "minimax": 256, "qwen3.5": 512, "dsv4": 256, "kimi": 384, "llama4": 128}


def _meta_state(case: Case, experts: int, vocab: int, tiny: bool):
    """transformers' model on the meta device: (config, {name: meta tensor}) in the names its
    save_pretrained writes (revert_weight_conversion undoes its in-memory fusing of experts)."""
    import torch
    import transformers
    from transformers.core_model_loading import revert_weight_conversion

    transformers.logging.set_verbosity_error()  # a cut vocabulary leaves bos/eos ids outside it: harmless here
    config = case.config(experts, vocab, tiny)
    config.architectures = [case.arch]
    with torch.device("meta"):
        model = getattr(transformers, case.arch)(config)
    state = model.state_dict()
    if case.arch != "DeepseekV4ForCausalLM":
        state = revert_weight_conversion(model, state)
        return config, {n: t for n, t in state.items() if n.startswith(case.keep)}
    from v4_checkpoint import native_name  # the release's names, as the V4 tests write them

    out = {}
    for name, t in state.items():
        new = native_name(name)
        if new.endswith(".ffn.experts.gate_up_proj"):  # [E, 2I, H]: w1 the first I rows, w3 the next
            for e in range(t.shape[0]):
                for w, half in (("w1", t[e, : t.shape[1] // 2]), ("w3", t[e, t.shape[1] // 2 :])):
                    out[new.replace("gate_up_proj", f"{e}.{w}.weight")] = half
        elif new.endswith(".ffn.experts.down_proj"):
            out |= {new.replace("down_proj", f"{e}.w2.weight"): t[e] for e in range(t.shape[0])}
        else:
            out[new] = t
    return config, out


def _dtype(case: Case, name: str, t) -> str:
    if not t.dtype.is_floating_point:
        return "I32"
    if case.arch == "DeepseekV4ForCausalLM":
        from v4_checkpoint import FP32

        return "F32" if FP32.search(name) else "BF16"
    return "F32" if name.endswith(case.fp32) else "BF16"


def _config_json(case: Case, config) -> dict:
    d = config.to_dict()
    d["torch_dtype"] = "bfloat16"
    if case.arch == "DeepseekV4ForCausalLM":  # what SGLang reads and transformers' save drops
        d |= {"compress_ratios": V4_RATIOS, "num_hash_layers": 1, "qk_rope_head_dim": int(config.head_dim * config.partial_rotary_factor)}
        d.pop("layer_types", None)
        d.pop("mlp_layer_types", None)
    return d


def layout(case: Case, experts: int, vocab: int, tiny: bool = False) -> tuple[list[Item], dict, dict[str, int]]:
    """(every tensor, config.json, the I32 tensors' value bounds) of the case at `experts`."""
    config, state = _meta_state(case, experts, vocab, tiny)
    items = [(n, _dtype(case, n, t), tuple(t.shape)) for n, t in state.items()]
    ints = {n: experts for n, d, _ in items if d == "I32"}  # V4's tid2eid: expert ids
    return items, _config_json(case, config), ints


def fit_experts(name: str, case: Case, vocab: int, gib: float) -> int:
    """The largest multiple of 8 experts (at most the real count) whose checkpoint fits in `gib`."""
    real = REAL_EXPERTS[name]
    sizes = [sum(nbytes(d, s) for _, d, s in layout(case, e, vocab)[0]) for e in (8, 16)]
    per8 = sizes[1] - sizes[0]
    n = 8 * (1 + int((gib * 2**30 - sizes[0]) // per8))
    return max(8, min(real, n))


def write_case(work: Path, name: str, experts: int, vocab: int, tiny: bool) -> tuple[Path, int, int]:
    case = CASES[name]
    items, config, ints = layout(case, experts, vocab, tiny)
    path = work / f"{name}-{experts}e"
    files = max(1, -(-sum(nbytes(d, s) for _, d, s in items) // (2 << 30)))  # ~2 GiB files, as releases ship
    total = write_random_checkpoint(path, items, config, files, ints)
    return path, len(items), total


# The writer copies in a ThreadPoolExecutor, whose threads cProfile does not see: the profiled run
# copies on the main thread instead (one worker, the same work in the same order).
PROFILE = """
import cProfile, pstats, sys
import tpshard.writer as w
class Inline:
    def __init__(self, *a): pass
    def __enter__(self): return self
    def __exit__(self, *a): return False
    def map(self, fn, *its): return list(map(fn, *its))
w.ThreadPoolExecutor = Inline
from tpshard.cli import main
sys.argv = ["tpshard", *sys.argv[2:]]
prof = cProfile.Profile()
try:
    prof.runcall(main)
except SystemExit:
    pass
for key in ("tottime", "cumulative"):
    print(f"--- by {key}", file=sys.stderr)
    pstats.Stats(prof, stream=sys.stderr).sort_stats(key).print_stats(14)
"""


def profile_split(cmd: list[str], out: Path) -> None:
    """One split of `cmd` (a `python -m tpshard split ...` line) with --workers 1 under cProfile;
    its top functions by own and cumulative time go to stderr."""
    import subprocess

    print(f"--- cProfile of tpshard {' '.join(cmd[3:])} --workers 1", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-c", PROFILE, "-", *cmd[3:], "--workers", "1"], check=False, cwd=str(HERE.parent))
    drop(out)


def case_experts(name: str, args) -> int:
    """The routed experts the case keeps: --experts (at most the real count), 8 at --tiny, else
    what fits --gib."""
    if args.experts:
        return min(args.experts, REAL_EXPERTS[name])
    return 8 if args.tiny else fit_experts(name, CASES[name], args.vocab, args.gib)


def case_size(name: str, args) -> tuple[int, int, int]:
    """(experts, tensors, bytes of tensor data) of the case's checkpoint, from its layout alone."""
    experts = case_experts(name, args)
    items = layout(CASES[name], experts, args.vocab, args.tiny)[0]
    return experts, len(items), sum(nbytes(d, s) for _, d, s in items)


def room(work: Path, total: int, log) -> None:
    """Refuse a checkpoint whose copy beside it would not fit on the disk (RuntimeError); warn when
    the page cache cannot hold the source and an output, so that the times include disk reads."""
    free = shutil.disk_usage(work).free
    if 2 * total + (1 << 30) > free:
        raise RuntimeError(
            f"the checkpoint ({total / 2**30:.1f} GiB) and one output need {2 * total / 2**30 + 1:.1f} GiB under"
            f" {work}, which has {free / 2**30:.1f} GiB free; lower --gib or --experts, or give another --workdir"
        )
    if 2 * total > meminfo("MemTotal"):
        log(f"warning: the source and one output ({2 * total / 2**30:.1f} GiB) exceed this machine's RAM"
            f" ({meminfo('MemTotal') / 2**30:.1f} GiB): the page cache cannot hold them, so cp -r and the splits read from the disk")  # fmt: skip


def run_case(name: str, args, work: Path, py: list[str], log) -> dict:
    case = CASES[name]
    experts, _, size = case_size(name, args)
    room(work, size, log)
    model, count, total = write_case(work, name, experts, args.vocab, args.tiny)
    warm(model)
    head = f"{name} ({case.arch}): {experts} of {REAL_EXPERTS[name]} experts, vocab {args.vocab or 'real'}, {count} tensors, {total / 2**30:.2f} GiB"
    log(head)
    out = work / "out"
    cases = {"cp -r": ["cp", "-r", str(model), str(out)]}
    cases |= {"split " + " ".join(t): [*py, "split", str(model), "-o", str(out), *t] for t in case.topologies}
    try:
        samples = alternate(cases, out, args.runs, lambda line: log(f"{name}: {line}"))
        if args.profile:
            for label, cmd in cases.items():
                if label.startswith("split"):
                    profile_split(cmd, out)
    finally:
        drop(out)
        shutil.rmtree(model, ignore_errors=True)
    rows = against_cp(samples)
    return {"case": name, "arch": case.arch, "experts": experts, "real_experts": REAL_EXPERTS[name], "vocab": args.vocab,
            "tensors": count, "bytes": total, "header": head, "rows": rows}  # fmt: skip


def print_case(result: dict) -> None:
    print(f"\n{result['header']}")
    print("| case | time s | × cp | cpu s | peak RSS MiB (anon) | load |\n|---|---|---|---|---|---|")
    for label, r in result["rows"].items():
        print(f"| `{label}` | {r['time_s']:.2f} | {r['x_cp']:.2f} | {r['cpu_s']:.2f} | {r['maxrss_mib']} ({r['anon_mib']}) | {r['loadavg']:.1f} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--gib", type=float, default=3.0, help="size of each checkpoint: routed experts are dropped to fit")
    ap.add_argument("--experts", type=int, help="routed experts per layer, at most each case's real count (instead of fitting --gib)")
    ap.add_argument("--vocab", type=int, default=32768, help="embedding / lm_head rows; 0: the family's real vocab")
    ap.add_argument("--tiny", action="store_true", help="tiny dims (hidden 64): a smoke run of the whole script")
    ap.add_argument("--profile", action="store_true", help="also run each split once under cProfile (stderr)")
    ap.add_argument("--sizes", action="store_true", help="print each case's experts, tensors and size; write nothing")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "tpshard-families-bench")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {', '.join(unknown)}; cases: {', '.join(CASES)}")
    if args.experts and (args.experts % 8 or args.experts < 8):
        ap.error("--experts must be a multiple of 8 (the splits use --ep 8)")
    if args.sizes:
        for name in names:
            experts, count, total = case_size(name, args)
            print(f"{name} ({CASES[name].arch}): {experts} of {REAL_EXPERTS[name]} experts, vocab {args.vocab or 'real'}, {count} tensors, {total / 2**30:.2f} GiB")
        return 0
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    log(f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs")
    py = [sys.executable, "-m", "tpshard"]
    results = []
    try:
        for name in names:
            results.append(run_case(name, args, work, py, log))
            print_case(results[-1])
    except RuntimeError as e:
        log(str(e))
        return 1
    finally:
        if args.json:
            args.json.write_text(json.dumps({"cpus": os.cpu_count(), "cases": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
