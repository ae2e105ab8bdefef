"""Random, valid inputs for the three ops (tests mutate them to build bad cases).

Shared by the reference tests, the kernel tests and the benchmarks so every implementation is
exercised on the same cases.
"""

from __future__ import annotations

import random

import torch

from . import reference


def rope_cache(max_pos: int, head_dim: int, theta: float = 1e6) -> torch.Tensor:
    """[max_pos, D] float32 rows [cos(D/2) | sin(D/2)] for NeoX RoPE."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


def context_kv_inputs(n=5, d_in=48, h=32, layers=2, hkv=2, d=16, num_blocks=6, block_size=4,
                      with_fc=True, with_bias=False, dtype=torch.float32, stacked=False,
                      skip_every=0, seed=0) -> dict:
    """Caches hold NaN; `stacked`: False = one tensor per cache, True = views of one
    [2, L, num_blocks, ...] tensor, "block_major" = views of one [num_blocks, L, 2, ...] tensor,
    "vllm_cpu" = per layer views of one [num_blocks, Hkv, 2 * block_size, D] tensor with K
    transposed inside each block (head_dim stride block_size), as vLLM's CPU attention keeps it."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    rows = layers * 2 * hkv * d
    slots = torch.randperm(num_blocks * block_size, generator=g)[:n]
    if skip_every:
        slots[::skip_every] = -1
    cache_shape = (num_blocks, block_size, hkv, d)
    if stacked == "vllm_cpu":
        kv = [torch.full((num_blocks, hkv, 2, block_size * d), float("nan"), dtype=dtype)
              for _ in range(layers)]
        key_caches = [c[:, :, 0].view(num_blocks, hkv, d, block_size).permute(0, 3, 1, 2)
                      for c in kv]
        value_caches = [c[:, :, 1].view(num_blocks, hkv, block_size, d).transpose(1, 2)
                        for c in kv]
    elif stacked == "block_major":   # [num_blocks, L, 2, ...]: each cache is a strided view
        kv = torch.full((num_blocks, layers, 2, *cache_shape[1:]), float("nan"), dtype=dtype)
        key_caches, value_caches = list(kv[:, :, 0].unbind(1)), list(kv[:, :, 1].unbind(1))
    elif stacked:                  # [2, L, ...]: each cache is a contiguous slice
        kc, vc = torch.full((2, layers, *cache_shape), float("nan"), dtype=dtype).unbind(0)
        key_caches, value_caches = list(kc.unbind(0)), list(vc.unbind(0))
    else:
        key_caches = [torch.full(cache_shape, float("nan"), dtype=dtype) for _ in range(layers)]
        value_caches = [torch.full(cache_shape, float("nan"), dtype=dtype) for _ in range(layers)]
    return dict(
        hidden=rnd(n, d_in if with_fc else h),
        fc_weight=rnd(h, d_in) / d_in**0.5 if with_fc else None,
        hidden_norm_weight=1 + 0.1 * rnd(h),
        kv_weight=rnd(rows, h) / h**0.5,
        kv_bias=0.1 * rnd(rows) if with_bias else None,
        k_norm_weight=1 + 0.1 * rnd(layers, d),
        positions=torch.randint(0, 64, (n,), generator=g),
        cos_sin_cache=rope_cache(64, d),
        slot_mapping=slots.long(),
        key_caches=key_caches,
        value_caches=value_caches,
        eps=1e-6,
    )


