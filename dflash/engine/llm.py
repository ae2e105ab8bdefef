"""`dflash.LLM`: load a target (and optionally a DFlash draft) and generate (docs/design.md 4.1)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from .. import host, sampling
from ..models import load_draft, load_target, load_tokenizer
from ..sampling import SamplingParams
from . import cost_model, distributed
from .cache import BlockAllocator
from .cost_model import CostModel
from .detokenizer import IncrementalDetokenizer, decode
from .engine import LLMEngine
from .request import Request, RequestOutput, Totals
from .speculation import Planner, expected_rate
from .worker import Worker

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
AUTO_DTYPES = ("bfloat16", "float32")   # float16 GEMMs have no fast CPU path
_announced: set[str] = set()
logger = logging.getLogger("dflash")


class LLM:
    """Speculative decoding engine with continuous batching over paged caches.

    Args:
        target: Hugging Face directory or GGUF file of the target model.
        draft: DFlashDraftModel directory, or None for target-only decoding (the baseline).
        dtype: "auto" (default: on CPU, the one of bfloat16 / float32 that the host's measured
            costs say decodes fastest; bfloat16 on an accelerator), "bfloat16", "float16" or
            "float32" (always honoured).
        max_num_seqs: sequences decoded together (continuous batching).
        block_size: DFlash block size B (default: the draft's; 1 without a draft).
        kv_block_size: tokens per paged-cache block.
        max_model_len: longest sequence (prompt + output) served; default min(4096, the target's
            max_position_embeddings).
        num_kv_blocks: cache blocks shared by all sequences; default enough for max_num_seqs
            sequences of max_model_len tokens. A request is admitted only once the blocks for
            its whole length (prompt + max_tokens + one block, capped by max_model_len) are
            free, so running requests never run out: the others wait.
        draft_sampling: "greedy" (argmax drafts, one-hot proposals) or "sample" (drafts sampled
            from the draft's processed distribution, dense proposals).
        tp_size: tensor-parallel ranks for the target (`dflash.engine.distributed`): this process
            is rank 0 and spawns the others (on CPU they share the cores; on an accelerator rank
            r uses device r). Must divide num_key_value_heads (and intermediate_size /
            num_experts). Release them with `close()` (or use the LLM as a context manager).
        tp_timeout: seconds a tensor-parallel collective waits for the other ranks before the
            run fails.
        speculation: "adaptive" (default): every step, each sequence verifies the number of
            drafts (0..B-1) that maximises expected tokens per second under `cost_model` and
            its acceptance so far; the draft forward is skipped when none verifies any. "fixed":
            every sequence verifies all B-1 drafts (the published DFlash schedule).
        recalibrate: measure the cost model again instead of reading its cache.

    Attributes: `cost_model` (`dflash.engine.cost_model.CostModel`, measured at start and
    cached; None for a target-only engine of a given dtype, which has nothing to choose),
    `dtype` (the torch dtype in use), `planner` (the verify-length chooser, None unless adaptive).
    """

    def __init__(self, target, draft=None, dtype: str | torch.dtype = "auto",
                 device: str = "cpu", max_num_seqs: int = 8, block_size: int | None = None,
                 kv_block_size: int = 16, max_model_len: int | None = None,
                 num_kv_blocks: int | None = None, draft_sampling: str = "greedy",
                 cp_size: int = 1, tokenizer=None, tp_size: int = 1, tp_timeout: float = 300.0,
                 speculation: str = "adaptive", recalibrate: bool = False):
        if cp_size != 1:
            raise ValueError(f"context parallelism (cp_size={cp_size}) is not supported; "
                             "use cp_size=1")
        if not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tp_size must be an integer >= 1, got {tp_size!r}")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if speculation not in ("adaptive", "fixed"):
            raise ValueError(f"speculation must be 'adaptive' or 'fixed', got {speculation!r}")
        if dtype != "auto":
            dtype = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
            if dtype not in DTYPES.values():
                raise ValueError(f"dtype must be 'auto' or one of {list(DTYPES)}, got {dtype!r}")
        self.speculation = speculation
        self._config = dict(target=target, draft=draft, device=device, max_num_seqs=max_num_seqs,
                            block_size=block_size, kv_block_size=kv_block_size,
                            max_model_len=max_model_len, num_kv_blocks=num_kv_blocks,
                            draft_sampling=draft_sampling, tokenizer=tokenizer, tp_size=tp_size,
                            tp_timeout=tp_timeout)
        self._group = None
        if dtype == "auto":
            self._build_fastest(recalibrate)
        else:
            self._build(dtype)
            needs_costs = self.draft is not None and speculation == "adaptive"
            self.cost_model = self._calibrate(recalibrate) if needs_costs else None
        self.planner = None if self.cost_model is None or self.draft is None or \
            speculation == "fixed" else Planner(self.block_size - 1, self.cost_model)

    def _build(self, torch_dtype: torch.dtype) -> None:
        c = self._config
        self._group = None if c["tp_size"] == 1 else distributed.Group(
            c["tp_size"], c["target"], c["draft"], torch_dtype, c["device"], c["tp_timeout"],
            c["max_model_len"] or 4096)
        try:
            self._init(c["target"], c["draft"], torch_dtype, c["device"], c["max_num_seqs"],
                       c["block_size"], c["kv_block_size"], c["max_model_len"],
                       c["num_kv_blocks"], c["draft_sampling"], c["tokenizer"])
        except BaseException:
            if self._group is not None:
                self._group.close(kill=True)
            raise

    def _cost_key(self, dtype_name: str) -> dict:
        """The calibration cache key of this engine's configuration in `dtype_name` (from the
        arguments alone, so a cached choice needs no model loaded)."""
        c = self._config
        shape = {k: c[k] for k in ("tp_size", "max_num_seqs", "block_size", "kv_block_size",
                                   "max_model_len", "num_kv_blocks", "draft_sampling")}
        return cost_model.cache_key(c["target"], c["draft"], dtype_name,
                                    device=str(c["device"]), **shape)

    def _calibrate(self, recalibrate: bool) -> CostModel:
        key = self._cost_key(_dtype_name(self.dtype))
        model = None if recalibrate else cost_model.load(key)
        if model is None:
            model = cost_model.calibrate(self.worker, self.allocator, self.max_num_seqs,
                                         self.block_size, self.max_model_len)
            cost_model.save(key, model)
            model = CostModel.from_json(model.to_json())   # as the next start will read it
        return model

    def _build_fastest(self, recalibrate: bool) -> None:
        """dtype="auto": the dtype whose measured costs decode fastest (an accelerator: bf16)."""
        if torch.device(self._config["device"]).type != "cpu":
            self._build(torch.bfloat16)
            self.cost_model = self._calibrate(recalibrate)
            return
        # the cached measurements decide without loading anything; missing ones are measured
        models = {name: None if recalibrate else cost_model.load(self._cost_key(name))
                  for name in AUTO_DTYPES}
        built = None
        for name in AUTO_DTYPES:
            if models[name] is None:
                if built is not None:   # the previous candidate goes before the next one loads
                    self.close()
                self._build(DTYPES[name])
                built, models[name] = name, self._calibrate(recalibrate)
        rates = {name: expected_rate(m, m.block_size, self._config["max_num_seqs"])
                 for name, m in models.items()}
        best = max(rates, key=lambda name: rates[name][0] * rates[name][1])
        if best != built:
            if built is not None:
                self.close()
            self._build(DTYPES[best])
        self.cost_model = models[best]
        _announce(f"dtype auto -> {best} on {host.summary()}: expected tok/s at concurrency "
                  f"1 / {self.max_num_seqs} " + ", ".join(
                      f"{name} {r[0]:.1f} / {r[1]:.1f}" for name, r in rates.items())
                  + f" ({'DFlash' if self.draft is not None else 'target only'}, from the "
                  "cost model measured on this host)")

    def _init(self, target, draft, torch_dtype, device, max_num_seqs, block_size, kv_block_size,
              max_model_len, num_kv_blocks, draft_sampling, tokenizer):
        tp = None if self._group is None else self._group.tp
        if tp is not None:
            device = self._group.device
        self.dtype = torch_dtype
        served = max_model_len or 4096   # RoPE tables cover what is served, no more
        self.target = load_target(target, torch_dtype, device, tp, served)
        self.draft = None if draft is None else load_draft(draft, self.target.cfg, torch_dtype,
                                                           device, served)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(target)
        if block_size is None:
            block_size = 1 if self.draft is None else self.draft.cfg.block_size
        if block_size < 1 or (self.draft is not None and block_size < 2):
            raise ValueError(f"block_size must be >= 2 with a draft (>= 1 without), "
                             f"got {block_size}")
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        limit = self.target.cos_sin.shape[0]
        if self.draft is not None:
            limit = min(limit, self.draft.cos_sin.shape[0])
        self.max_model_len = min(max_model_len or 4096, limit)
        blocks_per_seq = -(-(self.max_model_len + block_size) // kv_block_size)
        self.allocator = BlockAllocator(num_kv_blocks or max_num_seqs * blocks_per_seq,
                                        kv_block_size)
        worker_args = (self.target, self.draft, self.allocator.num_blocks, kv_block_size,
                       block_size, draft_sampling)
        self.worker = Worker(*worker_args) if tp is None else self._group.worker(*worker_args)
        self.stop_ids = set(self.target.cfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.stop_ids.add(self.tokenizer.eos_token_id)
        self.proposer = None     # tests may script the drafts (see Worker.step)
        self._next_id = 0
        self.reset_metrics()

    # ---------------------------------------------------------------------------- prompts
    def chat_prompt(self, message: str) -> str:
        """`message` as a single-turn chat with the generation prompt, via the tokenizer's
        chat template."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("the target has no tokenizer chat template")
        return self.tokenizer.apply_chat_template([{"role": "user", "content": message}],
                                                  tokenize=False, add_generation_prompt=True)

    def encode(self, prompt) -> list[int]:
        """The token ids `generate` runs for `prompt` (a string, or token ids it validates)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this target has no tokenizer: pass prompts as token id lists")
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        ids = [int(t) for t in prompt]
        vocab = self.target.cfg.vocab_size
        if not ids:
            raise ValueError("empty prompt")
        if not all(0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        return ids

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError, naming the sizes, if a request of these prompt tokens and params
        can never run here (too long for max_model_len or for the whole cache)."""
        if len(prompt_ids) + self.block_size > self.max_model_len:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit: prompt + one "
                             f"block of {self.block_size} exceeds max_model_len "
                             f"{self.max_model_len}")
        if self.allocator.blocks_for(self._reservation(len(prompt_ids), params)) > \
                self.allocator.num_blocks:
            raise ValueError(f"request of {len(prompt_ids)} prompt tokens + max_tokens "
                             f"{params.max_tokens} does not fit in the {self.allocator.num_blocks}"
                             f" cache blocks of {self.allocator.block_size} tokens: raise "
                             "num_kv_blocks or lower max_tokens")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (this target has none)")

    def _request(self, prompt, params: SamplingParams, detokenize: bool = False) -> Request:
        ids = self.encode(prompt)
        self.validate(ids, params)
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else self.stop_ids)
        detok = IncrementalDetokenizer(self.tokenizer, params.stop) if self.tokenizer is not None \
            and (detokenize or params.stop) else None
        request = Request(self._next_id, ids, params, sampling.request_seed(params),
                          frozenset(stop), detok)
        self._next_id += 1
        return request

    def _reservation(self, prompt_len: int, params: SamplingParams) -> int:
        """Cache tokens a request may ever need: its longest length plus one verify block."""
        return min(prompt_len + params.max_tokens, self.max_model_len) + self.block_size

    # --------------------------------------------------------------------------- generate
    def generate(self, prompts: Sequence, sampling_params: SamplingParams |
                 Sequence[SamplingParams] | None = None, use_tqdm: bool = False,
                 on_tokens=None) -> list[RequestOutput]:
        """Generate for every prompt (a string, or a list of token ids); outputs in prompt order.

        `on_tokens(request_index, new_token_ids)` is called as tokens are committed (streaming).
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        index = {}
        engine = LLMEngine(self, on_tokens=None if on_tokens is None else
                           lambda request_id, new: on_tokens(index[request_id], new))
        for i, (p, sp) in enumerate(zip(prompts, params)):
            index[engine.add_request(p, sp)] = i
        outputs: list[RequestOutput | None] = [None] * len(index)
        progress = _progress(len(index)) if use_tqdm else None
        start = time.perf_counter()
        for r in engine.waiting:
            r.metrics.arrival_time = start
        try:
            while engine.has_unfinished():
                for out in engine.step():
                    if out.finished:
                        outputs[index[out.request_id]] = out.output
                        if progress is not None:
                            progress.update(1)
        finally:
            if progress is not None:
                progress.close()
        self.totals.elapsed_s += time.perf_counter() - start
        return outputs

    def _plan(self, running: list[Request]) -> list[int]:
        if self.block_size == 1:
            return [0] * len(running)
        if self.planner is None:
            return [self.block_size - 1] * len(running)
        return self.planner.plan(running)

    def _record(self, running: list[Request], num_drafts: list[int], accepted: list[int],
                seconds: float):
        if self.planner is not None:
            self.planner.observe(running, num_drafts, accepted)
            self.planner.observe_time(num_drafts, seconds)
        self._steps += 1
        self._draft_skipped += self.block_size > 1 and not any(num_drafts)
        for r, k, a in zip(running, num_drafts, accepted):
            self._verify_lengths[k] += 1
            if k > 0:
                r.metrics.record_step(k, a)

    def _output(self, r: Request) -> RequestOutput:
        text = r.detok.text if r.detok is not None else None if self.tokenizer is None else \
            decode(self.tokenizer, r.output_ids)
        return RequestOutput(r.request_id, r.prompt_ids, r.output_ids, text, r.finish_reason,
                             r.metrics, r.stop_reason, r.error)

    # ---------------------------------------------------------------------------- metrics
    def metrics(self) -> dict:
        """Totals over every request generated so far."""
        t = self.totals
        per_position = (t.accepted_per_position + [0] * self.block_size)[:self.block_size - 1]
        tau = 1 + t.num_accepted_tokens / t.num_drafts if t.num_drafts else 1.0
        generated = t.generated_tokens
        return {
            "requests": t.requests,
            "num_drafts": t.num_drafts,
            "num_draft_tokens": t.num_draft_tokens,
            "num_accepted_tokens": t.num_accepted_tokens,
            "accepted_per_position": per_position,
            "mean_acceptance_length": tau,
            "draft_acceptance_rate": (tau - 1) / (self.block_size - 1) if self.block_size > 1
            else 0.0,
            "generated_tokens": generated,
            "elapsed_s": t.elapsed_s,
            "throughput_tok_s": generated / t.elapsed_s if t.elapsed_s else 0.0,
            "mean_ttft_s": t.ttft_sum / t.ttft_count if t.ttft_count else None,
            "mean_tpot_s": t.tpot_sum / t.tpot_count if t.tpot_count else None,
            "dtype": _dtype_name(self.dtype),
            "speculation": "none" if self.block_size == 1 else
            "adaptive" if self.planner is not None else "fixed",
            "decode_steps": self._steps,
            "draft_skipped_steps": self._draft_skipped,
            # request-steps that verified k drafts, k = 0..B-1
            "verify_length_histogram": list(self._verify_lengths),
            "cost_model": None if self.cost_model is None else self.cost_model.to_json(),
            # the planner's fit of measured step time to the cost model's decode and
            # speculation parts (tests may plan with a stand-in that has none)
            "cost_model_correction": None if getattr(self.planner, "time", None) is None else
            self.planner.time.as_dict(),
        }

    def reset_metrics(self) -> None:
        self.totals = Totals()
        self._steps = self._draft_skipped = 0
        self._verify_lengths = [0] * self.block_size

    # ------------------------------------------------------------------------------ close
    def close(self) -> None:
        """Stop the tensor-parallel ranks (nothing to do without tensor parallelism)."""
        if self._group is not None:
            self._group.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, d in DTYPES.items() if d == dtype)


def _announce(message: str) -> None:
    """Log `message` (info) once per process."""
    if message not in _announced:
        _announced.add(message)
        logger.info(message)


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req")
