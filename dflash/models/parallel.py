"""Tensor parallelism for the target: how its weights are split across ranks, and the collectives
its forward needs (over torch.distributed's default process group).

Splits (a checkpoint recipe's `Source.shard`, applied to each source tensor at load time, so a
rank reads and keeps only its part):
  ROWS     output rows cut into `size` equal runs: q|k|v by heads (k and v by kv heads), gate|up
           by intermediate rows; the fused layouts stay [q_r | k_r | v_r] and [gate_r | up_r].
  COLS     input columns cut likewise: o and down (row-parallel; their outputs are all-reduced).
  EXPERTS  MoE experts dealt out in contiguous runs (expert-parallel; outputs all-reduced).
  VOCAB    embedding / lm_head rows in runs of ceil(V / size), the last one zero-padded; the
           lookup all-reduces and the logits are all-gathered and trimmed to V.
  RANK0    a bias added after an all-reduce: rank 0 keeps it, the others hold zeros.
Everything else (norms, the router, RoPE tables) is replicated. KV heads are split, never
replicated, so `size` must divide num_key_value_heads (see `check_config`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .config import ConfigError, TargetConfig

ROWS, COLS, EXPERTS, VOCAB, RANK0 = "rows", "cols", "experts", "vocab", "rank0"


class TensorParallel:
    """This process's place (rank of size) in the tensor-parallel group: torch.distributed's
    default process group, initialized by the caller (see `dflash.engine.distributed`)."""

    def __init__(self, rank: int, size: int):
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside a tensor-parallel group of {size}")
        self.rank, self.size = rank, size

    def __repr__(self) -> str:
        return f"TensorParallel(rank={self.rank}, size={self.size})"

    # ----------------------------------------------------------------------- collectives
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank (in place)."""
        dist.broadcast(x, src=0)
        return x

    def broadcast_object(self, obj):
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def embedding(self, ids: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of a VOCAB-split table on every rank: each rank looks up the ids it holds
        (zeros elsewhere), so the sum is exact."""
        local = ids - self.rank * shard.shape[0]
        outside = (local < 0) | (local >= shard.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), shard).masked_fill_(outside[:, None], 0)
        return self.all_reduce(x)

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Full [..., V] logits on every rank from each rank's VOCAB-split columns."""
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        dist.all_gather(parts, logits.contiguous())
        return torch.cat(parts, -1)[..., :vocab_size]

    # ------------------------------------------------------------------------- loading
    def vocab_shard_rows(self, vocab_size: int) -> int:
        return -(-vocab_size // self.size)

    def shard(self, kind: str | None, tensor, shape: tuple[int, ...]):
        """This rank's part of one source tensor (anything sliceable, e.g. a safetensors slice)
        of full shape `shape`, as a tensor (an expert's tensors are whole: the loader picks
        this rank's experts)."""
        if kind in (None, EXPERTS):
            return tensor[:]
        if kind == RANK0:
            return tensor[:] if self.rank == 0 else torch.zeros(shape)
        if kind == VOCAB:
            rows = self.vocab_shard_rows(shape[0])
            start = self.rank * rows
            part = tensor[start:min(start + rows, shape[0])]
            return F.pad(part, (0, 0, 0, rows - part.shape[0]))   # zero rows past V
        dim = {ROWS: 0, COLS: 1}[kind]
        n = shape[dim] // self.size
        sl = slice(self.rank * n, (self.rank + 1) * n)
        return tensor[sl] if dim == 0 else tensor[:, sl]

    def experts(self, num_experts: int) -> range:
        """The experts this rank holds (EXPERTS split)."""
        n = num_experts // self.size
        return range(self.rank * n, (self.rank + 1) * n)


def check_config(cfg: TargetConfig, size: int) -> None:
    """Clear errors for the splits `size` ranks cannot make (heads follow from KV heads)."""
    need = {"num_key_value_heads": cfg.attn.num_kv_heads}
    layers = range(cfg.num_layers)
    if any(not cfg.is_moe_layer(i) for i in layers):
        need["intermediate_size"] = cfg.intermediate_size
    if any(cfg.is_moe_layer(i) for i in layers):
        need["num_experts"] = cfg.num_experts
    for name, value in need.items():
        if value % size:
            raise ConfigError(f"tensor parallelism: tp_size {size} must divide the target's "
                              f"{name} ({value})" + (" (KV heads are split across ranks, not "
                                                     "replicated)" if "key_value" in name else ""))
