"""Tensor-parallel layers that load presharded tensors: the engines' linear and vocab layers.

Mirrors vLLM/SGLang `linear.py` and `vocab_parallel_embedding.py` (docs/contracts.md, the load
contract): ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear,
VocabParallelEmbedding, ParallelLMHead. Every layer takes an explicit `LogicalGroup`, so per-rank
shapes are known before any process group exists, and a quant method that owns the weight
parameters and the GEMM; layers only pass shapes.

Loading is presharded: `load_shard(shard_id, tensor, param="weight")` copies a tensor that is
already this rank's slice into its place in the parameter, asserting the exact shape. Nothing
here slices a checkpoint tensor; that is the plan's and the writer's job, and a wrong slice must
show up as a wrong number in `verify`, not be silently repaired.

Padding: with `pad=True` a dim the group does not divide gets ceil(n / size) entries per rank,
the tail zero-filled by the writer (SGLang's pad_or_narrow). The math stays exact: a padded
gate/up row yields silu(0) * 0 = 0, which meets a padded (zero) down column; padded vocab rows
are never looked up and their logits are dropped after the gather.

Not here: choosing groups (the plan), reading files (the loader), attention itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from tpshard.runtime.groups import LogicalGroup
from tpshard.runtime.linear_method import QuantMethod, UnquantizedLinearMethod, new_param

ShardId = str | int | None

# Lossless float upcasts a load may do (a checkpoint in bf16 into an fp32 reference layer). Anything
# else must match exactly: a downcast would hide precision loss, and packed codes are bit patterns.
_UPCASTS = {
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float64),
    (torch.float16, torch.float64),
    (torch.float32, torch.float64),
}


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}: {numerator} is not divisible by {denominator}")
    return numerator // denominator


def split_size(total: int, size: int, pad: bool, what: str) -> int:
    """Entries per rank of a dim of `total` split `size` ways: exact, or ceil when padding is allowed."""
    if total % size == 0:
        return total // size
    if not pad:
        raise ValueError(
            f"{what}: {total} is not divisible by the group size {size}; "
            f"pass pad=True to give each rank {-(-total // size)} with zero padding"
        )
    return -(-total // size)


def pad_to_multiple(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class ShardInfo:
    """What a layer expects of one presharded tensor: compare with the manifest's ShardSpec."""

    group: str
    factor: int  # consecutive group ranks holding one replica
    group_rank: int
    group_size: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class _Piece:
    """One logical matrix fused along the output dim: its per-rank offset and size (padding included)."""

    shard_id: ShardId
    offset: int
    size: int
    factor: int = 1  # replica factor of this piece inside the layer's group (GQA kv heads)


