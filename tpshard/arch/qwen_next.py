"""Hybrid decoders: Qwen3.5-MoE and Qwen3-Next (SGLang models/qwen3_5_text.py, which registers
Qwen3_5MoeForCausalLM around the body of qwen3_5.py; qwen3_next.py; the shared MoE block of
qwen2_moe.py; transformers models/qwen3_5_moe/, models/qwen3_next/).

Layers are gated DeltaNet linear attention (`linear_attn`) or gated full attention (`self_attn`),
as config.json's layer_types says; every layer has routed experts, a shared expert and its gate.
What rank r holds (attn_tp = tp / attn_dp, moe_tp = tp / ep) is what SGLang 0.5.23's classes build:

- Linear attention, over attn_tp (the attention group; qwen3_5.py builds it with the attention-TP
  rank and size): Qwen3.5 stores the projections split. `in_proj_qkv` [2K + V, H] (K = key heads x
  key dim, V = value heads x value dim) loads as shards 0, 1, 2 of the fused in_proj_qkvz, so each
  rank holds its slice of *each* of the q, k and v segments, concatenated (a segmented cut,
  ShardSpec.segments), not one contiguous block; `in_proj_z` (shard 3), `in_proj_b`, `in_proj_a`
  are cut by rows. Qwen3-Next stores them fused and packed per key-head group ([q_g | k_g | v_g |
  z_g], [b_g | a_g]): its packed loader cuts `in_proj_qkvz` / `in_proj_ba` contiguously, whole
  groups per rank. Both: `conv1d` [2K + V, 1, k] segmented like in_proj_qkv (mamba's sharded
  conv loader), `A_log` / `dt_bias` [value heads] cut by value heads (SGLang keeps A_log in fp32
  in memory; the checkpoint's dtype is written), the gated `norm` [value dim] whole, `out_proj`
  by columns. Key heads and value heads must each divide attn_tp.
- Full attention: q_proj holds per head [q_h | gate_h] (attn_output_gate), one QKVParallelLinear
  over attn_tp cutting 2 x heads x head_dim rows by whole heads; k/v by kv heads (replicated when
  attn_tp > kv heads), o_proj by columns, q_norm / k_norm whole. Under --dcp (SGLang --dcp-size)
  Qwen3.5's K/V are cut over ReplicatedParallelGroup("attn_tp", dcp) (qwen3_5.py L1287-1297): kv
  rank attn_tp_rank // dcp of attn_tp / dcp, so each DCP group of dcp consecutive ranks holds the same
  kv heads (more than one per rank where kv heads > attn_tp / dcp); q, o_proj and the linear
  attention keep their attn_tp cut. Qwen3-Next's class never reads dcp: --dcp refused.
- MoE: Qwen2MoeSparseMoeBlock: the router whole, FusedMoE experts in contiguous blocks of E / ep
  per EP slot cut over moe_tp, the shared expert over the full tp (even under attention DP or EP),
  shared_expert_gate whole. It refuses tp greater than the routed experts.
- Quantized releases (docs/quantization.md): conv1d is built with quant_config=None (bf16 whatever
  the config lists); FP8 block scales are cut on their weight's 128-blocks, Qwen3.5's in_proj_qkv
  scale by segments like its weight, and every merged partition ([K, K, V, V], [nv, nv]) per rank
  must be whole blocks (fp8.py's block check; tpshard.arch.base.PARTITIONS).
- Embedding: Qwen3.5 builds it whole (padded rows) under attention DP (enable_tp = not DP
  attention), over tp otherwise; Qwen3-Next over attn_tp. lm_head over tp.
- Router (transformers' Qwen3_5MoeTopKRouter, Qwen3NextTopKRouter): softmax, top-k; Qwen3.5 always
  renormalises, Qwen3-Next as norm_topk_prob says.
- verify: the projections at layer level (tpshard.verify.layers_check.rank_major orders the
  segmented piece's reference as SEGMENTS says), conv1d / A_log / dt_bias by their bytes;
  `--model` runs tpshard.verify.hybrid_model's decoder (tpshard.runtime.deltanet's GatedDeltaNet
  on each rank's heads, the gated attention, the MoE with the shared expert's gate).
- Export: vLLM only (SGLang's sharded_state refuses routed experts); the tables below; the MTP layer
  left out (vLLM's target classes drop `mtp.`), fused experts refused (no vLLM names measured).
- The MTP layer (`mtp.*`, every release has one): cut as the draft classes load it (MTP_RULES below;
  SGLang's main classes skip every name with "mtp", qwen3_5.py L2203, qwen3_next.py L1186): mtp.layers.0
  a full-attention MoE layer cut as the main model's (its K/V over attn_tp without --dcp's replication,
  Rule.nextn), mtp.fc and the norms whole; SGLang builds the draft from the same model path (its
  architecture rewritten, configs/model_config.py L1134-1136, L1159-1181): serve it with
  --speculative-algorithm NEXTN (or EAGLE) on the same output. Refused in one line: a second MTP
  layer, an incomplete one.
- Qwen3.5's experts stored fused (`mlp.experts.gate_up_proj` [E, 2I, H], `down_proj` [E, H, I], the
  main layers' and the MTP layer's): FUSED below, the same FusedMoE parameters as the per-expert form;
  a checkpoint mixing the two forms in the main model is refused (the loader's fused flag sticks).
  Qwen3-Next's loader maps experts one by one only: its fused form refused in one line.
- --moe-a2a-backend: Qwen2MoeSparseMoeBlock's shared expert whole under tpshard.arch.qwen.A2A_SHARED.
- Refused: pipeline stages (no per-stage layout on record for these classes), dense MLP layers
  (mlp_only_layers, decoder_sparse_step).
- Qwen3_5MoeForConditionalGeneration (the published checkpoints: transformers' multimodal wrapper,
  the text model under `model.language_model.`, `lm_head` at the top, the vision tower under
  `model.visual.`): in SGLang's language-model-only mode. Its class (qwen3_5.py L2586, built by
  Qwen3VLForConditionalGeneration.__init__, qwen3_vl.py L1328) builds the same text body
  (qwen3_5.py's Qwen3_5MoeForCausalLM, over the text_config, lm_head a ParallelLMHead as the text
  class's), and its load_weights renames `model.language_model.` to `model.`: every text tensor is
  cut as the text class cuts it (the text rules over the wrapper's names, `wrapped`). The vision
  tower is NOT written: with `language_model_only` in the model's config SGLang builds no tower
  (`self.visual = None`), and the server flag --language-model-only refuses this class
  (LANGUAGE_MODEL_ONLY_ARCHITECTURES, server_args.py L335; arg_groups/model_hook.py L1079), so the
  launch line carries --json-model-override-args (applied to the config before ModelConfig reads
  language_model_only, configs/model_config.py L674, utils/hf_transformers/config.py L405).
  The MTP layer (top-level `mtp.*`, as the release names it: the draft reads the same names through
  either class) and fused experts as for the text class; export refused to either engine (no name
  table measured for the wrapper). `verify --model` runs the hybrid
  decoder on the wrapper's names against transformers' AutoModelForCausalLM, which loads the
  wrapper's text model as Qwen3_5MoeForCausalLM.
"""

