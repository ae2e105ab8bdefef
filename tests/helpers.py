"""Test helpers: tiny random checkpoints, a stand-in tokenizer, the Hugging Face greedy oracle."""

from __future__ import annotations

import random

import numpy as np
import torch

from dflash.engine import tree

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


def packed_weight_dtypes() -> list[torch.dtype]:
    """The dtypes `pack_linear_weight` re-lays out on CPU (oneDNN's layout or panels)."""
    return [torch.float32, torch.bfloat16]


def serving_engine(*args, **kwargs):
    """The engine a `dflash.serve.Server` runs: `LLM`'s arguments, failing requests isolated."""
    from dflash.engine import EngineArgs, LLMEngine

    return LLMEngine(EngineArgs(*args, **kwargs), isolate_errors=True)


def make_small_vocabulary(root):
    """A target with 12 tokens, all with real mass, its draft (blocks of 4), a prompt, and the
    exact distribution of the second generated token (from the Hugging Face model)."""
    from pathlib import Path

    root = Path(root)
    vocab = 12
    hf = make_tiny_target(root / "t", "qwen3", vocab_size=vocab, seed=3)
    with torch.no_grad():   # flatten the tiny model's logits so every token has real mass
        hf.lm_head.weight.mul_(0.15)
    hf.save_pretrained(root / "t")
    make_tiny_draft(root / "d", root / "t", block_size=4, mask_token_id=vocab - 1)
    prompt = [3, 1, 4, 1, 5]
    with torch.no_grad():
        p1 = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1].double(), -1)
        seq2 = torch.tensor([prompt + [t] for t in range(vocab)])
        p2_given_1 = torch.softmax(hf(seq2).logits[:, -1].double(), -1)
    return root / "t", root / "d", prompt, p1 @ p2_given_1


def second_token_pvalue(small_vocabulary, n, setup=None, **llm_args):
    """Chi-square p-value of the second tokens of n seeded requests (seeds 0..n-1, temperature 1)
    against their exact distribution, and the engine's metrics. The second token comes from a
    speculative step. `setup(llm)` runs before generating."""
    from scipy.stats import chisquare

    from dflash import LLM, SamplingParams

    target, draft, prompt, p2 = small_vocabulary
    llm = LLM(target, draft, dtype="float32", max_num_seqs=200, **llm_args)
    if setup is not None:
        setup(llm)
    outs = llm.generate([prompt] * n, [SamplingParams(temperature=1.0, max_tokens=2, seed=s)
                                       for s in range(n)])
    second = torch.tensor([o.token_ids[1] for o in outs])
    observed = torch.bincount(second, minlength=len(p2)).double()
    return chisquare(observed.numpy(), (p2 * n).numpy()).pvalue, llm.metrics()


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

    from dflash.models.config import default_target_layer_ids

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
    from dflash.models.layers import build_metadata

    return build_metadata([blocks], [start], [length], block_size)


class RandomVerifySchedule:
    """A stand-in for the engine's planner (`LLMEngine.planner`) that verifies random lengths in
    0..k_max, every one 0 on some steps, and trees of random sizes up to every candidate
    (seeded); `steps` and `trees` record its choices."""

    def __init__(self, seed: int, k_max: int):
        self.rng = random.Random(seed)
        self.k_max, self.steps, self.trees = k_max, [], []

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

    def tree_size(self):
        return tree.MAX_NODES

    def choose_nodes(self, candidates, requests, drafting, depth):
        counts = [self.rng.choice([0, 1, 2, 5, 15, len(t) - 1]) for t in candidates]
        self.trees.append([min(c, len(t) - 1) for c, t in zip(counts, candidates)])
        return [t.prefix(c + 1) for c, t in zip(self.trees[-1], candidates)]

    def observe_trees(self, *args):
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


def _llama_cpp_permute(w: torch.Tensor, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for Llama (convert_hf_to_gguf.py LlamaModel.permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape).numpy()


def write_llama_gguf(hf, path, rope_freqs: np.ndarray | None = None, qtype: str = "F32",
                     embedding_qtype: str | None = None, tokenizer: bool = False) -> None:
    """A Llama target as llama.cpp's converter writes it (tied embeddings): the norms in float32,
    the layers' linear weights in GGML type `qtype` (e.g. "Q4_1"), the embedding in
    `embedding_qtype` (default: `qtype`); with `tokenizer`, a made-up gpt2 vocabulary too."""
    import gguf

    def add(name, w: np.ndarray, qtype=qtype):
        kind = gguf.GGMLQuantizationType[qtype]
        if kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, w)
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, kind), raw_dtype=kind)

    c = hf.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    if tokenizer:
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list([f"t{i}" for i in range(c.vocab_size)])
        writer.add_token_types([gguf.TokenType.NORMAL] * c.vocab_size)
        writer.add_token_merges(["t 1", "t1 2"])
        writer.add_eos_token_id(c.vocab_size - 2)
    state = {k: v.detach() for k, v in hf.state_dict().items()}
    add("token_embd.weight", state["model.embed_tokens.weight"].numpy(),
        embedding_qtype or qtype)
    writer.add_tensor("output_norm.weight", state["model.norm.weight"].numpy())
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs)
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(c.num_hidden_layers):
        for hf_name, name in names.items():
            w = state[f"model.layers.{i}.{hf_name}.weight"]
            if name in ("attn_q", "attn_k"):
                heads = c.num_attention_heads if name == "attn_q" else c.num_key_value_heads
                w = torch.from_numpy(_llama_cpp_permute(w, heads))
            if name.endswith("norm"):
                writer.add_tensor(f"blk.{i}.{name}.weight", w.numpy())
            else:
                add(f"blk.{i}.{name}.weight", w.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
