"""The CPU emulation of the Ascend C API (ascend_kernels/emu) enforces the hardware rules.

Every rule has a kernel snippet that breaks it (tests/ascend_emu_snippets.cpp, `*_bad`) and the
emulation must stop it with an error naming the rule; where the job can be done legally, a twin
(`*_ok`) does it and its result is checked against torch.
"""

import pytest
import torch

from ascend_emu import ops

SENTINEL = 7.0


def run(name, inp=None):
    """Runs snippet `name` on `inp` (256 floats) and a sentinel-filled output; returns both and the
    order in which the blocks ran."""
    inp = torch.randn(256, generator=torch.Generator().manual_seed(0)) if inp is None else inp
    out = torch.full((256,), SENTINEL)
    order = ops().run_snippet(name, inp, out)
    return inp, out, order


@pytest.mark.parametrize("rule, snippet, message", [
    ("dma-granularity", "dma_granularity_bad", "moves 36 bytes, not a multiple of 32"),
    ("alignment", "alignment_bad", "starts at UB byte 12, not 32-byte aligned"),
    ("ub-bounds", "ub_bounds_bad", "covers 512 bytes of a tensor of 256"),
    ("ub-budget", "ub_budget_bad", "the unified buffer has 196608 bytes"),
    ("queue-depth", "queue_alloc_bad", "all 2 buffers of this queue are in use"),
    ("queue-depth", "queue_enque_bad", "already holds its depth of 1"),
    ("queue-depth", "queue_deque_bad", "DeQue on an empty queue"),
    ("bf16-arith", "bf16_arith_bad", "Add on bfloat16_t"),
    ("compare-256", "compare_bad", "must be a multiple of 256 bytes"),
    ("overlap", "overlap_bad", "operands .* overlap"),
    ("sync", "sync_v_s_bad", r"GetValue \(pipe S\) reads UB last written by pipe V .*V_S"),
    ("sync", "sync_mte2_v_bad", r"Muls \(pipe V\) reads UB last written by pipe MTE2 .*MTE2_V"),
    ("sync", "sync_v_v_bad", r"Adds \(pipe V\) reads UB last written by pipe V .*PIPE_V"),
    ("sync", "sync_v_mte3_bad", r"UB->GM \(pipe MTE3\) reads UB last written by pipe V .*V_MTE3"),
    ("sync", "sync_s_mte3_bad", r"UB->GM \(pipe MTE3\) reads UB last written by pipe S .*S_MTE3"),
    ("sync", "sync_war_bad", r"GM->UB \(pipe MTE2\) overwrites UB still being read by pipe V"),
    ("sync", "pipe_s_bad", "PipeBarrier<PIPE_S> raises a hardware error"),
    ("event", "event_deadlock_bad", "WaitFlag<V_S>.* without a matching SetFlag"),
    ("event", "event_leftover_bad", "never waited"),
    ("gm-bounds", "gm_bounds_bad", "outside every tensor passed to the kernel"),
    ("gm-bounds", "gm_readonly_bad", "writes to read-only input input"),
    ("block-race", "block_race_bad", "both write the same GM bytes"),
    ("dma-params", "dma_params_bad", "padding may not exceed 32 bytes"),
    ("dma-params", "dma_block_count_bad", "blockCount 4096 exceeds 4095"),
    ("cast", "cast_mode_bad", "only CAST_RINT / CAST_NONE"),
    ("select", "select_mode_bad", "needs VSEL_TENSOR_SCALAR_MODE"),
    ("queue", "queue_free_bad", "FreeTensor of a tensor this queue does not hold"),
    ("sum", "sum_bad", "rows of inner = 6 elements are not a multiple of 32 bytes"),
    ("event", "event_queue_collision_bad",
     r"SetFlag<V_MTE2>\(0\) while the previous one was never waited \(ID 0 is held by a queue's "
     r"FreeTensor\)"),
    ("event", "event_queue_hang_bad",
     r"AllocTensor .*WaitFlag<V_MTE2>\(0\) without a matching SetFlag .*would wait forever"),
    ("event", "event_pipe_end_bad",
     r"the pipe's end .*WaitFlag<MTE3_V>\(0\) without a matching SetFlag"),
    ("event", "event_pool_bad", "AllocEventID<V_S>: all 8 IDs are held"),
    ("select-reserved", "select_reserved_bad",
     "stores its scalar in the UB from byte 188416 .* reach byte 188448"),
    ("dma-position", "dma_position_bad", "DataCopyPad GM->UB on a VECCALC buffer"),
    ("kernel-type", "kernel_type_undeclared_bad", "declares no task type"),
    ("auto-sync", "auto_sync_bad", r"GetValue while SetFlag<MTE3_S>\(\d\) is held open"),
    ("block-race", "kernel_type_mix_bad", "both write the same GM bytes"),
])
def test_violation_is_caught(rule, snippet, message):
    with pytest.raises(RuntimeError, match=rf"ascend-emu \[{rule}\] .*{message}"):
        run(snippet)


