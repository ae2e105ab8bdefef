"""The target model: Qwen3 (dense and MoE), Qwen2 and Llama decoders over paged KV caches.

One compact implementation, gpt-fast style. Attention runs through `dflash.ops.paged_attention`
(causal), so prefill, decode and block verification are the same code path. The forward can
capture the residual stream after chosen layers (the DFlash draft's context features).

With a `TensorParallel` (tp) the model holds one rank's shard (see `parallel`): its own heads and
KV heads, intermediate rows, experts and vocabulary rows; the residual stream stays replicated.
tp=None is the single-process model, with no collective calls at all.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from .config import TargetConfig
from .layers import (
    PANEL_MAX_ROWS,
    AttentionMetadata,
    QuantizedWeight,
    add_rms_norm,
    linear,
    linear_parts,
    pack_linear_weight,
    pack_parameter,
    quantize_linear_weight,
    quantize_parameter,
    rms_norm,
    rope_cos_sin,
    rope_positions,
    silu_and_mul,
    unpacked,
    use_fused_ops,
)
from .parallel import TensorParallel


def _param(*shape: int) -> nn.Parameter:
    """Placeholder on the meta device; the loader assigns the real tensor."""
    return nn.Parameter(torch.empty(*shape, device="meta"), requires_grad=False)


def _ranks(tp: TensorParallel | None) -> int:
    return 1 if tp is None else tp.size


class Attention(nn.Module):
    def __init__(self, cfg: TargetConfig, tp: TensorParallel | None = None):
        super().__init__()
        a = cfg.attn
        n = _ranks(tp)
        self.num_heads, self.num_kv_heads = a.num_heads // n, a.num_kv_heads // n
        self.head_dim, self.eps, self.tp = a.head_dim, a.rms_norm_eps, tp
        self.qkv = _param((self.num_heads + 2 * self.num_kv_heads) * a.head_dim, a.hidden_size)
        self.qkv_bias = _param(self.qkv.shape[0]) if cfg.qkv_bias else None
        self.q_norm = _param(a.head_dim) if cfg.qk_norm else None
        self.k_norm = _param(a.head_dim) if cfg.qk_norm else None
        self.o = _param(a.hidden_size, self.num_heads * a.head_dim)
        self.o_bias = _param(a.hidden_size) if a.attention_bias else None

    def forward(self, x, cos_sin, meta: AttentionMetadata, key_cache, value_cache):
        # one call splits the heads, norms and rotates q/k and writes the new tokens' K/V to the
        # cache (attention takes them directly as well, so the order does not matter)
        q, k, v = ops.qkv_rope_cache(linear(x, self.qkv, self.qkv_bias), self.q_norm, self.k_norm,
                                     cos_sin, key_cache, value_cache, meta.slot_mapping,
                                     self.num_heads, self.eps, check=not meta.checked)
        out = ops.paged_attention(q, k, v, key_cache, value_cache, meta.block_table,
                                  meta.context_lens, meta.cu_query_lens, self.head_dim**-0.5,
                                  causal=True, check=not meta.checked, tree_mask=meta.tree_mask,
                                  out=meta.attention_output(self.num_heads, self.head_dim))
        out = linear(out.view(x.shape[0], -1), self.o, self.o_bias)
        return out if self.tp is None else self.tp.all_reduce(out)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, tp: TensorParallel | None = None):
        super().__init__()
        intermediate //= _ranks(tp)
        self.gate_up = _param(2 * intermediate, hidden)
        self.down = _param(hidden, intermediate)
        self.tp = tp

    WEIGHTS = ("gate_up", "down")   # the linear weights, as pack_weights and quantize see them

    def pack_weights(self) -> None:
        for name in self.WEIGHTS:
            pack_parameter(self, name)

    def forward(self, x):
        out = linear(silu_and_mul(linear(x, self.gate_up)), self.down)
        return out if self.tp is None else self.tp.all_reduce(out)


class MoE(nn.Module):
    """Top-k routed experts; each expert runs only on the tokens routed to it. Under tensor
    parallelism each rank holds a run of the experts and the partial outputs are summed."""

    def __init__(self, cfg: TargetConfig, tp: TensorParallel | None = None):
        super().__init__()
        e, h, i = cfg.num_experts, cfg.attn.hidden_size, cfg.moe_intermediate_size
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.local = range(e) if tp is None else tp.experts(e)
        self.router = _param(e, h)
        self.gate_up = _param(len(self.local), 2 * i, h)
        self.down = _param(len(self.local), h, i)
        self.tp = tp

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
            if count and expert in self.local:
                rows, pair = tokens[start:start + count], order[start:start + count]
                held = expert - self.local.start
                h = F.linear(silu_and_mul(F.linear(x[rows], self.gate_up[held])),
                             self.down[held])
                out.index_add_(0, rows, h * weights[pair, None])
            start += count
        return out if self.tp is None else self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TargetConfig, layer: int, tp: TensorParallel | None = None):
        super().__init__()
        h = cfg.attn.hidden_size
        self.eps = cfg.attn.rms_norm_eps
        self.input_norm = _param(h)
        self.post_norm = _param(h)
        self.attn = Attention(cfg, tp)
        self.mlp = MoE(cfg, tp) if cfg.is_moe_layer(layer) else \
            MLP(h, cfg.intermediate_size, tp)
        # the weights in `ops.decoder_layer`'s order once `fuse` ran; None: op by op
        self.fused: tuple | None = None

    def fuse(self) -> None:
        """Let `ops.decoder_layer` run this layer in one call (the same ops, so the same results)
        where that pays and can be done: on CPU (an NPU queues its ops without waiting for
        Python), with a dense MLP and no tensor parallelism, whose all-reduces sit between the
        ops. Call it once the weights are final: it holds them as they are now."""
        attn, mlp = self.attn, self.mlp
        self.fused = None
        if self.input_norm.device.type == "cpu" and attn.tp is None and isinstance(mlp, MLP):
            self.fused = (self.input_norm, self.post_norm, *linear_parts(attn.qkv), attn.qkv_bias,
                          attn.q_norm, attn.k_norm, *linear_parts(attn.o), attn.o_bias,
                          *linear_parts(mlp.gate_up), *linear_parts(mlp.down))

    def forward(self, x, residual, cos_sin, meta, key_cache, value_cache):
        """x: the previous layer's output, residual: the stream it adds to (None before the first
        layer, where x is the embeddings). Returns the same pair for the next layer: each residual
        add runs fused with the norm that follows it."""
        # one call, not nine, except where `linear` would leave panel_linear (long prefills) or
        # a graph capture gives the attention its output buffer
        if self.fused is not None and x.shape[0] <= PANEL_MAX_ROWS and \
                meta.attention_out is None and use_fused_ops(x) and \
                (residual is None or residual.dtype == x.dtype):
            attn = self.attn
            return ops.decoder_layer(x, residual, *self.fused, cos_sin, key_cache, value_cache,
                                     meta.slot_mapping, meta.block_table, meta.context_lens,
                                     meta.cu_query_lens, meta.tree_mask, attn.num_heads,
                                     attn.head_dim**-0.5, self.eps, not meta.checked)
        if residual is None:
            h, residual = rms_norm(x, self.input_norm, self.eps), x
        else:
            h, residual = add_rms_norm(x, residual, self.input_norm, self.eps)
        h, residual = add_rms_norm(self.attn(h, cos_sin, meta, key_cache, value_cache), residual,
                                   self.post_norm, self.eps)
        return self.mlp(h), residual


class TargetModel(nn.Module):
    def __init__(self, cfg: TargetConfig, tp: TensorParallel | None = None,
                 max_positions: int | None = None):
        """`max_positions`: the longest sequence served (sizes the RoPE table; see
        layers.rope_positions)."""
        super().__init__()
        self.cfg, self.tp = cfg, tp
        h = cfg.attn.hidden_size
        vocab = cfg.vocab_size if tp is None else tp.vocab_shard_rows(cfg.vocab_size)
        self.embed = _param(vocab, h)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = _param(h)
        self.lm_head = None if cfg.tie_word_embeddings else _param(vocab, h)
        self.packed_head: torch.Tensor | QuantizedWeight | None = None   # see pack_weights
        # after `quantize`: whether a float lm_head is held, and the quantized matrix embedding
        # lookups read when the float embedding is not
        self.float_head = True
        self.embed_rows: QuantizedWeight | None = None
        self.register_buffer("cos_sin", rope_cos_sin(
            cfg.attn, rope_positions(cfg.attn, max_positions)), persistent=False)

    @property
    def output_embedding(self) -> torch.Tensor:
        """The lm_head [V, H] (dequantized when only its quantized copy is held)."""
        if not self.float_head:
            return unpacked(self.packed_head).to(self.dtype)
        return self.embed if self.lm_head is None else self.lm_head

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of activations and of the weights held unquantized."""
        return self.norm.dtype

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """[layers, 2 (K, V), num_blocks, block_size, Hkv (this rank's), D]."""
        attn = self.layers[0].attn
        return (self.cfg.num_layers, 2, num_blocks, block_size, attn.num_kv_heads, attn.head_dim)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embed is None:   # read from its quantized copy
            return self.embed_rows.rows(ids).to(self.dtype)
        return F.embedding(ids, self.embed) if self.tp is None else \
            self.tp.embedding(ids, self.embed)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor,
                capture_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run T new tokens; returns (final-normed hidden [T, H], captured features or None).

        The features are the residual streams after each layer in `capture_layers`, concatenated
        in that order: [T, len(capture_layers) * H].
        """
        x, residual = self.embed_tokens(input_ids), None
        cos_sin = self.cos_sin[meta.positions]
        captured = {}
        caches = kv_cache.view(-1, *kv_cache.shape[2:]).unbind()   # layer i: K 2i, V 2i + 1
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, cos_sin, meta, caches[2 * i], caches[2 * i + 1])
            if i in capture_layers:
                captured[i] = residual + x   # the stream after layer i
        features = torch.cat([captured[i] for i in capture_layers], -1) if capture_layers else None
        hidden, _ = add_rms_norm(x, residual, self.norm, self.cfg.attn.rms_norm_eps)
        return hidden, features

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits [T, V] (on every rank)."""
        head = self.output_embedding if self.packed_head is None else self.packed_head
        logits = linear(hidden, head)
        return logits if self.tp is None else self.tp.gather_vocab(logits, self.cfg.vocab_size)

    def linear_weights(self) -> list[str]:
        """The names of the dense linear weights (the attention projections, a dense MLP's; not
        MoE experts nor the router), e.g. "layers.0.attn.qkv"."""
        out = []
        for i, layer in enumerate(self.layers):
            out += [f"layers.{i}.attn.qkv", f"layers.{i}.attn.o"]
            if isinstance(layer.mlp, MLP):
                out += [f"layers.{i}.mlp.{name}" for name in MLP.WEIGHTS]
        return out

    def _owner(self, name: str) -> tuple[nn.Module, str]:
        module, _, leaf = name.rpartition(".")
        return self.get_submodule(module), leaf

    def quantize(self, quantization: str, dtype: torch.dtype) -> None:
        """Quantize the dense linear weights and the lm_head (`layers.quantize_linear_weight`)
        from their values as loaded, which may be wider than `dtype` (float32: a GGUF's exact
        values); weights the format cannot hold, and the embedding (lookups; a tied lm_head
        gets a quantized copy), end in `dtype`. Under "int4" the lm_head takes int8, as
        llama.cpp's 4-bit files keep their output matrix in 6 or 8 bits: the logits are where
        4 bits cost the most agreement.

        Without tensor parallelism the model then holds its vocabulary matrices only quantized,
        as llama.cpp does: logits and a draft vocabulary's rows come from the quantized lm_head,
        and embedding lookups from it too when tied, else from an int8 copy of the embedding."""
        self.unfuse()
        for name in self.linear_weights():
            module, leaf = self._owner(name)
            if isinstance(getattr(module, leaf), nn.Parameter):   # not `quantize_weight`'s yet
                quantize_parameter(module, leaf, quantization, dtype)
        head = "int8" if quantization == "int4" else quantization
        self.packed_head = quantize_linear_weight(self.output_embedding.data, head)
        if self.tp is None and self.packed_head is not None:
            self.float_head, self.lm_head = False, None
            self.embed_rows = self.packed_head if self.cfg.tie_word_embeddings else \
                quantize_linear_weight(self.embed.data, "int8")
            self.embed = None
        for name in ("embed", "lm_head"):
            if getattr(self, name) is not None:
                setattr(self, name, nn.Parameter(getattr(self, name).data.to(dtype),
                                                 requires_grad=False))

    def quantize_weight(self, name: str, value: torch.Tensor, quantization: str,
                        dtype: torch.dtype) -> bool:
        """Install the dense linear weight `name` quantized from `value` (as `quantize` does,
        one weight at a time: the loader hands each over as read); False for other names."""
        if name not in self.linear_weights():
            return False
        self.unfuse()
        quantize_parameter(*self._owner(name), quantization, dtype, value)
        return True

    def unfuse(self) -> None:
        """Run every layer op by op again (before its weights are replaced)."""
        for layer in self.layers:
            layer.fused = None

    def pack_weights(self) -> None:
        """Re-lay the dense GEMM weights out for fast small-batch CPU GEMMs (see
        `pack_linear_weight`; a no-op off CPU, for float16 and for quantized weights), the last
        step of loading for inference. The embedding stays as it is for lookups, so a tied lm_head
        gets a packed copy. Then each layer that can runs as one call (`DecoderLayer.fuse`)."""
        for name in self.linear_weights():
            pack_parameter(*self._owner(name))
        if self.packed_head is None:
            self.packed_head = pack_linear_weight(self.output_embedding.data)
        for layer in self.layers:
            layer.fuse()

    def output_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the lm_head, e.g. a draft vocabulary's output embedding [len(ids), H]."""
        if not self.float_head:
            return self.packed_head.rows(ids).to(self.dtype)
        head = self.output_embedding
        return head[ids].contiguous() if self.tp is None else self.tp.embedding(ids, head)