def paged_attention_inputs(context_lens=(3, 0, 9), query_lens=(2, 1, 4), hq=4, hkv=2, d=8,
                           block_size=4, extra_blocks=2, causal=False, dtype=torch.float32,
                           seed=0) -> dict:
    """A ragged batch whose sequences own shuffled, non-contiguous cache blocks."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    blocks_per_seq = [(c + block_size - 1) // block_size for c in context_lens]
    max_blocks = max(max(blocks_per_seq), 1)
    num_blocks = sum(blocks_per_seq) + extra_blocks
    order = torch.randperm(num_blocks, generator=g)
    block_table = torch.zeros(len(context_lens), max_blocks, dtype=torch.int32)
    used = 0
    for b, nb in enumerate(blocks_per_seq):
        block_table[b, :nb] = order[used : used + nb].int()
        used += nb
    tq = sum(query_lens)
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return dict(
        query=rnd(tq, hq, d),
        key=rnd(tq, hkv, d),
        value=rnd(tq, hkv, d),
        key_cache=rnd(num_blocks, block_size, hkv, d),
        value_cache=rnd(num_blocks, block_size, hkv, d),
        block_table=block_table,
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        cu_query_lens=cu,
        scale=d**-0.5,
        causal=causal,
    )


def rejection_sample_inputs(bs=4, k=3, v=11, dense=True, greedy_every=2, seed=0,
                            peaked=True, draft_noise=1.0) -> dict:
    """Target/draft distributions where drafts are often, but not always, accepted.

    draft_noise scales the draft's logit noise: 0 makes q equal p (nearly everything accepted).
    """
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(bs, k + 1, v, generator=g) * (3.0 if peaked else 1.0)
    target_probs = torch.softmax(logits, -1)
    draft_logits = logits[:, :k] + draft_noise * torch.randn(bs, k, v, generator=g)
    draft_probs = torch.softmax(draft_logits, -1)
    draft_token_ids = torch.multinomial(draft_probs.view(-1, v), 1, generator=g).view(bs, k)
    is_greedy = torch.zeros(bs, dtype=torch.bool)
    if greedy_every:
        is_greedy[::greedy_every] = True
    return dict(
        draft_token_ids=draft_token_ids,
        draft_probs=draft_probs if dense else None,
        target_probs=target_probs,
        is_greedy=is_greedy,
        uniform=torch.rand(bs, k, generator=g),
        exponential=torch.empty(bs, v).exponential_(generator=g),
    )


# ------------------------------------------------------------------ tiny random checkpoints

TINY_TARGETS = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
                   "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [1]}),
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
               "tie_word_embeddings": True}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
}


# Inputs of the decoder layer's small ops (small shapes; caches hold 12 slots).

def _randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def rms_norm_inputs(dtype=torch.float32, shape=(5, 96)):
    return {"x": _randn(*shape, dtype=dtype, scale=3), "eps": 1e-6,
            "weight": (_randn(shape[-1], seed=1) * 0.5 + 1).to(dtype)}


def add_rms_norm_inputs(dtype=torch.float32, shape=(5, 96)):
    return {**rms_norm_inputs(dtype, shape), "residual": _randn(*shape, dtype=dtype, seed=2)}


def silu_and_mul_inputs(dtype=torch.float32, shape=(5, 2 * 80)):
    return {"x": _randn(*shape, dtype=dtype, scale=3)}


def _cos_sin(t, d, seed=3):
    angles = _randn(t, d // 2, seed=seed, scale=10)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def rope_inputs(dtype=torch.float32, shape=(5, 6, 32)):
    return {"x": _randn(*shape, dtype=dtype), "cos_sin": _cos_sin(shape[0], shape[2])}


def qkv_rope_cache_inputs(dtype=torch.float32, t=5, hq=4, hkv=2, d=32, norm=True):
    cache = (3, 4, hkv, d)   # 12 slots
    return {"qkv": _randn(t, (hq + 2 * hkv) * d, dtype=dtype),
            "q_norm_weight": _randn(d, seed=4).to(dtype) if norm else None,
            "k_norm_weight": _randn(d, seed=5).to(dtype) if norm else None,
            "cos_sin": _cos_sin(t, d), "key_cache": _randn(*cache, dtype=dtype, seed=6),
            "value_cache": _randn(*cache, dtype=dtype, seed=7),
            "slot_mapping": torch.tensor([5, -1, 11, 0, 6])[:t], "num_heads": hq, "eps": 1e-6}


def panel_linear_inputs(dtype=torch.float32, rows=5, n=48, k=37, bias=True, pairs=False):
    """Small integers over powers of two: every product and sum is exact in float32, so any
    summation order gives the same result. pairs: the weight in pair panels (bfloat16, k even)."""
    g = torch.Generator().manual_seed(8)
    weight = torch.randint(-8, 9, (n, k), generator=g) / 16
    layout = reference.to_pair_panels if pairs else reference.to_panels
    return {"x": torch.randint(-8, 9, (rows, k), generator=g).to(dtype),
            "weight_panels": layout(weight.to(dtype)),
            "bias": torch.randint(-8, 9, (n,), generator=g).to(dtype) / 4 if bias else None}


def packed_weight_dtypes() -> list[torch.dtype]:
    """The dtypes `pack_linear_weight` re-lays out on CPU (oneDNN's layout or panels)."""
    return [torch.float32, torch.bfloat16]


LAYER_OP_INPUTS = {"rms_norm": rms_norm_inputs, "add_rms_norm": add_rms_norm_inputs,
                   "silu_and_mul": silu_and_mul_inputs, "rope": rope_inputs,
                   "qkv_rope_cache": qkv_rope_cache_inputs, "panel_linear": panel_linear_inputs}


class CharTokenizer:
    """A stand-in tokenizer for tiny random targets (`LLM(..., tokenizer=CharTokenizer())`): one
    token per character, a chat template that returns the message itself."""

    eos_token_id = None
    chat_template = "the message"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return messages[0]["content"]

    def encode(self, text, add_special_tokens=False):
        return [1 + ord(c) % 90 for c in text]

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(chr(33 + i % 90) for i in ids)


def make_tiny_target(directory, kind: str = "qwen3", seed: int = 0, **overrides):
    """Save a tiny random Hugging Face target (float32) to `directory`; returns the HF model."""
    import transformers

    config_cls, model_cls, extra = TINY_TARGETS[kind]
    base = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False)
    config = getattr(transformers, config_cls)(**{**base, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float().eval()
    with torch.no_grad():   # random init is tiny; make logits spread so greedy is decisive
        for p in model.parameters():
            p.normal_(0, 0.2 if p.dim() > 1 else 0.05).add_(1.0 if p.dim() == 1 else 0.0)
    model.save_pretrained(directory)
    return model


def make_tiny_draft(directory, target_dir, num_layers: int = 2, block_size: int = 8,
                    mask_token_id: int = 95, target_layer_ids=None, seed: int = 0,
                    attention_bias: bool = False, use_dflash_config: bool = True,
                    shards: int = 1, **overrides) -> dict:
    """Save a random DFlashDraftModel checkpoint matching the target in `target_dir`."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    from .models.config import default_target_layer_ids

    tcfg = json.loads((Path(target_dir) / "config.json").read_text())
    h, ht = tcfg["hidden_size"], tcfg["hidden_size"]
    heads, kv_heads, d, inter = 4, 2, 16, 96
    ids = target_layer_ids or default_target_layer_ids(tcfg["num_hidden_layers"], num_layers)
    g = torch.Generator().manual_seed(seed)
    w = lambda *s: torch.randn(*s, generator=g) * (0.3 / s[-1] ** 0.5)  # noqa: E731
    norm = lambda n: 1 + 0.1 * torch.randn(n, generator=g)  # noqa: E731
    tensors = {"fc.weight": w(h, len(ids) * ht), "hidden_norm.weight": norm(h),
               "norm.weight": norm(h)}
    for i in range(num_layers):
        p = f"layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": norm(h), p + "post_attention_layernorm.weight": norm(h),
            p + "self_attn.q_proj.weight": w(heads * d, h) * 4,
            p + "self_attn.k_proj.weight": w(kv_heads * d, h) * 4,
            p + "self_attn.v_proj.weight": w(kv_heads * d, h),
            p + "self_attn.o_proj.weight": w(h, heads * d),
            p + "self_attn.q_norm.weight": norm(d), p + "self_attn.k_norm.weight": norm(d),
            p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
            p + "mlp.down_proj.weight": w(h, inter),
        })
        if attention_bias:
            for n, rows in (("q", heads * d), ("k", kv_heads * d), ("v", kv_heads * d), ("o", h)):
                tensors[p + f"self_attn.{n}_proj.bias"] = 0.1 * torch.randn(rows, generator=g)
    dflash_fields = {"block_size": block_size, "mask_token_id": mask_token_id,
                     "target_layer_ids": ids}
    config = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": h,
              "num_hidden_layers": num_layers, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "head_dim": d, "intermediate_size": inter,
              "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 512,
              "attention_bias": attention_bias, "vocab_size": tcfg["vocab_size"],
              **({"dflash_config": dflash_fields} if use_dflash_config else dflash_fields),
              **overrides}
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, directory / "model.safetensors")
    else:   # round-robin, so one layer's k_proj and v_proj land in different shards
        weight_map = {}
        for s in range(shards):
            file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[s::shards]}
            save_file(part, directory / file)
            weight_map.update({n: file for n in part})
        (directory / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tensors


def make_tiny_pair(root, block_size: int, kind: str = "qwen3"):
    """A tiny random target (`root / "target"`) and a two-layer DFlash draft for it
    (`root / "draft"`); returns both paths and the Hugging Face target."""
    from pathlib import Path

    root = Path(root)
    hf = make_tiny_target(root / "target", kind)
    make_tiny_draft(root / "draft", root / "target", num_layers=2, block_size=block_size)
    return root / "target", root / "draft", hf


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """The n tokens `transformers` greedy generation puts after `prompt`."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False)
    return out[0, len(prompt):].tolist()


def sequence_metadata(start: int, length: int, blocks: list[int], block_size: int):
    """AttentionMetadata for one sequence adding tokens start..start+length-1 to a paged cache
    whose logical block i is physical block blocks[i]."""
    from .models.layers import build_metadata

    return build_metadata([blocks], [start], [length], block_size)


class RandomVerifySchedule:
    """A stand-in for the engine's planner (`LLM.planner`) that verifies random lengths in
    0..k_max, every one 0 on some steps (seeded); `steps` records its choices."""

    def __init__(self, seed: int, k_max: int):
        self.rng = random.Random(seed)
        self.k_max, self.steps = k_max, []

    def plan(self, requests):
        if self.rng.random() < 0.2:
            ks = [0] * len(requests)
        else:
            ks = [self.rng.choice([0, 0, 1, 2, self.k_max]) for _ in requests]
        self.steps.append(ks)
        return ks

    def observe(self, *args):
        pass

    def observe_time(self, *args):
        pass

    def forget(self, request_id):
        pass


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}")


def save_byte_tokenizer(directory, merges=(("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("Ã", "©"))):
    """Save a byte-level BPE tokenizer (`tokenizers`, as GPT-2 / Qwen / SmolLM2 use) to
    `directory`, with a Qwen3-like chat template (honouring `enable_thinking=False`) and
    <|endoftext|> as EOS; returns the `transformers` tokenizer. Its vocabulary is the 256 bytes,
    one token per merge, then the special tokens: size it with `len(tokenizer)`. Multi-byte
    characters span several tokens, so streaming detokenization is exercised for real."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers import models as tok_models
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(tok_models.BPE(vocab=vocab, merges=list(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    return fast
