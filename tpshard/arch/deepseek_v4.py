"""DeepSeek-V4 (Flash, Pro) in the release's native checkpoint names (SGLang models/deepseek_v4.py
and deepseek_v4_nextn.py, layers/attention/compressor.py, layers/moe/hash_topk.py; transformers
models/deepseek_v4/ for the shapes).

Not DeepSeek-V3 with new sizes: one shared kv head, a LoRA-factored query, a grouped output
projection, per-layer compressed attention, mHC hyper-connections, hash-routed first layers,
attention sinks. SGLang reads the native names (`embed`, `head`, `norm`, `hc_head_*`,
`layers.N.attn.*`, `layers.N.ffn.*`, `mtp.K.*`) through `remap_weight_name_to_dpsk_hf_format`;
the engine layer names below are what that remap makes of them. What a rank holds
(DeepseekV4Attention.__init__, DeepseekV4DecoderLayer, DeepseekV4Model):

- `attn.wq_b` ColumnParallelLinear over attn_tp (dim 0, by heads: n_local_heads = n_heads //
  attn_tp); `attn.wo_a` [o_groups * o_lora_rank, heads * head_dim / o_groups] a ColumnParallelLinear
  over attn_tp, dim 0: whole output groups (n_local_groups = o_groups // attn_tp, which SGLang
  never checks divides: refused here); `attn.wo_b` RowParallelLinear over attn_tp (dim 1).
- Whole on every rank: `attn.wq_a` and `attn.wkv` (ReplicatedLinear, fused into `wqkv_a` under
  SGLANG_OPT_FUSE_WQA_WKV), `q_norm`, `kv_norm`, `attn.attn_sink` (an fp32 Parameter of all
  n_heads, sliced only in the forward: "attention sink should be replicated"), the compressors
  (`wkv`/`wgate` fused into a ReplicatedLinear `wkv_gate` on load, fp32 `ape`, `norm`), the
  ratio-4 layers' indexer (`wq_b`, `weights_proj`, its own compressor), the fp32 mHC tensors
  (`hc_attn_*`, `hc_ffn_*`, `hc_head_*`), the norms, the router (`ffn.gate.weight`, fp32
  `ffn.gate.bias`) and the hash layers' `ffn.gate.tid2eid` [vocab, top-k] (HashTopK: an integer
  table of *global* expert ids, whole under EP too).
- `ffn.experts.E.w1/w3/w2`: FusedMoE, contiguous blocks of E / ep experts per EP slot, w1/w3 dim 0
  and w2 dim 1 over moe_tp; `ffn.shared_experts.w1/w3/w2` a DeepseekV2MLP over the full tp even
  under EP. SGLang refuses tp greater than the routed experts.
- `embed`: VocabParallelEmbedding(enable_tp=not is_dp_attention_enabled()): over tp, and *whole*
  (padded to 64 rows) under attention DP (V3 cuts it over attn_tp). `head`: ParallelLMHead over tp,
  over attn_tp with --enable-dp-lm-head (use_attn_tp_group=enable_dp_lm_head); tied, it is the
  embedding itself. With SGLang's shared-experts fusion (ep 1, 256 experts, bf16 on CUDA) the shared
  expert is FusedMoE expert 256 over moe_tp = tp: the same bytes per rank.
- The MTP layer `mtp.0.*` (DeepseekV4ForCausalLMNextN, one layer asserted): its decoder
  (`mtp.0.attn.*`, `mtp.0.ffn.*`, norms, mHC; compress ratio 0, so no compressor) cut like a main
  layer; `e_proj`, `h_proj` ReplicatedLinear, `enorm`, `hnorm`, `norm`, `hc_head_*` whole; its
  `emb.tok_emb` / `head` (which the NextN loader skips: the draft shares the target's) cut like the
  model's. Optional in a complete checkpoint.
- config.json: SGLang indexes `compress_ratios[layer_id]` (asserting 0, 4 or 128), reads
  `num_hash_layers`, and asserts num_key_value_heads == 1. transformers' own save of a V4 model
  drops those keys and renames tensors (`model.layers.N.self_attn.*`, `attn.norm` for
  `attn.kv_norm`): refused in one line.
- The FP8 + FP4 release (quantization_config quant_method fp8, expert_dtype fp4): resolved by
  tpshard.quant.config (formats dsv4_fp8 / dsv4_fp4: `<module>.scale`, which SGLang's remap reads as
  weight_scale_inv); each scale cut with its weight in whole blocks by tpshard.quant, wo_a kept FP8
  (SGLang dequantizes it whole at load, then cuts it: the same rows). Other quant methods refused.
- Pipeline stages: refused (no per-stage layout on record). `verify` checks every layer at layer
  level; `verify --model` runs tpshard.verify.v4_model's decoder (bf16, or the release dequantized)
  against transformers' DeepseekV4ForCausalLM. Export: refused.
"""

