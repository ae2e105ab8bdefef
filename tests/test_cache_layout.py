"""Finding a framework's KV cache layout from its own cache-write function, and context_kv writing
into that cache in place (dflash.integrations.cache_layout; no framework needed)."""

import pytest
import torch

from dflash.integrations import cache_layout
from dflash.ops import reference
from dflash.ops.cases import context_kv_inputs

NB, BS, HKV, D = 5, 16, 2, 32


def block_write(store_k):
    """A cache write over [num_blocks, Hkv, block_size, 2 * D] per layer: K of each (block, head)
    in the first block_size * D values as `store_k` places it, V row-major [block_size, D] after
    it (written from the description of vLLM's CPU layout, with plain indexing)."""
    def write(key, value, cache, slots):
        nb, hkv, bs, _ = cache.shape
        d = key.shape[-1]
        flat = cache.view(nb, hkv, 2, bs * d)
        for t, slot in enumerate(slots.tolist()):
            b, offset = divmod(slot, bs)
            for h in range(hkv):
                store_k(flat[b, h, 0], offset, key[t, h], bs)
                flat[b, h, 1].view(bs, d)[offset] = value[t, h]
    return write


def _transposed(k, offset, row, bs):   # vLLM's CPU layout: K as [D, block_size]
    k.view(-1, bs)[:, offset] = row


def _paired(k, offset, row, bs):       # not affine: dims in pairs, [D / 2, block_size, 2]
    k.view(-1, bs, 2)[:, offset] = row.view(-1, 2)


transposed_k_write, packed_write = block_write(_transposed), block_write(_paired)


def test_probe_finds_the_transposed_k_layout():
    layout = cache_layout.probe(transposed_k_write, (HKV, BS, 2 * D), BS, HKV, D, torch.float32)
    per_block = HKV * BS * 2 * D
    assert layout == cache_layout.Layout(0, BS * D, (per_block, 1, 2 * BS * D, BS),
                                         (per_block, D, 2 * BS * D, 1))


def test_probe_rejects_a_layout_that_is_not_affine():
    assert cache_layout.probe(packed_write, (HKV, BS, 2 * D), BS, HKV, D, torch.float32) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_context_kv_writes_where_the_framework_would(dtype):
    """The op through the probed views writes, into the framework's own cache tensors, what the
    framework's write function stores for the reference's K/V (K within 1e-5 in float32 or one
    bf16 ulp; V bit-identical); nothing else changes."""
    args = context_kv_inputs(n=21, d_in=48, h=32, layers=2, hkv=HKV, d=D, num_blocks=NB,
                             block_size=BS, dtype=dtype, skip_every=4, seed=3)
    # what the framework stores: the reference's K/V rows through its own write
    plain = {**args, "key_caches": [torch.zeros(NB, BS, HKV, D, dtype=dtype) for _ in range(2)],
             "value_caches": [torch.zeros(NB, BS, HKV, D, dtype=dtype) for _ in range(2)]}
    reference.context_kv(**plain)
    slots = args["slot_mapping"]
    keep = slots >= 0
    expected = [torch.full((NB, HKV, BS, 2 * D), 7.0, dtype=dtype) for _ in range(2)]
    for layer, cache in enumerate(expected):
        rows = lambda c: c.flatten(0, 1)[slots[keep]]  # noqa: E731
        transposed_k_write(rows(plain["key_caches"][layer]), rows(plain["value_caches"][layer]),
                           cache, slots[keep])
    layout = cache_layout.probe(transposed_k_write, (HKV, BS, 2 * D), BS, HKV, D, dtype)
    caches = [torch.full((NB, HKV, BS, 2 * D), 7.0, dtype=dtype) for _ in range(2)]
    pairs = [cache_layout.views(c, layout, BS, HKV, D) for c in caches]
    pointers = [c.data_ptr() for c in caches]
    torch.ops.dflash.context_kv(**{**args, "key_caches": [k for k, _ in pairs],
                                   "value_caches": [v for _, v in pairs]})
    assert [c.data_ptr() for c in caches] == pointers   # written in place
    for got, want in zip(caches, expected):
        k_got, k_want = got.view(NB, HKV, 2, -1)[:, :, 0], want.view(NB, HKV, 2, -1)[:, :, 0]
        v_got, v_want = got.view(NB, HKV, 2, -1)[:, :, 1], want.view(NB, HKV, 2, -1)[:, :, 1]
        assert torch.equal(v_got, v_want)
        if dtype == torch.float32:
            torch.testing.assert_close(k_got, k_want, rtol=0, atol=1e-5)
        else:
            ulp = torch.finfo(dtype).eps * k_want.float().abs().clamp_min(1)
            assert ((k_got.float() - k_want.float()).abs() <= ulp).all()


def test_views_of_a_non_contiguous_cache_are_an_error():
    layout = cache_layout.probe(transposed_k_write, (HKV, BS, 2 * D), BS, HKV, D, torch.float32)
    cache = torch.zeros(HKV, NB, BS, 2 * D).transpose(0, 1)
    with pytest.raises(ValueError, match="a contiguous, block-major cache is needed"):
        cache_layout.views(cache, layout, BS, HKV, D)
