"""`torch.compile(fullgraph=True)` of the DFlash decode step on CPU, the stand-in for an ACL graph
capture (dflash/engine/step.py): one graph, compiled once for a whole greedy decode, with the
tokens of the eager step, of the engine's ragged path and of `transformers` target-only greedy
generation (float32, tiny random Qwen3 + DFlash draft); the same step captured eagerly on the
emulated Ascend launchers (the ACL graph contract: no copy, no allocated output); and context_kv
and rejection_sample traced alone (paged_attention alone: test_op_registry.py)."""

import inspect
from dataclasses import replace

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from dflash import SamplingParams, ops
from dflash.engine.request import Request
from dflash.engine.step import attention_buffers, decode_step
from dflash.engine.worker import Worker
from dflash.models import load_draft, load_target
from dflash.ops.cases import context_kv_inputs, rejection_sample_inputs

import ascend_emu
from helpers import hf_greedy, make_tiny_pair

B, TOKENS, KV_BLOCK = 8, 64, 16
PROMPTS = [[(5 * i + 11 * j) % 90 + 1 for j in range(n)] for i, n in enumerate([7, 19, 3])]
BLOCKS = -(-(max(map(len, PROMPTS)) + TOKENS + 2 * B) // KV_BLOCK)   # per sequence


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("compile"), B)


def _decode(models, step=decode_step, uniform=True):
    """Greedy-decode PROMPTS, all in one batch, until each has TOKENS tokens, through
    `Worker.step` with `step` as its decode_step (uniform=False: the ragged path instead).
    Returns the tokens, the accepted counts of each step, the drafts of each decode_step call
    and the worker."""
    target = load_target(models[0], torch.float32)
    worker = Worker(target, load_draft(models[1], target.cfg, torch.float32),
                    len(PROMPTS) * BLOCKS, KV_BLOCK, B)
    worker.uniform_steps = uniform
    drafts = []

    def recorded(*args):
        out = step(*args)
        drafts.append(out[2].clone())
        return out

    worker.decode_step = recorded
    requests = [Request(i, p, SamplingParams(max_tokens=10 * TOKENS), 0, frozenset())
                for i, p in enumerate(PROMPTS)]
    for i, r in enumerate(requests):   # every block table as wide: one shape for every step
        r.block_table = list(range(i * BLOCKS, (i + 1) * BLOCKS))
    for r, token in zip(requests, worker.prefill(requests)):
        r.append([token])
    accepted = []
    while min(len(r.output_ids) for r in requests) < TOKENS:
        emitted, counts = worker.step(requests)
        for r, tokens in zip(requests, emitted):
            r.append(tokens)
        accepted.append(counts)
    return [r.output_ids[:TOKENS] for r in requests], accepted, drafts, worker


@pytest.fixture(scope="module")
def eager(models):
    return _decode(models)


def _check_against_eager(models, eager, backend):
    counter = CompileCounterWithBackend(backend)
    tokens, accepted, drafts, _ = _decode(
        models, torch.compile(decode_step, fullgraph=True, backend=counter))
    eager_tokens, eager_accepted, eager_drafts, _ = eager
    # one graph (fullgraph: no break), compiled once: new positions, slots and context lengths
    # every step, the same shapes
    assert counter.frame_count == 1 and len(drafts) == len(eager_drafts) >= TOKENS // B
    assert tokens == eager_tokens
    assert accepted == eager_accepted
    assert all(torch.equal(a, b) for a, b in zip(drafts, eager_drafts))


def test_compiled_decode_step_is_one_graph_with_the_eager_tokens(models, eager):
    """aot_eager: dynamo's trace, the fake implementations and functionalization (the caches are
    written through auto_functionalized ops), running dflash's own kernels."""
    _check_against_eager(models, eager, "aot_eager")


@pytest.mark.slow
def test_inductor_compiled_decode_step_matches_eager(models, eager):
    _check_against_eager(models, eager, "inductor")


def test_uniform_steps_match_the_ragged_path_and_transformers(models, eager):
    """The uniform step writes the draft context of all B verified rows, the ragged path only the
    committed ones: the same tokens (target-only greedy, by transformers), the same committed
    draft context (up to the GEMM rounding of context_kv calls over other rows; a wrong row
    would differ by O(1)), the same acceptance."""
    tokens, accepted, drafts, uniform = eager
    ragged_tokens, ragged_accepted, ragged_drafts, ragged = _decode(models, uniform=False)
    assert not ragged_drafts and drafts
    assert tokens == ragged_tokens == [hf_greedy(models[2], p, TOKENS) for p in PROMPTS]
    assert accepted == ragged_accepted
    for i, p in enumerate(PROMPTS):
        n = len(p) + TOKENS - 1   # tokens with draft context in both runs
        slots = torch.arange(n) + i * BLOCKS * KV_BLOCK   # the table holds consecutive blocks
        committed = [w.draft_cache.flatten(2, 3)[:, :, slots] for w in (uniform, ragged)]
        torch.testing.assert_close(*committed, atol=1e-5, rtol=0)


