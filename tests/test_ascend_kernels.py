"""dflash's Ascend C kernels, compiled for x86 against the emulation, against dflash.ops.reference.

rejection_sample must return the reference's tokens exactly (same noise); context_kv must write
K within one ulp of a bfloat16/float16 cache (float32 caches: within 1e-6, only the summation order
of the sum of squares differs), V exactly, and leave every other slot untouched.
"""

import pytest
import torch

from dflash.ops import reference
from dflash.ops.cases import context_kv_inputs, rejection_sample_inputs

from ascend_emu import ops


@pytest.fixture
def emu():
    """The emulated ops with the default launch configuration, restored after each test."""
    yield ops()
    ops().configure(8, 0, 0)


def test_schemas_match_torch_ops_dflash(emu):
    for op in ("context_kv", "paged_attention", "rejection_sample"):
        ours = str(getattr(emu, op).default._schema).replace("dflash_emu::", "")
        assert ours == str(getattr(torch.ops.dflash, op).default._schema).replace("dflash::", "")


# ---------------------------------------------------------------------------------------------
# rejection_sample
# ---------------------------------------------------------------------------------------------

def assert_same_tokens(emu, args, check=True):
    expected = reference.rejection_sample(**args)
    got = emu.rejection_sample(**args, check=check)
    assert torch.equal(got[0], expected[0]), (got[0], expected[0])
    assert torch.equal(got[1], expected[1])
    return expected[1]


@pytest.mark.parametrize("dense", [True, False])
@pytest.mark.parametrize("case", [
    dict(bs=6, k=4, v=11),                                   # vocab below one 32-byte block
    dict(bs=5, k=3, v=1000, peaked=False),                   # one tile with a padded tail
    dict(bs=3, k=15, v=4099, greedy_every=3),                # DFlash block size, odd vocab
    dict(bs=4, k=0, v=70),                                   # no drafts: only the bonus token
])
def test_rejection_sample_matches_reference(emu, case, dense):
    accepted = torch.cat([
        assert_same_tokens(emu, rejection_sample_inputs(**case, dense=dense, seed=seed))
        for seed in range(8)])
    if case["k"]:  # the cases exercise both acceptance and rejection
        assert (accepted < case["k"]).any() and (accepted > 0).any()


@pytest.mark.parametrize("cores, max_tile", [(1, 64), (3, 128), (64, 0)])
def test_rejection_sample_any_tiling_and_block_count(emu, cores, max_tile):
    emu.configure(cores, max_tile)
    for dense in (True, False):
        for seed in range(4):
            args = rejection_sample_inputs(bs=5, k=5, v=1000, dense=dense, seed=seed)
            assert_same_tokens(emu, args, check=seed % 2 == 0)  # False: no host value checks


@pytest.mark.parametrize("dense, checked_copies", [(True, 5), (False, 4)])
def test_rejection_sample_copies_to_the_host_only_to_check(emu, dense, checked_copies):
    # Validation reads the ids and coins and the verdicts of the probability and noise scans back
    # to the host (each a wait on an NPU); check=False launches with none.
    args = rejection_sample_inputs(bs=4, k=3, v=500, dense=dense, seed=1)
    for check, copies in ((True, checked_copies), (False, 0)):
        before = emu.transfers()
        assert_same_tokens(emu, args, check=check)
        assert emu.transfers() - before == copies


def test_rejection_sample_ties_pick_the_first_index_across_tiles(emu):
    emu.configure(2, 64)
    args = rejection_sample_inputs(bs=4, k=2, v=300, dense=True, greedy_every=2, seed=3)
    p = args["target_probs"]
    p[:] = 0.001
    p[:, :, [250, 70, 130]] = 0.2          # greedy rows: argmax is 70 (tile 1), tied with 130, 250
    args["exponential"][:] = 1.0           # sampling rows: r / e ties the same way
    args["draft_token_ids"][:] = 5          # q(5) >> p(5): rejected, the residual ties too
    args["draft_probs"][:] = 0.0005
    args["draft_probs"][..., 5] = 0.5
    assert_same_tokens(emu, args)


