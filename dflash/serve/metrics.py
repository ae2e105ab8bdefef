"""`/metrics`: Prometheus text format with vLLM's metric names, so dashboards and tools written
for `vllm serve` read dflash unchanged. Every metric carries a `model_name` label, as in vLLM."""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from ..engine import tree
from ..engine.stats import Stats

# vLLM's buckets
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    """The server's metrics in their own registry (several servers may live in one process)."""

    def __init__(self, model_name: str, num_positions: int, num_blocks: int):
        self.registry = r = CollectorRegistry()
        label = {"model_name": model_name}
        self.label = label

        def counter(name, doc, labels=()):
            return Counter(name, doc, ["model_name", *labels], registry=r)

        def gauge(name, doc):
            return Gauge(name, doc, ["model_name"], registry=r).labels(**label)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, ["model_name"], buckets=buckets,
                             registry=r).labels(**label)

        self.num_drafts = counter("vllm:spec_decode_num_drafts",
                                  "Verification steps that carried drafts.").labels(**label)
        self.num_draft_tokens = counter("vllm:spec_decode_num_draft_tokens",
                                        "Draft tokens verified.").labels(**label)
        self.num_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens",
                                           "Draft tokens accepted.").labels(**label)
        per_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                          "Draft tokens accepted, per draft position.", ["position"])
        self.accepted_per_pos = [per_pos.labels(position=str(i), **label)
                                 for i in range(num_positions)]
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens processed.").labels(
            **label)
        self.generation_tokens = counter("vllm:generation_tokens",
                                         "Generated tokens.").labels(**label)
        self._success = counter("vllm:request_success", "Finished requests, by finish reason.",
                                ["finished_reason"])
        self.running = gauge("vllm:num_requests_running", "Requests decoding now.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting for admission.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc",
                              "Fraction of the KV-cache blocks in use (1 = all).")
        self.free_blocks = gauge("dflash:kv_cache_free_blocks", "Free KV-cache blocks.")
        gauge("dflash:kv_cache_total_blocks", "KV-cache blocks in all.").set(num_blocks)
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Time from arrival to the first generated token.", TTFT_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds",
                              "Per request: (finish - first token) / (output tokens - 1).",
                              TPOT_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Time from arrival to the end of the request.", E2E_BUCKETS)
        self.num_blocks = num_blocks
        self.tree_steps = gauge("dflash:spec_decode_tree_steps",
                                "Decode steps that verified trees of drafts, since start.")
        self._tree_nodes = Gauge("dflash:spec_decode_tree_request_steps",
                                 "Request-steps of tree steps, by draft nodes verified.",
                                 ["model_name", "nodes"], registry=r)
        self._tree_depths = Gauge("dflash:spec_decode_tree_accepted_depth",
                                  "Request-steps of tree steps, by accepted path length.",
                                  ["model_name", "depth"], registry=r)
        self._lookup = Gauge("dflash:spec_decode_tree_lookup_nodes",
                             "Nodes of tree steps only the prompt lookup proposed, verified and "
                             "on the accepted path.", ["model_name", "kind"], registry=r)
        self._confidence = {
            kind: Gauge(f"dflash:spec_decode_tree_{kind}_nodes",
                        f"Draft nodes of tree steps {doc}, by the draft's path probability (the "
                        "upper bound of its bin).", ["model_name", "confidence"], registry=r)
            for kind, doc in (("verified", "verified"),
                              ("accepted", "on the accepted path"))}

    def set_trees(self, stats: Stats) -> None:
        """The engine's tree figures: totals since start. The accepted / verified nodes of a
        confidence bin are how often the draft's confidence there came true."""
        self.tree_steps.set(stats.tree_steps)
        for k, n in stats.tree_nodes.items():
            self._tree_nodes.labels(nodes=str(k), **self.label).set(n)
        for k, n in stats.tree_depths.items():
            self._tree_depths.labels(depth=str(k), **self.label).set(n)
        self._lookup.labels(kind="verified", **self.label).set(stats.lookup_verified)
        self._lookup.labels(kind="accepted", **self.label).set(stats.lookup_accepted)
        for kind, counts in (("verified", stats.confidence_verified),
                             ("accepted", stats.confidence_accepted)):
            for upper, n in zip(tree.BIN_UPPERS, counts):
                self._confidence[kind].labels(confidence=str(upper), **self.label).set(n)

    def finished(self, reason: str) -> None:
        self._success.labels(finished_reason=reason, **self.label).inc()

    def set_load(self, running: int, waiting: int, free_blocks: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.free_blocks.set(free_blocks)
        self.kv_usage.set(1.0 - free_blocks / self.num_blocks)

    def render(self) -> bytes:
        return generate_latest(self.registry)
