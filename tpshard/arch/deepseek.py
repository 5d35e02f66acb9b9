"""DeepSeek V2 / V3 with MLA attention (SGLang models/deepseek_v2.py, deepseek_nextn.py).

- MLA: q_a_proj and kv_a_proj_with_mqa are one ReplicatedLinear in the engine
  (fused_qkv_a_proj_with_mqa), kept whole and separate on disk; q_b_proj (or q_proj without
  q_lora_rank) and kv_b_proj are column-parallel by heads, o_proj row-parallel, all over attn_tp.
- Layers below first_k_dense_replace (and off moe_layer_freq) have a dense MLP over tp, or whole
  with --moe-dense-tp 1; the others a router, routed experts and shared experts over the full tp.
- The MTP module is decoder layer num_hidden_layers: a MoE layer plus enorm, hnorm, eh_proj,
  shared_head.norm (whole), and its own embed_tokens / shared_head.head, cut like the model's
  (SGLang never reads them: the draft shares the target's; cut anyway so every tensor is checked).
- Pipeline stages: lm_head and norm on the last stage, which also runs the MTP layer and, with it,
  holds a second copy of model.embed_tokens (docs/pipeline.md).
- Router (transformers' DeepseekV3TopkRouter, DeepseekV2TopkRouter): V3 scores with a sigmoid,
  picks with e_score_correction_bias among the best topk_group of n_group groups (each scored by
  its top-2 sum); V2 a softmax, grouped (by each group's max) only with topk_method
  group_limited_greedy.
- Export: vLLM only (models/deepseek_v2.py), the MTP layer left out as vLLM never builds it.
- Under every all-to-all MoE backend (--moe-a2a-backend, A2A_SHARED) DeepseekV2MoE.__init__
  builds the shared experts with parallel_group="replicated" (deepseek_v2.py L874-897): whole on
  every rank, the MTP layer's too. With ep = tp each rank's MoE-TP is 1, so a shared expert fused
  into the experts (--enforce-shared-experts-fusion; off by default under DeepEP, L3355-3356) is
  also whole on every rank: the same bytes.
- Decode context parallelism (--dcp, SGLang --dcp-size) changes no weight: DeepseekV2AttentionMLA
  reads attn_dcp_size only to size the decode attention over the gathered heads (deepseek_v2.py
  L2053-2055, L2193-2204); q_b_proj / q_proj, kv_b_proj and o_proj stay over attn_tp. Nor does
  --dcp-replicate-q-proj: the model runner all-gathers each rank's q projection over its DCP group
  after loading (model_executor/model_runner.py L1130-1160), so the files hold the attn_tp cut
  (unlike vLLM 0.33.0's DCPGroupColumnParallelLinear, which loads the group's heads: export refused).
"""

from tpshard.arch.base import NORMS, VOCAB, Arch, EngineNames, EngineTable, L, Piece, Rule, gated_mlp, routed_experts, router
from tpshard.arch.engine_names import DENSE_PIECES, ROUTED, VLLM_ATTENTION_BUFFERS, vllm_mlp
from tpshard.arch.router import RouterConfig
from tpshard.arch.tensors import decoder_tensors, expert_tensors, mlp_tensors
from tpshard.manifest import ModelInfo

MLA: tuple[Rule, ...] = (
    Rule(L + r"\.self_attn\.q_a_proj", "ReplicatedLinear", "replicated", r"\1.self_attn.fused_qkv_a_proj_with_mqa", "q_a", "mla_q_a"),
    Rule(L + r"\.self_attn\.(q_a_layernorm|kv_a_layernorm)", "Replicated", "replicated", r"\1.self_attn.\2"),
    Rule(L + r"\.self_attn\.q_b_proj", "ColumnParallelLinear", "attn", r"\1.self_attn.q_b_proj", shape="mla_q_b", heads=True),
    Rule(L + r"\.self_attn\.q_proj", "ColumnParallelLinear", "attn", r"\1.self_attn.q_proj", shape="mla_q", heads=True),
    Rule(L + r"\.self_attn\.kv_b_proj", "ColumnParallelLinear", "attn", r"\1.self_attn.kv_b_proj", shape="mla_kv_b", heads=True),
    Rule(L + r"\.self_attn\.o_proj", "RowParallelLinear", "attn", r"\1.self_attn.o_proj", shape="mla_o", heads=True),
)  # fmt: skip
# With q_lora_rank the engine fuses kv_a_proj_with_mqa with q_a_proj; without, it stands alone.
KV_A_FUSED = Rule(L + r"\.self_attn\.kv_a_proj_with_mqa", "ReplicatedLinear", "replicated", r"\1.self_attn.fused_qkv_a_proj_with_mqa", "kv_a", "mla_kv_a")
KV_A_ALONE = KV_A_FUSED._replace(layer=r"\1.self_attn.kv_a_proj_with_mqa", piece="")