def test_data_copy_pad_moves_exactly_the_requested_bytes():
    inp, out, _ = run("dma_granularity_ok")
    assert torch.equal(out[:9], inp[:9])
    assert (out[9:] == SENTINEL).all()  # a 32-byte DataCopy would have overrun into out[9:16]


def test_aligned_operand_and_exact_budget_are_accepted():
    _, out, _ = run("alignment_ok")
    assert (out[:8] == 1).all() and (out[8:] == SENTINEL).all()
    _, out, _ = run("ub_budget_ok")   # the last 32 bytes of the 192 KiB budget are usable
    assert (out[:8] == 3).all() and (out[8:] == SENTINEL).all()


def test_queue_used_within_its_buffers_and_depth():
    inp, out, _ = run("queue_alloc_ok")   # 3 tiles through a queue of 2 buffers
    assert torch.equal(out[:192], inp[:192] + 1) and (out[192:] == SENTINEL).all()
    inp, out, _ = run("queue_enque_ok")   # both buffers held, depth 1 respected
    assert torch.equal(out[:64], inp[:64] + inp[64:128]) and (out[64:] == SENTINEL).all()


def test_bf16_computed_in_float_matches_torch():
    inp, out, _ = run("bf16_arith_ok")
    expected = (2 * inp[:64].bfloat16().float()).bfloat16().float()
    assert torch.equal(out[:64], expected)


def test_casts_round_to_nearest_even_like_torch():
    ties = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-130, 3e38, -0.0,
                         float("inf"), float("-inf")])
    half_cases = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, 65504.0, 65519.0, 65520.0, 1e5,
                               2**-24, 2**-25, 3 * 2**-26, 2**-14 - 2**-25, 1e-9, -(2**-24)])
    inp = torch.randn(256, generator=torch.Generator().manual_seed(1)) * 100
    inp[:len(ties)] = ties
    inp[128:128 + len(half_cases)] = half_cases
    _, out, _ = run("cast_roundtrip_ok", inp)
    assert torch.equal(out[:128], inp[:128].bfloat16().float())
    assert torch.equal(out[128:], inp[128:].half().float())


def test_reduce_max_reports_the_first_maximal_index():
    inp = torch.rand(256)
    inp[[37, 64, 190]] = 5.0  # tied maxima in different repeats; index 230 is past the count
    inp[230] = 9.0
    _, out, _ = run("reduce_max_index_ok", inp)
    assert out[0] == 5.0
    assert out[1:2].view(torch.int32).item() == 37


def test_elementwise_ops_match_torch():
    inp = torch.randn(256, generator=torch.Generator().manual_seed(2))
    inp[32:64] = inp[32:64].abs() + 0.1
    _, out, _ = run("elementwise_ok", inp)
    x, y = inp[:32], inp[32:64]
    expected = torch.cat([torch.maximum(x, y), torch.minimum(x, y), x - y, x / y, x.exp(),
                          y.log(), y.sqrt(), y.rsqrt()])
    torch.testing.assert_close(out, expected)


def test_the_inexact_mode_rounds_as_the_a2_vector_unit_does(monkeypatch):
    """DFLASH_EMU_INEXACT=1: Div / Exp / Ln / Sqrt / Rsqrt land within one ulp of the correctly
    rounded result (and do move: the negative control), every instruction flushes subnormal
    operands and results, and the same inputs give the same results."""
    inp = torch.randn(256, generator=torch.Generator().manual_seed(2))
    inp[32:64] = inp[32:64].abs() + 0.1
    inp[0], inp[32] = 1e-30, 1e10      # x / y = 1e-40: a subnormal quotient
    inp[1], inp[33] = -100.0, 1.0      # exp(-100): a subnormal result
    inp[2] = 2e-39                     # a subnormal operand: min(x, y) = x
    _, exact, _ = run("elementwise_ok", inp)
    monkeypatch.setenv("DFLASH_EMU_INEXACT", "1")
    _, rough, _ = run("elementwise_ok", inp)
    _, again, _ = run("elementwise_ok", inp)
    assert torch.equal(rough, again)
    assert exact[96] != 0 and rough[96] == 0 and exact[129] != 0 and rough[129] == 0
    assert exact[34] == inp[2] and rough[34] == 0 and rough[98] == 0   # and x / y with it
    normal = torch.ones(256, dtype=torch.bool)
    normal[[34, 96, 98, 129]] = False
    ulps = (rough.view(torch.int32) - exact.view(torch.int32)).abs()[normal]
    assert ulps[:95].max() == 0                         # max, min, sub: exact
    assert ulps[95:].max() == 1 and (ulps[95:] == 1).sum() > 40


def test_sum_adds_the_first_n_of_each_row_and_leaves_the_block_tail_unspecified():
    inp, out, _ = run("sum_ok")
    torch.testing.assert_close(out[:4], inp[:160].view(4, 40)[:, :37].sum(-1))
    assert torch.isnan(out[4:8]).all()