class _ShardedModule(nn.Module):
    """Shared loading machinery: a piece table along the output dim and exact-shape copies."""

    def __init__(self, *, group: LogicalGroup, quant_method: QuantMethod | None, dtype: torch.dtype | None, name: str):
        super().__init__()
        self.group = group
        self.quant_method = quant_method if quant_method is not None else UnquantizedLinearMethod()
        self.params_dtype = dtype if dtype is not None else torch.get_default_dtype()
        self.name = name or type(self).__name__
        self._pieces: list[_Piece] = []
        self._loaded: set[tuple[str, ShardId]] = set()

    def _piece(self, shard_id: ShardId) -> _Piece:
        for piece in self._pieces:
            if piece.shard_id == shard_id:
                return piece
        # Merged layers also accept a piece by index (vLLM/SGLang shard ids 0, 1, ...).
        if isinstance(shard_id, int) and 0 <= shard_id < len(self._pieces):
            return self._pieces[shard_id]
        known = [p.shard_id for p in self._pieces]
        raise KeyError(f"{self.name}: unknown shard id {shard_id!r}; this layer has {known}")

    def _param(self, param: str) -> nn.Parameter:
        params = dict(self.named_parameters(recurse=False))
        if param not in params:
            raise KeyError(f"{self.name}: no parameter {param!r}; it has {sorted(params)}")
        return params[param]

    def shard_info(self, shard_id: ShardId = None, param: str = "weight") -> ShardInfo:
        """Group, replica factor, group rank and per-rank shape this layer expects for one tensor."""
        target = self._param(param)
        g = self.group
        if target.output_dim is None:
            # Whole on every rank of the group: one replica spanning the group.
            return ShardInfo(g.name, g.factor * g.size, 0, 1, tuple(target.shape))
        piece = self._piece(shard_id)
        shape = list(target.shape)
        shape[target.output_dim] = piece.size // target.packed_factor
        return ShardInfo(g.name, g.factor * piece.factor, g.rank // piece.factor, g.size // piece.factor, tuple(shape))

    def load_shard(self, shard_id: ShardId, tensor: torch.Tensor, param: str = "weight") -> None:
        """Copy this rank's presharded `tensor` into `param` (the piece `shard_id` of it). Never slices."""
        target = self._param(param)
        label = f"{self.name}.{param}" + (f"[{shard_id}]" if shard_id is not None else "")
        if target.output_dim is None:
            dest = target.data
            shard_id = None
        else:
            piece = self._piece(shard_id)
            shard_id = piece.shard_id
            pf = target.packed_factor
            if piece.offset % pf or piece.size % pf:
                raise ValueError(
                    f"{label}: piece at offset {piece.offset} of size {piece.size} is not a multiple of the "
                    f"packed factor {pf}"
                )
            dest = target.data.narrow(target.output_dim, piece.offset // pf, piece.size // pf)
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ValueError(
                f"{label}: presharded tensor has shape {tuple(tensor.shape)}, this rank "
                f"({self.group.describe()}) expects {tuple(dest.shape)}"
            )
        if tensor.dtype != dest.dtype and (tensor.dtype, dest.dtype) not in _UPCASTS:
            raise ValueError(f"{label}: tensor dtype {tensor.dtype} cannot be loaded into {dest.dtype} without loss")
        dest.copy_(tensor)
        self._loaded.add((param, shard_id))

    def missing_shards(self) -> list[str]:
        """Parameter pieces never loaded, as 'param[shard_id]' strings; empty when fully loaded."""
        missing = []
        for pname, p in self.named_parameters(recurse=False):
            ids = [None] if p.output_dim is None else [piece.shard_id for piece in self._pieces]
            for sid in ids:
                if (pname, sid) not in self._loaded:
                    missing.append(pname + (f"[{sid}]" if sid is not None else ""))
        return missing

    def process_weights_after_loading(self) -> None:
        self.quant_method.process_weights_after_loading(self)

    def extra_repr(self) -> str:
        pieces = ", ".join(f"{p.shard_id}:{p.size}" for p in self._pieces)
        return f"{self.name}, {self.group.describe()}, out pieces per rank [{pieces}]"


class _LinearBase(_ShardedModule):
    def _create(self, in_per_rank: int, pieces: Sequence[_Piece], bias: bool, bias_whole: bool, out_total: int) -> None:
        self._pieces = list(pieces)
        self.in_per_rank = in_per_rank
        self.out_per_rank = sum(p.size for p in self._pieces)
        self.quant_method.create_weights(
            self, in_per_rank, self.out_per_rank, self.params_dtype, out_pieces=[p.size for p in self._pieces]
        )
        if bias:
            # A row-parallel bias is the whole output vector on every rank; a column bias is sliced.
            data = torch.zeros(out_total if bias_whole else self.out_per_rank, dtype=self.params_dtype)
            self.register_parameter("bias", new_param(data, output_dim=None if bias_whole else 0))
        else:
            self.bias = None


class ColumnParallelLinear(_LinearBase):
    """Y = X W^T with W split along its output dim: rank r holds rows [r*N_r, (r+1)*N_r).

    Output is this rank's [..., N_r] slice, or the whole [..., N] with gather_output=True.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        group: LogicalGroup,
        bias: bool = False,
        gather_output: bool = False,
        pad: bool = False,
        dtype: torch.dtype | None = None,
        quant_method: QuantMethod | None = None,
        name: str = "",
    ):
        super().__init__(group=group, quant_method=quant_method, dtype=dtype, name=name)
        self.input_size = input_size
        self.output_size = output_size
        self.gather_output = gather_output
        n_r = split_size(output_size, group.size, pad, f"{self.name} output size")
        self._create(input_size, [_Piece(None, 0, n_r)], bias, bias_whole=False, out_total=output_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.quant_method.apply(self, x, self.bias)  # [..., N_r]
        if self.gather_output and self.group.size > 1:
            out = self.group.all_gather(out, dim=-1)[..., : self.output_size]  # drop tail padding
        return out


class MergedColumnParallelLinear(_LinearBase):
    """Several column-parallel matrices fused along the output dim, per rank [piece0_r | piece1_r | ...].

    The MLP's gate_up_proj: output_sizes=[I, I], pieces "gate"/"up" (or 0/1), each split and
    padded on its own. Output is the per-rank [..., sum of piece sizes]; no gather (the gathered
    order would interleave ranks, which no caller wants).
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        *,
        group: LogicalGroup,
        bias: bool = False,
        pad: bool = False,
        piece_names: Sequence[str] | None = None,
        dtype: torch.dtype | None = None,
        quant_method: QuantMethod | None = None,
        name: str = "",
    ):
        super().__init__(group=group, quant_method=quant_method, dtype=dtype, name=name)
        if piece_names is None:
            piece_names = ("gate", "up") if len(output_sizes) == 2 else tuple(str(i) for i in range(len(output_sizes)))
        if len(piece_names) != len(output_sizes):
            raise ValueError(f"{self.name}: {len(piece_names)} piece names for {len(output_sizes)} output sizes")
        self.input_size = input_size
        self.output_sizes = tuple(output_sizes)
        pieces, offset = [], 0
        for pname, total in zip(piece_names, output_sizes):
            size = split_size(total, group.size, pad, f"{self.name} {pname} output size")
            pieces.append(_Piece(pname, offset, size))
            offset += size
        self._create(input_size, pieces, bias, bias_whole=False, out_total=sum(output_sizes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)  # [..., sum(piece sizes)]

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per-piece views of a forward output: [..., sum] -> ([..., size_0], [..., size_1], ...)."""
        return tuple(out.split([p.size for p in self._pieces], dim=-1))

    @property
    def piece_names(self) -> tuple[str, ...]:
        """The pieces in output order (the order `split` returns them)."""
        return tuple(str(p.shard_id) for p in self._pieces)


class QKVParallelLinear(_LinearBase):
    """Fused q/k/v projection split by heads, per rank [q_r | k_r | v_r] (QKVParallelLinear in sglang/srt/layers/linear.py).

    num_heads = H_q / size. If size >= H_kv each rank holds one kv head, shared by
    `num_kv_head_replicas = size / H_kv` consecutive ranks (kv head `rank // replicas`);
    otherwise H_kv / size kv heads per rank. `kv_replicas` > 1: K/V over SGLang's
    ReplicatedParallelGroup(group, kv_replicas) (Qwen3.5 under --dcp-size): the same rule with
    kv rank `rank // kv_replicas` of `size / kv_replicas`, q unchanged.
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        *,
        group: LogicalGroup,
        bias: bool = False,
        v_head_size: int | None = None,
        dtype: torch.dtype | None = None,
        quant_method: QuantMethod | None = None,
        name: str = "",
        kv_replicas: int = 1,
    ):
        super().__init__(group=group, quant_method=quant_method, dtype=dtype, name=name)
        total_num_kv_heads = total_num_kv_heads if total_num_kv_heads is not None else total_num_heads
        v_head_size = v_head_size if v_head_size is not None else head_size
        size = group.size
        self.hidden_size = hidden_size
        self.head_size = head_size
        self.v_head_size = v_head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = divide(total_num_heads, size, f"{self.name} query heads over a group of {size}")
        kv_size = divide(size, kv_replicas, f"{self.name} group over its K/V replicas")
        if kv_size >= total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(kv_size, total_num_kv_heads, f"{self.name} group size over kv heads")
        else:
            self.num_kv_heads = divide(total_num_kv_heads, kv_size, f"{self.name} kv heads over a group of {kv_size}")
            self.num_kv_head_replicas = 1
        r = kv_replicas * self.num_kv_head_replicas  # consecutive ranks of `group` holding one kv piece
        self.kv_shard_rank = group.rank // r  # which kv piece this rank holds
        q, k, v = self.num_heads * head_size, self.num_kv_heads * head_size, self.num_kv_heads * v_head_size
        pieces = [_Piece("q", 0, q), _Piece("k", q, k, factor=r), _Piece("v", q + k, v, factor=r)]
        out_total = (total_num_heads + total_num_kv_heads) * head_size + total_num_kv_heads * v_head_size
        self._create(hidden_size, pieces, bias, bias_whole=False, out_total=out_total)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)  # [..., q + k + v per rank]

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[..., q+k+v] -> q [..., num_heads*hd], k [..., num_kv*hd], v [..., num_kv*v_hd]."""
        q, k, v = out.split([p.size for p in self._pieces], dim=-1)
        return q, k, v


class RowParallelLinear(_LinearBase):
    """Y = X W^T with W split along its input dim: rank r holds columns [r*K_r, (r+1)*K_r).

    Each rank computes a partial sum; the bias (whole [N] on every rank) is added on group rank 0
    only, so it is counted once by the all-reduce over the layer's own group. With
    reduce_results=False the caller reduces (SGLang's o_proj under DP attention).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        group: LogicalGroup,
        bias: bool = False,
        input_is_parallel: bool = True,
        reduce_results: bool = True,
        pad: bool = False,
        dtype: torch.dtype | None = None,
        quant_method: QuantMethod | None = None,
        name: str = "",
    ):
        super().__init__(group=group, quant_method=quant_method, dtype=dtype, name=name)
        self.input_size = input_size
        self.output_size = output_size
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        k_r = split_size(input_size, group.size, pad, f"{self.name} input size")
        self._create(k_r, [_Piece(None, 0, output_size)], bias, bias_whole=True, out_total=output_size)

    def local_bias(self) -> torch.Tensor | None:
        """The bias this rank adds before the reduction: the whole bias on group rank 0, else none."""
        return self.bias if self.group.rank == 0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            # Full input [..., K]: zero-pad to size*K_r, keep this rank's columns -> [..., K_r].
            full = self.in_per_rank * self.group.size
            x = nn.functional.pad(x, (0, full - x.shape[-1]))
            x = x.narrow(-1, self.group.rank * self.in_per_rank, self.in_per_rank)
        out = self.quant_method.apply(self, x, self.local_bias())  # [..., N], partial sum
        if self.reduce_results:
            out = self.group.all_reduce(out)
        return out


