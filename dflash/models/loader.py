"""Checkpoint loading: Hugging Face directories (single or sharded safetensors) and GGUF files.

Each model declares a recipe: for every parameter, the checkpoint tensors (with their expected
shapes) it is assembled from. All sources are resolved only after every shard has been indexed, so
fused weights (q|k|v, gate|up, the draft's layer-major K/V) can mix tensors from different shards.
A source also says how tensor parallelism splits it (`parallel`): a rank slices each checkpoint
tensor before the concatenation and reads only its own part.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch

from .config import ConfigError, DraftConfig, TargetConfig, is_integer
from .draft import DFlashDraft
from .layers import llama3_scaling
from .parallel import COLS, EXPERTS, RANK0, ROWS, VOCAB, TensorParallel, check_config
from .target import TargetModel

# Older dflash exports kept the draft vocabulary in this file (other engines ignore it); drafts
# are now exported the way vLLM and SGLang read a reduced vocabulary (docs/design.md section 2).
DRAFT_VOCAB_FILE = "draft_vocab.json"


class CheckpointError(ValueError):
    """A checkpoint file or tensor is missing, malformed or has the wrong shape."""


@dataclass
class Source:
    """Parameter = tensors cat'ed along dim 0; with `group` > 0, each run of `group` tensors is
    cat'ed and the results stacked (experts, per-layer norms). `shard`: the tensor-parallel split
    (a `parallel` constant; None = replicated)."""

    tensors: list[tuple[str, tuple[int, ...]]]
    group: int = 0
    shard: str | None = None


# --------------------------------------------------------------------------------- recipes

def _layer_attention(r, ours, hf, a, q_rows, kv_rows, qkv_bias, o_bias, qk_norm, fused_kv=True):
    h = a.hidden_size
    q, k, v = (f"{hf}self_attn.{n}_proj" for n in "qkv")
    if fused_kv:
        r[f"{ours}qkv"] = Source([(f"{q}.weight", (q_rows, h)), (f"{k}.weight", (kv_rows, h)),
                                  (f"{v}.weight", (kv_rows, h))], shard=ROWS)
        if qkv_bias:
            r[f"{ours}qkv_bias"] = Source([(f"{q}.bias", (q_rows,)), (f"{k}.bias", (kv_rows,)),
                                           (f"{v}.bias", (kv_rows,))], shard=ROWS)
    else:
        r[f"{ours}q"] = Source([(f"{q}.weight", (q_rows, h))], shard=ROWS)
        if qkv_bias:
            r[f"{ours}q_bias"] = Source([(f"{q}.bias", (q_rows,))], shard=ROWS)
    r[f"{ours}o"] = Source([(f"{hf}self_attn.o_proj.weight", (h, q_rows))], shard=COLS)
    if o_bias:
        r[f"{ours}o_bias"] = Source([(f"{hf}self_attn.o_proj.bias", (h,))], shard=RANK0)
    if qk_norm:
        r[f"{ours}q_norm"] = Source([(f"{hf}self_attn.q_norm.weight", (a.head_dim,))])
        if fused_kv:
            r[f"{ours}k_norm"] = Source([(f"{hf}self_attn.k_norm.weight", (a.head_dim,))])


def _norms_and_mlp(r, ours, hf, h, inter, mlp_ours):
    r[f"{ours}input_norm"] = Source([(f"{hf}input_layernorm.weight", (h,))])
    r[f"{ours}post_norm"] = Source([(f"{hf}post_attention_layernorm.weight", (h,))])
    if inter:
        r[f"{mlp_ours}gate_up"] = Source([(f"{hf}mlp.gate_proj.weight", (inter, h)),
                                          (f"{hf}mlp.up_proj.weight", (inter, h))], shard=ROWS)
        r[f"{mlp_ours}down"] = Source([(f"{hf}mlp.down_proj.weight", (h, inter))], shard=COLS)


def target_recipe(cfg: TargetConfig) -> dict[str, Source]:
    a = cfg.attn
    h, v = a.hidden_size, cfg.vocab_size
    q_rows, kv_rows = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    r = {"embed": Source([("model.embed_tokens.weight", (v, h))], shard=VOCAB),
         "norm": Source([("model.norm.weight", (h,))])}
    if not cfg.tie_word_embeddings:
        r["lm_head"] = Source([("lm_head.weight", (v, h))], shard=VOCAB)
    for i in range(cfg.num_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        _layer_attention(r, f"{ours}attn.", hf, a, q_rows, kv_rows, cfg.qkv_bias,
                         a.attention_bias, cfg.qk_norm)
        moe = cfg.is_moe_layer(i)
        _norms_and_mlp(r, ours, hf, h, 0 if moe else cfg.intermediate_size, f"{ours}mlp.")
        if moe:
            e, inter = cfg.num_experts, cfg.moe_intermediate_size
            ex = [f"{hf}mlp.experts.{j}." for j in range(e)]
            r[f"{ours}mlp.router"] = Source([(f"{hf}mlp.gate.weight", (e, h))])
            r[f"{ours}mlp.gate_up"] = Source(
                [(f"{x}{p}_proj.weight", (inter, h)) for x in ex for p in ("gate", "up")], 2,
                EXPERTS)
            r[f"{ours}mlp.down"] = Source([(f"{x}down_proj.weight", (h, inter)) for x in ex], 1,
                                          EXPERTS)
    return r


def draft_recipe(cfg: DraftConfig, target_hidden: int) -> dict[str, Source]:
    a = cfg.attn
    h, d = a.hidden_size, a.head_dim
    q_rows, kv_rows = a.num_heads * d, a.num_kv_heads * d
    layers = range(cfg.num_layers)
    r = {"fc": Source([("fc.weight", (h, len(cfg.target_layer_ids) * target_hidden))]),
         "hidden_norm": Source([("hidden_norm.weight", (h,))]),
         "norm": Source([("norm.weight", (h,))]),
         "kv_weight": Source([(f"layers.{i}.self_attn.{p}_proj.weight", (kv_rows, h))
                              for i in layers for p in "kv"]),
         "k_norm": Source([(f"layers.{i}.self_attn.k_norm.weight", (d,)) for i in layers], 1)}
    if a.attention_bias:
        r["kv_bias"] = Source([(f"layers.{i}.self_attn.{p}_proj.bias", (kv_rows,))
                               for i in layers for p in "kv"])
    for i in layers:
        ours = f"layers.{i}."
        _layer_attention(r, ours, ours, a, q_rows, kv_rows, a.attention_bias, a.attention_bias,
                         True, fused_kv=False)
        _norms_and_mlp(r, ours, ours, h, cfg.intermediate_size, f"{ours}mlp.")
    return r


# --------------------------------------------------------------------------------- sources

class SafetensorsCheckpoint:
    """Name -> tensor over one or many memory-mapped safetensors shards."""

    def __init__(self, directory: Path):
        from safetensors import safe_open

        files, indexed = _safetensors_files(directory)
        self._handles, self._where, owner = [], {}, {}
        for name in files:
            path = directory / name
            if not path.exists():
                raise CheckpointError(f"shard {path} listed in the index does not exist")
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as e:   # SafetensorError (truncated, garbage), OSError
                raise CheckpointError(f"{path}: not a readable safetensors file ({e})") \
                    from None
            self._handles.append(handle)
            for key in handle.keys():
                if key in owner and not indexed:
                    # no index says which copy is meant (with one, the last shard's is taken,
                    # as transformers does)
                    raise CheckpointError(f"{directory}: tensor {key!r} is in both "
                                          f"{owner[key]} and {name}")
                self._where[key], owner[key] = handle, name

    def names(self) -> list[str]:
        return list(self._where)

    def dtype(self, name: str) -> str:
        """The tensor's safetensors dtype (F32, BF16, I8, F8_E4M3, ...)."""
        return self._where[name].get_slice(name).get_dtype()

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name].get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name)

    def lazy(self, name: str):
        """The tensor unread: slicing it reads only the slice."""
        return self._where[name].get_slice(name)


