"""Loads the compiled operator library and completes the `torch.ops.dflash` registrations.

* `dflash._C` holds the schemas (csrc/registry.cpp).
* CPU kernels are compiled once per CPU capability (`dflash._cpu_kernels_<cap>`); the best one
  this host supports (as ATen sees it, so `ATEN_CPU_CAPABILITY` lowers it too) is loaded.
* Every op gets a fake (meta) implementation here, so `torch.compile` and graph capture can
  trace it.
* An op without a compiled CPU kernel falls back to its PyTorch reference for the CPU key. The
  layer ops, philox_bits and top_k (CPU_ONLY_OPS) have CPU kernels only; their reference serves
  every other device.
* When the NPU build (`setup.py --device npu`) produced `dflash._npu_kernels`, torch_npu is
  imported and that library registers the PrivateUse1 (NPU) kernels. A CPU-only install never
  imports torch_npu.
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings

import torch

from .. import _C  # noqa: F401  (registers the schemas)
from . import checks, reference
from .packing import PANEL

LAYER_OPS = ("rms_norm", "add_rms_norm", "silu_and_mul", "rope", "qkv_rope_cache",
             "panel_linear", "quant_linear")
OPS = ("context_kv", "paged_attention", "rejection_sample", "philox_bits", "top_k", *LAYER_OPS)
# ops with CPU kernels only: their reference serves every other device
CPU_ONLY_OPS = ("philox_bits", "top_k", *LAYER_OPS)
# ops composed of the others in C++ for every device (CompositeImplicitAutograd): no kernel,
# reference or fake of their own
COMPOSITE_OPS = ("decoder_layer",)
# ops with an overload into caller-owned outputs (`.out`), for graph capture
OUT_OPS = ("paged_attention", "rejection_sample")
_CAPABILITY_ORDER = ("AVX512", "AVX2", "DEFAULT")


def _load_cpu_kernels() -> str | None:
    host = torch.backends.cpu.get_cpu_capability()
    usable = _CAPABILITY_ORDER[_CAPABILITY_ORDER.index(host):] if host in _CAPABILITY_ORDER \
        else ("DEFAULT",)
    for cap in usable:
        spec = importlib.util.find_spec(f"dflash._cpu_kernels_{cap.lower()}")
        if spec is not None and spec.origin is not None:
            torch.ops.load_library(spec.origin)
            return cap
    return None


def _load_npu_kernels() -> str | None:
    """Path of the NPU kernel library if one was built and loaded, else None."""
    spec = importlib.util.find_spec("dflash._npu_kernels")
    if spec is None or spec.origin is None:
        return None
    try:
        import torch_npu  # noqa: F401  (registers the NPU device, PrivateUse1, with torch)

        torch.ops.load_library(spec.origin)
    except (ImportError, OSError, RuntimeError) as e:  # e.g. CANN set_env.sh not sourced
        warnings.warn(f"dflash: NPU kernels {spec.origin} not loaded ({e}); "
                      "only the CPU implementations are available", RuntimeWarning, stacklevel=2)
        return None
    return spec.origin


def has_kernel(op: str, dispatch_key: str = "CPU") -> bool:
    """True when a compiled kernel (not the Python reference fallback) serves `op`."""
    return op not in _REFERENCE_FALLBACKS.get(dispatch_key, set()) and \
        torch._C._dispatch_has_kernel_for_dispatch_key(f"dflash::{op}", dispatch_key)


CPU_CAPABILITY = _load_cpu_kernels()
NPU_KERNELS = _load_npu_kernels()
_REFERENCE_FALLBACKS: dict[str, set[str]] = {"CPU": set()}

for _op in OPS:
    if not torch._C._dispatch_has_kernel_for_dispatch_key(f"dflash::{_op}", "CPU"):
        torch.library.register_kernel(f"dflash::{_op}", "cpu", getattr(reference, _op))
        _REFERENCE_FALLBACKS["CPU"].add(_op)
for _op in OUT_OPS:
    if not torch._C._dispatch_has_kernel_for_dispatch_key(f"dflash::{_op}.out", "CPU"):
        torch.library.register_kernel(f"dflash::{_op}.out", "cpu", getattr(reference, f"{_op}_out"))
        _REFERENCE_FALLBACKS["CPU"].add(f"{_op}.out")
for _op in CPU_ONLY_OPS:   # every device without its own kernel (CompositeExplicitAutograd)
    torch.library.register_kernel(f"dflash::{_op}", None, getattr(reference, _op))


@torch.library.register_fake("dflash::context_kv")
def _context_kv_fake(hidden, fc_weight, hidden_norm_weight, kv_weight, kv_bias, k_norm_weight,
                     positions, cos_sin_cache, slot_mapping, key_caches, value_caches, eps,
                     check=True):
    checks.context_kv_meta(hidden, fc_weight, hidden_norm_weight, kv_weight, kv_bias,
                           k_norm_weight, positions, cos_sin_cache, slot_mapping, key_caches,
                           value_caches, eps)


@torch.library.register_fake("dflash::paged_attention")
def _paged_attention_fake(query, key, value, key_cache, value_cache, block_table, context_lens,
                          cu_query_lens, scale, causal, check=True, tree_mask=None):
    checks.paged_attention_meta(query, key, value, key_cache, value_cache, block_table,
                                context_lens, cu_query_lens, scale, causal, tree_mask)
    return torch.empty_like(query)


@torch.library.register_fake("dflash::paged_attention.out")
def _paged_attention_out_fake(query, key, value, key_cache, value_cache, block_table,
                              context_lens, cu_query_lens, scale, causal, check=True,
                              tree_mask=None, *, out):
    checks.paged_attention_meta(query, key, value, key_cache, value_cache, block_table,
                                context_lens, cu_query_lens, scale, causal, tree_mask)
    checks.paged_attention_out(query, out)


@torch.library.register_fake("dflash::rejection_sample")
def _rejection_sample_fake(draft_token_ids, draft_probs, target_probs, is_greedy, uniform,
                           exponential, check=True):
    checks.rejection_sample_meta(draft_token_ids, draft_probs, target_probs, is_greedy, uniform,
                                 exponential)
    bs, k = draft_token_ids.shape
    return draft_token_ids.new_empty(bs, k + 1), draft_token_ids.new_empty(bs)


@torch.library.register_fake("dflash::rejection_sample.out")
def _rejection_sample_out_fake(draft_token_ids, draft_probs, target_probs, is_greedy, uniform,
                               exponential, check=True, *, output_token_ids, num_accepted):
    checks.rejection_sample_meta(draft_token_ids, draft_probs, target_probs, is_greedy, uniform,
                                 exponential)
    checks.rejection_sample_out(draft_token_ids, output_token_ids, num_accepted)


@torch.library.register_fake("dflash::philox_bits")
def _philox_bits_fake(seeds, offsets, stream, rows, n, check=True):
    checks.philox_bits_meta(seeds, offsets, stream, rows, n)
    return seeds.new_empty(seeds.shape[0], rows, n)


@torch.library.register_fake("dflash::top_k")
def _top_k_fake(x, k, probs):
    checks.top_k_meta(x, k)
    shape = (*x.shape[:-1], k)
    return x.new_empty(shape, dtype=torch.float32), x.new_empty(shape, dtype=torch.int64)


@torch.library.register_fake("dflash::rms_norm")
def _rms_norm_fake(x, weight, eps):
    checks.rms_norm_meta(x, weight, eps)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("dflash::add_rms_norm")
def _add_rms_norm_fake(x, residual, weight, eps):
    checks.add_rms_norm_meta(x, residual, weight, eps)
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(x, memory_format=torch.contiguous_format))


@torch.library.register_fake("dflash::silu_and_mul")
def _silu_and_mul_fake(x):
    checks.silu_and_mul_meta(x)
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)


@torch.library.register_fake("dflash::rope")
def _rope_fake(x, cos_sin):
    checks.rope_meta(x, cos_sin)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("dflash::qkv_rope_cache")
def _qkv_rope_cache_fake(qkv, q_norm_weight, k_norm_weight, cos_sin, key_cache, value_cache,
                         slot_mapping, num_heads, eps, check=True):
    checks.qkv_rope_cache_meta(qkv, q_norm_weight, k_norm_weight, cos_sin, key_cache,
                               value_cache, slot_mapping, num_heads, eps)
    t, (hkv, d) = qkv.shape[0], key_cache.shape[2:]
    return qkv.new_empty(t, num_heads, d), qkv.new_empty(t, hkv, d), qkv.new_empty(t, hkv, d)


@torch.library.register_fake("dflash::panel_linear")
def _panel_linear_fake(x, weight_panels, bias):
    checks.panel_linear_meta(x, weight_panels, bias)
    return x.new_empty(*x.shape[:-1], weight_panels.shape[0] * PANEL)


@torch.library.register_fake("dflash::quant_linear")
def _quant_linear_fake(x, weight, scales, mins, bias):
    checks.quant_linear_meta(x, weight, scales, mins, bias)
    return x.new_empty(*x.shape[:-1], weight.shape[0] * PANEL)
