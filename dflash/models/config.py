"""Model configurations read from Hugging Face `config.json` dicts (docs/design.md section 2)."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

SUPPORTED_TARGETS = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "LlamaForCausalLM",
                     "Qwen2ForCausalLM")
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


class ConfigError(ValueError):
    """A checkpoint's config is missing a field, has a bad value, or is not supported."""


LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                    "original_max_position_embeddings")


def _rope(cfg: dict, what: str) -> tuple[float, dict | None]:
    """(theta, scaling) from either the transformers-5 `rope_parameters` or the older fields."""
    params = cfg.get("rope_parameters") or {}
    theta = _number(params.get("rope_theta", cfg.get("rope_theta", 10000.0)), "rope_theta", what)
    scaling = cfg.get("rope_scaling") or params
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ConfigError(f"rope scaling type {rope_type!r} is not supported (default, llama3)")
    factors = {k: _number(_get(scaling, k, f"{what} llama3 rope_scaling of"), k, what)
               for k in LLAMA3_ROPE_KEYS}
    if factors["low_freq_factor"] >= factors["high_freq_factor"]:
        # the blend between the two wavelengths divides by their difference
        raise ConfigError(f"{what} config llama3 rope_scaling low_freq_factor "
                          f"{factors['low_freq_factor']} must be below high_freq_factor "
                          f"{factors['high_freq_factor']}")
    return theta, factors


def _number(value, name: str, what: str, low: float = 0.0, open_low: bool = True) -> float:
    """`value` as a finite float above `low` (at least `low` where not `open_low`): a NaN,
    infinite or non-positive RoPE base or norm epsilon silently turns every output into NaN."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or value < low or (open_low and value == low):
        raise ConfigError(f"{what} config {name}={value!r} must be a finite number "
                          f"{'>' if open_low else '>='} {low}")
    return float(value)


def _get(cfg: dict, name: str, what: str):
    if name not in cfg:
        raise ConfigError(f"{what} config.json has no {name!r}")
    return cfg[name]


# Bounds far beyond any real model: a value outside them is a broken or hostile config, refused
# before it sizes an allocation.
MAX_DIM = 2**20         # hidden, head and MLP sizes
MAX_COUNT = 2**14       # heads, layers, experts
MAX_INDEX = 2**31 - 1   # vocabulary size, positions


def is_integer(value) -> bool:
    """An integer and not a bool (JSON `true` is an int to Python)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _size(cfg: dict, name: str, what: str, default=None, low: int = 1, high: int = MAX_DIM
          ) -> int:
    """cfg[name] (or `default` where it is missing or null; required without a default) as an
    integer in [low, high]."""
    value = cfg.get(name)
    if value is None:
        value = _get(cfg, name, what) if default is None else default
    if not is_integer(value) or not low <= value <= high:
        raise ConfigError(f"{what} config {name}={value!r} must be an integer in "
                          f"[{low}, {high}]")
    return value


def _default(cfg: dict, name: str, default):
    """cfg[name], or `default` where it is missing or null (as transformers reads it)."""
    value = cfg.get(name)
    return default if value is None else value


def _flag(cfg: dict, name: str, what: str) -> bool:
    """cfg[name] (missing or null: false) as a bool: a string such as "false" would read as
    true."""
    value = _default(cfg, name, False)
    if not isinstance(value, bool):
        raise ConfigError(f"{what} config {name}={value!r} must be true or false")
    return value


# bias flags a config may set that dflash's implementation of the architecture would not follow
# the way transformers does
UNIMPLEMENTED_BIASES = {
    "LlamaForCausalLM": {"mlp_bias": "MLP biases are not implemented"},
    "Qwen2ForCausalLM": {"attention_bias": "transformers gives Qwen2 q/k/v biases and no o_proj "
                                           "bias whatever it says, dflash would add one"},
}
SILU_NAMES = ("silu", "swish")   # transformers' names for the one activation implemented


