"""dflash's Ascend C paged_attention kernel, compiled for x86 against the emulation, against
dflash.ops.reference.paged_attention.

The case matrix is the CPU kernel's: head_dim 64 / 128; GQA groups 1, 2, 4, 8; cache blocks of 16,
32 and 128 tokens; ragged batches whose sequences have 0, 1, 15, 16, 17 and 1000 cached tokens and
1 or 16 new tokens; both causal modes; float32 within 1e-5, bfloat16 / float16 within 2e-2. The
default run takes a sample that covers every value of every axis; the full product is `slow`.
"""

import itertools

import pytest
import torch

from dflash.ops import reference
from dflash.ops.cases import paged_attention_inputs

from ascend_emu import ops

CONTEXT_LENS = (0, 1, 15, 16, 17, 1000)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}


@pytest.fixture
def emu():
    """The emulated ops with the default launch configuration, restored after each test."""
    yield ops()
    ops().configure(8, 0, 0)


def check(emu, args):
    got = emu.paged_attention(**args)
    want = reference.paged_attention(**args)
    tol = TOLERANCE[args["query"].dtype]
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def matrix_case(d, group, block_size, query_len, causal, dtype, seed=0):
    """A ragged batch over every context length; query_len 'mixed' alternates 1 and 16."""
    lens = [1, 16] * 3 if query_len == "mixed" else [query_len] * len(CONTEXT_LENS)
    return paged_attention_inputs(context_lens=CONTEXT_LENS, query_lens=lens, hq=2 * group, hkv=2,
                                  d=d, block_size=block_size, causal=causal, dtype=dtype,
                                  seed=seed)


AXES = dict(d=(64, 128), group=(1, 2, 4, 8), block_size=(16, 32, 128), query_len=(1, 16),
            causal=(False, True), dtype=(torch.float32, torch.bfloat16, torch.float16))
# Every value of every axis at least once, in varied combinations.
SAMPLE = [
    (64, 1, 16, 1, False, torch.float32),
    (128, 2, 32, 16, True, torch.float32),
    (64, 4, 128, 16, False, torch.bfloat16),
    (128, 8, 16, 16, True, torch.float16),
    (128, 1, 128, 1, True, torch.bfloat16),
    (64, 8, 32, 1, False, torch.float16),
    (64, 2, 16, "mixed", True, torch.bfloat16),
    (128, 4, 32, "mixed", False, torch.float32),
]


@pytest.mark.parametrize("d, group, block_size, query_len, causal, dtype", SAMPLE)
def test_matches_reference_on_a_sample_of_the_matrix(emu, d, group, block_size, query_len, causal,
                                                     dtype):
    check(emu, matrix_case(d, group, block_size, query_len, causal, dtype))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(itertools.product(*AXES.values())),
                         ids=lambda c: "-".join(str(v).replace("torch.", "") for v in c))
def test_matches_reference_on_the_full_matrix(emu, case):
    check(emu, matrix_case(*case))


def test_sample_covers_every_axis_value():
    for i, values in enumerate(AXES.values()):
        assert set(values) <= {case[i] for case in SAMPLE}


@pytest.mark.parametrize("ub_bytes, fits", [
    # the whole DFlash block and GQA group per item, 32-key chunks
    (0, lambda q, h, kv: (q, h, kv) == (16, 4, 32)),
    # fewer query positions per item, 16-key chunks
    (48 * 1024, lambda q, h, kv: 1 < q < 16 and h == 4 and kv == 16),
    # items split the group's query heads
    (22 * 1024, lambda q, h, kv: q == 1 and h < 4 and kv == 16),
    # chunks below 16 keys
    (7 * 1024, lambda q, h, kv: kv < 8),
], ids=["whole-block", "fewer-positions", "split-heads", "small-chunks"])
def test_tiling_shrinks_with_the_unified_buffer_and_results_do_not_change(emu, ub_bytes, fits):
    emu.configure(3, 0, ub_bytes)
    assert fits(*emu.paged_attention_plan(8, 2, 64, 16, 16, 4))
    for causal in (False, True):
        args = paged_attention_inputs(context_lens=(40, 0, 17), query_lens=(16, 5, 1), hq=8,
                                      hkv=2, d=64, block_size=16, causal=causal, seed=1)
        check(emu, args)


