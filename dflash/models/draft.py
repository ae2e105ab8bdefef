"""The DFlash draft model (docs/design.md sections 1-2).

A stack of Qwen3 pre-norm layers without embedding or lm_head (both borrowed from the target).
Context tokens (committed tokens' target features) only contribute K/V, materialized once through
`dflash.ops.context_kv` into a paged cache; the block of B tokens attends to that context and to
itself with no causal mask through `dflash.ops.paged_attention(causal=False)`.

Every layer's k_proj/v_proj live in one layer-major `kv_weight` [L * 2 * Hkv * D, H] so that one
GEMM produces the context K/V of all layers; a layer's block K/V use its slice of the same weight.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import ops
from .config import DraftConfig
from .layers import (
    AttentionMetadata,
    add_rms_norm,
    inference_weight,
    linear,
    pack_parameter,
    quantize_parameter,
    rms_norm,
    rope,
    rope_cos_sin,
    rope_positions,
)
from .target import MLP, _param


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        a = cfg.attn
        self.num_heads, self.num_kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.eps = a.rms_norm_eps
        self.input_norm = _param(a.hidden_size)
        self.post_norm = _param(a.hidden_size)
        self.q = _param(a.num_heads * a.head_dim, a.hidden_size)
        self.q_bias = _param(self.q.shape[0]) if a.attention_bias else None
        self.q_norm = _param(a.head_dim)
        self.o = _param(a.hidden_size, a.num_heads * a.head_dim)
        self.o_bias = _param(a.hidden_size) if a.attention_bias else None
        self.mlp = MLP(a.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos_sin, kv_weight, kv_bias, k_norm, attend, rows=None):
        """`attend(q, k, v)` runs attention of the block over context + block. `rows` (None:
        all): the rows to return; past attention each row is computed from its own values only,
        so the output projection and the MLP run over those rows alone."""
        t = x.shape[0]
        h = rms_norm(x, self.input_norm, self.eps)
        q = linear(h, self.q, self.q_bias).view(t, self.num_heads, self.head_dim)
        kv = linear(h, kv_weight, kv_bias)
        k, v = kv.view(t, 2, self.num_kv_heads, self.head_dim).unbind(1)
        q = rope(rms_norm(q, self.q_norm, self.eps), cos_sin)
        k = rope(rms_norm(k, k_norm, self.eps), cos_sin)
        h = attend(q, k, v).reshape(t, -1)
        if rows is not None:
            h, x = h[rows], x[rows]
        h, x = add_rms_norm(linear(h, self.o, self.o_bias), x, self.post_norm, self.eps)
        return x + self.mlp(h)


class DFlashDraft(nn.Module):
    def __init__(self, cfg: DraftConfig, target_hidden_size: int,
                 max_positions: int | None = None):
        """`max_positions`: as for TargetModel."""
        super().__init__()
        self.cfg = cfg
        a = cfg.attn
        kv_rows = cfg.num_layers * 2 * a.num_kv_heads * a.head_dim
        self.fc = _param(a.hidden_size, len(cfg.target_layer_ids) * target_hidden_size)
        self.hidden_norm = _param(a.hidden_size)
        self.norm = _param(a.hidden_size)
        self.kv_weight = _param(kv_rows, a.hidden_size)
        self.kv_bias = _param(kv_rows) if a.attention_bias else None
        self.k_norm = _param(cfg.num_layers, a.head_dim)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.register_buffer("cos_sin", rope_cos_sin(a, rope_positions(a, max_positions)),
                             persistent=False)
        # Optional draft vocabulary (token ids the draft may propose): the draft's logits then
        # cost a fraction of the full lm_head. Proposals stay valid; verification is unchanged.
        self.draft_vocab: torch.Tensor | None = None
        # the draft's own output rows for that vocabulary [N, H] when its checkpoint ships them
        # (else the engine takes the target's lm_head rows)
        self.lm_head: torch.Tensor | None = None
        self.packed_kv: list[torch.Tensor] = []   # see pack_weights
        self.packed_fc: torch.Tensor | None = None
        self.quantization: str | None = None   # the block GEMMs' weight format (quantize)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """[layers, 2 (K, V), num_blocks, block_size, Hkv, D]."""
        a = self.cfg.attn
        return (self.cfg.num_layers, 2, num_blocks, block_size, a.num_kv_heads, a.head_dim)

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layer `layer`'s slice of the fused K/V weight and bias: k_proj rows then v_proj rows."""
        rows = 2 * self.cfg.attn.num_kv_heads * self.cfg.attn.head_dim
        sl = slice(layer * rows, (layer + 1) * rows)
        return self.kv_weight[sl], None if self.kv_bias is None else self.kv_bias[sl]

    def quantize(self, quantization: str) -> None:
        """Inference only: quantize the block's GEMM weights (`layers.quantize_linear_weight`:
        the layers' q, o and MLP weights now; the K/V slices and the context projection when
        `pack_weights` copies them, and the engine's draft vocabulary head likewise). The draft
        only proposes, so its weight format moves acceptance, never the output. Weights the
        format cannot hold stay in the model's dtype."""
        dtype = self.norm.dtype
        for layer in self.layers:
            for module, name in ((layer, "q"), (layer, "o"),
                                 *((layer.mlp, w) for w in layer.mlp.WEIGHTS)):
                quantize_parameter(module, name, quantization, dtype)
        self.quantization = quantization

    def pack_weights(self) -> None:
        """Inference only: the block GEMM weights in the fast CPU layout (`pack_linear_weight`),
        or in `quantization`'s format. The fused kv_weight stays plain for context_kv; the block
        path gets packed slices, and the context's fc projection runs before context_kv through
        a packed copy (a few rows a step: there torch's GEMM costs about twice panel_linear's)."""
        self.packed_fc = inference_weight(self.fc.data, self.quantization)
        for layer in self.layers:
            pack_parameter(layer, "q")
            pack_parameter(layer, "o")
            layer.mlp.pack_weights()
        self.packed_kv = [inference_weight(self.layer_kv(i)[0], self.quantization)
                          for i in range(self.cfg.num_layers)]

    def write_context(self, features: torch.Tensor, positions: torch.Tensor,
                      slot_mapping: torch.Tensor, kv_cache: torch.Tensor,
                      check: bool = True) -> None:
        """Append committed tokens' context K/V (features [N, n_aux * H_t]) to the draft cache.
        check=False: positions and slots come from a checked plan (`AttentionMetadata`)."""
        fc = self.fc
        if self.packed_fc is not None:
            features, fc = linear(features, self.packed_fc), None
        ops.context_kv(features, fc, self.hidden_norm, self.kv_weight, self.kv_bias,
                       self.k_norm, positions, self.cos_sin, slot_mapping,
                       list(kv_cache[:, 0]), list(kv_cache[:, 1]), self.cfg.attn.rms_norm_eps,
                       check)

    def forward(self, block_embeds: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Non-causal pass over blocks (block_embeds [T, H], the target's embeddings of the block
        tokens); returns the final-normed hidden states [T, H], or [len(rows), H] of the block
        rows `rows` (int64). The last layer's output projection and MLP then run over those
        rows only (every row's keys and values still feed its attention): a step that verifies
        k drafts a block pays for k rows there, not B."""
        a = self.cfg.attn
        scale = a.head_dim**-0.5
        out = meta.attention_output(a.num_heads, a.head_dim)
        cos_sin = self.cos_sin[meta.positions]
        x = block_embeds
        for i, layer in enumerate(self.layers):
            def attend(q, k, v, i=i):
                return ops.paged_attention(q, k, v, kv_cache[i, 0], kv_cache[i, 1],
                                           meta.block_table, meta.context_lens,
                                           meta.cu_query_lens, scale, causal=False,
                                           check=not meta.checked, out=out)
            kv_weight, kv_bias = self.layer_kv(i)
            if self.packed_kv:
                kv_weight = self.packed_kv[i]
            last = i == len(self.layers) - 1
            x = layer(x, cos_sin, kv_weight, kv_bias, self.k_norm[i], attend,
                      rows if last else None)
        return rms_norm(x, self.norm, self.cfg.attn.rms_norm_eps)
