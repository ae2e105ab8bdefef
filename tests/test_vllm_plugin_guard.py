"""The vLLM plugin's guards, without vLLM: a failure while registering never reaches vLLM's
plugin loader and replaces nothing; slot mappings given per layer (a list, or a mapping by layer
name as some vLLM builds pass) are used only when every layer shares one tensor."""

import logging
import sys
import types

import pytest
import torch

from dflash.integrations import vllm as plugin


def _fake_vllm(monkeypatch, model_class=None):
    """A `vllm` of a tested version; with `model_class`, its qwen3_dflash module too."""
    vllm = types.ModuleType("vllm")
    vllm.__version__ = plugin.TESTED_VLLM_VERSIONS[0]
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    for name in ("vllm.model_executor", "vllm.model_executor.models"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    if model_class is not None:
        module = types.ModuleType("vllm.model_executor.models.qwen3_dflash")
        module.DFlashQwen3Model = model_class
        monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(plugin.importlib.util, "find_spec", lambda name: None)   # no vllm_ascend


def _logged(caplog):
    """The messages alone: the reason must be in the line, not only in the traceback."""
    return [r.getMessage() for r in caplog.records if r.name == "vllm.dflash"]


def test_a_failing_registration_is_logged_and_replaces_nothing(monkeypatch, caplog):
    _fake_vllm(monkeypatch)   # the DFlash model module is missing
    with caplog.at_level(logging.ERROR, logger="vllm.dflash"):
        plugin.register()
    [line] = _logged(caplog)
    assert "not installed (ModuleNotFoundError" in line and "qwen3_dflash" in line

    class Renamed:   # a vLLM whose class lacks the method the plugin replaces
        def other(self):
            pass

    _fake_vllm(monkeypatch, Renamed)
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="vllm.dflash"):
        plugin.register()
    [line] = _logged(caplog)
    assert "(AttributeError" in line and "precompute_and_store_context_kv" in line
    assert not hasattr(Renamed, "precompute_and_store_context_kv")


def test_a_working_registration_replaces_the_method(monkeypatch):
    class DFlashQwen3Model:
        def precompute_and_store_context_kv(self, states, positions, slots=None):
            pass

    stock = DFlashQwen3Model.precompute_and_store_context_kv
    _fake_vllm(monkeypatch, DFlashQwen3Model)
    plugin.register()
    assert DFlashQwen3Model.precompute_and_store_context_kv.dflash_stock is stock


def _servable_model(layers=2, hkv=1, d=8, h=16):
    """The attributes context_kv reads of a draft the op serves, over (key, value) caches."""
    attn = types.SimpleNamespace(v_scale=None, rotary_emb=types.SimpleNamespace(rotary_dim=d))
    return types.SimpleNamespace(
        _num_attn_layers=layers, _num_kv_heads=hkv, _head_dim=d, _rms_norm_eps=1e-6,
        _hidden_norm_weight=torch.ones(h), _fused_kv_weight=torch.zeros(layers * 2 * hkv * d, h),
        _fused_kv_bias=None, _k_norm_weights=torch.ones(layers, d), _rope_is_neox=True,
        _rope_cos_sin_cache=torch.zeros(64, d), layers=[types.SimpleNamespace(self_attn=attn)],
        _attn_layers=[types.SimpleNamespace(kv_cache=(torch.zeros(2, 4, hkv, d),) * 2)
                      for _ in range(layers)])


def test_per_layer_slot_mappings_fall_back_unless_shared(monkeypatch):
    calls = []
    # context_kv looks the op up as torch.ops.dflash.context_kv at call time
    monkeypatch.setattr(torch.ops.dflash, "context_kv", lambda *args: calls.append(args[8]))
    model, states, positions = _servable_model(), torch.zeros(4, 16), torch.arange(4)
    a, b = torch.arange(4), torch.arange(4)   # equal values, distinct tensors
    for differing in ({"layers.0.attn": a, "layers.1.attn": b}, [a, b], {}, []):
        assert plugin.context_kv(model, states, positions, differing) is False
    assert calls == []   # vLLM's own function runs; the op never saw a mapping
    for shared in ({"layers.0.attn": a, "layers.1.attn": a}, [a, a], (a,), a):
        assert plugin.context_kv(model, states, positions, shared) is True
    assert len(calls) == 4 and all(s is a for s in calls)   # the one shared tensor


@pytest.mark.parametrize("given", [None, {"layer": None}])
def test_no_slot_mapping_is_vllm_s_own_function(given):
    assert plugin.context_kv(object(), torch.zeros(1, 8), torch.arange(1), given) is False
