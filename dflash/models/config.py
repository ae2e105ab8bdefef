"""Model configurations read from Hugging Face `config.json` dicts (docs/design.md section 2)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

SUPPORTED_TARGETS = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "LlamaForCausalLM",
                     "Qwen2ForCausalLM")
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


class ConfigError(ValueError):
    """A checkpoint's config is missing a field, has a bad value, or is not supported."""


def _rope(cfg: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from either the transformers-5 `rope_parameters` or the older fields."""
    params = cfg.get("rope_parameters") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or params
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise ConfigError(f"rope scaling type {rope_type!r} is not supported (default, llama3)")
    return float(theta), {k: scaling[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                  "original_max_position_embeddings")}


def _get(cfg: dict, name: str, what: str):
    if name not in cfg:
        raise ConfigError(f"{what} config.json has no {name!r}")
    return cfg[name]


# Bounds far beyond any real model: a value outside them is a broken or hostile config, refused
# before it sizes an allocation.
MAX_DIM = 2**20         # hidden, head and MLP sizes
MAX_COUNT = 2**14       # heads, layers, experts
MAX_INDEX = 2**31 - 1   # vocabulary size, positions


def _size(cfg: dict, name: str, what: str, default=None, low: int = 1, high: int = MAX_DIM
          ) -> int:
    """cfg[name] (or `default` where it is missing or null; required without a default) as an
    integer in [low, high]."""
    value = cfg.get(name)
    if value is None:
        value = _get(cfg, name, what) if default is None else default
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ConfigError(f"{what} config {name}={value!r} must be an integer in "
                          f"[{low}, {high}]")
    return value


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
        theta, scaling = _rope(cfg)
        kv_heads = _size(cfg, "num_key_value_heads", what, heads, high=MAX_COUNT)
        if heads % kv_heads:
            raise ConfigError(f"{what}: num_attention_heads {heads} is not a multiple of "
                              f"num_key_value_heads {kv_heads}")
        if cfg.get("head_dim") is None and hidden % heads:
            raise ConfigError(f"{what}: hidden_size {hidden} is not a multiple of "
                              f"num_attention_heads {heads} (and no head_dim is given)")
        return cls(hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads,
                   head_dim=_size(cfg, "head_dim", what, hidden // heads),
                   rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=theta,
                   rope_scaling=scaling,
                   max_position_embeddings=_size(cfg, "max_position_embeddings", what, 32768,
                                                 high=MAX_INDEX),
                   attention_bias=bool(cfg.get("attention_bias", False)))


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
        linear = sorted({t for t in cfg.get("layer_types") or [] if "linear" in t})
        if linear or arch == "Qwen3NextForCausalLM":
            kind = linear[0] if linear else "linear_attention (Qwen3-Next)"
            raise ConfigError(f"target {arch}: hybrid / linear-attention layers are not supported "
                              f"(layer type {kind!r}); dflash supports full-attention targets only")
        if arch not in SUPPORTED_TARGETS:
            raise ConfigError(f"target architecture {arch!r} is not supported; "
                              f"supported: {', '.join(SUPPORTED_TARGETS)}")
        eos = cfg.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        num_experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
        if arch != "Qwen3MoeForCausalLM":
            num_experts = 0
        return cls(
            architecture=arch,
            attn=AttentionConfig.from_hf(cfg, "target"),
            vocab_size=_size(cfg, "vocab_size", "target", high=MAX_INDEX),
            num_layers=_size(cfg, "num_hidden_layers", "target", high=MAX_COUNT),
            intermediate_size=_size(cfg, "intermediate_size", "target", 0, low=0),
            qk_norm=arch in QK_NORM_ARCHITECTURES,
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_token_ids=eos,
            num_experts=num_experts,
            num_experts_per_tok=cfg.get("num_experts_per_tok", 0),
            moe_intermediate_size=cfg.get("moe_intermediate_size", 0),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            decoder_sparse_step=cfg.get("decoder_sparse_step", 1) or 1,
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
        )

    def is_moe_layer(self, layer: int) -> bool:
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)


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
        for i in ids:
            if not isinstance(i, int) or not 0 <= i < target.num_layers:
                raise ConfigError(f"draft target_layer_ids {list(ids)}: id {i} is outside the "
                                  f"target's {target.num_layers} layers [0, {target.num_layers})")
        mask = field_("mask_token_id")
        if not isinstance(mask, int) or not 0 <= mask < target.vocab_size:
            raise ConfigError(f"draft mask_token_id {mask} is outside the target vocabulary "
                              f"of {target.vocab_size}")
        block = field_("block_size", 16)
        if not isinstance(block, int) or block < 2:
            raise ConfigError(f"draft block_size must be an integer >= 2, got {block}")
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