def _safetensors_files(directory: Path) -> tuple[list[str], bool]:
    """The weight files of a checkpoint directory, and whether an index lists them."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no weight_map (tensor name -> shard file)")
        named = set(weight_map.values())
        for name in named:
            _check_shard_name(name, index)
        return sorted(named), True
    if (directory / "model.safetensors").exists():
        return ["model.safetensors"], False   # as transformers: other files are not its weights
    files = sorted(p.name for p in directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory} has no *.safetensors weights")
    return files, False


def _check_shard_name(name, index: Path) -> None:
    """A shard named by the index must be a relative path inside the checkpoint directory: a
    hostile index could otherwise make the loader open any file. Checked on the name, not the
    resolved path, so symlinked shards (the Hugging Face cache's) still load."""
    if not isinstance(name, str) or Path(name).is_absolute() or ".." in Path(name).parts:
        raise CheckpointError(f"shard {name!r} listed in {index} is outside the checkpoint "
                              f"directory")


class GGUFCheckpoint:
    """Name (Hugging Face style) -> tensor of a memory-mapped GGUF file, each dequantized to
    float32 only when read, so loading holds one dequantized tensor at a time."""

    def __init__(self, reader, arch: str, heads: int, kv_heads: int):
        self._tensors = {}
        for t in reader.tensors:
            if t.name in _GGUF_GLOBAL_NAMES:
                self._tensors[_GGUF_GLOBAL_NAMES[t.name]] = (t, None)
                continue
            parts = t.name.split(".")
            if len(parts) != 4 or parts[0] != "blk" or parts[2] not in GGUF_LAYER_NAMES:
                continue  # tensors the model does not use (rope_freqs: in the config)
            _, layer, kind, suffix = parts
            # llama.cpp stores Llama q/k rows of each head interleaved for its RoPE
            permuted = {"attn_q": heads, "attn_k": kv_heads}.get(kind) if arch == "llama" \
                else None
            self._tensors[f"model.layers.{layer}.{GGUF_LAYER_NAMES[kind]}.{suffix}"] = \
                (t, permuted)

    def names(self) -> list[str]:
        return list(self._tensors)

    def dtype(self, name: str) -> str:
        """F32 (`get` dequantizes every float or quantized type to it), or the GGML integer
        type (I8, I16, I32, I64) of a tensor that holds no weights."""
        kind = self._tensors[name][0].tensor_type.name
        return kind if kind in GGML_INTEGER_TYPES else "F32"

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(n) for n in reversed(self._tensors[name][0].shape))   # GGML: [K, N]

    def get(self, name: str) -> torch.Tensor:
        import gguf

        t, heads = self._tensors[name]
        w = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type),
                                      dtype=np.float32))   # a writable copy
        return w if heads is None else _unpermute_rope_rows(w, heads)

    lazy = get


