"""The DFlash engine: scheduler, worker and paged caches."""

from .args import EngineArgs
from .cache import BlockAllocator
from .engine import LLMEngine, StepOutput
from .llm import LLM
from .request import RequestMetrics, RequestOutput

__all__ = ["LLM", "LLMEngine", "EngineArgs", "StepOutput", "BlockAllocator", "RequestMetrics",
           "RequestOutput"]