MOE = (
    router("mlp")
    + routed_experts("mlp", "gate_proj", "up_proj", "down_proj")
    + gated_mlp("mlp.shared_experts", "shared_expert", "shared_up", "shared_down", moe=True)
)
DENSE = gated_mlp("mlp", "dense_mlp", "mlp_up", "mlp_down", moe=False)

MTP: tuple[Rule, ...] = (
    Rule(L + r"\.(enorm|hnorm)", "Replicated", "replicated", r"\1.\2"),
    Rule(L + r"\.shared_head\.norm", "Replicated", "replicated", r"\1.shared_head.norm"),
    Rule(L + r"\.eh_proj", "ReplicatedLinear", "replicated", r"\1.eh_proj", shape="eh_proj"),
    Rule(L + r"\.embed_tokens", "VocabParallelEmbedding", "embed", r"\1.embed_tokens", shape="vocab"),
    Rule(L + r"\.shared_head\.head", "ParallelLMHead", "lm_head", r"\1.shared_head.head", shape="vocab"),
)  # fmt: skip

BASE = VOCAB + NORMS + MLA + MOE + DENSE + MTP
# DeepseekV2MoE.__init__ (deepseek_v2.py L874-885): _shared_expert_use_tp1 under each of these.
A2A_SHARED = frozenset(
    ("deepep", "pplx", "mooncake", "nixl", "mori", "ascend_fuseep", "flashinfer", "megamoe", "flashinfer_megamoe", "deepep_v2")
)


def sparse(model: ModelInfo, layer: int) -> bool:
    """DeepseekV2DecoderLayer._is_layer_sparse; the MTP decoder (layer >= num_layers) always is."""
    if layer >= model.num_layers:
        return True
    return model.num_experts > 0 and layer >= model.first_k_dense_replace and layer % model.moe_layer_freq == 0


def kv_a(model: ModelInfo) -> tuple[Rule, ...]:
    return (KV_A_FUSED,) if model.q_lora_rank else (KV_A_ALONE,)


def expected(model: ModelInfo, config: dict):
    """Per layer MLA attention, then a dense MLP or the router (with its correction bias under
    topk_method noaux_tc), every routed expert and the shared experts. The MTP layers are optional:
    an engine that serves without speculative decoding never reads them."""

    def mla(p: str):
        a = f"{p}.self_attn"
        if model.q_lora_rank:
            yield from (f"{a}.q_a_proj.weight", f"{a}.q_a_layernorm.weight", f"{a}.q_b_proj.weight")
        else:
            yield f"{a}.q_proj.weight"
        yield from (f"{a}.kv_a_proj_with_mqa.weight", f"{a}.kv_a_layernorm.weight", f"{a}.kv_b_proj.weight", f"{a}.o_proj.weight")

    def mlp(p: str, i: int):
        if not sparse(model, i):
            yield from mlp_tensors(f"{p}.mlp")
            return
        yield from expert_tensors(f"{p}.mlp", model, ("gate_proj", "up_proj", "down_proj"))
        if model.topk_method == "noaux_tc":
            yield f"{p}.mlp.gate.e_score_correction_bias"
        if model.num_shared_experts:
            yield from mlp_tensors(f"{p}.mlp.shared_experts")

    return decoder_tensors(model, config, mla, mlp)


def v3_router(config: dict, e: int, k: int) -> RouterConfig:
    return RouterConfig(
        num_experts=e, top_k=k, scoring="sigmoid",
        renormalize=bool(config.get("norm_topk_prob", True)), n_group=config.get("n_group") or 1,
        topk_group=config.get("topk_group") or 1, group_score="top2_sum", correction_bias=True,
        routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
    )  # fmt: skip


def v2_router(config: dict, e: int, k: int) -> RouterConfig:
    grouped = config.get("topk_method", "greedy") == "group_limited_greedy"
    return RouterConfig(
        num_experts=e, top_k=k, scoring="softmax", renormalize=False,
        n_group=(config.get("n_group") or 1) if grouped else 1, topk_group=(config.get("topk_group") or 1) if grouped else 1,
        group_score="max", routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
    )  # fmt: skip