# the weight dtypes read as they are; anything else (integers, bools, FP8 without its scales)
# would be cast to numbers that are not the model's
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
INTEGER_DTYPES = ("I64", "I32", "I16", "I8", "U8")   # of d2t (a float would be truncated)


def check_tensor(ckpt, name: str, shape: tuple[int, ...], where: str,
                 dtypes: tuple[str, ...] = FLOAT_DTYPES) -> None:
    """`name` is in `ckpt` with this shape and one of `dtypes`."""
    if name not in ckpt:
        raise CheckpointError(f"{where} is missing tensor {name!r}")
    if ckpt.shape(name) != shape:
        raise CheckpointError(f"{where}: tensor {name!r} has shape {list(ckpt.shape(name))}, "
                              f"expected {list(shape)}")
    if ckpt.dtype(name) not in dtypes:
        raise CheckpointError(f"{where}: tensor {name!r} has dtype {ckpt.dtype(name)}, "
                              f"expected {' or '.join(dtypes)}")


def check_sources(recipe: dict[str, Source], ckpt, where: str, layer_prefix: str,
                  num_layers: int) -> None:
    """Every tensor of `recipe` is in `ckpt` with its shape and a float dtype, and `ckpt` holds
    no layer `layer_prefix`N.* with N >= num_layers (config and weights would disagree on the
    model). Checked on metadata alone, before a model or its RoPE table is built."""
    for src in recipe.values():
        for name, shape in src.tensors:
            check_tensor(ckpt, name, shape, where)
    for name in ckpt.names():
        layer = name.removeprefix(layer_prefix).split(".")[0] \
            if name.startswith(layer_prefix) else ""
        if layer.isdigit() and int(layer) >= num_layers:
            raise CheckpointError(f"{where}: tensor {name!r} is of layer {layer}, but the config "
                                  f"has {num_layers} layers (num_hidden_layers / block_count)")