def test_uniform_step_on_a_checked_plan_skips_the_ops_value_checks(models, monkeypatch):
    """The worker's step plan is checked once on the host (`AttentionMetadata.checked`): every op
    of the uniform step then runs with check=False (on an NPU each check is a device-to-host
    copy, which a captured graph cannot hold)."""
    flags = []

    def recording(name, op):
        def recorded(*args, **kwargs):
            bound = inspect.signature(op).bind(*args, **kwargs)
            bound.apply_defaults()
            flags.append((name, bound.arguments["check"]))
            return op(*args, **kwargs)
        return recorded

    for name in ("context_kv", "paged_attention", "qkv_rope_cache", "decoder_layer"):
        monkeypatch.setattr(ops, name, recording(name, getattr(ops, name)))
    _, _, drafts, _ = _decode(models)
    # the target's layers pass the flag to their ops in one call each (ops.decoder_layer)
    assert drafts and {name for name, _ in flags} == {"context_kv", "paged_attention",
                                                      "decoder_layer"}
    assert not any(check for _, check in flags)


def _captured(emu, with_buffers: bool, costs: list):
    """decode_step as a capturing runner calls it on an NPU: the first call runs eagerly (the
    warm-up, which uploads context_kv's cache table), later ones while the emulated launchers
    capture, with the attention outputs allocated before (`attention_buffers`) or not. Appends
    each captured call's (host<->device copies, output allocations) to `costs`."""
    calls = []

    def step(target, draft, tokens, meta, *rest):
        calls.append(1)
        if len(calls) == 1:
            return decode_step(target, draft, tokens, meta, *rest)
        if with_buffers:
            meta = replace(meta, attention_out=attention_buffers(target, draft, tokens.numel()))
        before = emu.transfers(), emu.allocations()
        emu.set_capturing(True)
        try:
            out = decode_step(target, draft, tokens, meta, *rest)
        finally:
            emu.set_capturing(False)
        costs.append((emu.transfers() - before[0], emu.allocations() - before[1]))
        return out
    return step


def test_a_decode_step_keeps_the_capture_contract_on_the_emulated_npu(models, eager,
                                                                       monkeypatch):
    """The uniform step on the emulated Ascend launchers, captured after a warm-up: with its
    attention outputs preallocated, no op copies between host and device nor allocates an
    output, and the tokens and drafts are the eager step's; without them, the first attention
    is refused (the negative control)."""
    emu = ascend_emu.Emulated(ascend_emu.ops(), monkeypatch).emu
    costs = []
    tokens, accepted, drafts, _ = _decode(models, _captured(emu, True, costs))
    eager_tokens, eager_accepted, eager_drafts, _ = eager
    assert tokens == eager_tokens and accepted == eager_accepted
    assert all(torch.equal(a, b) for a, b in zip(drafts, eager_drafts))
    assert len(costs) == len(drafts) - 1 >= 2 and set(costs) == {(0, 0)}
    with pytest.raises(RuntimeError, match="paged_attention allocates its output while capturing"):
        _decode(models, _captured(emu, False, []))


@pytest.mark.parametrize("stacked", [False, "block_major"])
def test_context_kv_compiles_and_writes_the_caches(stacked):
    """The caches (separate tensors, or strided views of one as the engine's) are written in place
    by the compiled call exactly as by the eager one."""
    eager, compiled = context_kv_inputs(stacked=stacked), context_kv_inputs(stacked=stacked)
    ops.context_kv(**eager)
    torch.compile(ops.context_kv, fullgraph=True, backend="aot_eager")(**compiled)
    for name in ("key_caches", "value_caches"):
        for a, b in zip(eager[name], compiled[name]):
            assert torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.parametrize("dense", [True, False])
@pytest.mark.parametrize("check", [True, False])
def test_rejection_sample_compiles(dense, check):
    args = rejection_sample_inputs(dense=dense)
    compiled = torch.compile(ops.rejection_sample, fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(**args, check=check), ops.rejection_sample(**args)):
        assert torch.equal(got, want)
