"""ops.decoder_layer: a target layer in one call computes what the same ops give one by one, bit
for bit, for every weight form and model kind, on prefill, tree verification and decode steps,
writing the same caches; layers that cannot run as one call (experts) keep the op-by-op path."""

import pytest
import torch

from dflash.models import layers, load_target
from dflash.models import target as target_module
from dflash.models.layers import build_metadata

from helpers import TINY_TARGETS, make_tiny_target

BLOCK = 4
DENSE = [kind for kind in TINY_TARGETS if kind != "qwen3_moe"]
# (dtype, quantization, host.bf16_gemm's answer): each form `linear` tells apart
FORMS = {
    "float32-plain": (torch.float32, None, None),
    "float32-panels": (torch.float32, None, "panels"),
    "bf16-pairs": (torch.bfloat16, None, "pairs"),
    "bf16-panels": (torch.bfloat16, None, "panels"),
    "bf16-onednn": (torch.bfloat16, None, "onednn"),
    "int8": (torch.bfloat16, "int8", None),
    "int4": (torch.float32, "int4", None),
}


@pytest.fixture(scope="module", params=DENSE)
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    make_tiny_target(path, request.param)
    return path


def _steps():
    """Two sequences: a prefill of 9 and 5 tokens, a verification step of a tree (6 nodes) beside
    a chain (3), then one token each."""
    tables = [[5, 2, 9, 0, 7], [3, 8, 1, 6, 4]]
    return [
        build_metadata(tables, [0, 0], [9, 5], BLOCK, num_blocks=16),
        build_metadata(tables, [9, 5], [6, 3], BLOCK, num_blocks=16,
                       parents=[[-1, 0, 0, 1, 1, 2], [-1, 0, 1]]),
        build_metadata(tables, [15, 8], [1, 1], BLOCK, num_blocks=16),
    ]


def _run(model, steps, capture):
    """Hidden states and features of every step, and the cache they leave."""
    cache = torch.zeros(model.kv_cache_shape(16, BLOCK), dtype=model.dtype)
    g = torch.Generator().manual_seed(0)
    outputs = []
    with torch.inference_mode():
        for meta in steps:
            ids = torch.randint(0, 96, (meta.positions.shape[0],), generator=g)
            outputs += list(model(ids, meta, cache, capture_layers=capture))
    return outputs, cache


@pytest.mark.parametrize("form", list(FORMS))
def test_one_call_computes_the_ops_one_by_one(checkpoint, form, monkeypatch):
    dtype, quantization, gemm = FORMS[form]
    if gemm == "onednn" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("no oneDNN bf16 GEMMs here")
    if gemm is not None:
        monkeypatch.setattr(layers.host, "bf16_gemm", lambda: gemm)
    model = load_target(checkpoint, dtype=dtype, quantization=quantization)
    if gemm is not None or quantization is not None:
        model.pack_weights()
    else:   # plain weights: nothing to pack, the layers only fuse
        for layer in model.layers:
            layer.fuse()
    assert all(layer.fused is not None for layer in model.layers)
    calls = []
    one_call = target_module.ops.decoder_layer
    monkeypatch.setattr(target_module.ops, "decoder_layer",
                        lambda *a: calls.append(1) or one_call(*a))
    fused, fused_cache = _run(model, _steps(), capture=(0, 2))
    assert len(calls) == 3 * len(model.layers)
    model.unfuse()
    plain, plain_cache = _run(model, _steps(), capture=(0, 2))
    assert len(calls) == 3 * len(model.layers)   # op by op now
    for a, b in zip(fused, plain):
        assert torch.equal(a, b)
    assert torch.equal(fused_cache, plain_cache)


def test_layers_with_experts_run_op_by_op(tmp_path):
    make_tiny_target(tmp_path, "qwen3_moe")
    model = load_target(tmp_path, dtype=torch.float32)
    model.pack_weights()
    # layer 1 is dense (mlp_only_layers), the others route to experts
    assert [layer.fused is not None for layer in model.layers] == [False, True, False, False]


def test_replacing_weights_returns_to_op_by_op(checkpoint):
    model = load_target(checkpoint, dtype=torch.float32)
    for layer in model.layers:
        layer.fuse()
    model.quantize("int8", torch.float32)
    assert all(layer.fused is None for layer in model.layers)
    model.pack_weights()
    assert all(layer.fused is not None for layer in model.layers)


def test_long_prefills_take_the_ops_one_by_one(checkpoint, monkeypatch):
    model = load_target(checkpoint, dtype=torch.float32)
    model.pack_weights()
    calls = []
    monkeypatch.setattr(target_module.ops, "decoder_layer", lambda *a: calls.append(1))
    monkeypatch.setattr(target_module, "PANEL_MAX_ROWS", 8)
    cache = torch.zeros(model.kv_cache_shape(16, BLOCK))
    meta = build_metadata([[0, 1, 2]], [0], [9], BLOCK)
    with torch.inference_mode():
        model(torch.arange(9), meta, cache)
    assert not calls


def _layer_call(t=5, h=32, hq=4, hkv=2, d=8, inter=24):
    """Arguments of one ops.decoder_layer call with plain weights: a sequence of 3 cached tokens
    (block 0) and 5 new ones (slots of blocks 3 and 4)."""
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.3

    return dict(
        x=r(t, h), residual=r(t, h), input_norm=1 + r(h), post_norm=1 + r(h),
        qkv=r((hq + 2 * hkv) * d, h), qkv_scales=None, qkv_mins=None, qkv_bias=None,
        q_norm=None, k_norm=None, o=r(h, hq * d), o_scales=None, o_mins=None, o_bias=None,
        gate_up=r(2 * inter, h), gate_up_scales=None, gate_up_mins=None,
        down=r(h, inter), down_scales=None, down_mins=None, cos_sin=r(t, d),
        key_cache=r(6, BLOCK, hkv, d), value_cache=r(6, BLOCK, hkv, d),
        slot_mapping=torch.arange(12, 12 + t), block_table=torch.tensor([[0, 3, 4]],
                                                                         dtype=torch.int32),
        context_lens=torch.tensor([3], dtype=torch.int32),
        cu_query_lens=torch.tensor([0, t], dtype=torch.int32), tree_mask=None, num_heads=hq,
        scale=d ** -0.5, eps=1e-6, check=True)


BAD_CALLS = {
    "block_table": lambda a: a["block_table"].__setitem__((0, 0), 99),
    "cu_query_lens": lambda a: a["cu_query_lens"].__setitem__(-1, 4),
    "tree_mask": lambda a: a.__setitem__("tree_mask", torch.full((5, 1), 255, dtype=torch.uint8)),
    "o": lambda a: a.__setitem__("o", a["o"][:, :-1]),
    "gate_up": lambda a: a.__setitem__("gate_up", a["gate_up"][:-1]),
    "down": lambda a: a.__setitem__("down", a["down"][:-1]),
}


@pytest.mark.parametrize("bad", list(BAD_CALLS))
def test_a_rejected_call_leaves_the_caches_untouched(bad):
    """The layer writes the new tokens' K/V before its attention and later projections run, so
    what those would reject is checked before the write: a ValueError naming the problem, and
    the caches as they were (dflash/ops/checks.py's rule for every op)."""
    from dflash import ops

    ops.decoder_layer(**_layer_call())   # the unchanged call runs
    call = _layer_call()
    BAD_CALLS[bad](call)
    keys, values = call["key_cache"].clone(), call["value_cache"].clone()
    with pytest.raises(ValueError, match=bad):
        ops.decoder_layer(**call)
    assert torch.equal(call["key_cache"], keys) and torch.equal(call["value_cache"], values)
