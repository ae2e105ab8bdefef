"""Which implementation serves `dflash.ops.paged_attention` on Ascend NPUs, chosen at run time.

`DFLASH_NPU_ATTENTION` selects it for NPU tensors (CPU tensors always go to torch.ops.dflash):

* `dflash` (default): `torch.ops.dflash.paged_attention`, dflash's Ascend C kernel
  (ascend_kernels/paged_attention.cpp), which reads the new tokens' K/V from `key` / `value` and
  leaves the caches untouched.
* `fused_infer`: `torch_npu.npu_fused_infer_attention_score`, the fused attention production
  engines use on Ascend (vLLM-Ascend's attention backend): TND layout over the paged cache, with
  `sparse_mode=0` and no mask for the non-causal DFlash draft and `sparse_mode=3` (the causal
  mask aligned to the end of each sequence's keys) for the target. Like those engines it first
  writes the new tokens' K/V into the caches at their positions `context_lens[b] ..` through
  `block_table`, so the block table must cover them: dflash's engine reserves and, for the target,
  writes exactly these slots anyway; the draft's slots are rewritten by `context_kv` before they are
  read as context. It serves bfloat16 and float16 only (the torch_npu op has no float32).

torch_npu is imported only when an NPU tensor meets `fused_infer`, never at `import dflash`.
"""

from __future__ import annotations

import os

import torch

from . import checks

ENV = "DFLASH_NPU_ATTENTION"
BACKENDS = ("dflash", "fused_infer")
_MASK_SIZE = 2048  # sparse_mode 3 takes a fixed 2048 x 2048 upper-triangular mask


def backend() -> str:
    """The backend `DFLASH_NPU_ATTENTION` selects (default `dflash`)."""
    value = os.environ.get(ENV, "").strip().lower() or "dflash"
    if value not in BACKENDS:
        raise ValueError(f"{ENV}={value!r} is not a paged attention backend; "
                         f"choose one of {', '.join(BACKENDS)}")
    return value


def paged_attention(query, key, value, key_cache, value_cache, block_table, context_lens,
                    cu_query_lens, scale: float, causal: bool, check: bool = True,
                    tree_mask: torch.Tensor | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """`dflash.ops.paged_attention`, dispatched to the selected backend for NPU tensors (tree
    masks and `out` always take dflash's kernel: fused_infer's masks are per batch, not per
    row, and it allocates its output)."""
    if query.device.type == "npu" and backend() == "fused_infer" and tree_mask is None \
            and out is None:
        import torch_npu

        return fused_infer_attention(torch_npu, query, key, value, key_cache, value_cache,
                                     block_table, context_lens, cu_query_lens, scale, causal,
                                     check)
    args = (query, key, value, key_cache, value_cache, block_table, context_lens, cu_query_lens,
            scale, causal, check, tree_mask)
    if out is None:
        return torch.ops.dflash.paged_attention(*args)
    torch.ops.dflash.paged_attention.out(*args, out=out)
    return out


_masks: dict[torch.device, torch.Tensor] = {}


def _causal_mask(device: torch.device) -> torch.Tensor:
    if device not in _masks:
        ones = torch.ones(_MASK_SIZE, _MASK_SIZE, dtype=torch.bool, device=device)
        _masks[device] = torch.triu(ones, diagonal=1)
    return _masks[device]


def fused_infer_attention(torch_npu, query, key, value, key_cache, value_cache, block_table,
                          context_lens, cu_query_lens, scale: float, causal: bool,
                          check: bool = True) -> torch.Tensor:
    """paged_attention through `torch_npu.npu_fused_infer_attention_score` (module docstring).
    The op takes the per-sequence lengths as host lists, so every call reads `cu_query_lens` and
    `context_lens` back from the device; index values are read for checking only with `check`."""
    op = "paged_attention"
    checks.paged_attention_meta(query, key, value, key_cache, value_cache, block_table,
                                context_lens, cu_query_lens, scale, causal)
    if check:
        checks.paged_attention_values(query, key_cache, block_table, context_lens, cu_query_lens)
    checks.require(query.dtype in (torch.bfloat16, torch.float16), op,
                   f"{ENV}=fused_infer serves bfloat16 and float16, got {query.dtype} "
                   f"(npu_fused_infer_attention_score has no float32)")
    checks.require(key_cache.is_contiguous() and value_cache.is_contiguous(), op,
                   f"{ENV}=fused_infer needs contiguous key_cache and value_cache")
    num_blocks, block_size, hkv, d = key_cache.shape
    cu = cu_query_lens.tolist()
    ctx = context_lens.tolist()
    new = [end - start for start, end in zip(cu, cu[1:])]
    for b, (c, n) in enumerate(zip(ctx, new)):
        checks.require(c + n <= block_table.shape[1] * block_size, op,
                       f"{ENV}=fused_infer writes the new tokens into the cache, but block_table "
                       f"row {b} covers {block_table.shape[1] * block_size} tokens, not "
                       f"{c} + {n}")
    seqs = [b for b, n in enumerate(new) if n]
    if not seqs:
        return torch.empty_like(query)

    # The new tokens' cache slots (from the device's lengths: no copies to it), then their K/V
    # written there.
    device = query.device
    cu_dev = cu_query_lens.long()
    seq = torch.repeat_interleave(torch.arange(len(new), device=device), cu_dev[1:] - cu_dev[:-1],
                                  output_size=query.shape[0])
    positions = torch.arange(query.shape[0], device=device) - cu_dev[seq] + \
        context_lens.long()[seq]
    blocks = block_table.long()[seq, positions // block_size]
    bad = ((blocks < 0) | (blocks >= num_blocks)).nonzero() if check else ()
    if len(bad):
        t = int(bad[0])
        checks.fail(op, f"block_table[{int(seq[t])}, {int(positions[t]) // block_size}] = "
                        f"{int(blocks[t])} is out of range for {num_blocks} cache blocks "
                        f"(fused_infer writes new token {t} there)")
    slots = blocks * block_size + positions % block_size
    key_cache.view(-1, hkv, d).index_copy_(0, slots, key)
    value_cache.view(-1, hkv, d).index_copy_(0, slots, value)

    # sequences without new tokens leave the op's batch (the table's rows: a copy only then)
    table = block_table if len(seqs) == len(new) else \
        block_table[torch.tensor(seqs, device=device)]
    out, _ = torch_npu.npu_fused_infer_attention_score(
        query, key_cache.view(num_blocks, block_size, hkv * d),
        value_cache.view(num_blocks, block_size, hkv * d),
        atten_mask=_causal_mask(device) if causal else None,
        block_table=table,
        input_layout="TND",
        block_size=block_size,
        actual_seq_lengths=[cu[b + 1] for b in seqs],
        actual_seq_lengths_kv=[ctx[b] + new[b] for b in seqs],
        num_heads=query.shape[1],
        num_key_value_heads=hkv,
        scale=scale,
        sparse_mode=3 if causal else 0,
    )
    return out
