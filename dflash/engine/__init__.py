"""The DFlash engine: scheduler, worker and paged caches."""

from .cache import BlockAllocator
from .llm import LLM
from .request import RequestMetrics, RequestOutput

__all__ = ["LLM", "BlockAllocator", "RequestMetrics", "RequestOutput"]
