"""Target and draft models and their checkpoint loaders."""

from .config import ConfigError, DraftConfig, TargetConfig, default_target_layer_ids
from .draft import DFlashDraft
from .layers import AttentionMetadata
from .loader import CheckpointError, load_draft, load_target, load_tokenizer
from .target import TargetModel

__all__ = ["AttentionMetadata", "CheckpointError", "ConfigError", "DFlashDraft", "DraftConfig",
           "TargetConfig", "TargetModel", "default_target_layer_ids", "load_draft", "load_target",
           "load_tokenizer"]
