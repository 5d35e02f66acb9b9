"""Split one real-dims quantized MoE layer against `cp -r`: Kimi-K2's INT4 experts, GLM-4.5's FP8 block experts.

    python benchmarks/quant_moe_bench.py kimi --workdir /tmp/qmoe     # writes the checkpoint, prints its path
    farm-bench -n 3 --timeout 1800 -- python -m tpshard split CKPT -o OUT --tp 8 --vs 'cp -r CKPT OUT2'

Checkpoints (random bytes: a split moves bytes, it never reads their values), one decoder layer that
is a MoE layer, with the families' own dims:

- `kimi`: Kimi-K2 (DeepseekV3ForCausalLM): hidden 7168, MLA (64 heads, q_lora 1536, kv_lora 512,
  nope 128 + rope 64, v 128) in bf16, 384 routed experts of 2048 in compressed-tensors
  pack-quantized INT4, group 32 (`weight_packed` I32 [N, K/8], `weight_scale` BF16 [N, K/32],
  `weight_shape` I64 [2]) as the release stores them, one bf16 shared expert; ~9.5 GiB.
- `glm`: GLM-4.5-FP8 (Glm4MoeForCausalLM): hidden 5120, 96 heads of 128 over 8 kv heads, 160 routed
  experts of 1536 in FP8 block 128 (`weight` F8_E4M3, `weight_scale_inv` F32), attention and the
  shared expert FP8 too; ~3.9 GiB.

The vocab is cut to 2048 (the embedding and lm_head are not what this measures) and there is no MTP
layer. Suggested topologies: kimi `--tp 8` (moe_tp 8: 256 of each expert per rank, 8 groups of 32,
packed words cut), glm `--tp 8 --ep 2 --pad-blocks` (moe_tp 4: 384 per rank, 3 FP8 blocks; moe_tp 8
would leave 192, which SGLang and tpshard refuse; the shared expert, 1536 over tp 8, is padded to
two blocks per rank). `--sparse` writes headers and holes only, for `tpshard plan`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from moe_bench import write_random_checkpoint  # noqa: E402

VOCAB = 2048


def _ct_int4(out: list, name: str, n: int, k: int) -> None:
    out += [(f"{name}.weight_packed", "I32", (n, k // 8)), (f"{name}.weight_scale", "BF16", (n, k // 32)),
            (f"{name}.weight_shape", "I64", (2,))]  # fmt: skip


def _fp8(out: list, name: str, n: int, k: int) -> None:
    out += [(f"{name}.weight", "F8_E4M3", (n, k)), (f"{name}.weight_scale_inv", "F32", (-(-n // 128), -(-k // 128)))]


def _bf16(out: list, name: str, n: int, k: int) -> None:
    out.append((f"{name}.weight", "BF16", (n, k)))


def kimi() -> tuple[dict, list]:
    H, NH, QL, KVL, NOPE, ROPE, V, E, IE = 7168, 64, 1536, 512, 128, 64, 128, 384, 2048
    config = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": H, "num_attention_heads": NH,
        "num_key_value_heads": NH, "q_lora_rank": QL, "kv_lora_rank": KVL, "qk_nope_head_dim": NOPE, "qk_rope_head_dim": ROPE,
        "v_head_dim": V, "n_routed_experts": E, "moe_intermediate_size": IE, "n_shared_experts": 1, "first_k_dense_replace": 0,
        "intermediate_size": 18432, "vocab_size": VOCAB, "num_hidden_layers": 1, "num_nextn_predict_layers": 0,
        "moe_layer_freq": 1, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True, "rms_norm_eps": 1e-6,
        "torch_dtype": "bfloat16", "tie_word_embeddings": False,
        "quantization_config": {
            "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
            "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized", "input_activations": None,
                                          "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                                      "group_size": 32, "dynamic": False, "actorder": None}}},
        },
    }  # fmt: skip
    t: list = [("model.embed_tokens.weight", "BF16", (VOCAB, H))]
    p = "model.layers.0"
    t += [(f"{p}.input_layernorm.weight", "BF16", (H,)), (f"{p}.post_attention_layernorm.weight", "BF16", (H,))]
    _bf16(t, f"{p}.self_attn.q_a_proj", QL, H)
    t.append((f"{p}.self_attn.q_a_layernorm.weight", "BF16", (QL,)))
    _bf16(t, f"{p}.self_attn.q_b_proj", NH * (NOPE + ROPE), QL)
    _bf16(t, f"{p}.self_attn.kv_a_proj_with_mqa", KVL + ROPE, H)
    t.append((f"{p}.self_attn.kv_a_layernorm.weight", "BF16", (KVL,)))
    _bf16(t, f"{p}.self_attn.kv_b_proj", NH * (NOPE + V), KVL)
    _bf16(t, f"{p}.self_attn.o_proj", H, NH * V)
    t += [(f"{p}.mlp.gate.weight", "BF16", (E, H)), (f"{p}.mlp.gate.e_score_correction_bias", "F32", (E,))]
    for e in range(E):
        for proj, n, k in (("gate_proj", IE, H), ("up_proj", IE, H), ("down_proj", H, IE)):
            _ct_int4(t, f"{p}.mlp.experts.{e}.{proj}", n, k)
    for proj, n, k in (("gate_proj", IE, H), ("up_proj", IE, H), ("down_proj", H, IE)):
        _bf16(t, f"{p}.mlp.shared_experts.{proj}", n, k)
    t += [("model.norm.weight", "BF16", (H,)), ("lm_head.weight", "BF16", (VOCAB, H))]
    return config, t


def glm() -> tuple[dict, list]:
    H, NH, KV, HD, E, IE = 5120, 96, 8, 128, 160, 1536
    config = {
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_size": H, "num_attention_heads": NH,
        "num_key_value_heads": KV, "head_dim": HD, "partial_rotary_factor": 0.5, "attention_bias": True, "use_qk_norm": False,
        "n_routed_experts": E, "moe_intermediate_size": IE, "n_shared_experts": 1, "first_k_dense_replace": 0,
        "intermediate_size": 12288, "vocab_size": VOCAB, "num_hidden_layers": 1, "num_nextn_predict_layers": 0,
        "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
        "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "tie_word_embeddings": False, "max_position_embeddings": 131072,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    }  # fmt: skip
    t: list = [("model.embed_tokens.weight", "BF16", (VOCAB, H))]
    p = "model.layers.0"
    t += [(f"{p}.input_layernorm.weight", "BF16", (H,)), (f"{p}.post_attention_layernorm.weight", "BF16", (H,))]
    for proj, n in (("q_proj", NH * HD), ("k_proj", KV * HD), ("v_proj", KV * HD)):
        _fp8(t, f"{p}.self_attn.{proj}", n, H)
        t.append((f"{p}.self_attn.{proj}.bias", "BF16", (n,)))
    _fp8(t, f"{p}.self_attn.o_proj", H, NH * HD)
    t += [(f"{p}.mlp.gate.weight", "F32", (E, H)), (f"{p}.mlp.gate.e_score_correction_bias", "F32", (E,))]
    for e in range(E):
        for proj, n, k in (("gate_proj", IE, H), ("up_proj", IE, H), ("down_proj", H, IE)):
            _fp8(t, f"{p}.mlp.experts.{e}.{proj}", n, k)
    for proj, n, k in (("gate_proj", IE, H), ("up_proj", IE, H), ("down_proj", H, IE)):
        _fp8(t, f"{p}.mlp.shared_experts.{proj}", n, k)
    t += [("model.norm.weight", "BF16", (H,)), ("lm_head.weight", "BF16", (VOCAB, H))]
    return config, t


def write(out: Path, config: dict, items: list, files: int = 4, sparse: bool = False) -> int:
    """The checkpoint in `files` files of random small bytes (moe_bench.write_random_checkpoint);
    `sparse`: headers and holes only, enough for `tpshard plan`."""
    return write_random_checkpoint(out, items, config, files, sparse=sparse)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", choices=("kimi", "glm"))
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/tpshard-quant-moe-bench"))
    ap.add_argument("--sparse", action="store_true", help="headers and holes only (for plan)")
    args = ap.parse_args(argv)
    config, items = {"kimi": kimi, "glm": glm}[args.model]()
    out = args.workdir / f"{args.model}-1-layer{'-sparse' if args.sparse else ''}"
    total = write(out, config, items, sparse=args.sparse)
    print(f"{out}: {len(items)} tensors, {total / 2**30:.2f} GiB", file=sys.stderr)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
