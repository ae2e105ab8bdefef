"""The C++ CPU kernel of dflash::paged_attention against the PyTorch reference (docs/design.md 3.2).

The default run samples the issue's case matrix: every head_dim x GQA ratio x cache block size x
causal mode, with the dtype rotating so each dtype meets every other parameter value, and each call
a ragged batch holding every context length with both query lengths. The exhaustive sweep (every
combination, one sequence per call) is marked slow.
"""

import itertools
import os
import random

import pytest
import torch

from dflash import host
from dflash.ops import reference, registry
from dflash.ops.cases import paged_attention_inputs


@pytest.fixture(autouse=True)
def _kernel_is_loaded():
    assert registry.has_kernel("paged_attention"), \
        "the compiled paged_attention kernel is not loaded (pip install --no-build-isolation -e .)"


kernel = torch.ops.dflash.paged_attention
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}
HEAD_DIMS = (64, 128)
GROUPS = (1, 2, 4, 8)            # Hq / Hkv
BLOCK_SIZES = (16, 32, 128)
CONTEXTS = (0, 1, 15, 16, 17, 1000)
QUERY_LENS = (1, 16)             # decode, DFlash block


def assert_matches_reference(args):
    out = kernel(**args)
    expected = reference.paged_attention(**args)
    assert out.dtype == expected.dtype and out.shape == expected.shape
    tol = TOLERANCE[args["query"].dtype]
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    return out


def ragged_batch(seed):
    """Every context length with every query length, in a shuffled order, plus a sequence with no
    queries at all: (context_lens, query_lens)."""
    pairs = list(itertools.product(CONTEXTS, QUERY_LENS)) + [(5, 0)]
    random.Random(seed).shuffle(pairs)
    return tuple(c for c, _ in pairs), tuple(n for _, n in pairs)


@pytest.mark.parametrize("causal", [False, True], ids=["draft", "causal"])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_matches_reference_on_ragged_batches(head_dim, group, block_size, causal):
    # Latin-square dtype: each dtype meets every value of every other parameter
    index = HEAD_DIMS.index(head_dim) + GROUPS.index(group) + BLOCK_SIZES.index(block_size)
    dtype = DTYPES[(index + causal) % len(DTYPES)]
    seed = hash((head_dim, group, block_size, causal)) % 1000
    contexts, query_lens = ragged_batch(seed)
    assert_matches_reference(paged_attention_inputs(
        context_lens=contexts, query_lens=query_lens, hq=2 * group, hkv=2, d=head_dim,
        block_size=block_size, causal=causal, dtype=dtype, seed=seed))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["draft", "causal"])