def test_compare_select_match_torch():
    inp, out, _ = run("compare_ok")
    expected = torch.where(inp[:64] < inp[64:128], inp[:64], torch.tensor(-1.0))
    assert torch.equal(out[:64], expected)


@pytest.mark.parametrize("snippet, loaded", [("poison_fresh", 8), ("poison_pad", 5)])
def test_unwritten_ub_reads_as_nan(snippet, loaded):
    # Reading UB the kernel never wrote (fresh buffers, DataCopyPad padding without isPad) yields
    # NaN, so a kernel relying on it fails its comparison instead of passing by luck.
    _, out, _ = run(f"{snippet}_bad")
    assert torch.isnan(out[0])
    inp, out, _ = run(f"{snippet}_ok")
    torch.testing.assert_close(out[0], inp[:loaded].sum())


def test_legal_twins_compute_the_right_values():
    inp, out, _ = run("overlap_ok")
    assert torch.equal(out[:64], inp[:64] + inp[64:128])
    inp, out, _ = run("sync_v_s_ok")
    assert out[0] == inp[:64].max()
    inp, out, _ = run("sync_ok")
    assert torch.equal(out[:64], inp[:64] * 2 + 1)
    inp, out, _ = run("sync_war_ok")
    assert torch.equal(out[:64], inp[:64] * 2 + inp[64:128])
    inp, out, _ = run("sync_queue_ok")
    assert torch.equal(out[:128], inp[:128] * 2 + 1)
    run("event_ok")


def test_queue_and_kernel_flags_share_one_id_pool():
    # The legal twin of the collision / hang snippets takes its ID from the pool (FetchEventID
    # skips the ID the queue's FreeTensor holds) and computes the right values.
    inp, out, _ = run("event_queue_ok")
    assert torch.equal(out[:64], inp[64:128] + 2) and (out[64:] == SENTINEL).all()


def test_select_may_use_the_ub_below_its_reserved_tail():
    inp, out, _ = run("select_reserved_ok")
    assert torch.equal(out[:64], torch.where(inp[:64] < 0, inp[:64], torch.tensor(5.0)))


def tree_sum(x, lanes=64):
    """A2's count-form order: adjacent pairs within each 64-float repeat (zeros past the end),
    then the repeats' sums one after another."""
    total = None
    for start in range(0, len(x), lanes):
        v = torch.zeros(lanes)
        chunk = x[start:start + lanes]
        v[:len(chunk)] = chunk
        while len(v) > 1:
            v = v[0::2] + v[1::2]
        total = v[0] if total is None else total + v[0]
    return total


def sequential_sum(x):
    total = torch.zeros((), dtype=torch.float32)
    for value in x:
        total = total + value
    return total


def test_reductions_add_in_the_hardware_tree_order():
    # Values where the order of float additions shows: a kernel (or test) that expects the
    # sequential sum gets a different answer from the emulation, as it would from an A2.
    # 1 followed by values below half its ulp: added one by one they vanish, in a tree they add
    # up first.
    inp = torch.rand(256, generator=torch.Generator().manual_seed(5)) * 5e-8
    inp[0::40] = 1.0
    _, out, _ = run("reduce_sum_tree_ok", inp)
    assert out[0] == tree_sum(inp[:200])
    assert out[0] != sequential_sum(inp[:200])
    rows = inp[:160].view(4, 40)[:, :37]
    assert torch.equal(out[8:12], torch.stack([tree_sum(r) for r in rows]))
    assert any(out[8 + i] != sequential_sum(r) for i, r in enumerate(rows))


def test_blocks_run_once_each_in_shuffled_order():
    orders = []
    for _ in range(3):
        _, out, order = run("block_race_ok")
        assert sorted(order) == list(range(16))
        orders.append(order)
        slots = out[:128].view(16, 8)
        assert torch.equal(slots[:, 0], torch.arange(16.0))  # GetBlockIdx
        assert (slots[:, 1:] == 16).all()                     # GetBlockNum
    assert any(o != list(range(16)) for o in orders)
    assert len({tuple(o) for o in orders}) > 1  # a fresh shuffle every launch


def test_a_vector_kernel_splits_its_work_once_over_its_blocks():
    """The twin of kernel_type_mix_bad: declared vector-only, the same grid-stride kernel writes
    each of the 16 slots once, from block slot % 4 of 4."""
    _, out, order = run("kernel_type_aiv_ok")
    assert sorted(order) == [0, 1, 2, 3]
    slots = out[:128].view(16, 8)
    assert slots[:, 0].tolist() == [float(s % 4) for s in range(16)]
    assert (slots[:, 1:] == 4.0).all()


def test_a_dma_to_scalar_flag_waited_at_once_is_legal():
    """auto_sync_bad's twin: the same copy-out, scalar read and second copy-out, with the flag
    waited at once."""
    _, out, _ = run("auto_sync_ok")
    assert out[:8].tolist() == [1.0] * 8 and out[8:16].tolist() == [2.0] * 8
    assert (out[16:] == SENTINEL).all()
