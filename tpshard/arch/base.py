"""The vocabulary of the architecture tables: rules, the shapes config.json implies, `Arch` (all
tpshard knows about one engine model class), and the rule fragments several families share.

A rule matches a module path (the tensor name without its last part) and names the engine layer
class, the role that picks its group, and the engine layer it belongs to (q/k/v fuse into one
QKVParallelLinear, gate/up into one MergedColumnParallelLinear, every routed expert of a layer
into one FusedMoE). How each parameter of that layer is cut follows from the layer class and the
role alone (tpshard.plan). Each family's module (llama, qwen, deepseek, mixtral) declares its
`Arch`s from these fragments, those of tpshard.arch.tensors (the complete checkpoint) and
tpshard.arch.engine_names (the export tables); docs/architectures.md lists what one declares.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal, NamedTuple

from tpshard.arch.fused import FusedExperts
from tpshard.arch.router import RouterRule
from tpshard.manifest import ModelInfo
from tpshard.topology import GroupName, Topology

# attn -> the architecture's attention group; embed -> its embedding group under attention DP;
# lm_head -> tp (attn_tp with --dp-lm-head); mlp -> tp; shared_expert -> tp, or whole under an
# all-to-all backend of Arch.a2a_shared; dense_mlp -> tp, or whole with --moe-dense-tp 1; expert -> moe_tp within the expert's EP slot; replicated -> whole.
Role = Literal["attn", "mlp", "dense_mlp", "shared_expert", "expert", "embed", "lm_head", "replicated"]
LayerClass = Literal[
    "VocabParallelEmbedding",
    "ParallelLMHead",
    "QKVParallelLinear",
    "MergedColumnParallelLinear",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "FusedMoE",
    "ReplicatedLinear",
    "Replicated",
    "RMSNormTP",  # MiniMax-M2's q/k norms over the full width: cut by heads like q / k, RMS all-reduced
    "AttentionSinks",  # gpt-oss `self_attn.sinks` [heads]: cut with the q heads over the attention group
    "FusedExperts",  # routed experts stored fused [E, ...] (tpshard.arch.fused)
    # A per-head parameter vector of a layer (a gated DeltaNet's A_log, dt_bias; SGLang
    # sharded_weight_loader(0)): dim 0 cut over the group whatever the parameter's name.
    "HeadParameter",
]


class Rule(NamedTuple):
    module: str  # regex, matched in full against the module path; an expert's id is the group `expert`
    layer_class: LayerClass
    role: Role
    layer: str  # engine layer name, a template over the regex groups
    piece: str = ""  # q / k / v of a QKV layer; gate / up of a merged layer; w1 / w3 / w2 of a FusedMoE
    shape: str = ""  # key of SHAPES: the weight's [out, in] by config.json ("" = not checked)
    heads: bool = False  # cut by whole attention heads: the head count must divide the group
    moe: bool | None = None  # True: only in layers with experts; False: only in dense layers
    # Cut along dim 0 by segments (SEGMENTS key): the rank holds its contiguous slice of each
    # segment, concatenated (ShardSpec.segments), not one contiguous block. "" = not segmented.
    segments: str = ""
    # Head counts that must all divide the group (HEAD_COUNTS key), with `heads`; "" = the attention heads.
    head_counts: str = ""
    bias: bool = True  # False: the engine layer is built without a bias, so a checkpoint bias is refused
    # A layer of the speculative draft (MTP) model, built with is_nextn: Qwen3.5's draft attention
    # cuts K/V over attn_tp without --dcp's replication (qwen3_5.py L1287).
    nextn: bool = False
    # False: the engine builds the layer with quant_config=None, so it is bf16 whatever the quantization
    # config says (the gated DeltaNet's conv1d: SGLang qwen3_next.py L157-164, qwen3_5.py L398-405).
    quantized: bool = True


# [out, in] of a weight according to config.json.
SHAPES: dict[str, Callable[[ModelInfo], tuple[int, ...]]] = {
    "vocab": lambda m: (m.vocab_size, m.hidden_size),
    "q": lambda m: (m.num_heads * m.head_dim, m.hidden_size),
    "kv": lambda m: (m.num_kv_heads * m.head_dim, m.hidden_size),
    "o": lambda m: (m.hidden_size, m.num_heads * m.head_dim),
    "mlp_up": lambda m: (m.intermediate_size, m.hidden_size),
    "mlp_down": lambda m: (m.hidden_size, m.intermediate_size),
    "expert_up": lambda m: (m.moe_intermediate_size, m.hidden_size),
    "expert_down": lambda m: (m.hidden_size, m.moe_intermediate_size),
    "shared_up": lambda m: (m.shared_expert_intermediate_size, m.hidden_size),
    "shared_down": lambda m: (m.hidden_size, m.shared_expert_intermediate_size),
    "router": lambda m: (m.num_experts, m.hidden_size),
    "shared_gate": lambda m: (1, m.hidden_size),
    "mla_q_a": lambda m: (m.q_lora_rank or 0, m.hidden_size),
    "mla_kv_a": lambda m: (m.kv_lora_rank + m.qk_rope_head_dim, m.hidden_size),
    "mla_q_b": lambda m: (m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim), m.q_lora_rank or 0),
    "mla_q": lambda m: (m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim), m.hidden_size),
    "mla_kv_b": lambda m: (m.num_heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
    "mla_o": lambda m: (m.hidden_size, m.num_heads * m.v_head_dim),
    "eh_proj": lambda m: (m.hidden_size, 2 * m.hidden_size),
    # DeepSeek-V4 (tpshard/arch/deepseek_v4.py): LoRA query, one shared kv head, grouped output projection
    "v4_q_a": lambda m: (m.q_lora_rank or 0, m.hidden_size),
    "v4_q_b": lambda m: (m.num_heads * m.head_dim, m.q_lora_rank or 0),
    "v4_kv": lambda m: (m.head_dim, m.hidden_size),
    "v4_o_a": lambda m: (m.o_groups * m.o_lora_rank, m.num_heads * m.head_dim // max(m.o_groups, 1)),
    "v4_o_b": lambda m: (m.hidden_size, m.o_groups * m.o_lora_rank),
    "v4_index_q_b": lambda m: (m.index_n_heads * m.index_head_dim, m.q_lora_rank or 0),
    "v4_index_w": lambda m: (m.index_n_heads, m.hidden_size),
    "square": lambda m: (m.hidden_size, m.hidden_size),  # DeepSeek-V4's MTP e_proj / h_proj
    "q_norm": lambda m: (m.num_heads * m.head_dim,),  # [heads * head_dim]: MiniMax-M2's norm over every head
    "k_norm": lambda m: (m.num_kv_heads * m.head_dim,),
    # Gated attention (Qwen3.5 / Qwen3-Next full-attention layers): q_proj holds per head [q_h | gate_h].
    "gated_q": lambda m: (2 * m.num_heads * m.head_dim, m.hidden_size),
    # Gated DeltaNet linear attention: K = key heads x key dim, V = value heads x value dim.
    "linear_qkv": lambda m: (2 * _lin_k(m) + _lin_v(m), m.hidden_size),
    "linear_z": lambda m: (_lin_v(m), m.hidden_size),
    "linear_head": lambda m: (m.linear_num_value_heads, m.hidden_size),
    "linear_out": lambda m: (m.hidden_size, _lin_v(m)),
    "linear_qkvz": lambda m: (2 * _lin_k(m) + 2 * _lin_v(m), m.hidden_size),
    "linear_ba": lambda m: (2 * m.linear_num_value_heads, m.hidden_size),
}


def _lin_k(m: ModelInfo) -> int:
    return m.linear_num_key_heads * m.linear_key_head_dim


def _lin_v(m: ModelInfo) -> int:
    return m.linear_num_value_heads * m.linear_value_head_dim


# The segments of dim 0 a segmented rule cuts each of (Rule.segments), in rows.
SEGMENTS: dict[str, Callable[[ModelInfo], tuple[int, ...]]] = {
    "linear_qkv": lambda m: (_lin_k(m), _lin_k(m), _lin_v(m)),  # q | k | v of a gated DeltaNet
}

# The output partitions (output_sizes) of the engine's merged layer that a rule's weight (by its
# SHAPES key) loads into, each cut over the layer's group. SGLang's FP8 block method refuses a rank
# whose partition is off block_n, at any tp, once the layer has several (fp8.py L600-610), even
# where the rank's rows as a whole are whole blocks: the gated DeltaNet's in_proj_qkvz [K, K, V, V]
# and in_proj_ba [nv, nv] (qwen3_next.py L166-183, L350-366; qwen3_5.py L409-424, L635-668).
PARTITIONS: dict[str, Callable[[ModelInfo], tuple[int, ...]]] = {
    "linear_qkvz": lambda m: (_lin_k(m), _lin_k(m), _lin_v(m), _lin_v(m)),  # Qwen3-Next: packed, fused on disk
    "linear_ba": lambda m: (m.linear_num_value_heads,) * 2,
    "linear_qkv": lambda m: (_lin_k(m), _lin_k(m), _lin_v(m)),  # Qwen3.5: shards 0-2 of in_proj_qkvz
    "linear_z": lambda m: (_lin_v(m),),  # shard 3 of in_proj_qkvz
    "linear_head": lambda m: (m.linear_num_value_heads,),  # in_proj_b / in_proj_a: shards 0 / 1 of in_proj_ba
}

# The head counts a rule's cut must keep whole (Rule.head_counts): (what, count) each.
HEAD_COUNTS: dict[str, Callable[[ModelInfo], tuple[tuple[str, int], ...]]] = {
    "linear": lambda m: (("linear-attention key heads", m.linear_num_key_heads), ("linear-attention value heads", m.linear_num_value_heads)),
}


# ---- engine export names (tpshard.arch.engine_names says where the tables' facts come from) -----


class Piece(NamedTuple):
    engine: str  # engine key, a template over the HF name's regex groups; "" = not in the engine's state
    position: int  # place along dim 0 of the engine tensor (of each expert's slice when `stacked`)
    count: int  # pieces in the engine tensor (1 = the HF tensor itself)
    # Routed experts: the engine tensor is [E_local, rows, cols], the rank's experts in ascending id,
    # each expert's `count` pieces along its rows; its bytes are the dim-0 concatenation of those 2-D
    # pieces, expert by expert.
    stacked: bool = False
    # vLLM's dtype where its model builds the parameter in another dtype than the checkpoint's
    # (routers in float32): the export writes it cast (bf16 -> float32 is exact); "" = the checkpoint's.
    dtype: str = ""


class Buffer(NamedTuple):
    """A tensor the engine model registers that no checkpoint holds: its constant content."""

    engine: str  # template over `{layer}`, the decoder layer prefix model.layers.N
    dtype: str
    value: float


class EngineTable(NamedTuple):
    pieces: tuple[tuple[str, Piece], ...]  # (HF name regex, piece)
    tied: str  # the key a tied embedding / lm_head table is kept under
    buffers: tuple[Buffer, ...] = ()  # per decoder layer
    attn_dp: bool = False  # the engine model shards attention and the embedding over attn_tp
    buffers_at: str = r"(model\.layers\.\d+)\.self_attn\.o_proj\.weight"  # a kept tensor of each attention layer
    ep: str = ""  # "" = no routed experts; "vllm": vLLM's expert placement (tpshard.export.layout)
    q_lora: tuple = ()  # (pieces with q_lora_rank, pieces without): MLA's kv_a_proj_with_mqa
    drop_mtp: bool = False  # decoder layers >= num_hidden_layers (DeepSeek's MTP) are not in the engine's state
    # (plan, config.json) -> why the engine would build other keys than the table's for this
    # checkpoint, or None: the family's own refusals, called before anything is written.
    refuse: Callable[..., str | None] | None = None
    # experts stored fused: (engine key regex, "transpose" | "rank0" | "rotary"), what vLLM's loader
    # does to the rank's slice beyond slicing it (tpshard.export.fused; "rotary": Llama-4's q/k rows)
    fused: tuple[tuple[str, str], ...] = ()


class EngineNames(NamedTuple):
    """An architecture's table for each engine `tpshard export` writes for; None: that engine's
    export refuses the architecture (tpshard writes no name it has not mapped exactly); a str: it
    refuses it for that reason (where the engine holds other bytes than the tpshard output)."""

    vllm: EngineTable | str | None
    sglang: EngineTable | str | None


ENGINES: tuple[str, ...] = EngineNames._fields  # ("vllm", "sglang"), the order messages list them in


# ---- Arch -------------------------------------------------------------------------------------

# (ModelInfo, config.json) -> the tensor names a complete checkpoint holds, in a fixed order.
Expected = Callable[[ModelInfo, dict], Iterable[str]]
# The tensor-parallel decoder `verify --model` runs: tpshard.verify.decoder's dense one,
# tpshard.verify.moe_model's MoE / MLA one, tpshard.verify.llama4_model's, tpshard.verify.v4_model's, or
# tpshard.verify.hybrid_model's (gated DeltaNet and gated attention layers).
VerifyKind = Literal["dense", "moe", "llama4", "deepseek_v4", "hybrid"]


@dataclass(frozen=True)
class Arch:
    """One model class of the engine: everything tpshard knows about it (docs/architectures.md).

    The fields without a default must be declared by every architecture, `None` included where it
    means "refused", so that a new family cannot skip a check by forgetting one."""

    name: str  # the HF `architectures` entry
    rules: tuple[Rule, ...]
    engine: str  # the SGLang model file it follows, for messages
    attn_group: GroupName  # attention under attention DP ("tp": the engine ignores attention DP)
    embed_group: GroupName  # embedding under attention DP
    model_type: str  # config.json's model_type of this class (what `router_config` looks routers up by)
    expected: Expected  # the tensors a complete checkpoint holds (tpshard.completeness refuses one lacking any)
    exports: EngineNames  # per engine, its sharded_state names (tpshard export), or None: refused
    verify: VerifyKind | None  # the decoder `verify --model` runs; None: refused (layer level only)
    router: RouterRule | None  # MoE: how the router picks experts; None: no routed experts
    dp_lm_head: bool = True  # the engine's lm_head follows --enable-dp-lm-head
    attn_dp: bool = True  # the engine has an attention-DP layout at all (Mixtral: no)
    sparse: Callable[[ModelInfo, int], bool] | None = None  # MoE: which layer indices have experts
    experts_limit: GroupName | None = None  # the engine refuses more ranks in this group than experts
    check: Callable[[dict, ModelInfo], None] | None = None  # config refusals beyond the rules
    variant: Callable[[ModelInfo], tuple[Rule, ...]] | None = None  # rules that depend on config.json
    # Pipeline stages (docs/pipeline.md): the stages an untied lm_head is built on ("last",
    # or "every" where the model class builds it unconditionally); None = no pipeline layout known.
    pp_head: Literal["last", "every"] | None = None
    # A tied model at pp > 1: the last stage builds its own lm_head, filled from the embedding and cut
    # over the head's group (False: the engine ties the head to the first stage's embedding only).
    pp_tied_head: bool = False
    # vLLM 0.33.0 at pp > 1: a tied model's last stage builds its own embedding and ties lm_head to it
    # (LlamaModel / Qwen2Model: `tie_word_embeddings and is_last_rank`); False: the class never ties.
    pp_vllm_tied: bool = False
    # Routed experts stored fused [E, ...] (rule class FusedExperts): how each parameter is cut.
    fused_experts: FusedExperts | None = None
    # Refusals that need the topology (DeepSeek-V4: o_groups over attn_tp), before any tensor is cut.
    check_topology: Callable[[Topology, ModelInfo], None] | None = None
    # A regex every tensor name must match in full, where rules alone (which match module paths) would
    # take any parameter name: DeepSeek-V4's bare parameters (hc_attn_fn, attn_sink, ape, tid2eid).
    names: str = ""
    # SGLang --moe-a2a-backend: the backends under which the model class builds its shared experts
    # "replicated" (whole on every rank) instead of over tp; None: not established, so an all-to-all
    # backend is refused for a family with shared experts (tpshard.plan.refusals).
    a2a_shared: frozenset[str] | None = None
    # Tensors the family refuses by name before any cut (Llama-4's vision tower): one line, or None.
    refuse_tensors: Callable[[Iterable[str]], None] | None = None
    # SGLang --dcp-size: "kv", the attention's K/V over ReplicatedParallelGroup("attn_tp", dcp) (Qwen3.5);
    # "neutral", the class reads it but every weight keeps its attn_tp cut (DeepSeek MLA); None: refused.
    dcp: Literal["kv", "neutral"] | None = None
    # Tensors not written (a regex matched in full) and the plan's warning saying so, given whether or not
    # the checkpoint holds any (a reshard reads the output back without them): a wrapper's vision tower.
    dropped: tuple[str, str] | None = None
    server_hint: str = ""  # how the engine must be started for any output of this class (split prints it)

    def table(self, model: ModelInfo) -> tuple[Rule, ...]:
        return self.rules + (self.variant(model) if self.variant else ())


# Buffers some older checkpoints carry that engines recompute; dropped with a warning.
DROPPED = re.compile(r".*\.rotary_emb\.inv_freq")


_DIGITS = re.compile(r"\d+")
_GROUP_REF = re.compile(r"\\(\d)")


class Matcher:
    """Compiled rule table: module path -> (rule, engine layer name, global expert id or None).

    DeepSeek-V3 has ~90,000 tensors that differ mostly in layer and expert numbers: the rule found
    for a module with its numbers masked is tried first, and layer templates are pre-split."""

    def __init__(self, rules: tuple[Rule, ...]):
        self._rules = []
        for r in rules:
            pattern = re.compile(r.module)
            # the layer template as literals and group numbers: "\\1.self_attn.qkv_proj" -> ["", 1, ".self_attn.qkv_proj"]
            template = [part if j % 2 == 0 else int(part) for j, part in enumerate(_GROUP_REF.split(r.layer))]
            self._rules.append((pattern, r, template, "expert" in pattern.groupindex))
        self._seen: dict[str, int] = {}
        self._last: dict[str, tuple[Rule, str, int | None] | None] = {}

    def match(self, module: str) -> tuple[Rule, str, int | None] | None:
        if module in self._last:  # a weight's scale, zeros or bias follow it in the same module
            return self._last[module]
        self._last = {module: self._find(module)}
        return self._last[module]

    def _find(self, module: str) -> tuple[Rule, str, int | None] | None:
        shape = _DIGITS.sub("#", module)
        hint = self._seen.get(shape)
        if hint is not None:
            found = self._try(hint, module)
            if found is not None:
                return found
        for i in range(len(self._rules)):
            found = self._try(i, module)
            if found is not None:
                self._seen[shape] = i
                return found
        return None

    def _try(self, i: int, module: str) -> tuple[Rule, str, int | None] | None:
        pattern, rule, template, has_expert = self._rules[i]
        m = pattern.fullmatch(module)
        if m is None:
            return None
        layer = "".join([part if part.__class__ is str else m.group(part) for part in template])
        expert = m.group("expert") if has_expert else None
        return rule, layer, None if expert is None else int(expert)


# ---- fragments --------------------------------------------------------------------------------

L = r"(model\.layers\.\d+)"

VOCAB: tuple[Rule, ...] = (
    Rule(r"model\.embed_tokens", "VocabParallelEmbedding", "embed", "model.embed_tokens", shape="vocab"),
    Rule(r"lm_head", "ParallelLMHead", "lm_head", "lm_head", shape="vocab"),
)

NORMS: tuple[Rule, ...] = (
    Rule(r"model\.norm", "Replicated", "replicated", "model.norm"),
    Rule(L + r"\.(input_layernorm|post_attention_layernorm)", "Replicated", "replicated", r"\1.\2"),
)

QKV_ATTENTION: tuple[Rule, ...] = (
    Rule(L + r"\.self_attn\.q_proj", "QKVParallelLinear", "attn", r"\1.self_attn.qkv_proj", "q", "q"),
    Rule(L + r"\.self_attn\.k_proj", "QKVParallelLinear", "attn", r"\1.self_attn.qkv_proj", "k", "kv"),
    Rule(L + r"\.self_attn\.v_proj", "QKVParallelLinear", "attn", r"\1.self_attn.qkv_proj", "v", "kv"),
    Rule(L + r"\.self_attn\.o_proj", "RowParallelLinear", "attn", r"\1.self_attn.o_proj", shape="o"),
)

# Qwen3 normalises q and k per head before RoPE: [head_dim] weights, the same on every rank.
QK_NORM = (Rule(L + r"\.self_attn\.(q_norm|k_norm)", "Replicated", "replicated", r"\1.self_attn.\2"),)


def gated_mlp(block: str, role: Role, up: str, down: str, moe: bool | None = None) -> tuple[Rule, ...]:
    """gate/up/down of a SiLU MLP at `L.<block>`: one MergedColumnParallelLinear and one RowParallelLinear."""
    at, name = L + r"\." + re.escape(block), r"\1." + block
    return (
        Rule(at + r"\.gate_proj", "MergedColumnParallelLinear", role, name + ".gate_up_proj", "gate", up, moe=moe),
        Rule(at + r"\.up_proj", "MergedColumnParallelLinear", role, name + ".gate_up_proj", "up", up, moe=moe),
        Rule(at + r"\.down_proj", "RowParallelLinear", role, name + ".down_proj", shape=down, moe=moe),
    )


DENSE_MLP = gated_mlp("mlp", "mlp", "mlp_up", "mlp_down")


def routed_experts(block: str, gate: str, up: str, down: str) -> tuple[Rule, ...]:
    """`L.<block>.experts.<e>.<gate|up|down>`: SGLang FusedMoE shards w1 (gate), w3 (up), w2 (down)."""
    at, name = L + r"\." + re.escape(block) + r"\.experts\.(?P<expert>\d+)\.", r"\1." + block + ".experts"
    return (
        Rule(at + re.escape(gate), "FusedMoE", "expert", name, "w1", "expert_up", moe=True),
        Rule(at + re.escape(up), "FusedMoE", "expert", name, "w3", "expert_up", moe=True),
        Rule(at + re.escape(down), "FusedMoE", "expert", name, "w2", "expert_down", moe=True),
    )


def router(block: str) -> tuple[Rule, ...]:
    """The router `L.<block>.gate` [E, H] (DeepSeek's e_score_correction_bias is a parameter of it)."""
    return (Rule(L + r"\." + re.escape(block) + r"\.gate", "ReplicatedLinear", "replicated", r"\1." + block + ".gate", shape="router", moe=True),)


def first_and_more(names: list[str]) -> str:
    """The first of the tensors a refusal is about and how many more: "a.weight and 3 more"."""
    return f"{names[0]} and {len(names) - 1} more"
