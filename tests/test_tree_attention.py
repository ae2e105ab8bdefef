"""paged_attention with a tree mask (docs/design.md 3.2): each new token attends to its context,
its ancestors among the new tokens and itself.

The oracle is independent of the mask: a node's output must equal causal attention over the
sequence made of its context and its root-to-node path alone. The reference is checked against
it; the CPU kernel and the Ascend C kernel (under the emulation) against the reference on chains,
stars, deep, bushy and random trees, up to 80 nodes, in batches that mix trees, chains and
sequences without new tokens. Bad masks get the same error from every implementation.
"""

import itertools

import pytest
import torch

from dflash.ops import reference
from dflash.ops.cases import TREE_SHAPES, paged_attention_inputs, tree_mask, tree_parents

from ascend_emu import ops as emu_ops

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}
kernel = torch.ops.dflash.paged_attention


def tree_case(contexts, sizes, shapes, dtype=torch.float32, hq=4, hkv=2, d=64, block_size=16,
              seed=0):
    args = paged_attention_inputs(context_lens=contexts, query_lens=sizes, hq=hq, hkv=hkv, d=d,
                                  block_size=block_size, causal=True, dtype=dtype, seed=seed)
    parents = [tree_parents(n, shape, seed + i) for i, (n, shape) in enumerate(zip(sizes, shapes))]
    return args, parents


def path_oracle(args, parents):
    """Each node's output as causal attention over [context, root .. node] alone."""
    out = torch.empty_like(args["query"])
    cu = args["cu_query_lens"].tolist()
    for b, par in enumerate(parents):
        for i in range(len(par)):
            path = []
            j = i
            while j >= 0:
                path.insert(0, cu[b] + j)
                j = par[j]
            rows = torch.tensor(path)
            one = {**args, "query": args["query"][rows], "key": args["key"][rows],
                   "value": args["value"][rows], "block_table": args["block_table"][b:b + 1],
                   "context_lens": args["context_lens"][b:b + 1],
                   "cu_query_lens": torch.tensor([0, len(path)], dtype=torch.int32)}
            out[cu[b] + i] = reference.paged_attention(**one)[-1]
    return out


@pytest.mark.parametrize("shape", TREE_SHAPES)
def test_the_reference_attends_along_each_node_s_path(shape):
    args, parents = tree_case((0, 20, 37), (9, 17, 33), [shape] * 3, seed=3)
    got = reference.paged_attention(**args, tree_mask=tree_mask(parents))
    torch.testing.assert_close(got, path_oracle(args, parents), atol=1e-6, rtol=1e-6)


def test_a_chain_mask_is_the_causal_mask_and_a_wrong_mask_is_not():
    args, parents = tree_case((5, 40), (16, 9), ["chain", "chain"])
    causal = reference.paged_attention(**args)
    assert torch.equal(reference.paged_attention(**args, tree_mask=tree_mask(parents)), causal)
    star = [tree_parents(16, "star"), tree_parents(9, "star")]   # negative control
    assert not torch.allclose(reference.paged_attention(**args, tree_mask=tree_mask(star)),
                              causal, atol=1e-3)