def assemble(model: torch.nn.Module, recipe: dict[str, Source], ckpt, where: str,
             dtype: torch.dtype, device: torch.device, tp: TensorParallel | None = None,
             wide: frozenset[str] = frozenset(),
             consume: Callable[[str, torch.Tensor], bool] | None = None) -> None:
    """Fill every placeholder parameter of `model` from the checkpoint (its tensors passed
    `check_sources`); with `tp`, each parameter is this rank's shard. Parameters named in `wide`
    are assembled in float32 instead of `dtype` (the checkpoint's values, for a quantizer to
    read), and handed to `consume(name, value)` as soon as assembled: when it takes one (returns
    True, having installed the parameter itself), it is not stored, so a quantizer holds one
    weight in float32 at a time."""
    expected = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert set(expected) == set(recipe), sorted(set(expected) ^ set(recipe))
    state, consumed = {}, set()
    for ours, src in recipe.items():
        if tp is None:
            parts = [ckpt.get(name) for name, _ in src.tensors]
        else:
            parts = [tp.shard(src.shard, ckpt.lazy(name), shape) for name, shape in _held(src, tp)]
        parts = [part.to(device=device, dtype=torch.float32 if ours in wide else dtype)
                 for part in parts]
        if src.group:
            parts = [torch.cat(parts[i:i + src.group]) for i in range(0, len(parts), src.group)]
            value = torch.stack(parts)
        else:
            value = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
        assert value.shape == expected[ours], (ours, value.shape, expected[ours])
        del parts
        if ours in wide and consume is not None and consume(ours, value.contiguous()):
            consumed.add(ours)
            continue
        state[ours] = torch.nn.Parameter(value.contiguous(), requires_grad=False)
    result = model.load_state_dict(state, assign=True, strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= consumed, result
    for name, buf in model.named_buffers():   # buffers (RoPE tables) follow the device
        *parent, leaf = name.split(".")
        module = model.get_submodule(".".join(parent)) if parent else model
        setattr(module, leaf, buf.to(device))


def _held(src: Source, tp: TensorParallel) -> list[tuple[str, tuple[int, ...]]]:
    """The source tensors rank `tp` reads: all of them, or under an EXPERTS split its experts'."""
    if src.shard != EXPERTS:
        return src.tensors
    experts = tp.experts(len(src.tensors) // src.group)
    return src.tensors[experts.start * src.group:experts.stop * src.group]


# ------------------------------------------------------------------------------------ GGUF

GGML_INTEGER_TYPES = ("I8", "I16", "I32", "I64")
_GGUF_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM"}
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                      "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


def _gguf_field(reader, key, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _unpermute_rope_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp stores Llama q/k rows of each head interleaved (pairs for its RoPE); put them
    back in rotate-half order: first halves of all pairs, then second halves."""
    rows = w.shape[0]
    return w.view(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_config(reader, path: Path) -> dict:
    """The Hugging Face style config dict of an open GGUF file (`gguf.GGUFReader`), from its
    metadata and tensor shapes alone."""
    arch = _gguf_field(reader, "general.architecture")
    if arch not in _GGUF_ARCHS:
        raise ConfigError(f"GGUF architecture {arch!r} is not supported; "
                          f"supported: {', '.join(_GGUF_ARCHS)}")
    meta = lambda key, default=None: _gguf_field(reader, f"{arch}.{key}", default)  # noqa: E731
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise CheckpointError(f"{path} has no token_embd.weight tensor")
    cfg = {
        "architectures": [_GGUF_ARCHS[arch]],
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]),   # GGML order: [H, V]
        "hidden_size": meta("embedding_length"),
        "intermediate_size": meta("feed_forward_length"),
        "num_hidden_layers": meta("block_count"),
        "num_attention_heads": meta("attention.head_count"),
        "num_key_value_heads": meta("attention.head_count_kv"),
        "head_dim": meta("attention.key_length"),   # absent: hidden_size / heads
        "rms_norm_eps": meta("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": meta("rope.freq_base", 10000.0),
        "max_position_embeddings": meta("context_length", 4096),
        "tie_word_embeddings": "output.weight" not in tensors,
        "eos_token_id": _gguf_field(reader, "tokenizer.ggml.eos_token_id"),
    }
    if "rope_freqs.weight" in tensors:   # Llama 3.x
        divisors = torch.from_numpy(np.array(tensors["rope_freqs.weight"].data, np.float32))
        cfg["rope_scaling"] = _llama3_rope_scaling(divisors, cfg["rope_theta"], path)
    return cfg


def read_gguf(path: Path) -> tuple[dict, GGUFCheckpoint]:
    """A GGUF file as (Hugging Face style config dict, its tensors dequantized as read)."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:   # a truncated file fails in numpy or gguf, a directory in mmap
        raise CheckpointError(f"{path}: not a readable GGUF file ({type(e).__name__}: "
                              f"{e})") from None
    cfg = gguf_config(reader, path)
    return cfg, GGUFCheckpoint(reader, _gguf_field(reader, "general.architecture"),
                               cfg["num_attention_heads"], cfg["num_key_value_heads"])


def _llama3_rope_scaling(divisors: torch.Tensor, theta: float, path: Path) -> dict | None:
    """The Hugging Face `llama3` rope_scaling behind a GGUF's rope_freqs.weight. llama.cpp's
    converter stores it as one divisor per frequency: 1 for short wavelengths, `factor` for long
    ones, between them 1 / ((1 - s) / factor + s) with s linear in 1 / wavelength; that line is
    fitted here. It fixes only two ratios of the three length fields, so low_freq_factor is taken
    as 1 (every Llama 3.x release's): the same divisors, hence the same RoPE table."""
    divisors = divisors.double()
    if torch.all(divisors == 1):
        return None
    d = 2 * len(divisors)
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    factor = divisors.max().item()
    blend = (divisors > 1 + 1e-6) & (divisors < factor * (1 - 1e-6))
    scaling = None
    if blend.sum() >= 2:   # two points fix the line
        s = (1 / divisors[blend] - 1 / factor) / (1 - 1 / factor)
        # s = (original_max / wavelength - 1) / (high_freq_factor - 1)
        slope, intercept = np.polyfit((inv_freq[blend] / (2 * math.pi)).numpy(), s.numpy(), 1)
        if intercept < 0:
            scaling = {"factor": _round(factor), "low_freq_factor": 1.0,
                       "high_freq_factor": _round(1 - 1 / intercept),
                       "original_max_position_embeddings": _round(-slope / intercept)}
    if scaling is None or not torch.allclose(llama3_scaling(inv_freq, **scaling),
                                             inv_freq / divisors, rtol=1e-4, atol=0):
        raise ConfigError(f"{path.name}: rope_freqs.weight {divisors.float().tolist()} is not a "
                          f"Llama-3 RoPE scaling (rope_type llama3) that can be rebuilt")
    return {"rope_type": "llama3", **scaling}


def _round(x: float) -> float:
    """6 significant digits: the round values a config holds (8.0, 4.0, 8192.0), not fit noise."""
    return float(f"{x:.6g}")


# ---------------------------------------------------------------------------------- public

def _gguf_file(path: Path) -> Path | None:
    if path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").exists():
        found = sorted(path.glob("*.gguf"))
        if len(found) == 1:
            return found[0]
    return None


def read_config(path: Path) -> dict:
    config = path / "config.json"
    if not config.exists():
        raise CheckpointError(f"{path} has no config.json (nor a single .gguf file)")
    return read_json(config)


def read_json(path: Path) -> dict:
    """The JSON object in `path`, or a CheckpointError naming the file."""
    try:
        value = json.loads(path.read_bytes())
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read: {e}") from None
    except ValueError as e:   # JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


def _resolve(path) -> Path:
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"checkpoint path {path} does not exist")
    return path


def read_target_config(path) -> TargetConfig:
    """A target's config (a Hugging Face directory or a GGUF file), read without its weights."""
    return _target_source(_resolve(path))[0]


def _target_source(path: Path) -> tuple[TargetConfig, GGUFCheckpoint | None]:
    """The target's config and, for a GGUF file, its open checkpoint."""
    gguf_file = _gguf_file(path)
    if gguf_file is not None:
        cfg_dict, ckpt = read_gguf(gguf_file)
    else:
        cfg_dict, ckpt = read_config(path), None
    return TargetConfig.from_hf(cfg_dict), ckpt


def load_target(path, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                tp: TensorParallel | None = None, max_positions: int | None = None,
                quantization: str | None = None) -> TargetModel:
    """A target model from a Hugging Face directory or a GGUF file (dequantized on load); with
    `tp`, only this rank's tensor-parallel shard is read. `max_positions`: the longest sequence
    it will serve (its RoPE table's rows, at most max_position_embeddings). `quantization`
    (layers.QUANTIZATIONS): the format its linear weights are quantized to
    (`TargetModel.quantize`)."""
    path = _resolve(path)
    cfg, ckpt = _target_source(path)
    if tp is not None:
        check_config(cfg, tp.size)
    if ckpt is None:
        ckpt = SafetensorsCheckpoint(path)
    recipe = target_recipe(cfg)
    check_sources(recipe, ckpt, str(path), "model.layers.", cfg.num_layers)
    model = TargetModel(cfg, tp, max_positions)
    # quantized from the checkpoint's own values: a GGUF Q8_0 tensor comes back exactly
    wide = frozenset(model.linear_weights() + ["embed", "lm_head"]) & set(recipe) \
        if quantization else frozenset()
    consume = partial(_quantize, model, quantization, dtype) if quantization else None
    assemble(model, recipe, ckpt, str(path), dtype, torch.device(device), tp, wide, consume)
    if quantization:
        model.quantize(quantization, dtype)
    return model.eval()


def _quantize(model: TargetModel, quantization: str, dtype: torch.dtype, name: str,
              value: torch.Tensor) -> bool:
    return model.quantize_weight(name, value, quantization, dtype)


def load_draft(path, target: TargetConfig, dtype: torch.dtype = torch.bfloat16,
               device: torch.device | str = "cpu", max_positions: int | None = None,
               quantization: str | None = None) -> DFlashDraft:
    """A DFlashDraftModel directory, validated against its target (docs/design.md section 2);
    `max_positions` as for load_target; `quantization` (layers.QUANTIZATIONS, or None): the
    format of its block GEMM weights (`DFlashDraft.quantize`, for inference only)."""
    path = _resolve(path)
    config = read_config(path)
    cfg = DraftConfig.from_hf(config, target)
    ckpt = SafetensorsCheckpoint(path)
    recipe = draft_recipe(cfg, target.attn.hidden_size)
    check_sources(recipe, ckpt, str(path), "layers.", cfg.num_layers)
    model = DFlashDraft(cfg, target.attn.hidden_size, max_positions)
    assemble(model, recipe, ckpt, str(path), dtype, torch.device(device))
    vocab_file = path / DRAFT_VOCAB_FILE
    if config.get("draft_vocab_size") is not None:
        model.draft_vocab, model.lm_head = _reduced_vocabulary(config, ckpt, target, path, dtype)
    elif vocab_file.exists():
        ids = read_json(vocab_file).get("token_ids")
        if not isinstance(ids, list) or not ids or len(set(ids)) != len(ids) or \
                not all(isinstance(i, int) and 0 <= i < target.vocab_size for i in ids):
            raise CheckpointError(f"{vocab_file}: token_ids must be distinct ids in "
                                  f"[0, {target.vocab_size})")
        model.draft_vocab = torch.tensor(ids)
    if model.draft_vocab is not None:
        model.draft_vocab = model.draft_vocab.to(device)
        model.lm_head = None if model.lm_head is None else model.lm_head.to(device)
    if quantization is not None:
        model.quantize(quantization)
    return model.eval()


def _reduced_vocabulary(config: dict, ckpt, target: TargetConfig, path: Path,
                        dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(draft vocabulary [N] target ids, lm_head [N, H]) of a draft exported the EAGLE-3 way:
    `draft_vocab_size` N in config.json, `d2t` (target id - draft id) and `lm_head.weight`."""
    n, h = config["draft_vocab_size"], target.attn.hidden_size
    if not is_integer(n) or not 0 < n <= target.vocab_size:
        raise ConfigError(f"draft draft_vocab_size {n!r} must be an integer in "
                          f"[1, {target.vocab_size}] (the target's vocabulary)")
    check_tensor(ckpt, "d2t", (n,), f"{path} (draft_vocab_size {n})", INTEGER_DTYPES)
    check_tensor(ckpt, "lm_head.weight", (n, h), f"{path} (draft_vocab_size {n})")
    ids = torch.arange(n) + ckpt.get("d2t").long()
    if ids.min() < 0 or ids.max() >= target.vocab_size or len(ids.unique()) != n:
        raise CheckpointError(f"{path}: d2t must map the {n} draft ids to distinct target ids "
                              f"in [0, {target.vocab_size})")
    return ids, ckpt.get("lm_head.weight").to(dtype)


def load_tokenizer(path):
    """The checkpoint's tokenizer (with chat template), or None when it ships none."""
    from transformers import AutoTokenizer

    path = _resolve(path)
    gguf_file = _gguf_file(path)
    if gguf_file is not None:
        return AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json",
                                             "tokenizer.model")):
        return None
    return AutoTokenizer.from_pretrained(str(path))


def disassemble(model: torch.nn.Module, recipe: dict[str, Source]) -> dict[str, torch.Tensor]:
    """The inverse of `assemble`: checkpoint tensors (by their checkpoint names) from the fused
    parameters."""
    params = dict(model.named_parameters())
    out = {}
    for ours, src in recipe.items():
        value = params[ours].detach()
        if src.group:
            runs = [src.tensors[i:i + src.group] for i in range(0, len(src.tensors), src.group)]
            pieces = [(run, part) for run, part in zip(runs, value.unbind(0))]
        else:
            pieces = [(src.tensors, value)]
        for run, part in pieces:
            sizes = [shape[0] if shape else 1 for _, shape in run]
            for (name, shape), chunk in zip(run, part.split(sizes) if len(run) > 1 else [part]):
                out[name] = chunk.reshape(shape).contiguous().clone()
    return out


def save_draft(draft: DFlashDraft, directory, target: TargetModel,
               extra_config: dict | None = None, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write `draft` as a DFlashDraftModel checkpoint that dflash, vLLM and SGLang read unchanged
    (docs/design.md section 2): config.json (z-lab's `dflash_config`, the target's `vocab_size`
    and `num_target_layers`, `layer_types`) + model.safetensors with per-layer k_proj / v_proj /
    k_norm and no `model.` prefix. A draft vocabulary of N tokens adds `draft_vocab_size` N and
    the tensors `lm_head.weight` [N, H] (its rows of the target's lm_head unless the draft has
    its own) and `d2t` [N] int64 (target id - draft id)."""
    from safetensors.torch import save_file

    cfg = draft.cfg
    a = cfg.attn
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(dtype) for k, v in
               disassemble(draft, draft_recipe(cfg, target.cfg.attn.hidden_size)).items()}
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": a.hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": a.num_heads, "num_key_value_heads": a.num_kv_heads,
        "head_dim": a.head_dim, "intermediate_size": cfg.intermediate_size,
        "rms_norm_eps": a.rms_norm_eps, "rope_theta": a.rope_theta,
        "max_position_embeddings": a.max_position_embeddings,
        "attention_bias": a.attention_bias, "hidden_act": "silu", "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "vocab_size": target.cfg.vocab_size, "num_target_layers": target.cfg.num_layers,
        "layer_types": ["full_attention"] * cfg.num_layers,
        "dflash_config": {"block_size": cfg.block_size, "mask_token_id": cfg.mask_token_id,
                          "target_layer_ids": list(cfg.target_layer_ids)},
        **(extra_config or {}),
    }
    if draft.draft_vocab is not None:
        vocab = draft.draft_vocab.cpu()
        head = draft.lm_head if draft.lm_head is not None else target.output_rows(draft.draft_vocab)
        config["draft_vocab_size"] = len(vocab)
        tensors["lm_head.weight"] = head.detach().cpu().contiguous()   # the rows as they are
        tensors["d2t"] = vocab - torch.arange(len(vocab))
    if a.rope_scaling is not None:
        config["rope_scaling"] = {"rope_type": "llama3", **a.rope_scaling}
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (directory / DRAFT_VOCAB_FILE).unlink(missing_ok=True)   # superseded by d2t
