"""The dflash plugin on vllm-ascend: the draft's context K/V in one `torch.ops.dflash.context_kv`.

vLLM's `DFlashQwen3Model.precompute_and_store_context_kv` calls `ops.rms_norm` and
`ops.rotary_embedding`, which have no NPU kernels; vllm-ascend's worker patch
(`vllm_ascend.patch.worker.patch_qwen3_dflash`) replaces it with an unfused loop (hidden norm, the
fused K/V GEMM, one k_norm per layer, RoPE, one cache write per layer). `apply` imports that patch
first, so that vllm-ascend's own later import of it changes nothing, then installs the dflash
replacement over it (`dflash.integrations.vllm.install`): one op call writing every layer's
(key, value) caches, vllm-ascend's [num_blocks, block_size, Hkv, D], in place, through dflash's
NPU build of the op (the Ascend C epilogue, with the GEMMs by torch_npu).

Not run on an NPU here: it is tested on CPU against a stand-in of vllm-ascend's code path.
"""

from __future__ import annotations

import importlib


def apply() -> None:
    """vllm-ascend's patch of the method first, then dflash's over it."""
    from . import vllm as plugin

    importlib.import_module("vllm_ascend.patch.worker.patch_qwen3_dflash")
    plugin.install()