# Trees of every shape, context lengths on both sides of a 32-key tile and a cache block, sizes
# up to 80 nodes (a mask of 10 bytes a row), mixed with chains and an empty sequence.
CASES = [
    ((0, 17, 1000), (8, 16, 1), ("random", "bushy", "chain")),
    ((31, 32, 33), (65, 40, 2), ("deep", "star", "random")),
    ((3, 0, 129), (80, 0, 24), ("random", "chain", "bushy")),
    ((64,), (64,), ("star",)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("hq, hkv, d, block_size", [(4, 2, 64, 16), (9, 3, 64, 32),
                                                    (8, 1, 128, 16)])
def test_the_cpu_kernel_matches_the_reference(case, dtype, hq, hkv, d, block_size):
    contexts, sizes, shapes = CASES[case]
    args, parents = tree_case(contexts, sizes, shapes, dtype, hq, hkv, d, block_size, seed=case)
    mask = tree_mask(parents)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(kernel(**args, tree_mask=mask),
                               reference.paged_attention(**args, tree_mask=mask),
                               atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("context, size", [(0, 24), (45, 24), (60, 24), (100, 70), (240, 24),
                                           (500, 40)])
def test_tree_rows_equal_their_causal_path_bit_for_bit_in_the_kernel(dtype, context, size):
    """What keeps a tree step's output equal to target-only decoding: a node's row is computed
    as the same node at the end of a causal chain of its path (whose rows equal one-token
    decoding), with its keys in the same tiles and lanes: bit for bit, in float32 too. The
    kernel reads the context's whole key tiles once for many rows (70 rows: more than one work
    item) and the rest row by row; contexts of 240 and 500 cut the keys into chunks (a split
    item), a path crossing a chunk boundary at 240."""
    args, parents = tree_case((context,), (size,), ("random",), dtype, 9, 3, 64, 16, seed=5)
    tree = kernel(**args, tree_mask=tree_mask(parents))
    for i in range(size):
        path = []
        j = i
        while j >= 0:
            path.insert(0, j)
            j = parents[0][j]
        rows = torch.tensor(path)
        chain = kernel(**{**args, "query": args["query"][rows], "key": args["key"][rows],
                          "value": args["value"][rows],
                          "cu_query_lens": torch.tensor([0, len(path)], dtype=torch.int32)})
        assert torch.equal(tree[i], chain[-1]), f"node {i}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_chains_in_a_tree_call_equal_the_same_rows_without_a_mask_bit_for_bit(dtype):
    """The kernel sends a sequence whose tree is a chain (its mask rows the causal mask) down the
    causal path, one pass over the keys for all its rows: they must equal the rows of the same
    call without a mask, bit for bit, whatever trees share the call (a bushy tree beside chains
    of 1, 16, 45 and 20 rows, the 45 more than one work item, over contexts on both sides of a
    key tile and, the last, across a key chunk). The bushy tree's rows, which see fewer keys,
    must differ from the causal ones."""
    shapes = ("chain", "bushy", "chain", "chain", "chain")
    args, parents = tree_case((31, 40, 7, 100, 250), (16, 12, 1, 45, 20), shapes, dtype, 9, 3,
                              64, 16, seed=7)
    tree, causal = kernel(**args, tree_mask=tree_mask(parents)), kernel(**args)
    cu = args["cu_query_lens"].tolist()
    for b, shape in enumerate(shapes):
        rows = slice(cu[b], cu[b + 1])
        assert torch.equal(tree[rows], causal[rows]) == (shape == "chain"), f"sequence {b}"


@pytest.fixture
def emu():
    yield emu_ops()
    emu_ops().configure(8, 0, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_ascend_kernel_matches_the_reference(emu, case, dtype):
    contexts, sizes, shapes = CASES[case]
    args, parents = tree_case(contexts, sizes, shapes, dtype, 4, 2, 64, 16, seed=case)
    mask = tree_mask(parents)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(emu.paged_attention(**args, tree_mask=mask),
                               reference.paged_attention(**args, tree_mask=mask),
                               atol=tol, rtol=tol)


def test_the_ascend_kernel_reads_masks_only_on_request(emu):
    args, parents = tree_case((5, 9), (12, 7), ("random", "bushy"))
    mask = tree_mask(parents)
    before = emu.transfers()
    checked = emu.paged_attention(**args, tree_mask=mask)
    assert emu.transfers() - before == 4          # table, lengths, offsets and the mask
    before = emu.transfers()
    assert torch.equal(emu.paged_attention(**args, tree_mask=mask, check=False), checked)
    assert emu.transfers() == before


def _bad_masks():
    args, parents = tree_case((3, 0), (5, 3), ("random", "chain"))
    good = tree_mask(parents)
    blind = good.clone()
    blind[2, 0] &= ~(1 << 2)              # row 2 of sequence 0 does not see itself
    ahead = good.clone()
    ahead[5, 0] |= 1 << 1                 # row 0 of sequence 1 sees its row 1
    return args, {
        "needs causal": dict(causal=False, tree_mask=good),
        "dtype": dict(tree_mask=good.int()),
        "rows": dict(tree_mask=good[:-1]),
        "rank": dict(tree_mask=good[:, 0]),
        "too narrow": dict(tree_mask=tree_mask(parents)[:, :0]),
        "not itself": dict(tree_mask=blind),
        "a later row": dict(tree_mask=ahead),
    }


@pytest.mark.parametrize("case", list(_bad_masks()[1]))
def test_bad_masks_get_the_same_error_everywhere(emu, case):
    base, changes = _bad_masks()
    args = {**base, **changes[case]}
    with pytest.raises(ValueError, match="^paged_attention: .*tree_mask") as want:
        reference.paged_attention(**args)
    for implementation in (kernel, emu.paged_attention):
        with pytest.raises(ValueError) as got:
            implementation(**args)
        assert str(got.value) == str(want.value)


def test_the_fake_kernel_traces_a_tree_call():
    args, parents = tree_case((3, 8), (6, 4), ("random", "star"))
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v
                for k, v in itertools.chain(args.items(),
                                            [("tree_mask", tree_mask(parents))])}
        out = kernel(**fake)
    assert out.shape == args["query"].shape
