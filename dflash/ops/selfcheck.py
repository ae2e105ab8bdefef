"""`dflash selfcheck`: run each op's serving implementation against the PyTorch reference."""

from __future__ import annotations

import torch

from .. import ops
from . import cases, reference

CASES = {
    "context_kv": lambda dtype: cases.context_kv_inputs(
        n=24, d_in=256, h=128, layers=2, hkv=2, d=64, num_blocks=8, block_size=16, dtype=dtype,
        stacked=True, skip_every=5),
    "paged_attention": lambda dtype: cases.paged_attention_inputs(
        context_lens=(37, 5, 0), query_lens=(16, 16, 16), hq=8, hkv=2, d=64, block_size=16,
        dtype=dtype),
    "rejection_sample": lambda dtype: cases.rejection_sample_inputs(bs=4, k=15, v=1000),
    "philox_bits": lambda dtype: cases.philox_bits_inputs(),
    "top_k": lambda dtype: cases.top_k_inputs(dtype),
    **{op: lambda dtype, make=make: make(dtype) for op, make in cases.LAYER_OP_INPUTS.items()},
}


def _outputs(op: str, args: dict, result) -> torch.Tensor:
    """Everything the op produced: its results and the caches it writes, flattened."""
    tensors = [] if op == "context_kv" else \
        [result] if isinstance(result, torch.Tensor) else list(result)
    for name in ("key_caches", "value_caches", "key_cache", "value_cache"):
        tensors += args[name] if isinstance(args.get(name), list) else \
            [args[name]] if name in args else []
    return torch.cat([t.double().flatten() for t in tensors])   # exact for 32-bit words too


def _clone(args: dict) -> dict:
    return {k: ([t.clone() for t in v] if isinstance(v, list) else
                v.clone() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}


def run() -> bool:
    """Print one line per (op, dtype); True when every implementation agrees with the reference."""
    ok = True
    for op, make in CASES.items():
        exact = op in ("rejection_sample", "philox_bits")   # integer results: no dtype, no slack
        dtypes = (torch.float32,) if exact else (torch.float32, torch.bfloat16)
        for dtype in dtypes:
            args = make(dtype)
            got_args, want_args = _clone(args), _clone(args)
            got = _outputs(op, got_args, getattr(torch.ops.dflash, op)(**got_args))
            want = _outputs(op, want_args, getattr(reference, op)(**want_args))
            err = (got - want).abs().nan_to_num(0.0).max().item()
            same_nans = torch.equal(got.isnan(), want.isnan())
            tol = 0.0 if exact else (1e-5 if dtype == torch.float32 else 2e-2)
            good = err <= tol and same_nans
            ok &= good
            print(f"{op:17s} {str(dtype):15s} {ops.implementation(op):16s} "
                  f"max |err| = {err:.2e}  {'ok' if good else 'MISMATCH'}")
    return ok