from tpshard.arch.base import Arch, EngineNames, Rule
from tpshard.arch.tensors import config_value
from tpshard.errors import PlanError
from tpshard.manifest import ModelInfo
from tpshard.topology import Topology

LV = r"((?:layers|mtp)\.\d+)"  # a main decoder layer or the MTP layer's decoder
A = LV + r"\.attn\."
F = LV + r"\.ffn\."
SA, MLP = r"model.\1.self_attn.", r"model.\1.mlp."

RULES: tuple[Rule, ...] = (
    Rule(r"embed", "VocabParallelEmbedding", "embed", "model.embed_tokens", shape="vocab"),
    Rule(r"head", "ParallelLMHead", "lm_head", "lm_head", shape="vocab"),
    Rule(r"norm", "Replicated", "replicated", "model.norm"),
    Rule(r"", "Replicated", "replicated", "model"),  # hc_head_fn / hc_head_base / hc_head_scale
    Rule(LV, "Replicated", "replicated", r"model.\1"),  # hc_attn_* / hc_ffn_* of the layer
    Rule(LV + r"\.attn_norm", "Replicated", "replicated", r"model.\1.input_layernorm"),
    Rule(LV + r"\.ffn_norm", "Replicated", "replicated", r"model.\1.post_attention_layernorm"),
    Rule(A + r"wq_a", "ReplicatedLinear", "replicated", SA + "wq_a", shape="v4_q_a"),
    Rule(A + r"wkv", "ReplicatedLinear", "replicated", SA + "wkv", shape="v4_kv"),
    Rule(A + r"(q_norm|kv_norm)", "Replicated", "replicated", SA + r"\2"),
    Rule(LV + r"\.attn", "Replicated", "replicated", r"model.\1.self_attn"),  # attn_sink, whole
    Rule(A + r"wq_b", "ColumnParallelLinear", "attn", SA + "wq_b", shape="v4_q_b", heads=True),
    Rule(A + r"wo_a", "ColumnParallelLinear", "attn", SA + "wo_a", shape="v4_o_a", heads=True),
    Rule(A + r"wo_b", "RowParallelLinear", "attn", SA + "wo_b", shape="v4_o_b", heads=True),
    # SGLang fuses each compressor's wkv and wgate into one ReplicatedLinear wkv_gate on load
    Rule(A + r"((?:indexer\.)?compressor)\.wkv", "ReplicatedLinear", "replicated", SA + r"\2.wkv_gate", "wkv"),
    Rule(A + r"((?:indexer\.)?compressor)\.wgate", "ReplicatedLinear", "replicated", SA + r"\2.wkv_gate", "wgate"),
    Rule(A + r"((?:indexer\.)?compressor(?:\.norm)?)", "Replicated", "replicated", SA + r"\2"),  # ape, norm
    Rule(A + r"indexer\.wq_b", "ReplicatedLinear", "replicated", SA + r"indexer.wq_b", shape="v4_index_q_b"),
    Rule(A + r"indexer\.weights_proj", "ReplicatedLinear", "replicated", SA + r"indexer.weights_proj", shape="v4_index_w"),
    # The router: weight, fp32 bias (SGLang's e_score_correction_bias) or the hash layers' tid2eid, all
    # whole. Held as plain tensors ("Replicated": verify compares their bytes), as the router's
    # sqrtsoftplus scoring and hash routing are not tpshard.runtime.moe.route's
    Rule(F + r"gate", "Replicated", "replicated", MLP + "gate", shape="router", moe=True),
    Rule(F + r"experts\.(?P<expert>\d+)\.w1", "FusedMoE", "expert", MLP + "experts", "w1", "expert_up", moe=True),
    Rule(F + r"experts\.(?P<expert>\d+)\.w3", "FusedMoE", "expert", MLP + "experts", "w3", "expert_up", moe=True),
    Rule(F + r"experts\.(?P<expert>\d+)\.w2", "FusedMoE", "expert", MLP + "experts", "w2", "expert_down", moe=True),
    Rule(F + r"shared_experts\.w1", "MergedColumnParallelLinear", "shared_expert", MLP + "shared_experts.gate_up_proj", "gate", "shared_up", moe=True),
    Rule(F + r"shared_experts\.w3", "MergedColumnParallelLinear", "shared_expert", MLP + "shared_experts.gate_up_proj", "up", "shared_up", moe=True),
    Rule(F + r"shared_experts\.w2", "RowParallelLinear", "shared_expert", MLP + "shared_experts.down_proj", shape="shared_down", moe=True),
    # The MTP layer's own (deepseek_v4_nextn.py DeepseekV4ModelNextN)
    Rule(r"(mtp\.\d+)\.(e_proj|h_proj)", "ReplicatedLinear", "replicated", r"model.\1.\2", shape="square"),
    Rule(r"(mtp\.\d+)\.(enorm|hnorm|norm)", "Replicated", "replicated", r"model.\1.\2"),
    Rule(r"(mtp\.\d+)\.emb\.tok_emb", "VocabParallelEmbedding", "embed", r"model.\1.embed_tokens", shape="vocab"),
    Rule(r"(mtp\.\d+)\.head", "ParallelLMHead", "lm_head", r"model.\1.shared_head.head", shape="vocab"),
)  # fmt: skip

