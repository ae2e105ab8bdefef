"""Engine cost on the bundled SmolLM2 target: target-only decode vs Hugging Face `generate`
(same prompt, same run, fp32, batch 1), and one target forward of 16 vs 1 new tokens.

    python bench/bench_engine.py
"""
import time

import torch

from dflash import LLM, SamplingParams, assets
from dflash.models.layers import build_metadata

p = assets.smollm2_target()
from transformers import AutoModelForCausalLM

hf = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
hf.generation_config.eos_token_id = None
llm = LLM(p, dtype="float32", max_num_seqs=1)
prompt = llm.chat_prompt("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?")
ids = torch.tensor([llm.tokenizer.encode(prompt, add_special_tokens=False)])
with torch.no_grad():
    hf.generate(ids, max_new_tokens=4, do_sample=False)
    t = time.perf_counter(); hf.generate(ids, max_new_tokens=64, do_sample=False); hf_s = 64 / (time.perf_counter() - t)
llm.generate(prompt, SamplingParams(max_tokens=4)); llm.reset_metrics()
t = time.perf_counter(); llm.generate(prompt, SamplingParams(max_tokens=64, ignore_eos=True)); ours = 64 / (time.perf_counter() - t)
print(f"fp32 batch 1, 64 tokens: HF generate {hf_s:.1f} tok/s, dflash target-only {ours:.1f} tok/s, ratio {ours/hf_s:.2f}")
for dtype in ("bfloat16", "float32"):
    m = LLM(p, dtype=dtype, max_num_seqs=1).target
    cache = torch.zeros(m.kv_cache_shape(64, 16), dtype=m.embed.dtype)
    def fwd(n, start=100):
        meta = build_metadata([list(range(64))], [start], [n], 16)
        with torch.inference_mode():
            h, _ = m(torch.randint(0, 1000, (n,)), meta, cache); m.logits(h)
    for n in (1, 16): fwd(n)
    res = {}
    for n in (1, 16):
        t = time.perf_counter()
        for _ in range(20): fwd(n)
        res[n] = (time.perf_counter() - t) / 20
    print(f"{dtype}: target forward t(1) {res[1]*1e3:.1f} ms, t(16) {res[16]*1e3:.1f} ms, ratio {res[16]/res[1]:.2f}")
