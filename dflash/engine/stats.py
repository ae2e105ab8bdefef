"""The engine's running figures: finished requests' sums and what the decode steps did."""

from __future__ import annotations

from . import tree
from .request import Request, RequestMetrics


class Stats:
    """Running sums since the engine started or `reset`: constant memory however long a server
    runs. `elapsed_s` is the time spent in `LLMEngine.step`."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.elapsed_s = 0.0
        self.requests = self.num_drafts = self.num_draft_tokens = 0
        self.num_accepted_tokens = self.generated_tokens = 0
        self.accepted_per_position: list[int] = []
        self.ttft_sum = self.tpot_sum = 0.0
        self.ttft_count = self.tpot_count = 0
        self.steps = self.draft_skipped = 0
        self.verify_lengths = [0] * block_size   # request-steps that verified k drafts
        self.tree_steps = 0
        self.tree_nodes: dict[int, int] = {}     # request-steps of tree steps by nodes verified
        self.tree_depths: dict[int, int] = {}    # ... by accepted depth
        # draft nodes of tree steps by their draft path probability (tree.BINS bins), and those
        # of them on the accepted path: how well the draft's confidence predicts acceptance
        self.confidence_verified = [0] * tree.BINS
        self.confidence_accepted = [0] * tree.BINS
        # nodes of tree steps only the prompt lookup proposed, and those accepted
        self.lookup_verified = self.lookup_accepted = 0

    def add(self, m: RequestMetrics) -> None:
        """Count a finished request."""
        self.requests += 1
        self.num_drafts += m.num_drafts
        self.num_draft_tokens += m.num_draft_tokens
        self.num_accepted_tokens += m.num_accepted_tokens
        self.generated_tokens += m.generated_tokens
        per_position = self.accepted_per_position
        per_position += [0] * (len(m.accepted_per_position) - len(per_position))
        for i, n in enumerate(m.accepted_per_position):
            per_position[i] += n
        if m.time_to_first_token is not None:
            self.ttft_sum += m.time_to_first_token
            self.ttft_count += 1
        if m.time_per_output_token is not None:
            self.tpot_sum += m.time_per_output_token
            self.tpot_count += 1

    def record_step(self, running: list[Request], num_drafts: list[int],
                    accepted: list[int]) -> None:
        """Count a decode step in which running[i] verified num_drafts[i] drafts and accepted
        accepted[i] of them."""
        self.steps += 1
        self.draft_skipped += self.block_size > 1 and not any(num_drafts)
        for r, k, a in zip(running, num_drafts, accepted):
            self.verify_lengths[k] += 1
            if k > 0:
                r.metrics.record_step(k, a)

    def record_tree_step(self, running: list[Request], trees: list[tree.Tree],
                         paths: list[list[int]]) -> None:
        """Count a tree step in which running[i] verified trees[i] and accepted the path
        paths[i] (node indices from the root)."""
        self.steps += 1
        self.tree_steps += 1
        self.draft_skipped += all(len(t) == 1 for t in trees)
        for r, t, path in zip(running, trees, paths):
            k, a = len(t) - 1, len(path) - 1
            self.tree_nodes[k] = self.tree_nodes.get(k, 0) + 1
            self.tree_depths[a] = self.tree_depths.get(a, 0) + 1
            if k > 0:
                r.metrics.record_step(k, a, max(t.depths))
        scores, _, accepted = tree.verified_nodes(trees, paths)
        for b, hit in zip(tree.confidence_bins(scores).tolist(), accepted):
            self.confidence_verified[b] += 1
            self.confidence_accepted[b] += hit
        _, _, accepted = tree.verified_nodes(trees, paths, lookup=True)
        self.lookup_verified += len(accepted)
        self.lookup_accepted += sum(accepted)

    def summary(self) -> dict:
        b = self.block_size
        tau = 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
        return {
            "requests": self.requests,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": (self.accepted_per_position + [0] * b)[:b - 1],
            "mean_acceptance_length": tau,
            "draft_acceptance_rate": (tau - 1) / (b - 1) if b > 1 else 0.0,
            "generated_tokens": self.generated_tokens,
            "elapsed_s": self.elapsed_s,
            "throughput_tok_s": self.generated_tokens / self.elapsed_s if self.elapsed_s else 0.0,
            "mean_ttft_s": self.ttft_sum / self.ttft_count if self.ttft_count else None,
            "mean_tpot_s": self.tpot_sum / self.tpot_count if self.tpot_count else None,
            "decode_steps": self.steps,
            "draft_skipped_steps": self.draft_skipped,
            "verify_length_histogram": list(self.verify_lengths),
            "tree_steps": self.tree_steps,
            # request-steps of tree steps by draft nodes verified, and by accepted depth
            "tree_node_histogram": dict(sorted(self.tree_nodes.items())),
            "tree_accepted_depth_histogram": dict(sorted(self.tree_depths.items())),
            # verified draft nodes by draft path probability (bins up to bin_upper), and how
            # many of them were accepted
            "tree_confidence": {"bin_upper": list(tree.BIN_UPPERS),
                                "verified": list(self.confidence_verified),
                                "accepted": list(self.confidence_accepted)},
            # verified nodes only the prompt lookup proposed, and how many were accepted
            "tree_lookup_nodes": {"verified": self.lookup_verified,
                                  "accepted": self.lookup_accepted},
        }
