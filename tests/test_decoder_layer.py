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