# vLLM (models/deepseek_v2.py). MLA: DeepseekV2MLAAttention (L1052-1106) hands q_b_proj / q_proj,
# o_proj and q_a_layernorm to its `mla_attn` wrapper (L1196-1198), whose names sort first; with
# q_lora_rank, fused_qkv_a_proj = [q_a_proj; kv_a_proj_with_mqa] (L1052), else kv_a_proj_with_mqa
# stands alone. The MLA attention's four scale buffers sit at self_attn.mla_attn.mla_attn. The
# router's e_score_correction_bias is a float32 parameter of the gate, built only when config.json
# says topk_method "noaux_tc" (L327-332). The MTP layer (num_hidden_layers) is not built
# (make_layers L1468) and its weights are skipped (L1653-1654).
_MLA = L + r"\.self_attn\."
VLLM_PIECES = (
    tuple(p for p in DENSE_PIECES if ".self_attn." not in p[1].engine)  # embedding, norms, dense MLP of layers < first_k_dense_replace
    + (
        (_MLA + r"q_a_proj\.weight", Piece(r"\1.self_attn.fused_qkv_a_proj.weight", 0, 2)),
        (_MLA + r"q_a_layernorm\.weight", Piece(r"\1.self_attn.mla_attn.q_a_layernorm.weight", 0, 1)),
        (_MLA + r"q_b_proj\.weight", Piece(r"\1.self_attn.mla_attn.q_b_proj.weight", 0, 1)),
        (_MLA + r"q_proj\.weight", Piece(r"\1.self_attn.mla_attn.q_proj.weight", 0, 1)),
        (_MLA + r"kv_a_layernorm\.weight", Piece(r"\1.self_attn.kv_a_layernorm.weight", 0, 1)),
        (_MLA + r"kv_b_proj\.weight", Piece(r"\1.self_attn.kv_b_proj.weight", 0, 1)),
        (_MLA + r"o_proj\.weight", Piece(r"\1.self_attn.mla_attn.o_proj.weight", 0, 1)),
        (L + r"\.mlp\.gate\.weight", Piece(r"\1.mlp.experts.gate.weight", 0, 1)),
        (L + r"\.mlp\.gate\.e_score_correction_bias", Piece(r"\1.mlp.experts.gate.e_score_correction_bias", 0, 1, dtype="F32")),
    )
    + ROUTED
    + vllm_mlp("mlp.shared_experts", "mlp.experts._shared_experts._layer")
)
VLLM_KV_A_FUSED = ((_MLA + r"kv_a_proj_with_mqa\.weight", Piece(r"\1.self_attn.fused_qkv_a_proj.weight", 1, 2)),)
VLLM_KV_A_ALONE = ((_MLA + r"kv_a_proj_with_mqa\.weight", Piece(r"\1.self_attn.kv_a_proj_with_mqa.weight", 0, 1)),)


def refuse_router_bias(plan, config: dict) -> str | None:
    """vLLM's DeepSeek gate has e_score_correction_bias only for topk_method "noaux_tc"
    (models/deepseek_v2.py L327-332): otherwise the key would be unknown to it (KeyError on load)."""
    method = config.get("topk_method")
    if method == "noaux_tc" or not any(t.name.endswith(".e_score_correction_bias") and t.cuts for t in plan.tensors):
        return None
    says = f"says topk_method {method!r}" if method is not None else "names no topk_method"
    return f'the checkpoint has mlp.gate.e_score_correction_bias but config.json {says}; vllm builds that parameter only for "noaux_tc", so its load would fail; fix config.json'


MLA_BUFFERS = tuple(b._replace(engine=b.engine.replace("self_attn.attn.", "self_attn.mla_attn.mla_attn.")) for b in VLLM_ATTENTION_BUFFERS)
EXPORTS = EngineNames(
    vllm=EngineTable(
        VLLM_PIECES, tied="lm_head.weight", buffers=MLA_BUFFERS, ep="vllm", drop_mtp=True, q_lora=(VLLM_KV_A_FUSED, VLLM_KV_A_ALONE),
        refuse=refuse_router_bias,
    ),
    sglang=None,
)

ARCHS = tuple(
    Arch(
        name, BASE, "deepseek_v2.py", attn_group="attn_tp", embed_group="attn_tp", model_type=model_type,
        expected=expected, exports=EXPORTS, verify="moe", router=rule, sparse=sparse, experts_limit="tp",
        variant=kv_a, pp_head="last", pp_tied_head=True, a2a_shared=A2A_SHARED, dcp="neutral",
    )
    for name, model_type, rule in (("DeepseekV3ForCausalLM", "deepseek_v3", v3_router), ("DeepseekV2ForCausalLM", "deepseek_v2", v2_router))
)  # fmt: skip
