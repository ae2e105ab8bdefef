"""The PyTorch references against closed-form cases computed by hand (never by themselves)."""

import math

import pytest
import torch

from dflash.ops import reference
from dflash.ops.cases import context_kv_inputs, paged_attention_inputs, rope_cache

# ------------------------------------------------------------------------------ context_kv

def _identity_context_kv(position: int, head_dim: int = 4):
    """fc=None, H = D, one layer, one kv head, k_proj = I, v_proj = 2I, unit norm weights, eps 0."""
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    kv_weight = torch.cat([torch.eye(head_dim), 2 * torch.eye(head_dim)])
    kc = torch.full((2, 2, 1, head_dim), float("nan"))
    vc = torch.full((2, 2, 1, head_dim), float("nan"))
    reference.context_kv(x, None, torch.ones(head_dim), kv_weight, None,
                         torch.ones(1, head_dim), torch.tensor([position]),
                         rope_cache(8, head_dim, theta=100.0), torch.tensor([3]), [kc], [vc], 0.0)
    return x, kc, vc


def test_context_kv_position_zero_is_norm_only():
    x, kc, vc = _identity_context_kv(position=0)
    normed = x[0] / math.sqrt((1 + 4 + 9 + 16) / 4)
    torch.testing.assert_close(kc[1, 1, 0], normed)       # slot 3 = block 1, offset 1
    torch.testing.assert_close(vc[1, 1, 0], 2 * normed)
    assert torch.isnan(kc[0]).all() and torch.isnan(kc[1, 0]).all()   # nothing else written


def test_context_kv_rope_rotates_pairs_by_hand():
    position = 3
    x, kc, _ = _identity_context_kv(position=position)
    n = x[0] / math.sqrt(7.5)
    # D = 4: pairs (0, 2) and (1, 3) rotate by position * theta^(-2i/D), theta = 100
    a0, a1 = position * 1.0, position * 100.0 ** -0.5
    expected = torch.tensor([
        n[0] * math.cos(a0) - n[2] * math.sin(a0),
        n[1] * math.cos(a1) - n[3] * math.sin(a1),
        n[2] * math.cos(a0) + n[0] * math.sin(a0),
        n[3] * math.cos(a1) + n[1] * math.sin(a1),
    ])
    torch.testing.assert_close(kc[1, 1, 0], expected)


def test_context_kv_layer_major_layout_and_skip():
    """Layer l's K/V are rows [2l*Hkv*D, (2l+2)*Hkv*D) of kv_weight; slot -1 writes nothing."""
    args = context_kv_inputs(n=3, layers=2, hkv=1, d=4, h=4, with_fc=False, num_blocks=2,
                             block_size=2)
    args["positions"] = torch.zeros(3, dtype=torch.long)
    args["slot_mapping"] = torch.tensor([2, -1, 0])
    args["hidden_norm_weight"] = torch.ones(4)
    args["k_norm_weight"] = torch.ones(2, 4)
    args["eps"] = 0.0
    w = torch.zeros(16, 4)
    w[0:4], w[4:8], w[8:12], w[12:16] = torch.eye(4), 2 * torch.eye(4), 3 * torch.eye(4), \
        -torch.eye(4)
    args["kv_weight"] = w
    reference.context_kv(**args)
    h = args["hidden"]
    c = h / h.pow(2).mean(-1, keepdim=True).sqrt()     # RMS-normalised rows
    kc, vc = args["key_caches"], args["value_caches"]
    for t, (blk, off) in ((0, (1, 0)), (2, (0, 0))):
        torch.testing.assert_close(kc[0][blk, off, 0], c[t])           # k_norm of c is c
        torch.testing.assert_close(vc[0][blk, off, 0], 2 * c[t])
        torch.testing.assert_close(kc[1][blk, off, 0], c[t])           # 3c renormalised
        torch.testing.assert_close(vc[1][blk, off, 0], -c[t])
    assert torch.isnan(kc[0][0, 1]).all() and torch.isnan(kc[0][1, 1]).all()


# ------------------------------------------------------------------------- paged_attention