def test_rejection_sample_zero_residual_falls_back_to_p(emu):
    args = rejection_sample_inputs(bs=6, k=3, v=500, dense=True, greedy_every=0, seed=4)
    args["target_probs"][:, :3] = args["draft_probs"] * 0.5   # p <= q everywhere: residual is 0
    args["uniform"][:] = 0.75                                   # and every first draft is rejected
    assert (assert_same_tokens(emu, args) == 0).all()
    zero = rejection_sample_inputs(bs=2, k=2, v=100, dense=False, greedy_every=0, seed=5)
    zero["target_probs"][0] = 0.0  # all-zero rows: every weight ties at 0, index 0 wins
    assert_same_tokens(emu, zero)


@pytest.mark.parametrize("inexact", ["0", "1"])
def test_rejection_sample_subnormal_residual_falls_back_to_p(emu, monkeypatch, inexact):
    """A residual whose only mass is subnormal is empty, in the reference, the CPU kernel and
    the Ascend kernel alike, also where the vector unit flushes subnormals (DFLASH_EMU_INEXACT)
    and would otherwise see no mass where the others see some."""
    monkeypatch.setenv("DFLASH_EMU_INEXACT", inexact)
    args = rejection_sample_inputs(bs=4, k=2, v=300, dense=True, greedy_every=0, seed=6)
    args["target_probs"][:, :2] = args["draft_probs"] * 0.5   # p <= q: no residual mass ...
    args["draft_probs"][:, 0, 7] = 0.0
    args["target_probs"][:, 0, 7] = 1e-40                      # ... but a subnormal one
    args["draft_token_ids"][:, 0] = 3
    args["uniform"][:] = 0.99                                  # every first draft is rejected
    tokens, accepted = reference.rejection_sample(**args)
    assert (accepted == 0).all() and (tokens[:, 0] != 7).all()   # drawn from p, not the 7
    cpu = torch.ops.dflash.rejection_sample(**args)
    assert torch.equal(cpu[0], tokens) and torch.equal(cpu[1], accepted)
    assert_same_tokens(emu, args)


@pytest.mark.parametrize("dense, v", [(False, 6700), (True, 5200)])
def test_rejection_sample_tile_near_the_select_reserved_ub(emu, dense, v):
    # One tile holds the whole vocabulary; planned against the full 192 KiB its buffers would
    # reach into the last 8 KiB, where Select (tensor-scalar) stores its scalar.
    for seed in range(2):
        assert_same_tokens(emu, rejection_sample_inputs(bs=3, k=4, v=v, dense=dense, seed=seed))


def test_rejection_sample_full_vocabulary(emu):
    for dense in (True, False):
        assert_same_tokens(emu, rejection_sample_inputs(bs=2, k=3, v=151936, dense=dense, seed=6))


def test_rejection_sample_empty_batch_and_strided_inputs(emu):
    empty = rejection_sample_inputs(bs=0, k=3, v=20)
    out, acc = emu.rejection_sample(**empty)
    assert out.shape == (0, 4) and acc.shape == (0,)
    args = rejection_sample_inputs(bs=4, k=3, v=50, seed=7)
    wide = torch.rand(4, 4, 100)
    wide[..., ::2] = args["target_probs"]
    args["target_probs"] = wide[..., ::2]
    assert_same_tokens(emu, args)


# ---------------------------------------------------------------------------------------------
# context_kv
# ---------------------------------------------------------------------------------------------

def ordered_bits(t: torch.Tensor) -> torch.Tensor:
    """Float bit patterns mapped to integers that are adjacent for adjacent floats."""
    ints = t.view(torch.int32 if t.dtype == torch.float32 else torch.int16).long()
    sign = 1 << (8 * t.element_size() - 1)
    return torch.where(ints < 0, -(ints + sign), ints)


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    finite = torch.isfinite(a) & torch.isfinite(b)
    assert torch.equal(finite, torch.isfinite(a) | torch.isfinite(b)), "written slots differ"
    if not finite.any():
        return 0
    return int((ordered_bits(a[finite]) - ordered_bits(b[finite])).abs().max())


