"""A DFlash draft written as llama.cpp's DFlash GGUF (`dflash export-gguf`), so that llama.cpp
runs our drafts with `--spec-type draft-dflash` (docs/design.md section 2).

llama.cpp's `dflash` architecture reads Qwen3 hyperparameters, `dflash.block_size`,
`dflash.target_layers` (hidden-state indices: 0 is the embedding output, so the stream after
target layer i is i + 1) and the target's tokenizer, whose `mask_token_id` fills the block. A
reduced draft vocabulary is `d2t` [N] int64 holding absolute target ids, where our checkpoints
keep target id - draft id (the EAGLE-3 convention vLLM and SGLang read), plus the draft's own
`output.weight` [N, H] (the target's rows for a draft that keeps its vocabulary in
`draft_vocab.json`); a full-vocabulary draft has no head and borrows the target's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .config import ConfigError, DraftConfig, TargetConfig
from .loader import (
    GGUF_LAYER_NAMES,
    CheckpointError,
    SafetensorsCheckpoint,
    load_draft,
    read_config,
    read_gguf,
)

ARCH = "dflash"
OUTTYPES = ("bf16", "f16", "f32")
_GLOBAL_NAMES = {"fc.weight": "fc.weight", "hidden_norm.weight": "enc.output_norm.weight",
                 "norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
_LAYER_NAMES = {hf: kind for kind, hf in GGUF_LAYER_NAMES.items()}   # self_attn.q_proj: attn_q


def _gguf_name(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    _, layer, rest = name.split(".", 2)               # layers.{i}.{module}.weight
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER_NAMES[module]}.{suffix}"


def export_draft_gguf(draft_dir, target_gguf, out, outtype: str = "bf16") -> Path:
    """Write the draft in `draft_dir` for the target GGUF file `target_gguf` (whose tokenizer it
    copies) to `out`. Matrices are stored as `outtype`, vectors in float32; returns `out`."""
    import gguf

    if outtype not in OUTTYPES:
        raise ValueError(f"outtype {outtype!r} is not one of {', '.join(OUTTYPES)}")
    draft_dir, target_gguf, out = Path(draft_dir), Path(target_gguf), Path(out)
    if target_gguf.suffix != ".gguf" or not target_gguf.is_file():
        raise CheckpointError(f"{target_gguf} is not a GGUF file: llama.cpp needs the target's "
                              f"tokenizer from the target GGUF the draft will run with")
    target_config, target_ckpt = read_gguf(target_gguf)   # a damaged file: an error naming it
    target = TargetConfig.from_hf(target_config)
    reader = gguf.GGUFReader(str(target_gguf))   # its tokenizer fields
    config = read_config(draft_dir)
    cfg = DraftConfig.from_hf(config, target)
    a = cfg.attn
    if a.attention_bias or a.rope_scaling is not None:
        raise ConfigError("llama.cpp's DFlash GGUF has no attention biases or RoPE scaling; "
                          "this draft uses them")
    ckpt = SafetensorsCheckpoint(draft_dir)
    names = ["fc.weight", "hidden_norm.weight", "norm.weight"] + [
        f"layers.{i}.{module}.weight" for i in range(cfg.num_layers) for module in _LAYER_NAMES]
    reduced = config.get("draft_vocab_size") is not None
    if reduced:
        names.append("lm_head.weight")
    missing = [n for n in names + (["d2t"] if reduced else []) if n not in ckpt]
    if missing:
        raise CheckpointError(f"{draft_dir}: the draft checkpoint lacks {', '.join(missing)}")
    # every check dflash's loader makes (shapes, d2t's distinct ids within the vocabulary):
    # llama.cpp scatters the draft logits to the d2t rows as they are
    vocab = load_draft(draft_dir, target, torch.float32).draft_vocab
    tensors = {name: ckpt.get(name) for name in names}
    if vocab is not None and not reduced:   # draft_vocab.json: the lm_head rows are the target's
        head = "lm_head.weight" if "lm_head.weight" in target_ckpt else "model.embed_tokens.weight"
        tensors["lm_head.weight"] = target_ckpt.get(head)[vocab]

    partial = out.with_name(out.name + ".part")
    writer = gguf.GGUFWriter(str(partial), ARCH)
    writer.add_name(draft_dir.name)
    writer.add_context_length(a.max_position_embeddings)
    writer.add_embedding_length(a.hidden_size)
    writer.add_block_count(cfg.num_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(a.num_heads)
    writer.add_head_count_kv(a.num_kv_heads)
    writer.add_key_length(a.head_dim)
    writer.add_value_length(a.head_dim)
    writer.add_rope_dimension_count(a.head_dim)
    writer.add_rope_freq_base(a.rope_theta)
    writer.add_layer_norm_rms_eps(a.rms_norm_eps)
    writer.add_uint32(f"{ARCH}.block_size", cfg.block_size)
    writer.add_array(f"{ARCH}.target_layers", [i + 1 for i in cfg.target_layer_ids])
    for field in reader.fields.values():
        if field.name.startswith("tokenizer.") and field.name != "tokenizer.ggml.mask_token_id":
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), field.types[0], sub)
    writer.add_mask_token_id(cfg.mask_token_id)

    kind = gguf.GGMLQuantizationType[outtype.upper()]
    for name, w in tensors.items():
        w = w.float().numpy()
        if w.ndim == 1 or kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(_gguf_name(name), w)
        else:
            writer.add_tensor(_gguf_name(name), gguf.quants.quantize(w, kind), raw_dtype=kind)
    if vocab is not None:
        writer.add_tensor("d2t", vocab.numpy().astype(np.int64))   # absolute target ids
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(out)   # never leave a truncated file behind
    return out
