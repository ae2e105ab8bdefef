"""The target model: Qwen3 (dense and MoE), Qwen2 and Llama decoders over paged KV caches.

One compact implementation, gpt-fast style. Attention runs through `dflash.ops.paged_attention`
(causal), so prefill, decode and block verification are the same code path. The forward can
capture the residual stream after chosen layers (the DFlash draft's context features).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from .config import TargetConfig
from .layers import AttentionMetadata, apply_rope, rms_norm, rope_cos_sin, silu_and_mul


def _param(*shape: int) -> nn.Parameter:
    """Placeholder on the meta device; the loader assigns the real tensor."""
    return nn.Parameter(torch.empty(*shape, device="meta"), requires_grad=False)


class Attention(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        a = cfg.attn
        self.num_heads, self.num_kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.eps = a.rms_norm_eps
        self.qkv = _param((a.num_heads + 2 * a.num_kv_heads) * a.head_dim, a.hidden_size)
        self.qkv_bias = _param(self.qkv.shape[0]) if cfg.qkv_bias else None
        self.q_norm = _param(a.head_dim) if cfg.qk_norm else None
        self.k_norm = _param(a.head_dim) if cfg.qk_norm else None
        self.o = _param(a.hidden_size, a.num_heads * a.head_dim)
        self.o_bias = _param(a.hidden_size) if a.attention_bias else None

    def forward(self, x, cos_sin, meta: AttentionMetadata, key_cache, value_cache):
        t, dtype = x.shape[0], x.dtype
        q, k, v = F.linear(x, self.qkv, self.qkv_bias).split(
            [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
             self.num_kv_heads * self.head_dim], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = rms_norm(q, self.q_norm, self.eps), rms_norm(k, self.k_norm, self.eps)
        q, k = apply_rope(q, cos_sin).to(dtype), apply_rope(k, cos_sin).to(dtype)
        out = ops.paged_attention(q, k, v, key_cache, value_cache, meta.block_table,
                                  meta.context_lens, meta.cu_query_lens, self.head_dim**-0.5,
                                  causal=True)
        # the new tokens' K/V join the cache after attention (they were passed directly)
        key_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, k)
        value_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, v)
        return F.linear(out.view(t, -1), self.o, self.o_bias)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up = _param(2 * intermediate, hidden)
        self.down = _param(hidden, intermediate)

    def forward(self, x):
        return F.linear(silu_and_mul(F.linear(x, self.gate_up)), self.down)


class MoE(nn.Module):
    """Top-k routed experts; each expert runs only on the tokens routed to it."""

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        e, h, i = cfg.num_experts, cfg.attn.hidden_size, cfg.moe_intermediate_size
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.router = _param(e, h)
        self.gate_up = _param(e, 2 * i, h)
        self.down = _param(e, h, i)

    def forward(self, x):
        probs = torch.softmax(F.linear(x, self.router).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(x.dtype).flatten()
        # sort the (token, expert) pairs by expert so each expert sees one contiguous slice
        order = experts.flatten().argsort(stable=True)
        counts = torch.bincount(experts.flatten(), minlength=self.router.shape[0]).tolist()
        tokens = order // self.top_k
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                rows, pair = tokens[start:start + count], order[start:start + count]
                h = F.linear(silu_and_mul(F.linear(x[rows], self.gate_up[expert])),
                             self.down[expert])
                out.index_add_(0, rows, h * weights[pair, None])
            start += count
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TargetConfig, layer: int):
        super().__init__()
        h = cfg.attn.hidden_size
        self.eps = cfg.attn.rms_norm_eps
        self.input_norm = _param(h)
        self.post_norm = _param(h)
        self.attn = Attention(cfg)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(layer) else MLP(h, cfg.intermediate_size)

    def forward(self, x, cos_sin, meta, key_cache, value_cache):
        x = x + self.attn(rms_norm(x, self.input_norm, self.eps), cos_sin, meta, key_cache,
                          value_cache)
        return x + self.mlp(rms_norm(x, self.post_norm, self.eps))


class TargetModel(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.attn.hidden_size
        self.embed = _param(cfg.vocab_size, h)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = _param(h)
        self.lm_head = None if cfg.tie_word_embeddings else _param(cfg.vocab_size, h)
        self.register_buffer("cos_sin", rope_cos_sin(cfg.attn, cfg.attn.max_position_embeddings),
                             persistent=False)

    @property
    def output_embedding(self) -> torch.Tensor:
        return self.embed if self.lm_head is None else self.lm_head

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """[layers, 2 (K, V), num_blocks, block_size, Hkv, D]."""
        a = self.cfg.attn
        return (self.cfg.num_layers, 2, num_blocks, block_size, a.num_kv_heads, a.head_dim)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor,
                capture_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run T new tokens; returns (final-normed hidden [T, H], captured features or None).

        The features are the residual streams after each layer in `capture_layers`, concatenated
        in that order: [T, len(capture_layers) * H].
        """
        x = F.embedding(input_ids, self.embed)
        cos_sin = self.cos_sin[meta.positions]
        captured = {}
        for i, layer in enumerate(self.layers):
            x = layer(x, cos_sin, meta, kv_cache[i, 0], kv_cache[i, 1])
            if i in capture_layers:
                captured[i] = x
        features = torch.cat([captured[i] for i in capture_layers], -1) if capture_layers else None
        return rms_norm(x, self.norm, self.cfg.attn.rms_norm_eps), features

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.output_embedding)