def test_a_head_dim_that_does_not_fit_is_rejected(emu):
    assert emu.paged_attention_plan(1, 1, 8192, 16, 1, 4) == [0, 0, 0]
    args = paged_attention_inputs(context_lens=(3,), query_lens=(1,), hq=1, hkv=1, d=8192)
    with pytest.raises(ValueError, match="paged_attention: head_dim 8192 does not fit"):
        emu.paged_attention(**args)


@pytest.mark.parametrize("cores", [1, 5, 64])
def test_any_block_count(emu, cores):
    emu.configure(cores, 0, 0)
    for causal in (False, True):
        check(emu, paged_attention_inputs(context_lens=(33, 0, 5, 64), query_lens=(3, 16, 0, 1),
                                          hq=6, hkv=3, d=64, block_size=8, causal=causal,
                                          dtype=torch.bfloat16, seed=2))


@pytest.mark.parametrize("d", [8, 40, 72])
def test_head_dims_below_or_between_32_byte_blocks(emu, d):
    for dtype in (torch.float32, torch.float16):
        check(emu, paged_attention_inputs(context_lens=(9, 20), query_lens=(4, 2), hq=4, hkv=2,
                                          d=d, block_size=4, causal=True, dtype=dtype, seed=3))


def test_sharp_softmax_rescales_across_chunks(emu):
    # Scores grow along the keys, so every chunk raises the running max of every row.
    args = paged_attention_inputs(context_lens=(200,), query_lens=(4,), hq=2, hkv=1, d=64,
                                  block_size=16, seed=4)
    ramp = torch.linspace(0.0, 3.0, args["key_cache"].shape[0] * 16).view(-1, 16, 1, 1)
    args["key_cache"] = args["key_cache"].abs() * ramp
    args["query"] = args["query"].abs() * 4.0
    check(emu, args)


def test_views_and_strided_inputs(emu):
    # The engine passes per-layer views of one stacked cache and slices of fused projections.
    args = paged_attention_inputs(context_lens=(20, 7), query_lens=(3, 2), hq=4, hkv=2, d=64,
                                  block_size=8, seed=5)
    stacked = torch.stack([torch.randn_like(args["key_cache"]), args["key_cache"],
                           args["value_cache"]])
    qkv = torch.cat([args["query"], args["key"], args["value"]], dim=1)
    args.update(key_cache=stacked[1], value_cache=stacked[2], query=qkv[:, :4], key=qkv[:, 4:6],
                value=qkv[:, 6:])
    assert not args["query"].is_contiguous()
    check(emu, args)


def test_a_cache_that_is_not_contiguous_is_refused(emu):
    # The kernel reads a block at block * block_size rows: a strided cache (K and V interleaved
    # per block, [blocks, 2, block_size, Hkv, D]) used to be copied whole on every call.
    args = paged_attention_inputs(context_lens=(20, 7), query_lens=(3, 2), hq=4, hkv=2, d=64,
                                  block_size=8, seed=5)
    interleaved = torch.stack([args["key_cache"], args["value_cache"]], dim=1)
    args.update(key_cache=interleaved[:, 0], value_cache=interleaved[:, 1])
    before = emu.allocations()
    with pytest.raises(ValueError, match="key_cache must be contiguous for the Ascend kernel"):
        emu.paged_attention(**args)
    assert emu.allocations() == before
    args.update(key_cache=args["key_cache"].contiguous(), value_cache=args["value_cache"].clone())
    check(emu, args)


def test_no_query_rows(emu):
    args = paged_attention_inputs(context_lens=(5, 3), query_lens=(0, 0))
    assert emu.paged_attention(**args).shape == (0, 4, 8)


@pytest.mark.parametrize("query_len", [16, "mixed"])
def test_only_a_checked_call_copies_its_index_tensors_to_the_host(emu, query_len):
    # A checked call reads cu_query_lens, context_lens and the block table back to check them;
    # without the checks the launch reads nothing: the kernel lists its own work items and the
    # tiling depends on shapes only, so both calls compute the same, bit for bit.
    args = matrix_case(64, 2, 16, query_len, True, torch.float32)
    before = emu.transfers()
    check(emu, args)
    assert emu.transfers() - before == 3
    checked = emu.paged_attention(**args)
    before = emu.transfers()
    unchecked = emu.paged_attention(**args, check=False)
    assert emu.transfers() == before
    assert torch.equal(unchecked, checked)
