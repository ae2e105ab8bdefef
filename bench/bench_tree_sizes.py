"""Acceptance by verify size: tau (tokens per step) of a chain of k argmax drafts against a
best-first tree of N draft nodes, each size fixed for a whole run of the bundled pair over the
held-out GSM8K questions, greedy. Sizes are forced by a fixed planner in place of the engine's;
every run must produce the same texts (greedy output is the target's own)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # this checkout's dflash and bench

from bench.common import write  # noqa: E402
from dflash import LLM, SamplingParams, assets  # noqa: E402
from dflash.bench import load_dataset  # noqa: E402
from dflash.engine.tree import MAX_NODES  # noqa: E402

SIZES = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64]


class FixedSizes:
    """The engine planner's interface with one answer: chains of `drafts` drafts, or trees of
    `nodes` nodes that may reach the whole block (the planner's chain length then is all of it)."""

    def __init__(self, drafts: int, nodes: int = 0):
        self.drafts, self.nodes = drafts, nodes

    def plan(self, requests):
        return [self.drafts] * len(requests)

    def tree_size(self):
        return self.nodes

    def choose_nodes(self, candidates, requests, drafting, depth):
        return [t.prefix(min(self.nodes, len(t) - 1) + 1) for t in candidates]

    def observe(self, *args):
        pass

    observe_time = observe_trees = observe

    def forget(self, request_id):
        pass


def run(llm: LLM, planner: FixedSizes, prompts: list[str], max_tokens: int):
    llm.engine.planner = planner
    llm.reset_metrics()
    outputs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens))
    return [o.token_ids for o in outputs], llm.metrics()["mean_acceptance_length"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="runs/gsm8k-heldout.jsonl")
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args(argv)
    prompts = load_dataset(args.dataset, args.num_prompts)
    target, draft = assets.smollm2_target(), assets.bundled_draft()
    kw = dict(dtype=args.dtype, max_num_seqs=len(prompts))
    chain, tree = (LLM(target, draft, speculation=s, **kw) for s in ("chain", "adaptive"))
    positions = chain.block_size - 1
    reference, rows = None, []
    for n in [s for s in SIZES if s <= MAX_NODES]:
        row = {"verify rows (drafts or nodes)": n}
        for name, llm, planner in (("chain", chain, FixedSizes(n) if n <= positions else None),
                                   ("tree", tree, FixedSizes(positions, n))):
            if planner is None:
                row[f"{name} tau"] = None
                continue
            texts, tau = run(llm, planner, prompts, args.max_tokens)
            reference = reference or texts
            row[f"{name} tau"] = round(tau, 3)
            row[f"{name} texts equal"] = sum(a == b for a, b in zip(texts, reference))
            print(name, n, row[f"{name} tau"], flush=True)
        rows.append(row)
    write("tree_sizes", rows, list(rows[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
