"""Tensor-parallel serving driven from one user process (`LLM(..., tp_size=N)`).

Design: the caller's process is rank 0. It runs the scheduler (`LLM.generate`) and makes every
sampling decision. `Group` spawns ranks 1..N-1 with torch.multiprocessing; each loads its shard of
the target (`dflash.models.parallel`) and a replicated draft, then follows: before every worker
call (prefill or decode step) rank 0 sends the batch's state over a pipe (prompt or pending
token, block table, cached length and sampling params per request), and every rank runs the same
`Worker` code, whose forwards meet in torch.distributed collectives (gloo on CPU, hccl on NPU).
The draft runs on every rank (the target features it reads are replicated, and its embedding and
lm_head are the vocab-split target's), but the draft tokens and the emitted / accepted tokens are
broadcast from rank 0, so every rank's caches follow rank 0's decisions exactly, whatever the
rounding of the collectives and whatever the followers' random streams (theirs are never used).

Failures: commands travel over pipes, not collectives, so an idle engine never times out. The
collectives have a timeout, so a rank that hangs fails the run after `timeout` seconds (as one
that hangs while loading fails the start, `timeout` seconds after rank 0 has loaded), and a rank
that dies closes its sockets, which fails rank 0's next collective at once; a follower that raises
sends its traceback first. Rank 0 then stops the whole group and raises one RuntimeError saying
what happened to each rank. The group is torch.distributed's default process group, so a process
holds one tensor-parallel LLM at a time (`LLM.close()` releases it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..models import load_draft, load_target
from ..models.parallel import TensorParallel
from .request import Request
from .worker import Worker

BACKENDS = {"cpu": "gloo", "npu": "hccl", "cuda": "nccl"}
_GRACE_S = 2.0          # how long a failing rank gets to report before it is killed
_MAX_REPORT = 8000      # characters of a follower's traceback kept (one pipe message)


def rank_device(device, rank: int) -> torch.device:
    """Rank r's device: the CPU for every rank, else accelerator r of this host."""
    device = torch.device(device)
    return device if device.type == "cpu" else torch.device(device.type, rank)


class TPWorker(Worker):
    """A Worker whose sampling decisions are rank 0's. On rank 0 (with a `group`) each call is
    first sent to the followers; on a follower (group None) `follow` replays rank 0's calls."""

    defer_context = False   # followers rebuild their requests every call: nothing can wait
    uniform_steps = False   # the ranks take rank 0's drafts and tokens, broadcast by the stages

    def __init__(self, tp: TensorParallel, group: Group | None, *worker_args):
        self.tp, self.group = tp, group
        super().__init__(*worker_args)

    def prefill(self, requests: list[Request], ends: list[int] | None = None):
        return self._lead("prefill", requests, lambda rs: super(TPWorker, self).prefill(
            rs, ends), ends)

    def step(self, requests: list[Request], num_drafts=None):
        if self.proposer is not None:
            raise ValueError("a scripted proposer is not supported with tensor parallelism")
        return self._lead("step", requests, lambda rs: super(TPWorker, self).step(
            rs, num_drafts=num_drafts), num_drafts)

    def tree_step(self, requests: list[Request], depths: list[int], reach: list[int],
                  size: int, choose):
        if self.proposer is not None:
            raise ValueError("a scripted proposer is not supported with tensor parallelism")
        return self._lead("tree_step", requests, lambda rs: super(TPWorker, self).tree_step(
            rs, depths, reach, size, choose), depths, reach, size)

    def measure_costs(self, *args):
        if self.group is None:
            return super().measure_costs(*args)
        self.group.send(("measure_costs", args))
        with self.group.stop_on_error():
            return super().measure_costs(*args)

    def _lead(self, kind: str, requests: list[Request], run, *extra):
        if self.group is None:
            return run(requests)
        self.group.send((kind, [_state(kind, r) for r in requests], *extra))
        with self.group.stop_on_error():
            return run(requests)

    def follow(self, kind: str, *payload) -> None:
        if kind == "measure_costs":
            self.measure_costs(*payload[0])
            return
        requests = [_mirror(s) for s in payload[0]]
        if kind == "prefill":
            self.prefill(requests, payload[1])
        elif kind == "tree_step":   # the sizes are rank 0's (grow_trees)
            self.tree_step(requests, payload[1], payload[2], payload[3],
                           lambda trees, _: [t.prefix(1) for t in trees])
        else:
            self.step(requests, num_drafts=payload[1])

    @torch.inference_mode()
    def draft_forward(self, inputs):
        drafts, probs = super().draft_forward(inputs)
        return self.tp.broadcast(drafts.contiguous()), probs

    def grow_trees(self, *args):
        return self.tp.broadcast_object(super().grow_trees(*args))

    def accept_trees(self, *args):
        return self.tp.broadcast_object(super().accept_trees(*args))

    @torch.inference_mode()
    def verify(self, *args):
        verified = super().verify(*args)
        verified.emitted, verified.accepted = self.tp.broadcast_object(
            (verified.emitted, verified.accepted))
        return verified