@pytest.mark.parametrize("query_len", QUERY_LENS)
@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_exhaustive_case_matrix(head_dim, group, block_size, context, query_len, causal, dtype):
    assert_matches_reference(paged_attention_inputs(
        context_lens=(context,), query_lens=(query_len,), hq=group, hkv=1, d=head_dim,
        block_size=block_size, causal=causal, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("hq, hkv, head_dim, prompt", [
    (9, 3, 64, 300),      # SmolLM2-135M: query tiles of 42 rows (128 query vectors)
    (32, 8, 128, 70),     # Qwen3-8B: query tiles of 32 rows
])
def test_long_prompts_span_many_query_tiles(hq, hkv, head_dim, prompt, causal, dtype):
    """Prefill (no context) and chunked prefill (a context, then a long chunk of new tokens)."""
    assert_matches_reference(paged_attention_inputs(
        context_lens=(0, 45), query_lens=(prompt, prompt // 2 + 1), hq=hq, hkv=hkv,
        d=head_dim, block_size=16, causal=causal, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_batch(dtype):
    contexts = (7, 300, 1, 64, 129, 0, 2000, 33)
    assert_matches_reference(paged_attention_inputs(
        context_lens=contexts, query_lens=(1,) * len(contexts), hq=32, hkv=8, d=128,
        block_size=32, causal=True, dtype=dtype))


@pytest.mark.parametrize("head_dim", [1, 8, 24, 72, 200])
def test_head_dims_that_are_not_a_multiple_of_the_vector_width(head_dim):
    for dtype in DTYPES:
        assert_matches_reference(paged_attention_inputs(
            context_lens=(40, 3), query_lens=(5, 16), hq=6, hkv=2, d=head_dim, block_size=8,
            causal=True, dtype=dtype))


# ----------------------------------------------------------------------- independent oracles

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_zero_queries_average_the_visible_values(causal, dtype):
    """q = 0 makes every score equal, so each output row is the mean of the values it may see."""
    contexts, query_lens = (37, 0, 70), (16, 3, 1)
    args = paged_attention_inputs(context_lens=contexts, query_lens=query_lens, hq=4, hkv=2,
                                  d=64, block_size=16, causal=causal, dtype=dtype)
    args["query"].zero_()
    out = kernel(**args).float()
    value_cache, value = args["value_cache"].float(), args["value"].float()
    row = 0
    for b, (ctx, n) in enumerate(zip(contexts, query_lens)):
        blocks = args["block_table"][b].long()
        context = value_cache[blocks].flatten(0, 1)[:ctx]          # [ctx, Hkv, D]
        for i in range(n):
            new = value[row - i: row - i + (i + 1 if causal else n)]
            expected = torch.cat([context, new]).mean(0).repeat_interleave(2, dim=0)
            torch.testing.assert_close(out[row], expected, atol=TOLERANCE[dtype],
                                       rtol=TOLERANCE[dtype])
            row += 1


@pytest.mark.parametrize("slope", [0.125, 0.3125])   # scores rise 4 or 10 per 32-key tile
@pytest.mark.parametrize("direction", ["rising", "falling"])
def test_softmax_is_exact_when_scores_climb_across_the_context(slope, direction):
    """Steadily rising scores make the online softmax move its reference point again and again;
    falling ones never after the first tile. Keys along one axis keep every score exact in
    float32, so the closed form in float64 is the oracle."""
    ctx, n, d = 512, 4, 64
    args = paged_attention_inputs(context_lens=(ctx,), query_lens=(n,), hq=2, hkv=1, d=d,
                                  block_size=16)
    position = torch.arange(ctx + n, dtype=torch.float32)
    if direction == "falling":
        position = position.flip(0)
    keys = torch.zeros(ctx + n, d)
    keys[:, 0] = position * slope / args["scale"]
    blocks = args["block_table"][0].long()
    args["key_cache"][blocks] = keys[:ctx].view(-1, 16, 1, d)
    args["key"][:, 0] = keys[ctx:]
    args["query"].zero_()
    args["query"][..., 0] = 1
    values = torch.cat([args["value_cache"][blocks].flatten(0, 1), args["value"]])[:, 0]
    expected = (torch.softmax(position.double() * slope, 0) @ values.double()).float()
    out = kernel(**args)
    torch.testing.assert_close(out, expected.expand_as(out), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_output_is_rounded_once(dtype):
    """Inputs upcast exactly to float32, so the float32 reference on them is the exact result up to
    float32 accumulation; one round-to-nearest-even to `dtype` then leaves half an ulp. Causal
    items of 32 or more tokens (sequence 0's first 32) take the matrix-engine path on CPUs that
    have one, whose P carries ~16 bits (P_hi + P_lo in `dtype`): its accumulation error is bounded
    by 2^-15 of sum(p |v|) / sum(p), the softmax-weighted mean of |v|, instead of float32's."""
    args = paged_attention_inputs(context_lens=(100, 9, 50), query_lens=(40, 1, 3), hq=8, hkv=2,
                                  d=128, block_size=16, causal=True, dtype=dtype)
    out = kernel(**args).float()
    upcast = {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v
              for k, v in args.items()}
    exact = reference.paged_attention(**upcast)
    weighted = reference.paged_attention(**{**upcast, "key": upcast["key"],
                                            "value": upcast["value"].abs(),
                                            "value_cache": upcast["value_cache"].abs()})
    ulp = torch.finfo(dtype).eps * torch.exp2(torch.floor(torch.log2(exact.abs())))
    assert ((out - exact).abs() <= 0.5 * ulp + 2**-15 * weighted + 1e-6).all()
    # the rest of sequence 0 and sequences 1 and 2 run on the vector path: float32 throughout
    tail = slice(32, None)
    assert ((out - exact)[tail].abs() <= 0.5 * ulp[tail] + 1e-5 * exact[tail].abs() + 1e-6).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (32, 8, 128)])
@pytest.mark.parametrize("ctx", [100, 250, 600])
def test_verification_rows_equal_decode_bit_for_bit(dtype, hq, hkv, d, ctx):
    """Row i of a causal 16-token verification is exactly the 1-token decode of token i once
    tokens 0..i-1 are cached: what makes DFlash output equal target-only output in bf16 too.
    Contexts of 250 and 600 put the rows' keys in several key chunks of a split item, the
    verification's last rows past a chunk boundary that its first rows do not reach."""
    n, bs = 16, 16
    args = paged_attention_inputs(context_lens=(ctx + n,), query_lens=(n,), hq=hq, hkv=hkv, d=d,
                                  block_size=bs, extra_blocks=0, causal=True, dtype=dtype)
    args["context_lens"] = torch.tensor([ctx], dtype=torch.int32)
    verify = kernel(**args)
    table = args["block_table"][0].long()
    for i in range(n):
        slot = ctx + i - 1
        if i:   # token i-1 joins the cache, as the engine writes it after its step
            args["key_cache"][table[slot // bs], slot % bs] = args["key"][i - 1]
            args["value_cache"][table[slot // bs], slot % bs] = args["value"][i - 1]
        decode = kernel(**{**args, "query": args["query"][i:i + 1], "key": args["key"][i:i + 1],
                           "value": args["value"][i:i + 1],
                           "context_lens": torch.tensor([ctx + i], dtype=torch.int32),
                           "cu_query_lens": torch.tensor([0, 1], dtype=torch.int32)})
        assert torch.equal(decode[0], verify[i]), f"row {i}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_rows_do_not_depend_on_the_thread_count(dtype):
    """Long contexts go in key chunks, merged by the last chunk to finish: one thread and two
    compute every row the same way, bit for bit (chunks follow key indices, not threads)."""
    args = paged_attention_inputs(context_lens=(600, 1000, 40), query_lens=(1, 16, 7), hq=9,
                                  hkv=3, d=64, block_size=16, causal=True, dtype=dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(**args)
        torch.set_num_threads(2)
        two = kernel(**args)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    tol = 2e-2 if dtype != torch.float32 else 1e-5
    torch.testing.assert_close(two, reference.paged_attention(**args), atol=tol, rtol=tol)


# --------------------------------------------------------------------- layouts and edge cases

def test_strided_inputs_and_cache_views():
    """Query/key/value views with gaps, and caches that are views of a [Hkv, block] major
    allocation inside a stacked per-layer tensor, read through their strides."""
    args = paged_attention_inputs(context_lens=(50, 7), query_lens=(16, 3), hq=8, hkv=2, d=64,
                                  block_size=16, causal=True)
    expected = reference.paged_attention(**args)
    nb, bs, hkv, d = args["key_cache"].shape
    stacked = torch.randn(3, 2, nb, hkv, bs, d)      # [layer, k/v, block, head, slot, dim]
    stacked[1, 0] = args["key_cache"].transpose(1, 2)
    stacked[1, 1] = args["value_cache"].transpose(1, 2)
    args["key_cache"], args["value_cache"] = stacked[1].transpose(2, 3).unbind(0)
    assert not args["key_cache"].is_contiguous()
    for name in ("query", "key", "value"):
        wide = torch.randn(args[name].shape[0], args[name].shape[1], 2 * d)
        wide[..., ::2] = args[name]
        args[name] = wide[..., ::2]                   # last-dim stride 2
    torch.testing.assert_close(kernel(**args), expected)


def test_unused_block_table_entries_are_never_read():
    args = paged_attention_inputs(context_lens=(20, 0, 3), query_lens=(2, 4, 1), block_size=8,
                                  causal=True)
    args["block_table"] = torch.cat([args["block_table"],
                                     torch.full((3, 4), -1, dtype=torch.int32)], dim=1)
    args["block_table"][0, 3:] = 1 << 30      # sequence 0 uses blocks 0..2 only
    args["block_table"][1, :] = -7            # no context, so no block is used
    assert_matches_reference(args)


def test_empty_batches_and_empty_query_ranges():
    args = paged_attention_inputs(context_lens=(4, 9), query_lens=(0, 0))
    assert kernel(**args).shape == (0, 4, 8)
    none = paged_attention_inputs(context_lens=(4,), query_lens=(0,))
    none["block_table"] = none["block_table"][:0]
    none["context_lens"] = none["context_lens"][:0]
    none["cu_query_lens"] = none["cu_query_lens"][:1]
    assert kernel(**none).shape == (0, 4, 8)


WIDENED = """
import sys, torch
from dflash import ops
torch.save([ops.paged_attention(**args) for args in torch.load(sys.argv[1])], sys.argv[2])
"""


@pytest.mark.skipif(registry.CPU_CAPABILITY != "AVX512" or host.bf16_gemm() == "panels",
                    reason="the AVX-512 build's two bf16 paths need a CPU with AVX512-BF16 that "
                           "ONEDNN_MAX_CPU_ISA leaves visible")
def test_bf16_pair_dots_and_widened_scores_both_match_the_reference(tmp_path):
    """bf16 Q.K takes VDPBF16PS where the CPU has it; ONEDNN_MAX_CPU_ISA=AVX512_CORE hides it (a
    CPU without bf16 units), and the same calls widen K to float32 instead. Both match the
    reference, on head dims that fill 16-pair vectors and ones that do not (and an odd one, which
    always widens); that the outputs are not all equal shows the limit switched the path."""
    import subprocess
    import sys

    cases = [paged_attention_inputs(context_lens=(40, 3, 70), query_lens=(5, 16, 1), hq=6, hkv=2,
                                    d=d, block_size=16, causal=causal, dtype=torch.bfloat16,
                                    seed=d)
             for d in (8, 24, 64, 72, 128, 15) for causal in (False, True)]
    torch.save(cases, tmp_path / "inputs.pt")
    subprocess.run([sys.executable, "-c", WIDENED, tmp_path / "inputs.pt", tmp_path / "out.pt"],
                   env={**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}, check=True)
    widened = torch.load(tmp_path / "out.pt")
    tol = TOLERANCE[torch.bfloat16]
    for args, other in zip(cases, widened, strict=True):
        assert_matches_reference(args)
        torch.testing.assert_close(other, reference.paged_attention(**args), atol=tol, rtol=tol)
    assert not all(torch.equal(kernel(**args), other) for args, other in zip(cases, widened))


def test_single_thread_and_all_threads_agree_bitwise():
    """Work items are independent, so the thread count must not change a single bit."""
    args = paged_attention_inputs(context_lens=(300, 0, 77, 1000), query_lens=(16, 40, 1, 16),
                                  hq=9, hkv=3, d=64, block_size=32, causal=True,
                                  dtype=torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = kernel(**args)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(kernel(**args), single)


# ---------------------------------------------------------------------------------- bad input

def _bad_cases():
    a = paged_attention_inputs()          # contexts (3, 0, 9), queries (2, 1, 4), block size 4
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    used = a["block_table"].clone()
    used[2, 2] = 11                        # the third block of a 9-token context
    negative = a["block_table"].clone()
    negative[2, 0] = -3
    return {
        "query dtype": dict(query=a["query"].double()),
        "query int": dict(query=a["query"].int()),
        "value dtype": dict(value=a["value"].bfloat16()),
        "key_cache dtype": dict(key_cache=a["key_cache"].half()),
        "value_cache dtype": dict(value_cache=a["value_cache"].bfloat16()),
        "key rows": dict(key=a["key"][:-1]),
        "value heads": dict(value=a["value"][:, :1]),
        "value_cache shape": dict(value_cache=a["value_cache"][:-1]),
        "key_cache rank": dict(key_cache=a["key_cache"][0]),
        "zero kv heads": dict(key=a["key"][:, :0], value=a["value"][:, :0],
                              key_cache=a["key_cache"][:, :, :0],
                              value_cache=a["value_cache"][:, :, :0]),
        "heads not a multiple": dict(query=torch.zeros(7, 3, 8)),
        "context_lens dtype": dict(context_lens=a["context_lens"].long()),
        "context_lens size": dict(context_lens=i32(3, 0)),
        "cu_query_lens dtype": dict(cu_query_lens=a["cu_query_lens"].long()),
        "cu_query_lens start": dict(cu_query_lens=i32(1, 3, 4, 7)),
        "cu_query_lens end": dict(cu_query_lens=i32(0, 2, 3, 8)),
        "cu_query_lens order": dict(cu_query_lens=i32(0, 3, 2, 7)),
        "negative context": dict(context_lens=i32(3, -1, 9)),
        "context beyond the table": dict(context_lens=i32(3, 0, 13)),
        "used block out of range": dict(block_table=used),
        "used block negative": dict(block_table=negative),
        "scale inf": dict(scale=float("inf")),
        "scale nan": dict(scale=float("nan")),
    }


@pytest.mark.parametrize("case", list(_bad_cases()))
def test_bad_input_raises_the_reference_error(case):
    args = {**paged_attention_inputs(), **_bad_cases()[case]}
    with pytest.raises(ValueError, match="^paged_attention: ") as want:
        reference.paged_attention(**args)
    with pytest.raises(ValueError) as got:
        kernel(**args)
    assert str(got.value) == str(want.value)


def test_zero_length_cache_blocks_are_not_divided_by():
    """A degenerate cache with 0 slots per block is fine while no context uses it."""
    args = paged_attention_inputs(context_lens=(0, 0), query_lens=(3, 1), hq=2, hkv=1)
    expected = reference.paged_attention(**args)
    args["key_cache"] = args["key_cache"][:, :0]
    args["value_cache"] = args["value_cache"][:, :0]
    torch.testing.assert_close(kernel(**args), expected)
    with pytest.raises(ValueError, match="context_lens\\[0\\] = 1 is out of range"):
        kernel(**{**args, "context_lens": torch.tensor([1, 0], dtype=torch.int32)})