class VocabParallelEmbedding(_ShardedModule):
    """Embedding table split by rows of the vocab padded to a multiple of `padding_size` (64).

    Rank r holds padded rows [r*pp, (r+1)*pp); rows at or beyond the real vocab are zero. Ids
    outside this rank's real range give a zero row; the all-reduce over the group fills them in.
    The lookup is the quant method's `embedding(layer, local_ids)` (UnquantizedLinearMethod has it).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        group: LogicalGroup,
        padding_size: int = 64,
        dtype: torch.dtype | None = None,
        quant_method: QuantMethod | None = None,
        name: str = "",
    ):
        super().__init__(group=group, quant_method=quant_method, dtype=dtype, name=name)
        self.num_embeddings = num_embeddings  # the real vocab
        self.embedding_dim = embedding_dim
        self.padded_num_embeddings = pad_to_multiple(num_embeddings, padding_size)
        self.rows_per_rank = divide(
            self.padded_num_embeddings,
            group.size,
            f"{self.name} vocab {num_embeddings} padded to a multiple of {padding_size}, over a group of {group.size}",
        )
        self.vocab_start = group.rank * self.rows_per_rank
        # Real rows of this rank: [vocab_start, vocab_end); a trailing rank may hold none.
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, num_embeddings)
        self.vocab_start = min(self.vocab_start, num_embeddings)
        self._pieces = [_Piece(None, 0, self.rows_per_rank)]
        self.quant_method.create_weights(self, embedding_dim, self.rows_per_rank, self.params_dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        in_range = (ids >= self.vocab_start) & (ids < self.vocab_end)  # [...]
        local = local.masked_fill(~in_range, 0)  # any valid index; its row is zeroed below
        out = self.quant_method.embedding(self, local)  # [..., embedding_dim]
        out = out.masked_fill(~in_range.unsqueeze(-1), 0)
        return self.group.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection with the embedding's layout: local logits [..., pp], gathered, cut to V."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        group: LogicalGroup,
        bias: bool = False,
        padding_size: int = 64,
        dtype: torch.dtype | None = None,
        quant_method: QuantMethod | None = None,
        name: str = "",
    ):
        super().__init__(
            num_embeddings, embedding_dim, group=group, padding_size=padding_size, dtype=dtype,
            quant_method=quant_method, name=name,
        )
        if bias:
            self.register_parameter("bias", new_param(torch.zeros(self.rows_per_rank, dtype=self.params_dtype), output_dim=0))
        else:
            self.bias = None

    def tie_weights(self, embedding: VocabParallelEmbedding) -> None:
        """Share the embedding's weight (tie_word_embeddings): same group, same rows per rank required."""
        if (embedding.group, embedding.rows_per_rank) != (self.group, self.rows_per_rank):
            raise ValueError(
                f"{self.name}: cannot tie to {embedding.name}: groups {self.group.describe()} vs "
                f"{embedding.group.describe()}, rows per rank {self.rows_per_rank} vs {embedding.rows_per_rank}"
            )
        self.weight = embedding.weight
        self._loaded.add(("weight", None))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.quant_method.apply(self, hidden, self.bias)  # [..., pp]
        logits = self.group.all_gather(logits, dim=-1)  # [..., padded vocab]
        return logits[..., : self.num_embeddings]  # padding rows are not tokens
