"""DFlash block-diffusion speculative decoding for Qwen3-family targets (CPU and Ascend NPU)."""

from . import ops  # noqa: F401  (registers torch.ops.dflash.*)
from .engine import LLM
from .sampling import SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"
