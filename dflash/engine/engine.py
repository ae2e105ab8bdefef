"""The online engine: requests join and leave between steps (docs/design.md 4.5).

`LLM.generate` is a loop over it; `dflash serve` steps it in a background thread. One `step()` is
one scheduler iteration: admit waiting requests whose whole cache reservation is free (up to
max_num_seqs) and prefill them, then one decode step (draft, verify, commit) for every running
request. Finished and aborted requests give their cache blocks back at once.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from ..sampling import SamplingParams
from . import tree
from .args import EngineArgs, dtype_name
from .loading import load
from .processor import Processor
from .request import Request, RequestMetrics, RequestOutput
from .speculation import Planner
from .stats import Stats

logger = logging.getLogger("dflash")

# prompt tokens a step prefills for one long prompt: the other requests' tokens wait at most
# this long prefill a step, not a whole prompt's (within PANEL_MAX_ROWS, so a chunk's linears
# sum each row as a whole prompt's would)
PREFILL_CHUNK = 256


@dataclass
class StepOutput:
    """What one step did for one request. Unpacks as (request_id, new_token_ids, finished,
    finish_reason)."""

    request_id: int
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    text: str | None = None                 # the new text (None without a detokenizer)
    output: RequestOutput | None = None     # the whole output, once finished
    metrics: RequestMetrics | None = None   # the request's figures so far

    def __iter__(self):
        yield from (self.request_id, self.new_token_ids, self.finished, self.finish_reason)


class LLMEngine:
    """Continuous batching over paged caches: the engine owns the models, worker, cache allocator,
    request processor, verify-length planner and figures (`dflash.LLM` is its offline facade).

    Args:
        args: what to build (`EngineArgs`: the arguments `dflash.LLM` documents).
        isolate_errors: False (what `LLM.generate` uses): an error inside a step frees the cache
            blocks of every request in flight and propagates. True (what the server uses): when a
            batched model call raises, each of its requests runs again alone; the ones that still
            raise finish with finish_reason "error" (and `output.error`), the others continue.

    Attributes: `target`, `draft`, `tokenizer`, `dtype`, `block_size`, `max_num_seqs`,
    `max_model_len`, `worker`, `allocator`, `processor` (requests in, outputs out), `cost_model`
    (measured at start and cached; None for a target-only engine of a given dtype, which has
    nothing to choose), `planner` (the verify-length chooser, None unless adaptive), `stats`.

    Not thread-safe: one thread calls add_request, abort and step (the server's engine thread).
    """

    def __init__(self, args: EngineArgs, isolate_errors: bool = False):
        loaded = load(args)
        self.group = loaded.group   # the tensor-parallel ranks, None without tensor parallelism
        self.target, self.draft, self.tokenizer = loaded.target, loaded.draft, loaded.tokenizer
        self.dtype, self.block_size = loaded.dtype, loaded.block_size
        self.max_num_seqs, self.max_model_len = loaded.max_num_seqs, loaded.max_model_len
        self.worker, self.allocator, self.cost_model = \
            loaded.worker, loaded.allocator, loaded.cost_model
        self.processor = Processor(self.tokenizer, self.target.cfg.vocab_size, loaded.stop_ids,
                                   self.block_size, self.max_model_len, self.allocator)
        self.planner = None if self.cost_model is None or self.draft is None or \
            args.speculation == "fixed" else Planner(self.block_size - 1, self.cost_model,
                                                     trees=args.speculation == "adaptive")
        # "adaptive" verifies trees of drafts where the worker can (section 4.6), "chain" chains
        self.trees = self.planner is not None and args.speculation == "adaptive"
        self.stats = Stats(self.block_size)
        self.isolate_errors = isolate_errors
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_steps = 0
        self._admitting: list[Request] = []
        self.prefilling: list[Request] = []       # admitted, prompt longer than PREFILL_CHUNK
        self._requests: dict[int, Request] = {}   # live or not yet reported as finished
        self._reported: dict[int, int] = {}       # output tokens already handed out
        self._done: list[Request] = []            # ended between steps (aborts)
        self._on_tokens: dict[int, object] = {}   # request id -> its streaming callback

    # ----------------------------------------------------------------------------- requests
    def add_request(self, prompt, params: SamplingParams | None = None, detokenize: bool = False,
                    arrival_time: float | None = None, on_tokens=None) -> int:
        """Queue a prompt (a string or token ids); returns its request id. `detokenize`: keep
        the text incrementally (`StepOutput.text` deltas); stop strings imply it.
        `on_tokens(new_token_ids)` is called as its tokens are committed. Raises ValueError for
        a request that can never run (too long, bad token ids)."""
        r = self.processor.request(prompt, SamplingParams() if params is None else params,
                                   detokenize=detokenize)
        if arrival_time is not None:
            r.metrics.arrival_time = arrival_time
        self.waiting.append(r)
        self._requests[r.request_id] = r
        if on_tokens is not None:
            self._on_tokens[r.request_id] = on_tokens
        return r.request_id

    def abort(self, request_id: int) -> bool:
        """End a waiting or running request now (finish_reason "abort"): its cache blocks are
        free before the next step, which reports it. False if it is unknown or already over."""
        r = self._requests.get(request_id)
        if r is None or r.finished:
            return False
        r.finish("abort")
        for queue in (self.running, self.prefilling, self.waiting):
            if r in queue:
                queue.remove(r)
                self._release(r)
        # else its first token is being committed (an on_tokens callback): the scheduler
        # retires it with the requests it admitted
        self._done.append(r)
        return True

    def has_unfinished(self) -> bool:
        """True while a request waits, runs, or has an end the next step() will report."""
        return bool(self.waiting or self.running or self.prefilling or self._done)

    @property
    def num_running(self) -> int:
        """Requests admitted: decoding, or prefilling a long prompt a chunk a step."""
        return len(self.running) + len(self.prefilling)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # --------------------------------------------------------------------------------- step
    def step(self) -> list[StepOutput]:
        """One scheduler iteration; one output per request that got tokens or ended."""
        start = time.perf_counter()
        try:
            return self._step()
        finally:
            self.stats.elapsed_s += time.perf_counter() - start

    def _step(self) -> list[StepOutput]:
        touched, self._done = self._done, []
        try:
            self._schedule(touched)
        except Exception as error:
            in_flight = list({id(r): r for r in
                              self.running + self._admitting + self.prefilling}.values())
            self.running, self._admitting, self.prefilling = [], [], []
            if not self.isolate_errors:
                for r in in_flight:   # an error mid-run must not leak cache blocks
                    self._release(r, count=False)
                    self._requests.pop(r.request_id, None)
                    self._reported.pop(r.request_id, None)
                raise
            for r in in_flight:
                if not r.finished:
                    self._fail(r, error)
                self._release(r)
            touched += in_flight
        seen, outputs = set(), []
        for r in touched:
            # a request's end is reported once (one aborted from a callback is touched twice)
            if r.request_id not in seen and r.request_id in self._requests:
                seen.add(r.request_id)
                outputs.append(self._report(r))
        return outputs

    def _schedule(self, touched: list[Request]) -> None:
        admitted = self._admitting
        while self.waiting and self.num_running + len(admitted) < self.max_num_seqs and \
                self.allocator.grow(self.waiting[0].block_table, self.processor.reservation(
                    len(self.waiting[0].prompt_ids), self.waiting[0].params)):
            admitted.append(self.waiting.popleft())
        admitted_any = bool(admitted)
        if admitted:
            # a long prompt prefills a chunk a step (below), so that it does not hold up the
            # streams of the running requests for all of its length
            self.prefilling += [r for r in admitted if len(r.prompt_ids) > PREFILL_CHUNK]
            self._start([r for r in admitted if len(r.prompt_ids) <= PREFILL_CHUNK], None,
                        touched)
            self._admitting = admitted = []
        if self.prefilling:
            r = self.prefilling[0]
            self._start([r], [min(r.num_cached + PREFILL_CHUNK, len(r.prompt_ids))], touched)
        self._retire()
        if not self.running:
            if self.waiting and not admitted_any and not self.prefilling:
                # all blocks are free: it must have fit
                raise RuntimeError("internal error: cache blocks were not returned")
            return
        running = list(self.running)
        touched += running
        num_drafts = [min(k, n) for k, n in zip(self._plan(running), self._room(running)[0])]
        if self.trees and self.planner is not None and any(num_drafts) and \
                self.worker.can_tree(running):
            self._tree_step(running, num_drafts)
        else:
            self._chain_step(running, num_drafts)
        self._retire()
        self.num_steps += 1

    def _start(self, requests: list[Request], ends: list[int] | None,
               touched: list[Request]) -> None:
        """Prefill `requests` up to `ends` (default: their prompts' ends); the ones whose
        prompts are done commit their first token and run."""
        if not requests:
            return
        ok, _, first = self._call(lambda rs, ks: self.worker.prefill(rs, ends), requests)
        # out of `prefilling` before their first commit: an abort from on_tokens then finds
        # them in no queue, and they are retired with the others (see abort)
        started = [r for r in requests if r.finished or r.num_cached == len(r.prompt_ids)]
        self.prefilling = [r for r in self.prefilling if r not in started]
        self._admitting = started
        done = [(r, token) for r, token in zip(ok, first) if token is not None]
        self._commit_each([r for r, _ in done], [[token] for _, token in done])
        self.running += started   # the ones that failed are finished: retired below
        touched += started
        self._admitting = []

    def _chain_step(self, running: list[Request], num_drafts: list[int]) -> None:
        step_start = time.perf_counter()
        ok, ks, results = self._call(lambda rs, ks: list(zip(*self.worker.step(rs, ks))),
                                     running, num_drafts)
        if ok:
            accepted = [a for _, a in results]
            if self.planner is not None:
                self.planner.observe(ok, ks, accepted)
                self.planner.observe_time(ks, time.perf_counter() - step_start)
            self.stats.record_step(ok, ks, accepted)
        self._commit_each(ok, [tokens for tokens, _ in results])

    def _tree_step(self, running: list[Request], num_drafts: list[int]) -> None:
        """In a step where the planner lets some sequences draft, every sequence verifies a
        tree chosen by `Planner.choose_nodes`: of the draft's candidates where it drafts, and
        of the prompt lookup's. A step where none drafts decodes without trees (design.md 4.6)."""
        step_start = time.perf_counter()

        def run(rs: list[Request], ks: list[int]):
            depths, reach = self._tree_depths(rs, ks)
            return list(zip(*self.worker.tree_step(
                rs, depths, reach, self.planner.tree_size(),
                lambda candidates, requests: self.planner.choose_nodes(
                    candidates, requests, sum(d > 0 for d in depths), max(depths)))))

        ok, ks, results = self._call(run, running, num_drafts)
        if ok:
            trees, paths = [t for _, t, _ in results], [p for _, _, p in results]
            self.planner.observe_trees(ok, trees, paths, self._tree_depths(ok, ks)[0],
                                       time.perf_counter() - step_start)
            self.stats.record_tree_step(ok, trees, paths)
        self._commit_each(ok, [tokens for tokens, _, _ in results])

    def _room(self, requests: list[Request]) -> tuple[list[int], list[int]]:
        """Per request, the most drafts its next step's draft pass may propose, and the deepest
        any node may lie (the prompt lookup's too): a step commits up to one token more than it
        verifies, and no sequence grows past max_model_len. The draft's block must fit there
        too (the RoPE tables end), so the last block_size - 1 tokens get no draft pass."""
        drafts, reach = [], []
        for r in requests:
            length = len(r.prompt_ids) + len(r.output_ids)
            left = self.max_model_len - length - 1
            drafts.append(left if length + self.block_size - 1 <= self.max_model_len else 0)
            reach.append(min(left, self.block_size - 1))
        return drafts, reach

    def _tree_depths(self, requests: list[Request], ks: list[int]
                     ) -> tuple[list[int], list[int]]:
        """Per request of a tree step (before its tokens are committed): how deep the draft's
        candidates may reach (`tree.depth_limits` of its chain length) and how deep any node
        may, within `_room`."""
        drafts, reach = self._room(requests)
        return [min(d, n) for d, n in zip(tree.depth_limits(ks, self.block_size - 1), drafts)], \
            reach

    def _plan(self, running: list[Request]) -> list[int]:
        if self.block_size == 1:
            return [0] * len(running)
        if self.planner is None:
            return [self.block_size - 1] * len(running)
        return self.planner.plan(running)

    def _call(self, fn, requests: list[Request], ks: list[int] | None = None):
        """fn(requests, ks) -> one result per request, for the requests (and their ks) that
        succeeded; see isolate_errors."""
        try:
            return requests, ks, fn(requests, ks)
        except Exception as error:
            if not self.isolate_errors:
                raise
            if len(requests) == 1:
                self._fail(requests[0], error)
                return [], [], []
        ok, ok_ks, results = [], [], []
        for i, r in enumerate(requests):
            k = None if ks is None else [ks[i]]
            try:
                result = fn([r], k)
            except Exception as error:
                self._fail(r, error)
                continue
            ok.append(r)
            ok_ks.append(None if ks is None else ks[i])
            results.append(result[0])
        return ok, ok_ks, results

    def _commit_each(self, requests: list[Request], token_lists: list[list[int]]) -> None:
        """Commit each request's tokens; with isolate_errors, a request whose commit raises
        (its detokenizer, its stop strings, on_tokens) fails alone."""
        for r, tokens in zip(requests, token_lists):
            try:
                self._commit(r, tokens)
            except Exception as error:
                if not self.isolate_errors:
                    raise
                self._fail(r, error)

    def _commit(self, r: Request, tokens: list[int]) -> None:
        before = len(r.output_ids)
        r.append(tokens)
        on_tokens = self._on_tokens.get(r.request_id)
        if on_tokens is not None:
            on_tokens(r.output_ids[before:])
        if len(r.prompt_ids) + len(r.output_ids) >= self.max_model_len and not r.finished:
            r.finish("length")

    def _fail(self, r: Request, error: Exception) -> None:
        r.error = f"{type(error).__name__}: {error}"
        logger.error("request %d failed", r.request_id, exc_info=error)
        r.finish("error", flush=False)   # its detokenizer may be what failed

    def _retire(self) -> None:
        for r in self.running:
            if r.finished:
                self._release(r)
        self.running = [r for r in self.running if not r.finished]

    def _release(self, r: Request, count: bool = True) -> None:
        if self.planner is not None:
            self.planner.forget(r.request_id)
        self.allocator.free(r.block_table)
        self._on_tokens.pop(r.request_id, None)
        if count:
            self.stats.add(r.metrics)

    def _report(self, r: Request) -> StepOutput:
        start = self._reported.get(r.request_id, 0)
        new = r.output_ids[start:]
        self._reported[r.request_id] = len(r.output_ids)
        text = None if r.detok is None else r.detok.take_delta()
        output = None
        if r.finished:
            output = self.processor.output(r)
            self._requests.pop(r.request_id, None)
            self._reported.pop(r.request_id, None)
        return StepOutput(r.request_id, new, r.finished, r.finish_reason, text, output,
                          r.metrics)

    # ---------------------------------------------------------------------------- metrics
    def metrics(self) -> dict:
        """Totals over every request finished so far (see `Stats`), and the engine's setup."""
        return {
            **self.stats.summary(),
            "dtype": dtype_name(self.dtype),
            "speculation": "none" if self.block_size == 1 else
            "adaptive" if self.trees else "chain" if self.planner is not None else "fixed",
            # per kind of request (greedy, sampled): the chooser's estimates
            "tree_calibration": None if getattr(self.planner, "calibrations", None) is None
            else {kind: c.as_dict() for kind, c in self.planner.calibrations.items()},
            "cost_model": None if self.cost_model is None else self.cost_model.to_json(),
            # the planner's fit of measured step time to the cost model's decode and
            # speculation parts (tests may plan with a stand-in that has none)
            "cost_model_correction": None if getattr(self.planner, "time", None) is None else
            self.planner.time.as_dict(),
        }

    def reset_metrics(self) -> None:
        self.stats = Stats(self.block_size)

    def close(self, kill: bool = False) -> None:
        """Stop the tensor-parallel ranks, politely unless `kill` (nothing to do without
        tensor parallelism)."""
        if self.group is not None:
            self.group.close(kill)