def check_context_kv(emu, args):
    """Runs the emulated kernel on `args` and the reference on a copy of the caches; compares."""
    ref = {**args, "key_caches": [c.clone() for c in args["key_caches"]],
           "value_caches": [c.clone() for c in args["value_caches"]]}
    reference.context_kv(**ref)
    emu.context_kv(**args)
    for got, want in zip(args["key_caches"], ref["key_caches"]):
        if got.dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, equal_nan=True)
        else:
            assert ulps(got, want) <= 1
    for got, want in zip(args["value_caches"], ref["value_caches"]):
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", [
    dict(),                                                     # D=16: fp32 halves 32-byte aligned
    dict(d=12, with_fc=False, with_bias=True, skip_every=2),   # padded halves, skipped slots
    dict(n=19, hkv=8, d=128, layers=3, num_blocks=8, block_size=4, stacked=True),
    dict(n=7, d=6, hkv=3, h=24, d_in=40, skip_every=3),        # halves shorter than a block
])
def test_context_kv_matches_reference(emu, case, dtype):
    check_context_kv(emu, context_kv_inputs(dtype=dtype, **case))


@pytest.mark.parametrize("cores", [1, 2, 64])
def test_context_kv_any_block_count_and_duplicate_slots(emu, cores):
    emu.configure(cores, 0)
    args = context_kv_inputs(n=9, dtype=torch.bfloat16, seed=8)
    args["slot_mapping"][[2, 5, 7]] = int(args["slot_mapping"][0])  # the last writer wins
    args["slot_mapping"][3] = -1
    check_context_kv(emu, args)


def test_context_kv_rejects_caches_without_contiguous_rows(emu):
    args = context_kv_inputs()
    args["key_caches"][1] = args["key_caches"][1].transpose(2, 3).contiguous().transpose(2, 3)
    with pytest.raises(ValueError, match=r"key_caches\[1\] must have contiguous \[Hkv, D\] rows"):
        emu.context_kv(**args)


def test_only_a_checked_context_kv_copies_positions_and_slots_to_the_host(emu):
    # Both are checked on the host in a checked call; check=False reads nothing back and
    # writes the same caches. A new set of caches uploads its address table once.
    args = context_kv_inputs()
    before = emu.transfers()
    check_context_kv(emu, args)
    assert emu.transfers() - before == 3          # positions, slots; the caches' table
    fresh = context_kv_inputs()   # the same inputs, caches still all NaN
    unchecked = {**args, "key_caches": fresh["key_caches"], "value_caches": fresh["value_caches"]}
    emu.context_kv(**unchecked, check=False)
    assert emu.transfers() - before == 4          # the new caches' table
    emu.context_kv(**unchecked, check=False)
    assert emu.transfers() - before == 4          # nothing at all
    for got, want in zip(unchecked["key_caches"] + unchecked["value_caches"],
                         args["key_caches"] + args["value_caches"]):
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))


def test_unchecked_launches_make_no_transfer_and_capture_refuses_one(emu):
    """Graph capture's contract: a launch with check=False on known caches copies nothing in
    either direction (tilings travel as kernel arguments); while capturing, a copy raises, and
    so does an output the launcher would allocate (the .out overloads: test_out_variants)."""
    kv = context_kv_inputs()
    emu.context_kv(**kv, check=False)                       # uploads the caches' table
    rs = rejection_sample_inputs(bs=3, k=4, v=50)
    before = emu.transfers()
    emu.set_capturing(True)
    try:
        emu.context_kv(**kv, check=False)
        with pytest.raises(RuntimeError, match="rejection_sample allocates its output while "
                                               "capturing"):
            emu.rejection_sample(**rs, check=False)
        with pytest.raises(RuntimeError, match="device-to-host copy while capturing"):
            emu.rejection_sample(**rs)
        fresh = context_kv_inputs(seed=1)
        with pytest.raises(RuntimeError, match="host-to-device copy while capturing"):
            emu.context_kv(**fresh, check=False)
    finally:
        emu.set_capturing(False)
    assert emu.transfers() == before