def _check_computed_as_configured(cfg: dict, what: str) -> None:
    """Refuse config fields that change what the model computes but are not implemented, rather
    than compute another model's outputs."""
    quantization = cfg.get("quantization_config")
    if quantization is not None:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        raise ConfigError(f"{what} config quantization_config (quant_method {method!r}) is not "
                          f"supported: dflash reads unquantized weights (and quantizes them "
                          f"itself with quantization=...)")
    act = cfg.get("hidden_act", "silu")
    if act not in SILU_NAMES:
        raise ConfigError(f"{what} config hidden_act={act!r} is not supported (silu only)")


@dataclass(frozen=True)
class AttentionConfig:
    """What a decoder layer's attention needs; shared by targets and drafts."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    attention_bias: bool

    @classmethod
    def from_hf(cls, cfg: dict, what: str) -> AttentionConfig:
        hidden = _size(cfg, "hidden_size", what)
        heads = _size(cfg, "num_attention_heads", what, high=MAX_COUNT)
        theta, scaling = _rope(cfg, what)
        kv_heads = _size(cfg, "num_key_value_heads", what, heads, high=MAX_COUNT)
        if heads % kv_heads:
            raise ConfigError(f"{what}: num_attention_heads {heads} is not a multiple of "
                              f"num_key_value_heads {kv_heads}")
        if cfg.get("head_dim") is None and hidden % heads:
            raise ConfigError(f"{what}: hidden_size {hidden} is not a multiple of "
                              f"num_attention_heads {heads} (and no head_dim is given)")
        return cls(hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads,
                   head_dim=_size(cfg, "head_dim", what, hidden // heads),
                   rms_norm_eps=_number(_default(cfg, "rms_norm_eps", 1e-6), "rms_norm_eps",
                                        what, open_low=False),
                   rope_theta=theta,
                   rope_scaling=scaling,
                   max_position_embeddings=_size(cfg, "max_position_embeddings", what, 32768,
                                                 high=MAX_INDEX),
                   attention_bias=_flag(cfg, "attention_bias", what))


@dataclass(frozen=True)
class TargetConfig:
    architecture: str
    attn: AttentionConfig
    vocab_size: int
    num_layers: int
    intermediate_size: int
    qk_norm: bool
    qkv_bias: bool
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...] = ()
    # Mixture of experts (Qwen3-MoE); num_experts == 0 means dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = field(default=())

    @classmethod
    def from_hf(cls, cfg: dict) -> TargetConfig:
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        _check_attention_layers(cfg, arch)
        if arch not in SUPPORTED_TARGETS:
            raise ConfigError(f"target architecture {arch!r} is not supported; "
                              f"supported: {', '.join(SUPPORTED_TARGETS)}")
        _check_computed_as_configured(cfg, "target")
        for name, why in UNIMPLEMENTED_BIASES.get(arch, {}).items():
            if _flag(cfg, name, "target"):
                raise ConfigError(f"target config {name}=True is not supported for {arch}: {why}")
        eos = cfg.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        if not all(is_integer(t) and t >= 0 for t in eos):
            raise ConfigError(f"target config eos_token_id={cfg['eos_token_id']!r} must be a "
                              f"token id or a list of them")
        attn = AttentionConfig.from_hf(cfg, "target")
        return cls(
            architecture=arch,
            attn=attn,
            vocab_size=_size(cfg, "vocab_size", "target", high=MAX_INDEX),
            num_layers=_size(cfg, "num_hidden_layers", "target", high=MAX_COUNT),
            intermediate_size=_size(cfg, "intermediate_size", "target", 0, low=0),
            qk_norm=arch in QK_NORM_ARCHITECTURES,
            qkv_bias=arch == "Qwen2ForCausalLM" or attn.attention_bias,
            tie_word_embeddings=_flag(cfg, "tie_word_embeddings", "target"),
            eos_token_ids=eos,
            **(_moe_fields(cfg) if arch == "Qwen3MoeForCausalLM" else {}),
        )

    def is_moe_layer(self, layer: int) -> bool:
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)


def _check_attention_layers(cfg: dict, arch: str | None) -> None:
    """Every layer of a target must be full attention: a linear-attention or sliding-window
    layer computes other outputs than dflash's. `layer_types` (as transformers 5 writes it)
    says so per layer; an older config only sets `use_sliding_window`."""
    types = set(cfg.get("layer_types") or [])
    linear = sorted(t for t in types if "linear" in t)
    if linear or arch == "Qwen3NextForCausalLM":
        kind = linear[0] if linear else "linear_attention (Qwen3-Next)"
        raise ConfigError(f"target {arch}: hybrid / linear-attention layers are not supported "
                          f"(layer type {kind!r}); dflash supports full-attention targets only")
    other = sorted(types - {"full_attention"})
    if other:
        raise ConfigError(f"target config layer_types has {other}: dflash attends to the full "
                          f"context (full_attention layers only)")
    if not types and cfg.get("use_sliding_window"):
        raise ConfigError("target config use_sliding_window=True is not supported: dflash "
                          "attends to the full context")


def _moe_fields(cfg: dict) -> dict:
    """The routed-experts fields of a Qwen3-MoE config, each checked: they size the expert
    tensors and the router's top-k."""
    # Qwen's configs say num_experts, transformers 5 writes num_local_experts
    name = "num_experts" if cfg.get("num_experts") is not None else "num_local_experts"
    experts = _size(cfg, name, "target", high=MAX_COUNT)
    return dict(num_experts=experts,
                num_experts_per_tok=_size(cfg, "num_experts_per_tok", "target", high=experts),
                moe_intermediate_size=_size(cfg, "moe_intermediate_size", "target"),
                norm_topk_prob=_flag(cfg, "norm_topk_prob", "target"),
                decoder_sparse_step=cfg.get("decoder_sparse_step", 1) or 1,
                mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()))


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """docs/design.md 2: [L // 2] for one draft layer, else round(1 + i * (L - 4) / (n - 1))."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    return [round(1 + i * (num_target_layers - 4) / (num_draft_layers - 1))
            for i in range(num_draft_layers)]


@dataclass(frozen=True)
class DraftConfig:
    attn: AttentionConfig
    num_layers: int
    intermediate_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, cfg: dict, target: TargetConfig) -> DraftConfig:
        archs = cfg.get("architectures") or []
        if archs != ["DFlashDraftModel"]:
            raise ConfigError(f"draft architectures must be ['DFlashDraftModel'], got {archs}")
        dflash_cfg = cfg.get("dflash_config") or {}

        def field_(name, default=None):
            value = dflash_cfg.get(name, cfg.get(name, default))
            if value is None:
                raise ConfigError(f"draft config has no {name!r} (in dflash_config or top level)")
            return value

        layers = _size(cfg, "num_hidden_layers", "draft", high=MAX_COUNT)
        ids = field_("target_layer_ids", default_target_layer_ids(target.num_layers, layers))
        if not isinstance(ids, (list, tuple)):
            raise ConfigError(f"draft target_layer_ids {ids!r} must be a list of layer ids")
        for i in ids:
            if not is_integer(i) or not 0 <= i < target.num_layers:
                raise ConfigError(f"draft target_layer_ids {ids!r}: id {i!r} is outside the "
                                  f"target's {target.num_layers} layers [0, {target.num_layers})")
        mask = field_("mask_token_id")
        if not is_integer(mask) or not 0 <= mask < target.vocab_size:
            raise ConfigError(f"draft mask_token_id {mask!r} is outside the target vocabulary "
                              f"of {target.vocab_size}")
        block = field_("block_size", 16)
        if not is_integer(block) or block < 2:
            raise ConfigError(f"draft block_size must be an integer >= 2, got {block!r}")
        _check_computed_as_configured(cfg, "draft")
        attn = AttentionConfig.from_hf(cfg, "draft")
        if attn.hidden_size != target.attn.hidden_size:
            raise ConfigError(f"draft hidden_size {attn.hidden_size} != target hidden_size "
                              f"{target.attn.hidden_size}")
        if cfg.get("use_sliding_window"):
            warnings.warn("draft config sets use_sliding_window: the sliding window is not "
                          "applied (dflash attends to the full context)", stacklevel=2)
        return cls(attn=attn, num_layers=layers,
                   intermediate_size=_size(cfg, "intermediate_size", "draft"),
                   block_size=block, mask_token_id=mask, target_layer_ids=tuple(ids))