# The rules match module paths; these are the only names a tensor of theirs may have: a weight, or
# one of V4's bare parameters (mHC, the sink, a compressor's ape, the router's bias and tid2eid).
NAMES = (
    r"hc_head_(?:fn|base|scale)|(?:layers|mtp)\.\d+\.(?:hc_(?:attn|ffn|head)_(?:fn|base|scale)|attn\.attn_sink"
    r"|attn\.(?:indexer\.)?compressor\.ape|ffn\.gate\.(?:bias|tid2eid))|.+\.weight|.+\.scale"
)
HC = ("fn", "base", "scale")
COMPRESSOR = ("wkv.weight", "wgate.weight", "ape", "norm.weight")


def sparse(model: ModelInfo, layer: int) -> bool:
    """Every DeepSeek-V4 layer (and the MTP layer) is a MoE layer: no first_k_dense_replace."""
    return True


def compress_ratios(config: dict, model: ModelInfo) -> list[int]:
    """Each main layer's compress ratio (a config without them is refused first, by refuse_config)."""
    ratios = config_value(config, "compress_ratios") or [0] * model.num_layers
    return list(ratios[: model.num_layers])


def expected(model: ModelInfo, config: dict):
    """The native names of every main layer: norms, mHC, the attention with its sink, the
    compressor of a compressed layer (and the indexer of a ratio-4 one), the router (tid2eid in the
    num_hash_layers first layers, the correction bias in the others), every routed expert and the
    shared experts. The MTP layer is optional: an engine serving without speculative decoding never
    reads it."""
    yield "embed.weight"
    yield "norm.weight"
    if not config_value(config, "tie_word_embeddings", False):
        yield "head.weight"
    yield from (f"hc_head_{h}" for h in HC)
    hashed = int(config_value(config, "num_hash_layers", 0))
    for i, ratio in enumerate(compress_ratios(config, model)):
        p = f"layers.{i}"
        yield from (f"{p}.attn_norm.weight", f"{p}.ffn_norm.weight")
        yield from (f"{p}.hc_{part}_{h}" for part in ("attn", "ffn") for h in HC)
        a = f"{p}.attn"
        yield from (f"{a}.{w}.weight" for w in ("wq_a", "q_norm", "wq_b", "wkv", "kv_norm", "wo_a", "wo_b"))
        yield f"{a}.attn_sink"
        if ratio:
            yield from (f"{a}.compressor.{c}" for c in COMPRESSOR)
        if ratio == 4:
            yield from (f"{a}.indexer.wq_b.weight", f"{a}.indexer.weights_proj.weight")
            yield from (f"{a}.indexer.compressor.{c}" for c in COMPRESSOR)
        f = f"{p}.ffn"
        yield f"{f}.gate.weight"
        yield f"{f}.gate.tid2eid" if i < hashed else f"{f}.gate.bias"
        for e in range(model.num_experts):
            yield from (f"{f}.experts.{e}.{w}.weight" for w in ("w1", "w2", "w3"))
        if model.num_shared_experts:
            yield from (f"{f}.shared_experts.{w}.weight" for w in ("w1", "w2", "w3"))


