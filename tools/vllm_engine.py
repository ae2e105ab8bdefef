"""Run vLLM (its CPU build) with or without DFlash and the dflash plugin on one pair of models.

Used by bench/bench_vllm.py and the `vllm` tests; needs the environment of .ci/vllm-env. Modes:

- `stock`: vLLM's DFlash drafter as shipped (no plugin loaded: VLLM_PLUGINS is empty);
- `plugin`: the same with the dflash plugin (VLLM_PLUGINS=dflash);
- `per-layer-k-norm`: stock, except that the context k_norm runs one layer at a time with vLLM's
  own rms_norm op (vLLM 0.32's CPU rms_norm applies row 0 of a [layers, head_dim] weight to every
  layer; see docs/vllm.md);
- `target-only`: no speculative decoding.

    python tools/vllm_engine.py --mode plugin --prompts 8 --max-tokens 64 --out result.json

The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the context K/V function can
be timed: the result holds the outputs' token ids, tok/s, vLLM's speculative-decoding counters and
the seconds spent in DFlashQwen3Model.precompute_and_store_context_kv per call.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

MODES = ("stock", "plugin", "per-layer-k-norm", "target-only")
QUESTIONS = Path(__file__).resolve().parents[1] / "data" / "gsm8k" / "train.jsonl"


def held_out_prompts(tokenizer_dir, count: int) -> list[list[int]]:
    """Chat prompts of the last `count` GSM8K questions (held out from the bundled draft)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    lines = QUESTIONS.read_text().splitlines()[-count:]
    return [tok.apply_chat_template([{"role": "user", "content": json.loads(x)["question"]}],
                                    add_generation_prompt=True, tokenize=True, return_dict=False)
            for x in lines]


def grouped_rms_norm_error() -> float:
    """vLLM's CPU `ops.rms_norm` on x [L, N, Hkv, D] with weight [L, D] (how its DFlash drafter
    norms the context K of all layers in one call): largest difference from a per-layer norm."""
    import torch
    from vllm import _custom_ops as vllm_ops

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 5, 2, 64, generator=g), 1 + 0.5 * torch.randn(3, 64, generator=g)
    out = torch.empty_like(x)
    vllm_ops.rms_norm(out, x, w, 1e-6)
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w[:, None, None]
    return (out - expected).abs().max().item()


def per_layer_k_norm(self, all_k):
    """Replaces DFlashQwen3Model._normalize_context_k: vLLM's own rms_norm op, called once per
    draft layer with that layer's k_norm weight."""
    import torch
    from vllm import _custom_ops as vllm_ops

    out = torch.empty_like(all_k)
    for layer in range(all_k.shape[0]):
        vllm_ops.rms_norm(out[layer], all_k[layer], self._k_norm_weights[layer].contiguous(),
                          self._rms_norm_eps)
    return out


def start(mode: str, target, draft, dtype: str = "float32", max_num_seqs: int = 8,
          num_speculative_tokens: int = 15, max_model_len: int = 1024):
    """An offline vLLM engine in this process; call before anything imports vllm."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    os.environ["VLLM_PLUGINS"] = "dflash" if mode == "plugin" else ""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM
    from vllm.model_executor.models import qwen3_dflash

    if mode == "per-layer-k-norm":
        qwen3_dflash.DFlashQwen3Model._normalize_context_k = per_layer_k_norm
    spec = None if mode == "target-only" else {
        "method": "dflash", "model": str(draft), "num_speculative_tokens": num_speculative_tokens}
    return LLM(model=str(target), dtype=dtype, max_model_len=max_model_len, enforce_eager=True,
               max_num_seqs=max_num_seqs, speculative_config=spec, disable_log_stats=False,
               seed=0)


class ContextKVTimer:
    """Wall time of each DFlashQwen3Model.precompute_and_store_context_kv call that writes the
    cache (one per draft step), whichever function serves it."""

    def __init__(self):
        from vllm.model_executor.models import qwen3_dflash

        self.cls = qwen3_dflash.DFlashQwen3Model
        self.inner = self.cls.precompute_and_store_context_kv
        self.seconds: list[float] = []
        timer = self

        def timed(model, context_states, context_positions, context_slot_mapping=None):
            begin = time.perf_counter()
            timer.inner(model, context_states, context_positions, context_slot_mapping)
            if context_slot_mapping is not None:
                timer.seconds.append(time.perf_counter() - begin)

        self.cls.precompute_and_store_context_kv = timed


def spec_counters(llm) -> dict:
    """vLLM's speculative-decoding counters (the `vllm:spec_decode_*` metrics)."""
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": []}
    names = {"vllm:spec_decode_num_drafts": "drafts",
             "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
    for metric in llm.get_metrics():
        if metric.name in names:
            out[names[metric.name]] = int(metric.value)
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["accepted_per_pos"] = [int(v) for v in metric.values]
    out["tau"] = 1 + out["accepted"] / out["drafts"] if out["drafts"] else None
    return out


def generate(llm, prompts: list[list[int]], max_tokens: int) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=False)
    begin = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - begin
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return {"token_ids": tokens, "seconds": seconds,
            "tok_per_s": sum(map(len, tokens)) / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--target", type=Path, help="default: the bundled target (HF copy)")
    parser.add_argument("--draft", type=Path, help="default: the bundled draft")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=0, help="prompts run once before timing")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    from dflash.assets import bundled_draft, smollm2_hf_target

    target = args.target or smollm2_hf_target()
    prompts = held_out_prompts(target, args.prompts)
    llm = start(args.mode, target, args.draft or bundled_draft(), args.dtype, args.concurrency)
    if args.warmup:
        generate(llm, prompts[:args.warmup], 8)
    before = spec_counters(llm)
    timer = ContextKVTimer()
    result = generate(llm, prompts, args.max_tokens)
    after = spec_counters(llm)
    counters = {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")}
    counters["accepted_per_pos"] = [a - b for a, b in zip(
        after["accepted_per_pos"], before["accepted_per_pos"] or [0] * 99)]
    counters["tau"] = 1 + counters["accepted"] / counters["drafts"] if counters["drafts"] else None
    import vllm
    result.update(mode=args.mode, dtype=args.dtype, concurrency=args.concurrency,
                  vllm_version=vllm.__version__, spec=counters,
                  context_kv_seconds=timer.seconds)
    args.out.write_text(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
