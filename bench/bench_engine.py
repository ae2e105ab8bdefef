"""Engine cost on the bundled SmolLM2 target: target-only decode vs Hugging Face `generate`
(same prompt, same run, fp32, batch 1), and one target forward of 16 vs 1 new tokens.

    python bench/bench_engine.py
"""

import time

import torch
from transformers import AutoModelForCausalLM

from dflash import LLM, SamplingParams, assets
from dflash.models.layers import build_metadata

QUESTION = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many "
            "clips in May. How many clips did Natalia sell altogether in April and May?")


def tokens_per_second(generate, n: int = 64) -> float:
    generate(4)   # warm-up
    start = time.perf_counter()
    generate(n)
    return n / (time.perf_counter() - start)


def forward_ms(model, n: int, repeats: int = 20) -> float:
    """One target forward of n new tokens after 100 cached ones, lm_head included."""
    cache = torch.zeros(model.kv_cache_shape(64, 16), dtype=model.embed.dtype)
    meta = build_metadata([list(range(64))], [100], [n], 16)
    ids = torch.randint(0, 1000, (n,))

    def once():
        with torch.inference_mode():
            hidden, _ = model(ids, meta, cache)
            model.logits(hidden)

    once()
    start = time.perf_counter()
    for _ in range(repeats):
        once()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    path = assets.smollm2_target()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                              dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    llm = LLM(path, dtype="float32", max_num_seqs=1)
    prompt = llm.chat_prompt(QUESTION)
    ids = torch.tensor([llm.tokenizer.encode(prompt, add_special_tokens=False)])
    with torch.no_grad():
        hf_tok_s = tokens_per_second(
            lambda n: hf.generate(ids, max_new_tokens=n, do_sample=False))
    ours = tokens_per_second(
        lambda n: llm.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True)))
    print(f"fp32 batch 1, 64 tokens: HF generate {hf_tok_s:.1f} tok/s, dflash target-only "
          f"{ours:.1f} tok/s, ratio {ours / hf_tok_s:.2f}")
    for dtype in ("bfloat16", "float32"):
        model = LLM(path, dtype=dtype, max_num_seqs=1).target
        one, block = forward_ms(model, 1), forward_ms(model, 16)
        print(f"{dtype}: target forward t(1) {one:.1f} ms, t(16) {block:.1f} ms, "
              f"ratio {block / one:.2f}")


if __name__ == "__main__":
    main()