def _state(kind: str, r: Request) -> tuple:
    """What a follower needs of a request for one call (followers keep no request state)."""
    return (r.prompt_ids if kind == "prefill" else [], r.output_ids[-1:], r.block_table,
            r.num_cached, r.params, r.seed)


def _mirror(state: tuple) -> Request:
    prompt, pending, table, cached, params, seed = state
    r = Request(-1, prompt, params, seed, frozenset())
    r.output_ids, r.block_table, r.num_cached = pending, table, cached
    return r


class Group:
    """Rank 0's side of a tensor-parallel group: the spawned followers, their pipes and the
    process group. `target` / `draft` are checkpoint paths each follower loads its part of."""

    def __init__(self, size: int, target, draft, dtype: torch.dtype, device, timeout: float,
                 max_positions: int, quantization: str | None = None,
                 draft_quantization: str | None = None):
        device = torch.device(device)
        if device.type not in BACKENDS:
            raise ValueError(f"tensor parallelism supports devices {list(BACKENDS)}, "
                             f"got {device.type!r}")
        if device.type != "cpu":
            # a rank without its device would fail only once spawned, while rank 0 waits
            # tp_timeout for it to join the group
            count = _device_module(device.type).device_count()
            if count < size:
                raise ValueError(f"tensor parallelism: tp_size {size} needs {size} "
                                 f"{device.type} devices (rank r uses device r), found {count}")
        if dist.is_initialized():
            raise RuntimeError("tensor parallelism starts its own torch.distributed process group"
                               ", but one is already initialized in this process (another "
                               "tensor-parallel LLM? call its close() first)")
        self.size, self.timeout, self.device = size, timeout, rank_device(device, 0)
        self.tp = TensorParallel(0, size)
        self.procs, self.conns, self.closed = [], [], False
        self._threads = torch.get_num_threads()
        # on CPU the ranks share the cores
        threads = max(1, self._threads // size) if device.type == "cpu" else self._threads
        ctx = mp.get_context("spawn")
        with self.stop_on_error():
            store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                                  timeout=timedelta(seconds=timeout))
            spec = dict(target=str(target), draft=None if draft is None else str(draft),
                        dtype=dtype, device=str(device), backend=BACKENDS[device.type],
                        port=store.port, timeout=timeout, threads=threads,
                        max_positions=max_positions, quantization=quantization,
                        draft_quantization=draft_quantization)
            for rank in range(1, size):
                ours, theirs = ctx.Pipe()
                proc = ctx.Process(target=_follow, args=(rank, size, theirs, spec), daemon=True,
                                   name=f"dflash-tp-rank{rank}")
                proc.start()
                theirs.close()   # so a follower's death reads as EOF on our end
                self.procs.append(proc)
                self.conns.append(ours)
            self._expect("started")
            _use_device(self.device)
            _init_process_group(spec, 0, size, store)
            torch.set_num_threads(threads)

    # ------------------------------------------------------------------------ protocol
    def worker(self, target, draft, *worker_args) -> TPWorker:
        """Rank 0's worker; the followers build theirs (after loading) from the same args."""
        self.send(worker_args)
        with self.stop_on_error():
            worker = TPWorker(self.tp, self, target, draft, *worker_args)
            # rank 0 has loaded its own shard: the others should be done about as soon, so a
            # follower that hangs while loading fails the start as a hang in a collective would
            self._expect("ready", self.timeout)
        return worker

    def send(self, message) -> None:
        if self.closed:
            raise RuntimeError("the tensor-parallel group is stopped (after a failure, or "
                               "close()); create a new LLM")
        with self.stop_on_error():
            for rank, conn in enumerate(self.conns, 1):
                try:
                    conn.send(message)
                except OSError as e:
                    raise RuntimeError(f"tensor-parallel rank {rank} is gone ({e})") from e

    def _expect(self, what: str, timeout: float | None = None) -> None:
        """Wait until every follower says `what` (each is alive or its pipe reads EOF, or a
        reset when it died with a message of ours unread), at most `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for rank, conn in enumerate(self.conns, 1):
            if deadline is not None and not conn.poll(max(0.0, deadline - time.monotonic())):
                raise RuntimeError(f"tensor-parallel rank {rank} did not report {what!r} "
                                   f"within {timeout:g} s (tp_timeout)")
            try:
                message = conn.recv()
            except (EOFError, OSError):
                message = None
            if message is not None and message[0] == "error":   # what _report would show
                raise RuntimeError(f"tensor-parallel rank {rank} raised before reporting "
                                   f"{what!r}:\n{message[1]}")
            if message != (what,):
                hint = "" if what != "started" else " (see its stderr; a script that starts " \
                    "a tensor-parallel LLM needs the `if __name__ == '__main__':` guard)"
                raise RuntimeError(f"tensor-parallel rank {rank} stopped before reporting "
                                   f"{what!r}{hint}")

    @contextlib.contextmanager
    def stop_on_error(self):
        """Any error inside stops the group. A RuntimeError (what failed collectives raise)
        becomes one RuntimeError reporting every rank; rank 0's other errors (a bad argument,
        KeyboardInterrupt) propagate unchanged."""
        try:
            yield
        except BaseException as e:
            if not isinstance(e, RuntimeError):
                self.close(kill=True)
                raise
            raise self._failure(e) from e

    def _failure(self, exc: RuntimeError) -> RuntimeError:
        deadline = time.monotonic() + _GRACE_S
        reports = [f"rank {rank} {_report(proc, conn, deadline)}"
                   for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), 1)]
        self.close(kill=True)
        lines = [f"rank 0: {type(exc).__name__}: {exc}", *reports]
        return RuntimeError("tensor-parallel run failed; the group is stopped.\n  " +
                            "\n  ".join(lines))

    def close(self, kill: bool = False) -> None:
        """Stop the followers (politely unless `kill`) and release the process group."""
        if self.closed:
            return
        self.closed = True
        if not kill:
            for conn in self.conns:
                with contextlib.suppress(OSError):
                    conn.send(None)
        for proc in self.procs:
            if not kill:
                proc.join(5.0)
            if proc.is_alive():
                proc.kill()
            proc.join()
        for conn in self.conns:
            conn.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(self._threads)


def _report(proc, conn, deadline: float) -> str:
    """What became of one follower: its traceback, its exit, or that it is still running."""
    try:
        while conn.poll(max(0.0, deadline - time.monotonic())):
            message = conn.recv()
            if message[0] == "error":
                return f"raised:\n{message[1]}"
    except (EOFError, OSError):
        pass
    proc.join(max(0.0, deadline - time.monotonic()))
    code = proc.exitcode
    if code is None:
        return "was still running"
    return f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"


def _device_module(device_type: str):
    """torch.cuda, torch.npu, ... for an accelerator type."""
    if device_type == "npu":
        import torch_npu  # noqa: F401  (registers the npu device and the hccl backend)
    return getattr(torch, device_type)


def _use_device(device: torch.device) -> None:
    """Make `device` current (collectives and object broadcasts use the current device)."""
    if device.type != "cpu":
        _device_module(device.type).set_device(device)


def _init_process_group(spec: dict, rank: int, size: int, store) -> None:
    dist.init_process_group(spec["backend"], store=store, rank=rank, world_size=size,
                            timeout=timedelta(seconds=spec["timeout"]))


def _follow(rank: int, size: int, conn, spec: dict) -> None:
    """A follower process: join the group, load this rank's shard, replay rank 0's calls."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is rank 0's to handle
    code = 0
    try:
        conn.send(("started",))
        device = rank_device(spec["device"], rank)
        _use_device(device)
        torch.set_num_threads(spec["threads"])
        store = dist.TCPStore("127.0.0.1", spec["port"], size, is_master=False,
                              timeout=timedelta(seconds=spec["timeout"]))
        _init_process_group(spec, rank, size, store)
        tp = TensorParallel(rank, size)
        target = load_target(spec["target"], spec["dtype"], device, tp, spec["max_positions"],
                             spec["quantization"])
        draft = None if spec["draft"] is None else \
            load_draft(spec["draft"], target.cfg, spec["dtype"], device, spec["max_positions"],
                       spec["draft_quantization"])
        worker_args = conn.recv()
        if worker_args is not None:   # None: rank 0 gave up before building its worker
            worker = TPWorker(tp, None, target, draft, *worker_args)
            conn.send(("ready",))
            while (command := conn.recv()) is not None:
                worker.follow(*command)
        dist.destroy_process_group()
    except EOFError:   # rank 0 is gone
        pass
    except BaseException:
        code = 1
        with contextlib.suppress(OSError):
            conn.send(("error", traceback.format_exc()[-_MAX_REPORT:]))
    # Skip the interpreter's teardown: a follower has nothing to save, and the distributed
    # runtime's static destructors were seen to abort at exit now and then.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