@pytest.mark.parametrize("causal", [False, True])
def test_attention_with_one_key_returns_its_value(causal):
    args = paged_attention_inputs(context_lens=(0,), query_lens=(1,), hq=4, hkv=2, causal=causal)
    out = reference.paged_attention(**args)
    expected = args["value"].repeat_interleave(2, dim=1)   # head h reads kv head h // 2
    torch.testing.assert_close(out, expected)


def test_causal_first_token_without_context_sees_only_itself():
    args = paged_attention_inputs(context_lens=(0,), query_lens=(5,), causal=True)
    out = reference.paged_attention(**args)
    torch.testing.assert_close(out[0], args["value"][0].repeat_interleave(2, dim=0))


def test_two_keys_match_hand_softmax():
    """One query, one cached key and one new key: out = softmax-weighted mix, by hand."""
    args = paged_attention_inputs(context_lens=(1,), query_lens=(1,), hq=1, hkv=1, d=2,
                                  block_size=2, extra_blocks=0)
    q, k_new, v_new = torch.tensor([1.0, 2.0]), torch.tensor([0.5, -1.0]), torch.tensor([3.0, 1.0])
    k_ctx, v_ctx = torch.tensor([2.0, 1.0]), torch.tensor([-1.0, 4.0])
    args["query"][0, 0], args["key"][0, 0], args["value"][0, 0] = q, k_new, v_new
    blk = int(args["block_table"][0, 0])
    args["key_cache"][blk, 0, 0], args["value_cache"][blk, 0, 0] = k_ctx, v_ctx
    args["scale"] = 0.7
    s_ctx, s_new = 0.7 * (1 * 2 + 2 * 1), 0.7 * (1 * 0.5 - 2 * 1)
    w_ctx = math.exp(s_ctx) / (math.exp(s_ctx) + math.exp(s_new))
    expected = w_ctx * v_ctx + (1 - w_ctx) * v_new
    for causal in (False, True):   # the only new token sees the context and itself either way
        args["causal"] = causal
        torch.testing.assert_close(reference.paged_attention(**args)[0, 0], expected)


