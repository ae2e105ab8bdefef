"""Build what an engine runs on from its `EngineArgs`: the models (through a tensor-parallel
group when asked), tokenizer, paged cache, worker, and the measured cost model, including the
dtype "auto" choice (docs/design.md 4.1)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .. import host
from ..models import DFlashDraft, TargetModel, load_draft, load_target, load_tokenizer
from . import cost_model, distributed
from .args import DTYPES, EngineArgs, dtype_name
from .cache import BlockAllocator
from .cost_model import CostModel
from .speculation import expected_rate
from .worker import Worker

AUTO_DTYPES = ("bfloat16", "float32")   # float16 GEMMs have no fast CPU path
_announced: set[str] = set()
logger = logging.getLogger("dflash")


@dataclass
class Loaded:
    target: TargetModel
    draft: DFlashDraft | None
    tokenizer: object
    dtype: torch.dtype
    block_size: int
    max_num_seqs: int
    max_model_len: int
    allocator: BlockAllocator
    worker: Worker
    stop_ids: set[int]
    group: distributed.Group | None
    cost_model: CostModel | None = None   # None for a target-only or fixed-speculation engine

    def close(self) -> None:
        """Stop the tensor-parallel ranks (nothing to do without tensor parallelism)."""
        if self.group is not None:
            self.group.close()


def load(args: EngineArgs) -> Loaded:
    if args.dtype == "auto":
        return _load_fastest(args)
    loaded = _build(args, args.dtype)
    if loaded.draft is not None and args.speculation != "fixed":
        loaded.cost_model = _calibrate(args, loaded)
    return loaded


def _build(args: EngineArgs, dtype: torch.dtype) -> Loaded:
    group = None if args.tp_size == 1 else distributed.Group(
        args.tp_size, args.target, args.draft, dtype, args.device, args.tp_timeout,
        args.served_len, args.quantization, args.draft_quantization)
    try:
        return _load_models(args, dtype, group)
    except BaseException:
        if group is not None:
            group.close(kill=True)
        raise


def _load_models(args: EngineArgs, dtype: torch.dtype, group) -> Loaded:
    tp = None if group is None else group.tp
    device = args.device if group is None else group.device
    served = args.served_len   # RoPE tables cover what is served, no more
    target = load_target(args.target, dtype, device, tp, served, args.quantization)
    draft = None if args.draft is None else load_draft(args.draft, target.cfg, dtype, device,
                                                       served, args.draft_quantization)
    tokenizer = args.tokenizer if args.tokenizer is not None else load_tokenizer(args.target)
    block_size = args.block_size
    if block_size is None:
        block_size = 1 if draft is None else draft.cfg.block_size
    if block_size < 1 or (draft is not None and block_size < 2):
        raise ValueError(f"block_size must be >= 2 with a draft (>= 1 without), "
                         f"got {block_size}")
    # a RoPE table holds min(served, the model's max_position_embeddings) rows
    limits = {name: m.cos_sin.shape[0] for name, m in (("target", target), ("draft", draft))
              if m is not None}
    for name, rows in limits.items():
        if args.max_model_len is not None and rows < args.max_model_len:
            raise ValueError(f"max_model_len {args.max_model_len} is beyond the {name}'s "
                             f"max_position_embeddings ({rows}); unset, it is the longest "
                             f"the models reach")
    max_model_len = min(served, *limits.values())
    if max_model_len <= block_size:
        raise ValueError(f"max_model_len must be above the block size ({block_size}: a "
                         f"{'draft block' if draft is not None else 'token'} after a prompt "
                         f"token), got {max_model_len}")
    num_blocks = args.num_kv_blocks
    if num_blocks is None:
        num_blocks = args.max_num_seqs * -(-(max_model_len + block_size) // args.kv_block_size)
    # the caches first: a block count too large to hold fails there, before the allocator
    # lists every block id
    worker_args = (target, draft, num_blocks, args.kv_block_size, block_size,
                   args.draft_sampling)
    worker = Worker(*worker_args) if group is None else group.worker(*worker_args)
    allocator = BlockAllocator(num_blocks, args.kv_block_size)
    stop_ids = set(target.cfg.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        stop_ids.add(tokenizer.eos_token_id)
    return Loaded(target, draft, tokenizer, dtype, block_size, args.max_num_seqs, max_model_len,
                  allocator, worker, stop_ids, group)


def _cost_key(args: EngineArgs, name: str) -> dict:
    """The calibration cache key of this configuration in dtype `name` (from the arguments
    alone, so a cached choice needs no model loaded)."""
    shape = {k: getattr(args, k) for k in ("tp_size", "max_num_seqs", "block_size",
                                           "kv_block_size", "max_model_len", "num_kv_blocks",
                                           "draft_sampling", "quantization",
                                           "draft_quantization")}
    return cost_model.cache_key(args.target, args.draft, name, device=str(args.device), **shape)


def _calibrate(args: EngineArgs, loaded: Loaded) -> CostModel:
    """`loaded`'s cost model; on an error (e.g. while measuring) its tensor-parallel ranks are
    stopped, as nobody else gets to close it."""
    try:
        key = _cost_key(args, dtype_name(loaded.dtype))
        model = None if args.recalibrate else cost_model.load(key)
        if model is None:
            model = cost_model.calibrate(loaded.worker, loaded.allocator, loaded.max_num_seqs,
                                         loaded.block_size, loaded.max_model_len)
            cost_model.save(key, model)
            model = CostModel.from_json(model.to_json())   # as the next start will read it
        return model
    except BaseException:
        loaded.close()
        raise


def _load_fastest(args: EngineArgs) -> Loaded:
    """dtype "auto": the dtype whose measured costs decode fastest (an accelerator: bf16)."""
    if torch.device(args.device).type != "cpu":
        loaded = _build(args, torch.bfloat16)
        loaded.cost_model = _calibrate(args, loaded)
        return loaded
    # the cached measurements decide without loading anything; missing ones are measured
    models = {name: None if args.recalibrate else cost_model.load(_cost_key(args, name))
              for name in AUTO_DTYPES}
    loaded = None
    for name in AUTO_DTYPES:
        if models[name] is None:
            if loaded is not None:   # the previous candidate goes before the next one loads
                loaded.close()
            loaded = _build(args, DTYPES[name])
            models[name] = loaded.cost_model = _calibrate(args, loaded)
    rates = {name: expected_rate(m, m.block_size, args.max_num_seqs)
             for name, m in models.items()}
    best = max(rates, key=lambda name: rates[name][0] * rates[name][1])
    if loaded is None or loaded.dtype != DTYPES[best]:
        if loaded is not None:
            loaded.close()
        loaded = _build(args, DTYPES[best])
    loaded.cost_model = models[best]
    _announce(f"dtype auto -> {best} on {host.summary()}: expected tok/s at concurrency "
              f"1 / {args.max_num_seqs} " + ", ".join(
                  f"{name} {r[0]:.1f} / {r[1]:.1f}" for name, r in rates.items())
              + f" ({'DFlash' if loaded.draft is not None else 'target only'}, from the "
              "cost model measured on this host)")
    return loaded


def _announce(message: str) -> None:
    """Log `message` (info) once per process."""
    if message not in _announced:
        _announced.add(message)
        logger.info(message)