def refuse_config(config: dict, model: ModelInfo) -> None:
    """What SGLang's DeepseekV4 classes read or assert of config.json, and quant methods other than the release's."""
    name = model.architecture
    quant = config_value(config, "quantization_config")
    if quant is not None and (not isinstance(quant, dict) or str(quant.get("quant_method", "")).lower() != "fp8"):
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise PlanError(
            f"{name}: quantization_config quant_method {method!r}; tpshard splits DeepSeek-V4 in bf16 or in its"
            " release's form (quant_method fp8: FP8 linears with 128x128 ue8m0 block scales, FP4 routed experts)"
        )
    ratios = config_value(config, "compress_ratios")
    if ratios is None or config_value(config, "num_hash_layers") is None:
        raise PlanError(
            f"{name}: config.json has no compress_ratios / num_hash_layers, which SGLang's deepseek_v4.py reads:"
            " a config written by transformers' save_pretrained (it renames tensors too: model.layers.N.self_attn.*);"
            " split the release's native checkpoint (embed, head, layers.N.attn.*, layers.N.ffn.*)"
        )
    if len(ratios) < model.num_layers or any(r not in (0, 4, 128) for r in ratios[: model.num_layers]):
        raise PlanError(
            f"{name}: compress_ratios {ratios} must give each of the {model.num_layers} layers 0, 4 or 128"
            " (SGLang's DeepseekV4Attention asserts it)"
        )
    if model.num_kv_heads != 1:
        raise PlanError(f"{name}: num_key_value_heads {model.num_kv_heads}; SGLang's DeepseekV4Attention asserts one shared kv head")
    if model.num_nextn_predict_layers > 1:
        raise PlanError(
            f"{name}: num_nextn_predict_layers {model.num_nextn_predict_layers}; SGLang's DeepseekV4ForCausalLMNextN"
            ' asserts "Only 1 nextn layer is supported"'
        )


def refuse_topology(t: Topology, model: ModelInfo) -> None:
    """Whole heads and whole output groups per attention rank (n_heads // attn_tp, o_groups // attn_tp)."""
    if model.num_heads % t.attn_tp:
        raise PlanError(f"{model.architecture}: {model.num_heads} attention heads do not divide over the attn_tp group of {t.attn_tp} ranks")
    if model.o_groups % t.attn_tp:
        raise PlanError(
            f"{model.architecture}: o_groups {model.o_groups} does not divide over the attn_tp group of {t.attn_tp} ranks;"
            " SGLang's DeepseekV4Attention gives each rank o_groups // attn_tp whole output groups of wo_a"
        )


ARCHS = (
    Arch(
        "DeepseekV4ForCausalLM", RULES, "deepseek_v4.py", attn_group="attn_tp", embed_group="replicated",
        model_type="deepseek_v4", expected=expected, exports=EngineNames(vllm=None, sglang=None), verify="deepseek_v4",
        router=None, sparse=sparse, experts_limit="tp", check=refuse_config,
        check_topology=refuse_topology, names=NAMES,
    ),
)  # fmt: skip
