"""The engine thread: one background thread owns the `LLMEngine` and steps it; HTTP handlers
(on the event loop) hand requests and aborts over through a thread-safe queue, and get each
request's step outputs back on an asyncio queue (docs/design.md 4.5)."""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import replace

from ..engine import LLMEngine, RequestMetrics, StepOutput
from ..sampling import SamplingParams
from .metrics import ServerMetrics


class ShuttingDown(RuntimeError):
    """What ends the requests the server still holds when it stops (a 503)."""

    def __init__(self):
        super().__init__("the server is shutting down")


class Handle:
    """One request's hand-over: created on the event loop, filled by the engine thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, prompt_ids: list[int],
                 params: SamplingParams, on_release):
        self.loop = loop
        self._on_release = on_release
        self.released = False
        self.prompt_ids, self.params = prompt_ids, params
        self.arrival = time.perf_counter()
        self.events: asyncio.Queue = asyncio.Queue()
        self.engine_id: int | None = None
        self.finished = False          # set on the event loop when the last event is read
        self.closed = False
        self.streaming = False         # a StreamingResponse owns the handle (and closes it)
        # the figures the Prometheus counters already include (engine thread)
        self.counted = RequestMetrics()

    def deliver(self, event) -> None:
        """From the engine thread: a StepOutput, or an Exception that ends the request."""
        try:
            self.loop.call_soon_threadsafe(self._receive, event)
        except RuntimeError:   # the event loop is closed: nobody is waiting any more
            pass

    def _receive(self, event) -> None:
        self.events.put_nowait(event)
        if isinstance(event, Exception) or event.finished:
            self.release()

    def release(self) -> None:
        """Give the request's server slot back, once: when the engine is done with it or when
        its response ends, whichever comes first (a client that reads slowly holds none)."""
        if not self.released:
            self.released = True
            self._on_release()


class EngineThread:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, on_failure=None):
        """`on_failure()` is called (from the engine thread) if the thread dies of an error."""
        self.engine = engine
        self.on_failure = on_failure
        self.metrics = metrics
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._handles: dict[int, Handle] = {}
        self._thread = threading.Thread(target=self._run, name="dflash-engine", daemon=True)
        self._stopping = False
        self.error: BaseException | None = None   # what stopped the thread, if not stop()
        # the latest aborts: (step when requested, step when its blocks were freed)
        self.aborts: deque[tuple[int, int]] = deque(maxlen=1024)

    # ------------------------------------------------------------------- from the event loop
    def start(self) -> None:
        self._thread.start()

    def started(self) -> bool:
        return self._thread.ident is not None

    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def running(self) -> bool:
        """True while the thread runs: after `stop`, while it finishes the step it was in."""
        return self._thread.is_alive()

    def submit(self, handle: Handle) -> None:
        self._commands.put(("add", handle))

    def abort(self, handle: Handle) -> None:
        self._commands.put(("abort", handle, self.engine.num_steps))

    def stop(self, timeout: float = 30.0) -> None:
        """Abort whatever still runs and end the thread."""
        self._commands.put(("stop",))
        self._thread.join(timeout)

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        try:
            self._publish_load()   # before the first request: /metrics shows the free cache
            while True:
                command = self._commands.get() if not self.engine.has_unfinished() else None
                commands = [] if command is None else [command]
                while True:
                    try:
                        commands.append(self._commands.get_nowait())
                    except queue.Empty:
                        break
                for c in commands:
                    if c[0] == "stop":
                        self._stop()
                        return
                    self._command(c)
                self._publish_load()
                if self.engine.has_unfinished():
                    self._step()
                    self._publish_load()
        except BaseException as e:   # a bug in this loop: fail every request, stop serving
            self.error = e
            traceback.print_exc(file=sys.stderr)
            for handle in self._handles.values():
                handle.deliver(RuntimeError(f"the engine thread failed: {e}"))
            self._handles.clear()
            if self.on_failure is not None:
                self.on_failure()
            raise

    def _command(self, c) -> None:
        if c[0] == "add":
            handle = c[1]
            if handle.closed:
                return
            try:
                handle.engine_id = self.engine.add_request(
                    handle.prompt_ids, handle.params, detokenize=True, arrival_time=handle.arrival)
            except Exception as e:
                handle.deliver(e)
                return
            self._handles[handle.engine_id] = handle
            self.metrics.prompt_tokens.inc(len(handle.prompt_ids))
        elif c[0] == "abort":
            handle, requested_at = c[1], c[2]
            if handle.engine_id is not None and self.engine.abort(handle.engine_id):
                self._handles.pop(handle.engine_id, None)
                self.aborts.append((requested_at, self.engine.num_steps))
                self.metrics.finished("abort")

    def _stop(self) -> None:
        self._stopping = True
        for request_id, handle in list(self._handles.items()):
            self.engine.abort(request_id)
            handle.deliver(ShuttingDown())
        self._handles.clear()
        while self.engine.has_unfinished():   # report the aborts (nothing runs any more)
            self.engine.step()
        self._publish_load()

    def _step(self) -> None:
        outputs = self.engine.step()
        for out in outputs:
            handle = self._handles.get(out.request_id)
            if handle is None:
                continue
            self._count(handle, out)
            handle.deliver(out)
            if out.finished:
                del self._handles[out.request_id]

    def _count(self, handle: Handle, out: StepOutput) -> None:
        m, counted, metrics = out.metrics, handle.counted, self.metrics
        metrics.generation_tokens.inc(len(out.new_token_ids))
        if m is not None:
            metrics.num_drafts.inc(m.num_drafts - counted.num_drafts)
            metrics.num_draft_tokens.inc(m.num_draft_tokens - counted.num_draft_tokens)
            metrics.num_accepted_tokens.inc(m.num_accepted_tokens - counted.num_accepted_tokens)
            before = counted.accepted_per_position + [0] * len(m.accepted_per_position)
            for i, n in enumerate(m.accepted_per_position):
                if n > before[i] and i < len(metrics.accepted_per_pos):
                    metrics.accepted_per_pos[i].inc(n - before[i])
            if counted.first_token_time is None and m.time_to_first_token is not None:
                metrics.ttft.observe(m.time_to_first_token)
            handle.counted = replace(m, accepted_per_position=list(m.accepted_per_position))
            if out.finished:
                if m.time_per_output_token is not None:
                    metrics.tpot.observe(m.time_per_output_token)
                if m.finish_time is not None:
                    metrics.e2e.observe(m.finish_time - m.arrival_time)
        if out.finished:
            metrics.finished(out.finish_reason or "unknown")

    def _publish_load(self) -> None:
        self.metrics.set_load(self.engine.num_running, self.engine.num_waiting,
                              self.engine.allocator.num_free)
        self.metrics.set_trees(self.engine.stats)
