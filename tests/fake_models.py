"""Checkpoints of headers only, shaped like the real MoE / MLA models of the MoE and MLA worked tables of docs/contracts.md (DeepSeek-V3,
Qwen3-30B-A3B, Mixtral-8x7B), so that the worked per-rank tables can be planned without the bytes."""

from __future__ import annotations

from pathlib import Path

from tpshard.checkpoint import Checkpoint
from tpshard.safetensors_format import TensorInfo, nbytes_of

BLOCK = 128


def _checkpoint(config: dict, shapes: dict[str, tuple[tuple[int, ...], str]], files: int = 1) -> Checkpoint:
    tensors, offsets = {}, [0] * files
    for i, (name, (shape, dtype)) in enumerate(shapes.items()):
        f = i * files // len(shapes)
        n = nbytes_of(dtype, shape)
        tensors[name] = TensorInfo(f"model-{f:05d}.safetensors", dtype, shape, offsets[f], offsets[f] + n)
        offsets[f] += n
    return Checkpoint(
        path=Path("/nonexistent"), config=config, tensors=tensors, index_file="model.safetensors.index.json",
        weight_files=tuple(f"model-{f:05d}.safetensors" for f in range(files)),
    )  # fmt: skip


def _linear(shapes: dict, name: str, n: int, k: int, fp8: bool) -> None:
    """A weight [n, k]; FP8 block: F8_E4M3 plus weight_scale_inv [ceil(n/128), ceil(k/128)] F32."""
    if fp8:
        shapes[f"{name}.weight"] = ((n, k), "F8_E4M3")
        shapes[f"{name}.weight_scale_inv"] = ((-(-n // BLOCK), -(-k // BLOCK)), "F32")
    else:
        shapes[f"{name}.weight"] = ((n, k), "BF16")


V3 = dict(
    hidden_size=7168, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, moe_intermediate_size=2048, n_shared_experts=1,
    first_k_dense_replace=3, intermediate_size=18432, vocab_size=129280, num_hidden_layers=61,
    num_nextn_predict_layers=1, moe_layer_freq=1, num_experts_per_tok=8, n_group=8, topk_group=4,
    routed_scaling_factor=2.5, scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=True,
    num_key_value_heads=128,
)  # fmt: skip


def deepseek_v3(*, layers: int | None = None, fp8: bool = True, mtp: bool = True, files: int = 8, **overrides) -> Checkpoint:
    """DeepSeek-V3 (FP8 block 128x128 by default). `layers` keeps the first few decoder layers
    (the MTP layer stays layer num_hidden_layers); the full model has 61 + 1."""
    c = {**V3, **overrides}
    n_layers = c["num_hidden_layers"] if layers is None else layers
    c["num_hidden_layers"] = n_layers
    if not mtp:
        c["num_nextn_predict_layers"] = 0
    h, nh, e = c["hidden_size"], c["num_attention_heads"], c["n_routed_experts"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    shapes: dict = {"model.embed_tokens.weight": ((c["vocab_size"], h), "BF16")}
    for i in range(n_layers + (1 if mtp else 0)):
        p = f"model.layers.{i}"
        shapes[f"{p}.input_layernorm.weight"] = ((h,), "BF16")
        if c["q_lora_rank"]:
            _linear(shapes, f"{p}.self_attn.q_a_proj", c["q_lora_rank"], h, fp8)
            shapes[f"{p}.self_attn.q_a_layernorm.weight"] = ((c["q_lora_rank"],), "BF16")
            _linear(shapes, f"{p}.self_attn.q_b_proj", nh * qk, c["q_lora_rank"], fp8)
        else:
            _linear(shapes, f"{p}.self_attn.q_proj", nh * qk, h, fp8)
        _linear(shapes, f"{p}.self_attn.kv_a_proj_with_mqa", c["kv_lora_rank"] + c["qk_rope_head_dim"], h, fp8)
        shapes[f"{p}.self_attn.kv_a_layernorm.weight"] = ((c["kv_lora_rank"],), "BF16")
        _linear(shapes, f"{p}.self_attn.kv_b_proj", nh * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"], fp8)
        _linear(shapes, f"{p}.self_attn.o_proj", h, nh * c["v_head_dim"], fp8)
        shapes[f"{p}.post_attention_layernorm.weight"] = ((h,), "BF16")
        if i < c["first_k_dense_replace"]:
            _linear(shapes, f"{p}.mlp.gate_proj", c["intermediate_size"], h, fp8)
            _linear(shapes, f"{p}.mlp.up_proj", c["intermediate_size"], h, fp8)
            _linear(shapes, f"{p}.mlp.down_proj", h, c["intermediate_size"], fp8)
        else:
            shapes[f"{p}.mlp.gate.weight"] = ((e, h), "BF16")
            shapes[f"{p}.mlp.gate.e_score_correction_bias"] = ((e,), "F32")
            for x in range(e):
                _linear(shapes, f"{p}.mlp.experts.{x}.gate_proj", c["moe_intermediate_size"], h, fp8)
                _linear(shapes, f"{p}.mlp.experts.{x}.up_proj", c["moe_intermediate_size"], h, fp8)
                _linear(shapes, f"{p}.mlp.experts.{x}.down_proj", h, c["moe_intermediate_size"], fp8)
            s = c["n_shared_experts"] * c["moe_intermediate_size"]
            _linear(shapes, f"{p}.mlp.shared_experts.gate_proj", s, h, fp8)
            _linear(shapes, f"{p}.mlp.shared_experts.up_proj", s, h, fp8)
            _linear(shapes, f"{p}.mlp.shared_experts.down_proj", h, s, fp8)
        if i == n_layers:  # the MTP module
            shapes |= {
                f"{p}.enorm.weight": ((h,), "BF16"), f"{p}.hnorm.weight": ((h,), "BF16"),
                f"{p}.eh_proj.weight": ((h, 2 * h), "BF16"), f"{p}.shared_head.norm.weight": ((h,), "BF16"),
                f"{p}.embed_tokens.weight": ((c["vocab_size"], h), "BF16"),
                f"{p}.shared_head.head.weight": ((c["vocab_size"], h), "BF16"),
            }  # fmt: skip
    shapes["model.norm.weight"] = ((h,), "BF16")
    shapes["lm_head.weight"] = ((c["vocab_size"], h), "BF16")
    config = dict(c, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", torch_dtype="bfloat16")
    if fp8:
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}
    return _checkpoint(config, shapes, files)


def _gqa_layer(p: str, c: dict, h: int, hd: int) -> dict:
    """A decoder layer's norms and q/k/v/o of a GQA attention (bf16)."""
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    return {
        f"{p}.input_layernorm.weight": ((h,), "BF16"), f"{p}.post_attention_layernorm.weight": ((h,), "BF16"),
        f"{p}.self_attn.q_proj.weight": ((heads * hd, h), "BF16"), f"{p}.self_attn.k_proj.weight": ((kv * hd, h), "BF16"),
        f"{p}.self_attn.v_proj.weight": ((kv * hd, h), "BF16"), f"{p}.self_attn.o_proj.weight": ((h, heads * hd), "BF16"),
    }  # fmt: skip


def qwen_moe(arch: str = "Qwen3MoeForCausalLM", *, layers: int = 48, **overrides) -> Checkpoint:
    """Qwen3-30B-A3B by default (bf16): H 2048, 32 heads of 128, 4 kv heads, 128 experts of 768."""
    c = dict(
        hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        moe_intermediate_size=768, intermediate_size=6144, vocab_size=151936, num_hidden_layers=layers,
        num_experts_per_tok=8, norm_topk_prob=True,
    )  # fmt: skip
    c |= overrides
    h, hd, e = c["hidden_size"], c["head_dim"], c["num_experts"]
    shapes: dict = {"model.embed_tokens.weight": ((c["vocab_size"], h), "BF16")}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes |= _gqa_layer(p, c, h, hd) | {f"{p}.mlp.gate.weight": ((e, h), "BF16")}
        if arch == "Qwen3MoeForCausalLM":
            shapes |= {f"{p}.self_attn.q_norm.weight": ((hd,), "BF16"), f"{p}.self_attn.k_norm.weight": ((hd,), "BF16")}
        for x in range(e):
            shapes[f"{p}.mlp.experts.{x}.gate_proj.weight"] = ((c["moe_intermediate_size"], h), "BF16")
            shapes[f"{p}.mlp.experts.{x}.up_proj.weight"] = ((c["moe_intermediate_size"], h), "BF16")
            shapes[f"{p}.mlp.experts.{x}.down_proj.weight"] = ((h, c["moe_intermediate_size"]), "BF16")
        if arch == "Qwen2MoeForCausalLM":
            s = c["shared_expert_intermediate_size"]
            shapes |= {
                f"{p}.mlp.shared_expert.gate_proj.weight": ((s, h), "BF16"),
                f"{p}.mlp.shared_expert.up_proj.weight": ((s, h), "BF16"),
                f"{p}.mlp.shared_expert.down_proj.weight": ((h, s), "BF16"),
                f"{p}.mlp.shared_expert_gate.weight": ((1, h), "BF16"),
            }  # fmt: skip
    shapes |= {"model.norm.weight": ((h,), "BF16"), "lm_head.weight": ((c["vocab_size"], h), "BF16")}
    model_type = "qwen3_moe" if arch == "Qwen3MoeForCausalLM" else "qwen2_moe"
    return _checkpoint(dict(c, architectures=[arch], model_type=model_type), shapes)


def mixtral(*, layers: int = 32, **overrides) -> Checkpoint:
    """Mixtral-8x7B (bf16): H 4096, 32 heads, 8 kv heads, 8 experts of 14336, vocab 32000."""
    c = dict(
        hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
        intermediate_size=14336, vocab_size=32000, num_hidden_layers=layers, num_experts_per_tok=2,
    )  # fmt: skip
    c |= overrides
    h, hd, e, i_ = c["hidden_size"], c["hidden_size"] // c["num_attention_heads"], c["num_local_experts"], c["intermediate_size"]
    shapes: dict = {"model.embed_tokens.weight": ((c["vocab_size"], h), "BF16")}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        shapes |= _gqa_layer(p, c, h, hd) | {f"{p}.block_sparse_moe.gate.weight": ((e, h), "BF16")}
        for x in range(e):
            shapes[f"{p}.block_sparse_moe.experts.{x}.w1.weight"] = ((i_, h), "BF16")
            shapes[f"{p}.block_sparse_moe.experts.{x}.w3.weight"] = ((i_, h), "BF16")
            shapes[f"{p}.block_sparse_moe.experts.{x}.w2.weight"] = ((h, i_), "BF16")
    shapes |= {"model.norm.weight": ((h,), "BF16"), "lm_head.weight": ((c["vocab_size"], h), "BF16")}
    return _checkpoint(dict(c, architectures=["MixtralForCausalLM"], model_type="mixtral"), shapes)


# Qwen3.5-397B-A17B's text model, as its config.json gives it: 60 layers (every 4th full attention),
# H 4096, 32 heads of 256 over 2 kv heads (gated q), gated DeltaNet with 16 key heads and 64 value
# heads of 128, 512 experts of 1024 + a shared expert of 1024, vocab 248320.
QWEN3_5 = dict(
    hidden_size=4096, num_hidden_layers=60, num_attention_heads=32, num_key_value_heads=2, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=64, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=1024,
    shared_expert_intermediate_size=1024, vocab_size=248320, full_attention_interval=4,
)  # fmt: skip


def qwen3_5_moe(*, layers: int = 60, fused: bool = False, mtp: bool = False, **overrides) -> Checkpoint:
    """Qwen3_5MoeForCausalLM at Qwen3.5-397B-A17B's dims (bf16; A_log fp32 as the release keeps it);
    `fused`: the experts as gate_up_proj [E, 2I, H] / down_proj [E, H, I]; `mtp`: the MTP layer mtp.*."""
    c = {**QWEN3_5, "num_hidden_layers": layers, **overrides}
    h, e, hd = c["hidden_size"], c["num_experts"], c["head_dim"]
    k, v, nv = c["linear_num_key_heads"] * c["linear_key_head_dim"], c["linear_num_value_heads"] * c["linear_value_head_dim"], c["linear_num_value_heads"]
    heads, kv, i_e, s = c["num_attention_heads"], c["num_key_value_heads"], c["moe_intermediate_size"], c["shared_expert_intermediate_size"]
    shapes: dict = {"model.embed_tokens.weight": ((c["vocab_size"], h), "BF16")}
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes |= {f"{p}.input_layernorm.weight": ((h,), "BF16"), f"{p}.post_attention_layernorm.weight": ((h,), "BF16")}
        if (i + 1) % c["full_attention_interval"]:
            a = f"{p}.linear_attn"
            shapes |= {
                f"{a}.in_proj_qkv.weight": ((2 * k + v, h), "BF16"), f"{a}.in_proj_z.weight": ((v, h), "BF16"),
                f"{a}.in_proj_b.weight": ((nv, h), "BF16"), f"{a}.in_proj_a.weight": ((nv, h), "BF16"),
                f"{a}.conv1d.weight": ((2 * k + v, 1, c["linear_conv_kernel_dim"]), "BF16"),
                f"{a}.A_log": ((nv,), "F32"), f"{a}.dt_bias": ((nv,), "BF16"),
                f"{a}.norm.weight": ((c["linear_value_head_dim"],), "F32"), f"{a}.out_proj.weight": ((h, v), "BF16"),
            }  # fmt: skip
        else:
            a = f"{p}.self_attn"
            shapes |= {
                f"{a}.q_proj.weight": ((2 * heads * hd, h), "BF16"), f"{a}.k_proj.weight": ((kv * hd, h), "BF16"),
                f"{a}.v_proj.weight": ((kv * hd, h), "BF16"), f"{a}.o_proj.weight": ((h, heads * hd), "BF16"),
                f"{a}.q_norm.weight": ((hd,), "BF16"), f"{a}.k_norm.weight": ((hd,), "BF16"),
            }  # fmt: skip
        shapes[f"{p}.mlp.gate.weight"] = ((e, h), "BF16")
        if fused:
            shapes |= {f"{p}.mlp.experts.gate_up_proj": ((e, 2 * i_e, h), "BF16"), f"{p}.mlp.experts.down_proj": ((e, h, i_e), "BF16")}
        for x in range(0 if fused else e):
            shapes |= {
                f"{p}.mlp.experts.{x}.gate_proj.weight": ((i_e, h), "BF16"), f"{p}.mlp.experts.{x}.up_proj.weight": ((i_e, h), "BF16"),
                f"{p}.mlp.experts.{x}.down_proj.weight": ((h, i_e), "BF16"),
            }  # fmt: skip
        shapes |= {
            f"{p}.mlp.shared_expert.gate_proj.weight": ((s, h), "BF16"), f"{p}.mlp.shared_expert.up_proj.weight": ((s, h), "BF16"),
            f"{p}.mlp.shared_expert.down_proj.weight": ((h, s), "BF16"), f"{p}.mlp.shared_expert_gate.weight": ((1, h), "BF16"),
        }  # fmt: skip
    shapes |= {"model.norm.weight": ((h,), "BF16"), "lm_head.weight": ((c["vocab_size"], h), "BF16")}
    if mtp:  # the last full-attention layer's tensors at mtp.layers.0, fc and the three norms
        last = max(i for i in range(layers) if (i + 1) % c["full_attention_interval"] == 0)
        shapes |= {"mtp.layers.0." + n.split(".", 3)[3]: v for n, v in list(shapes.items()) if n.startswith(f"model.layers.{last}.")}
        shapes |= {"mtp.fc.weight": ((h, 2 * h), "BF16")} | {f"mtp.{n}.weight": ((h,), "BF16") for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
    config = dict(c, architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text", dtype="bfloat16")
    return _checkpoint(config, shapes, files=8)