@pytest.mark.parametrize("causal", [False, True])
def test_zero_queries_average_the_visible_values(causal):
    """With q = 0 all scores tie, so each output is the mean of the values it may see."""
    ctx_lens, q_lens = (5, 0, 9), (3, 2, 4)
    args = paged_attention_inputs(context_lens=ctx_lens, query_lens=q_lens, hq=2, hkv=1,
                                  block_size=4, causal=causal)
    args["query"].zero_()
    out = reference.paged_attention(**args)
    bs = 4
    row = 0
    for b, (ctx, n) in enumerate(zip(ctx_lens, q_lens)):
        ctx_values = [args["value_cache"][int(args["block_table"][b, i // bs]), i % bs, 0]
                      for i in range(ctx)]
        for i in range(n):
            visible = ctx_values + [args["value"][row - i + j, 0] for j in range(n)
                                    if not causal or j <= i]
            expected = torch.stack(visible).mean(0)
            torch.testing.assert_close(out[row, 0], expected)
            torch.testing.assert_close(out[row, 1], expected)
            row += 1


# ------------------------------------------------------------------------ rejection_sample

def _rs(drafts, target_probs, draft_probs=None, greedy=False, uniform=None, exponential=None):
    drafts = torch.tensor([drafts], dtype=torch.long)
    k, v = drafts.shape[1], target_probs.shape[-1]
    return reference.rejection_sample(
        drafts, draft_probs, target_probs[None], torch.tensor([greedy]),
        torch.full((1, k), 0.5) if uniform is None else torch.tensor([uniform]),
        torch.ones(1, v) if exponential is None else exponential[None])


def _one_hot_rows(tokens, v=6):
    return torch.nn.functional.one_hot(torch.tensor(tokens), v).float()


@pytest.mark.parametrize("drafts, targets, expected, accepted", [
    ([1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4], 3),     # perfect match: 3 drafts + bonus
    ([5, 2, 3], [1, 2, 3, 4], [1, -1, -1, -1], 0),  # first-position mismatch: correction only
    ([1, 5, 3], [1, 2, 3, 4], [1, 2, -1, -1], 1),   # middle mismatch
    ([4], [4, 0], [4, 0], 1),                        # K = 1
])
def test_greedy_rows_emit_accepted_then_argmax(drafts, targets, expected, accepted):
    probs = 0.5 * _one_hot_rows(targets) + 0.1      # argmax = targets, other mass spread
    out, n = _rs(drafts, probs, greedy=True)
    assert out[0].tolist() == expected and int(n[0]) == accepted


def test_greedy_ties_pick_first_index():
    probs = torch.tensor([[0.1, 0.4, 0.4, 0.1], [0.25] * 4])
    out, n = _rs([2], probs, greedy=True)   # argmax of row 0 is 1 (first of the tie), not 2
    assert out[0].tolist() == [1, -1] and int(n[0]) == 0


def test_q_equal_p_accepts_everything():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(5, 8, generator=g), -1)
    drafts = [1, 4, 0, 7]
    out, n = _rs(drafts, p, draft_probs=p[None, :4], uniform=[0.999] * 4)
    assert int(n[0]) == 4 and out[0, :4].tolist() == drafts


def test_one_hot_acceptance_is_coin_below_p():
    p = torch.tensor([[0.2, 0.7, 0.1], [0.3, 0.3, 0.4]])
    assert int(_rs([1], p, uniform=[0.69])[1][0]) == 1
    assert int(_rs([1], p, uniform=[0.71])[1][0]) == 0


def test_one_hot_residual_excludes_rejected_draft():
    p = torch.tensor([[0.0, 0.6, 0.4], [1.0, 0.0, 0.0]])
    out, n = _rs([1], p, uniform=[0.9])  # 0.9 >= 0.6: rejected; residual mass only on token 2
    assert out[0].tolist() == [2, -1] and int(n[0]) == 0


def test_dense_residual_is_positive_part_of_p_minus_q():
    p = torch.tensor([[0.5, 0.3, 0.2], [1.0, 0.0, 0.0]])
    q = torch.tensor([[[0.2, 0.6, 0.2]]])
    # reject token 1 (0.9 * 0.6 >= 0.3); residual = [0.3, 0, 0]: only token 0 can come out
    out, _ = _rs([1], p, draft_probs=q, uniform=[0.9], exponential=torch.tensor([5.0, 1e-3, 1e-3]))
    assert out[0].tolist() == [0, -1]


def test_zero_residual_falls_back_to_p():
    p = torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    q = torch.tensor([[[0.0, 0.0, 1.0]]])
    out, n = _rs([0], p, draft_probs=q, uniform=[0.0])   # p(0) = 0: reject; max(p - q, 0) = 0
    assert out[0].tolist() == [2, -1] and int(n[0]) == 0


def test_exponential_race_picks_largest_ratio():
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    out, _ = _rs([], p, exponential=torch.tensor([0.01, 1.0, 1.0, 1.0]))
    assert out[0].tolist() == [0]   # 0.1 / 0.01 = 10 beats 0.4 / 1


def test_degenerate_cache_shapes_are_served_as_by_the_kernels():
    """Shapes the checks allow: a block size of 0 with no context (paged_attention) and no kv
    heads (context_kv). The references give what the CPU kernels give instead of failing."""
    p = paged_attention_inputs(context_lens=(0, 0, 0))
    p["key_cache"], p["value_cache"] = p["key_cache"][:, :0], p["value_cache"][:, :0]
    torch.testing.assert_close(reference.paged_attention(**p),
                               torch.ops.dflash.paged_attention(**p))
    c = context_kv_inputs(hkv=0)
    kernel = dict(c, key_caches=[x.clone() for x in c["key_caches"]],
                  value_caches=[x.clone() for x in c["value_caches"]])
    reference.context_kv(**c)
    torch.ops.dflash.context_kv(**kernel)
    assert all(torch.equal(a, b) for a, b in zip(c["key_caches"], kernel["key_caches"]))