from tpshard.arch.base import NORMS, QK_NORM, VOCAB, Arch, EngineNames, EngineTable, L, Piece, Rule, first_and_more
from tpshard.arch.engine_names import NO_MLP, ROUTED, VLLM_MOE, bf16_only, vllm_mlp
from tpshard.arch.fused import FusedExperts, FusedParam
from tpshard.arch.qwen import A2A_SHARED, EXPERTS, SHARED_EXPERT, refuse_dense_layers
from tpshard.arch.router import RouterConfig
from tpshard.arch.tensors import config_value, decoder_tensors, expert_tensors, mlp_tensors
from tpshard.errors import PlanError
from tpshard.manifest import ModelInfo

A = L + r"\.self_attn"
LA = L + r"\.linear_attn"
_QKVZ, _BA = r"\1.linear_attn.in_proj_qkvz", r"\1.linear_attn.in_proj_ba"


def _linear(at: str, cls, layer: str, piece: str = "", shape: str = "", segments: str = "", quantized: bool = True) -> Rule:
    """A linear-attention rule: over the attention group, cut by whole key / value heads."""
    return Rule(at, cls, "attn", layer, piece, shape, heads=True, head_counts="linear", segments=segments, quantized=quantized)


GATED_ATTENTION = (
    Rule(A + r"\.q_proj", "QKVParallelLinear", "attn", r"\1.self_attn.qkv_proj", "q", "gated_q"),
    Rule(A + r"\.k_proj", "QKVParallelLinear", "attn", r"\1.self_attn.qkv_proj", "k", "kv"),
    Rule(A + r"\.v_proj", "QKVParallelLinear", "attn", r"\1.self_attn.qkv_proj", "v", "kv"),
    Rule(A + r"\.o_proj", "RowParallelLinear", "attn", r"\1.self_attn.o_proj", shape="o"),
)
LINEAR_COMMON = (
    # built with quant_config=None (qwen3_next.py L157-164, qwen3_5.py L398-405): bf16 in every release
    _linear(LA + r"\.conv1d", "ColumnParallelLinear", r"\1.linear_attn.conv1d", segments="linear_qkv", quantized=False),
    _linear(LA, "HeadParameter", r"\1.linear_attn", shape="linear_head"),  # A_log, dt_bias
    Rule(LA + r"\.norm", "Replicated", "replicated", r"\1.linear_attn.norm"),
    _linear(LA + r"\.out_proj", "RowParallelLinear", r"\1.linear_attn.out_proj", shape="linear_out"),
)
QWEN3_5_LINEAR = LINEAR_COMMON + (
    _linear(LA + r"\.in_proj_qkv", "MergedColumnParallelLinear", _QKVZ, "qkv", "linear_qkv", segments="linear_qkv"),
    _linear(LA + r"\.in_proj_z", "MergedColumnParallelLinear", _QKVZ, "z", "linear_z"),
    _linear(LA + r"\.in_proj_b", "MergedColumnParallelLinear", _BA, "b", "linear_head"),
    _linear(LA + r"\.in_proj_a", "MergedColumnParallelLinear", _BA, "a", "linear_head"),
)
QWEN3_NEXT_LINEAR = LINEAR_COMMON + (
    _linear(LA + r"\.in_proj_qkvz", "ColumnParallelLinear", _QKVZ, shape="linear_qkvz"),  # whole key-head groups
    _linear(LA + r"\.in_proj_ba", "ColumnParallelLinear", _BA, shape="linear_ba"),
)
# Qwen3.5's experts stored fused (the release's form: mlp.experts.gate_up_proj [E, 2I, H], down_proj
# [E, H, I]). Qwen3_5MoeForCausalLM.load_weights (qwen3_5.py L2270-2293; the wrapper's L2855-2880, the
# MTP draft's qwen3_5_mtp.py L434-461) chunks gate_up_proj in two on dim -2 (rows [0, I) gate, [I, 2I)
# up) and feeds each expert by its global id to FusedMoE.weight_loader as w1 / w3 / w2, which keeps the
# rank's EP block and narrows each to its moe_tp rows (gate, up) or columns (down), as for experts
# stored one by one: per rank a segmented cut of dim 1 (its slice of the gate half, then of the up
# half) and down_proj on dim 2, inside its EP block of dim 0 (tpshard.plan.fused).
FUSED_EXPERTS = (Rule(L + r"\.mlp\.experts", "FusedExperts", "expert", r"\1.mlp.experts", moe=True),)
FUSED = FusedExperts(
    params={
        "gate_up_proj": FusedParam("w13", "segmented", 1, per_i=2, shape="e_2i_h"),
        "down_proj": FusedParam("w2", "single", 2, shape="e_h_i"),
    },
    ep_loads="always",
    per_expert=(("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))),
)
COMMON = VOCAB + NORMS + GATED_ATTENTION + QK_NORM + EXPERTS + SHARED_EXPERT


def _in_mtp(rule: Rule) -> Rule:
    """A decoder-layer rule at the MTP layer `mtp.layers.0` (the draft's model.layers.0)."""
    return rule._replace(module=MTP + rule.module[len(L) :], nextn=True)


# The MTP layer, as the draft classes load it (Qwen3_5ForCausalLMMTP, qwen3_5_mtp.py L362-370;
# Qwen3NextForCausalLMMTP through Qwen3NextForCausalLM.load_weights(is_mtp=True), qwen3_next.py
# L1173-1184): mtp.layers.0.* is the draft's model.layers.0, one full-attention MoE layer
# (num_hidden_layers 1, full_attention_interval 1: qwen3_5_mtp.py L136-143, qwen3_next_mtp.py
# L66-73) built by the main classes' own decoder layer with is_nextn, so cut as the main model's
# full-attention layers (its K/V without --dcp's replication); mtp.norm the draft's final norm;
# mtp.fc a plain nn.Linear [H, 2H] and mtp.pre_fc_norm_embedding / _hidden GemmaRMSNorms, all whole.
# The draft reads no embedding or lm_head of its own: Qwen3.5's loads the target's
# model.embed_tokens (qwen3_5_mtp.py L344-356), and both take the target's head.
MTP = r"(mtp\.layers\.\d+)"
MTP_RULES = tuple(_in_mtp(r) for r in NORMS + GATED_ATTENTION + QK_NORM + EXPERTS + SHARED_EXPERT if r.module.startswith(L)) + (
    Rule(r"mtp\.fc", "ReplicatedLinear", "replicated", "mtp.fc", shape="eh_proj"),
    Rule(r"mtp\.(pre_fc_norm_embedding|pre_fc_norm_hidden|norm)", "Replicated", "replicated", r"mtp.\1"),
)
QWEN3_5_MTP = MTP_RULES + tuple(_in_mtp(r) for r in FUSED_EXPERTS)


def expected(fused: bool):
    """Per layer its linear or full attention (config.json layer_types), the router, every routed
    expert, the shared expert and its gate."""
    linear = ("in_proj_qkvz", "in_proj_ba") if fused else ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")

    def tensors(model: ModelInfo, config: dict):
        kinds = layer_kinds(config, model)

        def attention(p: str):
            if kinds[int(p.rsplit(".", 1)[1])] == "linear_attention":
                yield from (f"{p}.linear_attn.{n}.weight" for n in (*linear, "conv1d", "norm", "out_proj"))
                yield from (f"{p}.linear_attn.A_log", f"{p}.linear_attn.dt_bias")
                return
            yield from (f"{p}.self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"))

        def mlp(p: str, i: int):
            yield from expert_tensors(f"{p}.mlp", model, ("gate_proj", "up_proj", "down_proj"))
            yield from (*mlp_tensors(f"{p}.mlp.shared_expert"), f"{p}.mlp.shared_expert_gate.weight")

        return decoder_tensors(model, config, attention, mlp)

    return tensors


def layer_kinds(config: dict, model: ModelInfo) -> list[str]:
    """config.json's layer_types, one per decoder layer; without it, as transformers' configs derive
    it: every full_attention_interval-th layer (default 4) full attention, the others linear."""
    every = config_value(config, "full_attention_interval", 4)
    derived = [("full_attention" if isinstance(every, int) and every > 0 and (i + 1) % every == 0 else "linear_attention") for i in range(model.num_layers)]
    kinds = config_value(config, "layer_types", derived)
    if not isinstance(kinds, list) or len(kinds) != model.num_layers or set(kinds) - {"linear_attention", "full_attention"}:
        raise PlanError(
            f"{model.architecture}: config.json's layer_types must name linear_attention or full_attention for each of"
            f" the {model.num_layers} layers (found {str(kinds)[:80]})"
        )
    return kinds


def refuse_config(config: dict, model: ModelInfo) -> None:
    layer_kinds(config, model)
    refuse_dense_layers(config, model)
    if not model.linear_num_key_heads or not model.linear_key_head_dim or not model.linear_value_head_dim:
        raise PlanError(f"{model.architecture}: config.json lacks the linear-attention sizes (linear_num_key_heads, linear_key_head_dim, linear_value_head_dim)")
    if model.linear_num_value_heads % model.linear_num_key_heads:
        raise PlanError(
            f"{model.architecture}: {model.linear_num_value_heads} linear-attention value heads are not a multiple of"
            f" the {model.linear_num_key_heads} key heads"
        )


def renormalised_router(config: dict, e: int, k: int) -> RouterConfig:
    return RouterConfig(num_experts=e, top_k=k, renormalize=True)  # Qwen3_5MoeTopKRouter divides by the top-k sum


def next_router(config: dict, e: int, k: int) -> RouterConfig:
    return RouterConfig(num_experts=e, top_k=k, renormalize=bool(config.get("norm_topk_prob", True)))


def every_layer_sparse(model: ModelInfo, layer: int) -> bool:
    return True


# The MTP layer's tensors besides its routed experts (tests/qwen_release.py builds them by these names).
MTP_TENSORS = tuple(f"mtp.{n}.weight" for n in ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")) + tuple(
    f"mtp.layers.0.{n}.weight" for n in (
        "input_layernorm", "post_attention_layernorm", *(f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")),
        "mlp.gate", *(f"mlp.shared_expert.{p}" for p in ("gate_proj", "up_proj", "down_proj")), "mlp.shared_expert_gate",
    )
)  # fmt: skip
_FUSED_NAMES = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def refuse_unplaced(names) -> None:
    """What SGLang would not load as the checkpoint has it, by the tensors' names, in one line: an MTP
    layer past the first or one incomplete, and the main model's experts fused in some layers and one
    by one in others (its load_weights switches to the fused mapping at the first fused name and keeps
    it, qwen3_5.py L2228-2230, so the per-expert tensors after it would not load)."""
    names = list(names)
    extra = sorted(n for n in names if n.startswith("mtp.layers.") and not n.startswith("mtp.layers.0."))
    if extra:
        raise PlanError(
            f"the checkpoint holds a second MTP layer ({first_and_more(extra)}); SGLang's MTP draft"
            " (qwen3_5_mtp.py, qwen3_next_mtp.py) builds one layer, mtp.layers.0, so it would not load: split a copy"
            " whose index leaves the others out"
        )
    mtp = {n for n in names if n.startswith("mtp.")}
    experts = {n for n in mtp if n.startswith("mtp.layers.0.mlp.experts.")}
    fused = {"mtp.layers.0" + f for f in _FUSED_NAMES}
    lacking = [n for n in MTP_TENSORS if n not in mtp] + ([] if not mtp or fused <= experts or experts - fused else ["mtp.layers.0.mlp.experts.*"])
    if mtp and lacking:
        raise PlanError(
            f"the checkpoint's MTP layer is incomplete: it lacks {', '.join(lacking[:4])}{' and more' if len(lacking) > 4 else ''};"
            " SGLang's draft would run with weights never loaded: complete it, or split a copy whose index leaves mtp.*"
            " out to serve without MTP"
        )
    main = [n for n in names if not n.startswith("mtp.") and ".mlp.experts." in n]
    stored = [n for n in main if n.endswith(_FUSED_NAMES)]
    if stored and len(stored) != len(main):
        one = next(n for n in main if not n.endswith(_FUSED_NAMES))
        raise PlanError(
            f"the checkpoint stores some experts fused ({stored[0]}) and others one by one ({one}); SGLang's"
            " qwen3_5.py load_weights keeps the fused mapping from the first fused tensor on, so the others would not"
            " load: store every layer's experts the same way"
        )


def refuse_next_fused(names) -> None:
    """Qwen3-Next's experts stored fused: its loader has no mapping for them (one line); then the MTP
    layer's refusals."""
    names = list(names)
    fused = sorted(n for n in names if n.endswith(_FUSED_NAMES))
    if fused:
        raise PlanError(
            f"Qwen3-Next: experts stored fused ({first_and_more(fused)}): SGLang's qwen3_next.py"
            " load_weights maps experts stored one by one only (L1232-1270: no parameter takes the fused name),"
            " so it would not load them; save the experts one by one and split that"
        )
    refuse_unplaced(names)


# Qwen3_5MoeForConditionalGeneration: the text model's `model.` is the wrapper's `model.language_model.`
TEXT, WRAPPED, WRAPPER = "model.", "model.language_model.", "Qwen3_5MoeForConditionalGeneration"


def wrapped(rule: Rule) -> Rule:
    """A text rule over the wrapper's names (lm_head stays at the top, as the wrapper saves it)."""
    for old, new in ((r"model\.", r"model\.language_model\."), (r"(model\.", r"(model\.language_model\.")):
        if rule.module.startswith(old):
            return rule._replace(module=new + rule.module[len(old) :], layer=wrapped_name(rule.layer))
    return rule


def wrapped_name(name: str) -> str:
    """A text class's tensor or module name as the wrapper saves it."""
    return WRAPPED + name.removeprefix(TEXT) if name.startswith(TEXT) else name


def wrapped_expected(model: ModelInfo, config: dict):
    """The text class's tensors under the wrapper's names (the vision tower is not written)."""
    return map(wrapped_name, expected(fused=False)(model, config))


LANGUAGE_ONLY = """--json-model-override-args '{"language_model_only": true}'"""
VISION_DROPPED = (
    r"model\.visual\..*",
    "the vision tower (model.visual.*) is not written: SGLang builds none with language_model_only in the model's config"
    f" (qwen3_vl.py Qwen3VLForConditionalGeneration.__init__); start it with {LANGUAGE_ONLY}, text requests only",
)


# vLLM 0.33.0 (models/qwen3_next.py, qwen3_5.py; the linear attention is QwenGatedDeltaNetAttention,
# layers/mamba/gdn/qwen_gdn_linear_attn.py), keys read from the models built on CPU (docs/deploy.md).
# Each rank's tensors are the tpshard output's at attn_tp = tp: in_proj_qkvz / in_proj_ba are
# MergedColumnParallelLinear cut over tp, with one output (Qwen3-Next's packed key-head groups, cut
# contiguously: whole groups) or [K, K, V, V] / [V heads, V heads] (Qwen3.5: in_proj_qkv loads as
# shards 0-2, in_proj_z as 3, in_proj_b / in_proj_a as 0 / 1: [q_r; k_r; v_r; z_r], [b_r; a_r]);
# conv1d by mamba_v2_sharded_weight_loader over the [K, K, V] segments; A_log (a float32 Parameter:
# written in float32) and dt_bias by value heads (sharded_weight_loader(0)); norm whole; out_proj by
# columns. No attention buffers on the linear layers (they have no self_attn.o_proj). The MoE block
# is Qwen3-MoE's (router kept as mlp.experts.gate) with Qwen2-MoE's shared expert and its gate.
_LA = L + r"\.linear_attn\."
_HYBRID_VLLM = (
    NO_MLP
    + (
        # the MTP layer: not in the target model (hf_to_vllm_mapper's {"mtp.": None}, models/qwen3_5.py L327-329,
        # qwen3_next.py L823), only in vLLM's draft model, which tpshard does not export
        (r"mtp\..*", Piece("", 0, 1)),
        (_LA + r"(conv1d|norm|out_proj)\.weight", Piece(r"\1.linear_attn.\2.weight", 0, 1)),
        (_LA + r"A_log", Piece(r"\1.linear_attn.A_log", 0, 1, dtype="F32")),
        (_LA + r"dt_bias", Piece(r"\1.linear_attn.dt_bias", 0, 1)),
        (L + r"\.mlp\.gate\.weight", Piece(r"\1.mlp.experts.gate.weight", 0, 1)),
        (L + r"\.mlp\.shared_expert_gate\.weight", Piece(r"\1.mlp.experts._shared_experts._layer.expert_gate.weight", 0, 1)),
    )
    + ROUTED
    + vllm_mlp("mlp.shared_expert", "mlp.experts._shared_experts._layer")
)
QWEN3_NEXT_VLLM = _HYBRID_VLLM + (
    (_LA + r"(in_proj_qkvz|in_proj_ba)\.weight", Piece(r"\1.linear_attn.\2.weight", 0, 1)),
)
QWEN3_5_VLLM = _HYBRID_VLLM + (
    (_LA + r"in_proj_qkv\.weight", Piece(r"\1.linear_attn.in_proj_qkvz.weight", 0, 2)),
    (_LA + r"in_proj_z\.weight", Piece(r"\1.linear_attn.in_proj_qkvz.weight", 1, 2)),
    (_LA + r"in_proj_b\.weight", Piece(r"\1.linear_attn.in_proj_ba.weight", 0, 2)),
    (_LA + r"in_proj_a\.weight", Piece(r"\1.linear_attn.in_proj_ba.weight", 1, 2)),
)

ARCHS = (
    Arch(
        "Qwen3_5MoeForCausalLM", COMMON + QWEN3_5_LINEAR + FUSED_EXPERTS + QWEN3_5_MTP, "qwen3_5_text.py", attn_group="attn_tp", embed_group="replicated",
        model_type="qwen3_5_moe_text", expected=expected(fused=False), exports=EngineNames(vllm=EngineTable(QWEN3_5_VLLM, refuse=bf16_only("models/qwen3_5.py"), **VLLM_MOE), sglang=None),
        verify="hybrid", router=renormalised_router, sparse=every_layer_sparse, experts_limit="tp", check=refuse_config, a2a_shared=A2A_SHARED, dcp="kv",
        refuse_tensors=refuse_unplaced, fused_experts=FUSED,
    ),
    Arch(
        WRAPPER, tuple(map(wrapped, COMMON + QWEN3_5_LINEAR + FUSED_EXPERTS)) + QWEN3_5_MTP, "qwen3_5.py", attn_group="attn_tp",
        embed_group="replicated", model_type="qwen3_5_moe", expected=wrapped_expected, exports=EngineNames(vllm=None, sglang=None),
        verify="hybrid", router=renormalised_router, sparse=every_layer_sparse, experts_limit="tp", check=refuse_config, a2a_shared=A2A_SHARED, dcp="kv",
        dropped=VISION_DROPPED, refuse_tensors=refuse_unplaced, fused_experts=FUSED, server_hint=f"start SGLang with {LANGUAGE_ONLY}: this output holds no vision tower",
    ),
    Arch(
        "Qwen3NextForCausalLM", COMMON + QWEN3_NEXT_LINEAR + MTP_RULES, "qwen3_next.py", attn_group="attn_tp", embed_group="attn_tp",
        model_type="qwen3_next", expected=expected(fused=True), exports=EngineNames(vllm=EngineTable(QWEN3_NEXT_VLLM, refuse=bf16_only("models/qwen3_next.py"), **VLLM_MOE), sglang=None),
        verify="hybrid", router=next_router, sparse=every_layer_sparse, experts_limit="tp", check=refuse_config, a2a_shared=A2A_SHARED,
        refuse_tensors=refuse_next_fused,
    ),
)  # fmt: skip
