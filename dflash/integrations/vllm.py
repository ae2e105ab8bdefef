"""vLLM plugin: vLLM's DFlash drafter computes its context K/V with `torch.ops.dflash.context_kv`.

Installed with `pip install "dflash-npu[vllm]"` and registered under vLLM's plugin entry point
group `vllm.general_plugins` as `dflash`: vLLM loads it in every process it starts (all plugins by
default; `VLLM_PLUGINS=dflash` selects it alone, `VLLM_PLUGINS=` with nothing loads none).

What it replaces: the body of `DFlashQwen3Model.precompute_and_store_context_kv` (vLLM's
`qwen3_dflash.py`: hidden RMSNorm -> fused K/V GEMM of all draft layers -> grouped k_norm -> RoPE
-> per-layer cache insert) by one `context_kv` call in its `fc_weight=None` form (vLLM applies
`fc` before, in `combine_hidden_states`), writing straight into vLLM's own per-layer KV cache
tensors in the layout vLLM's attention backend reads them (`cache_layout`). A draft or cache the op
cannot serve exactly as vLLM would (quantized K/V projections, a V scale, partial or non-NeoX RoPE,
per-layer slot mappings, a cache layout the probe cannot map) keeps vLLM's own function.

What it does not replace, and why:
- the draft's attention over context + block: vLLM's CPU attention kernel reads its own block
  layout (K transposed inside each block) with vLLM's metadata (sequence lengths that include the
  block, a scheduler plan); `dflash.ops.paged_attention` reads [num_blocks, block_size, Hkv, D]
  with a contiguous head_dim, so serving it would mean copying the cache or extending the kernel.
- the rejection sampler: vLLM's verifies the whole batch on its own flattened metadata and draws
  its random numbers from per-request generators inside the sampler; `dflash.ops.rejection_sample`
  takes the noise as tensors, so swapping it would change which tokens a seeded request samples.

A vLLM version other than those in TESTED_VLLM_VERSIONS gets a warning and no change at all.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Mapping

import torch

from . import cache_layout

TESTED_VLLM_VERSIONS = ("0.32.0",)
REPLACED = ("vllm.model_executor.models.qwen3_dflash.DFlashQwen3Model"
            ".precompute_and_store_context_kv")

# a child of vLLM's "vllm" logger, so its lines are printed with vLLM's own format and level.
# vLLM loads plugins before it configures logging, so the INFO line naming the replacement is
# logged when the op first serves a call (once per process), not at registration.
logger = logging.getLogger("vllm.dflash")
_announced: list[bool] = []


def register() -> None:
    """The entry point vLLM calls in each of its processes; idempotent. It never raises: a
    failure is logged and leaves vLLM as it was (install() patches one attribute, last)."""
    try:
        _register()
    except Exception as error:
        # the reason in the line itself, not only in the traceback a log format may drop
        logger.exception("dflash plugin: not installed (%s: %s); vLLM runs with its own "
                         "functions", type(error).__name__, error)


def _register() -> None:
    import vllm

    if vllm.__version__ not in TESTED_VLLM_VERSIONS:
        logger.warning("dflash plugin: vLLM %s is not a version it was tested with (%s); it "
                       "replaces nothing", vllm.__version__, ", ".join(TESTED_VLLM_VERSIONS))
        return
    if importlib.util.find_spec("vllm_ascend") is not None:
        from . import vllm_ascend
        vllm_ascend.apply()
    else:
        install()


def install() -> None:
    """Replace DFlashQwen3Model.precompute_and_store_context_kv (whatever serves it now: vLLM's
    own, or a platform's patch of it) by `context_kv` below; idempotent. Everything is looked up
    and built first and the class patched by one assignment, last, so a failure (caught and
    logged by register) leaves vLLM's function in place."""
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    stock = DFlashQwen3Model.precompute_and_store_context_kv
    if getattr(stock, "dflash_stock", None) is not None:
        return

    def precompute_and_store_context_kv(self, context_states, context_positions,
                                        context_slot_mapping=None):
        if type(self) is not DFlashQwen3Model or not context_kv(
                self, context_states, context_positions, context_slot_mapping):
            stock(self, context_states, context_positions, context_slot_mapping)
        elif not _announced:
            _announced.append(True)
            logger.info("dflash plugin: %s replaced by torch.ops.dflash.context_kv (%s)",
                        REPLACED, _implementation())

    precompute_and_store_context_kv.dflash_stock = stock
    precompute_and_store_context_kv.__doc__ = stock.__doc__
    DFlashQwen3Model.precompute_and_store_context_kv = precompute_and_store_context_kv
    logger.debug("dflash plugin: %s patched", REPLACED)


def _implementation() -> str:
    from .. import ops

    return ops.implementation("context_kv")


def context_kv(model, context_states: torch.Tensor, context_positions: torch.Tensor,
               context_slot_mapping) -> bool:
    """The replacement body: write the context K/V of `model` (a vLLM DFlashQwen3Model) into its
    layers' KV caches with one `torch.ops.dflash.context_kv` call. Returns False, having done
    nothing, when vLLM's own function must run instead: the dummy run without a slot mapping
    (it only profiles memory), per-layer slot mappings, or a draft / cache the op does not serve.

    context_states: [N, H] (fc already applied); context_positions: [N]; context_slot_mapping:
    [N], or one per layer as a list or a mapping by layer name (vLLM builds differ): that is used
    only when every layer has the same tensor; per-layer mappings that differ return False."""
    context_slot_mapping = _one_slot_mapping(context_slot_mapping)
    if context_slot_mapping is None:
        return False
    if not hasattr(model, "_num_attn_layers"):
        model._build_fused_kv_buffers()
    if not _supported(model):
        return False
    caches = _cache_views(model)
    if caches is None:
        return False
    torch.ops.dflash.context_kv(
        context_states, None, model._hidden_norm_weight, model._fused_kv_weight,
        model._fused_kv_bias, model._k_norm_weights, context_positions, _float_rope_cache(model),
        context_slot_mapping, *caches, model._rms_norm_eps)
    return True


def _one_slot_mapping(slot_mapping):
    """The slot mapping every layer shares, or None: none given (the dummy run), per-layer
    mappings that differ (mixed attention groups), or none at all in a list or mapping."""
    if isinstance(slot_mapping, Mapping):
        slot_mapping = list(slot_mapping.values())
    if isinstance(slot_mapping, (list, tuple)):
        if not slot_mapping or any(s is not slot_mapping[0] for s in slot_mapping):
            return None
        slot_mapping = slot_mapping[0]
    return slot_mapping if isinstance(slot_mapping, torch.Tensor) else None


def _supported(model) -> bool:
    """The drafts whose context K/V the op computes exactly as vLLM's function does."""
    cached = getattr(model, "_dflash_supported", None)
    if cached is None:
        rope = model.layers[0].self_attn.rotary_emb
        attn = model.layers[0].self_attn
        cached = (model._fused_kv_weight is not None and attn.v_scale is None
                  and model._rope_is_neox and rope.rotary_dim == model._head_dim
                  and model._rope_cos_sin_cache.dim() == 2
                  and model._rope_cos_sin_cache.shape[1] == model._head_dim)
        if not cached:
            logger.warning("dflash plugin: this DFlash draft (quantized K/V, V scale or partial / "
                           "non-NeoX RoPE) keeps vLLM's own context K/V function")
        model._dflash_supported = cached
    return cached


def _float_rope_cache(model) -> torch.Tensor:
    """vLLM's cos/sin table as float32 (the op's input), converted once."""
    table = model._rope_cos_sin_cache
    cached = getattr(model, "_dflash_rope", None)
    if cached is None or cached[0] is not table:
        cached = (table, table.float().contiguous())
        model._dflash_rope = cached
    return cached[1]


def _cache_views(model):
    """Per-layer K and V views of vLLM's KV cache tensors, rebuilt when vLLM reallocates them.

    A layer's cache is either a (key, value) pair of [num_blocks, block_size, Hkv, D] tensors
    (vllm-ascend), used as they are, or one tensor whose layout `cache_layout.probe` finds from
    the backend's own do_kv_cache_update (vLLM's CPU backend)."""
    layers = model._attn_layers
    kv_caches = [layer.kv_cache for layer in layers]
    hkv, d = model._num_kv_heads, model._head_dim
    if all(isinstance(c, (tuple, list)) and len(c) == 2 for c in kv_caches):
        if all(t.dim() == 4 and tuple(t.shape[2:]) == (hkv, d) for c in kv_caches for t in c):
            return [c[0] for c in kv_caches], [c[1] for c in kv_caches]
        return None
    if any(not isinstance(c, torch.Tensor) or c.dim() != 4 for c in kv_caches):
        return None
    key = tuple(c.data_ptr() for c in kv_caches)
    cached = getattr(model, "_dflash_views", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    attn = layers[0]
    # vLLM's CPU backend: [num_blocks, Hkv, block_size, 2 * D]
    block_size = kv_caches[0].shape[2]

    def write(k, v, cache, slots):
        attn.impl.do_kv_cache_update(attn, k, v, cache, slots)

    layout = cache_layout.probe(write, tuple(kv_caches[0].shape[1:]), block_size, hkv, d,
                                kv_caches[0].dtype)
    if layout is None:
        logger.warning("dflash plugin: the KV cache layout of %s is not one the op can write in "
                       "place; vLLM's own context K/V function runs", type(attn.impl).__name__)
        model._dflash_views = (key, None)
        return None
    pairs = [cache_layout.views(c, layout, block_size, hkv, d) for c in kv_caches]
    result = ([k for k, _ in pairs], [v for _, v in pairs])
    model._dflash_views = (key, result)
    return result
