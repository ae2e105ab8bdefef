"""`dflash.LLM`: load a target (and optionally a DFlash draft) and generate (docs/design.md 4.1):
the offline facade over an `LLMEngine`."""

from __future__ import annotations

import numbers
import time
from collections.abc import Sequence
from functools import partial

import torch

from ..sampling import SamplingParams
from .args import EngineArgs
from .engine import LLMEngine
from .request import RequestOutput


def _from_engine(name: str) -> property:
    return property(lambda self: getattr(self.engine, name),
                    doc=f"The engine's `{name}` (`LLMEngine.{name}`).")


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
        max_model_len: longest sequence (prompt + output) served; default min(4096, the
            target's and the draft's max_position_embeddings). Beyond those it is an error.
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
            run fails (and, at start, rank 0 for the others to load once it has).
        speculation: "adaptive" (default): every step, the sequences whose drafts pay under
            `cost_model` and their acceptance so far verify a tree of the draft's best
            candidates, sized by the same cost model from the draft's own confidence
            (docs/design.md 4.6); the draft forward is skipped when none would pay. Sampled
            drafts (draft_sampling="sample") verify chains. "chain": each sequence verifies the
            number of argmax drafts (0..B-1) that maximises expected tokens per second.
            "fixed": every sequence verifies all B-1 drafts (the published DFlash schedule).
        recalibrate: measure the cost model again instead of reading its cache (kept in
            $DFLASH_CALIBRATION_DIR, default ~/.cache/dflash/calibration).
        quantization: None (default: the target's GEMM weights in `dtype`), "int8" or "int4":
            its dense linear weights and lm_head quantized on load per output column and group
            of 32 inputs, in llama.cpp's Q8_0 / Q4_1 forms (docs/design.md 4.7; CPU). The draft
            stays in `dtype` unless `draft_quantization` says otherwise.
        draft_quantization: None (default) or "int8" / "int4": the draft's block GEMM weights
            quantized the same way. It only proposes, so this moves acceptance (a little) and
            its pass's cost, never the output.

    Attributes: `engine` (the `LLMEngine` it drives) and, read from it, `target`, `draft`,
    `tokenizer`, `dtype` (the torch dtype in use), `block_size`, `max_num_seqs`,
    `max_model_len`, `worker`, `allocator`, `cost_model` (`dflash.engine.cost_model.CostModel`,
    measured at start and cached; None for a target-only engine of a given dtype, which has
    nothing to choose) and `planner` (the verify-size chooser, None unless adaptive or chain).
    """

    def __init__(self, target, draft=None, dtype: str | torch.dtype = "auto",
                 device: str = "cpu", max_num_seqs: int = 8, block_size: int | None = None,
                 kv_block_size: int = 16, max_model_len: int | None = None,
                 num_kv_blocks: int | None = None, draft_sampling: str = "greedy",
                 cp_size: int = 1, tokenizer=None, tp_size: int = 1, tp_timeout: float = 300.0,
                 speculation: str = "adaptive", recalibrate: bool = False,
                 quantization: str | None = None, draft_quantization: str | None = None):
        self.engine = LLMEngine(EngineArgs(
            target, draft, dtype, device, max_num_seqs, block_size, kv_block_size, max_model_len,
            num_kv_blocks, draft_sampling, cp_size, tokenizer, tp_size, tp_timeout, speculation,
            recalibrate, quantization, draft_quantization))

    target = _from_engine("target")
    draft = _from_engine("draft")
    tokenizer = _from_engine("tokenizer")
    dtype = _from_engine("dtype")
    block_size = _from_engine("block_size")
    max_num_seqs = _from_engine("max_num_seqs")
    max_model_len = _from_engine("max_model_len")
    worker = _from_engine("worker")
    allocator = _from_engine("allocator")
    cost_model = _from_engine("cost_model")
    planner = _from_engine("planner")

    def chat_prompt(self, message: str) -> str:
        """`message` as a single-turn chat with the generation prompt, via the tokenizer's
        chat template."""
        return self.engine.processor.chat_prompt(message)

    def encode(self, prompt) -> list[int]:
        """The token ids `generate` runs for `prompt` (a string, or token ids it checks)."""
        return self.engine.processor.encode(prompt)

    def generate(self, prompts: Sequence, sampling_params: SamplingParams |
                 Sequence[SamplingParams] | None = None, use_tqdm: bool = False,
                 on_tokens=None) -> list[RequestOutput]:
        """Generate for every prompt (a string, or a list of token ids); outputs in prompt order.

        `on_tokens(request_index, new_token_ids)` is called as tokens are committed (streaming).
        The engine must have no unfinished requests of its own (added through `engine`).
        """
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and
                                        isinstance(prompts[0], numbers.Number)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a string, a list of token ids or a list of "
                            f"those, got {type(prompts).__name__}")
        params = SamplingParams() if sampling_params is None else sampling_params
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        bad = [params] if not isinstance(params, (list, tuple)) else \
            [sp for sp in params if not isinstance(sp, SamplingParams)]
        if bad:
            raise TypeError(f"sampling_params must be SamplingParams or a list of them, "
                            f"got {type(bad[0]).__name__}")
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        engine, index = self.engine, {}
        if engine.has_unfinished():   # their outputs would be someone else's to collect
            raise RuntimeError(f"LLM.generate needs the engine to itself: requests added "
                               f"through llm.engine are unfinished ({engine.num_waiting} "
                               f"waiting, {engine.num_running} running); step or abort them")
        outputs: list[RequestOutput | None] = [None] * len(prompts)
        progress = _progress(len(prompts)) if use_tqdm else None
        arrival = time.perf_counter()
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                stream = None if on_tokens is None else partial(on_tokens, i)
                index[engine.add_request(p, sp, arrival_time=arrival, on_tokens=stream)] = i
            while engine.has_unfinished():
                for out in engine.step():
                    if out.finished:
                        outputs[index[out.request_id]] = out.output
                        if progress is not None:
                            progress.update(1)
        finally:
            if progress is not None:
                progress.close()
            if any(out is None for out in outputs):   # an error: leave nothing queued behind
                for request_id in index:
                    engine.abort(request_id)
                while engine.has_unfinished():
                    engine.step()
        return outputs

    def metrics(self) -> dict:
        """Totals over every request generated so far."""
        return self.engine.metrics()

    def reset_metrics(self) -> None:
        self.engine.reset_metrics()

    def close(self) -> None:
        """Stop the tensor-parallel ranks (nothing to do without tensor parallelism)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req")
