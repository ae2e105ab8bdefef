"""dflash's fused operators inside other inference frameworks.

- `dflash.integrations.vllm`: a vLLM plugin (entry point group `vllm.general_plugins`, name
  `dflash`) that computes vLLM's DFlash draft context K/V with `torch.ops.dflash.context_kv`.
- `dflash.integrations.vllm_ascend`: the same replacement for vllm-ascend's NPU code path.

Both share `dflash.integrations.cache_layout`, which finds how an attention backend lays out its
paged KV cache so that the op writes into that cache in place.
"""
