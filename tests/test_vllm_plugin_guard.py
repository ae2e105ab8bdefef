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


def test_a_failing_registration_is_logged_and_replaces_nothing(monkeypatch, caplog):
    _fake_vllm(monkeypatch)   # the DFlash model module is missing
    with caplog.at_level(logging.ERROR, logger="vllm.dflash"):
        plugin.register()
    assert "not installed" in caplog.text and "qwen3_dflash" in caplog.text

    class Renamed:   # a vLLM whose class lacks the method the plugin replaces
        def other(self):
            pass

    _fake_vllm(monkeypatch, Renamed)
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="vllm.dflash"):
        plugin.register()
    assert "precompute_and_store_context_kv" in caplog.text
    assert not hasattr(Renamed, "precompute_and_store_context_kv")


def test_a_working_registration_replaces_the_method(monkeypatch):
    class DFlashQwen3Model:
        def precompute_and_store_context_kv(self, states, positions, slots=None):
            pass

    stock = DFlashQwen3Model.precompute_and_store_context_kv
    _fake_vllm(monkeypatch, DFlashQwen3Model)
    plugin.register()
    assert DFlashQwen3Model.precompute_and_store_context_kv.dflash_stock is stock


def test_per_layer_slot_mappings_fall_back_unless_shared(monkeypatch):
    calls = []
    monkeypatch.setattr(plugin, "_supported", lambda model: calls.append(model) or False)
    a, b = torch.arange(4), torch.arange(4)
    model = types.SimpleNamespace(_num_attn_layers=2)
    for differing in ({"layers.0.attn": a, "layers.1.attn": b}, [a, b], {}, []):
        assert plugin.context_kv(model, torch.zeros(4, 8), torch.arange(4), differing) is False
    assert calls == []   # fell back before looking at the model or calling the op
    for shared in ({"layers.0.attn": a, "layers.1.attn": a}, [a, a], (a,), a):
        assert plugin.context_kv(model, torch.zeros(4, 8), torch.arange(4), shared) is False
    assert calls == [model] * 4   # got as far as the model check, with one tensor


@pytest.mark.parametrize("given", [None, {"layer": None}])
def test_no_slot_mapping_is_vllm_s_own_function(given):
    assert plugin.context_kv(object(), torch.zeros(1, 8), torch.arange(1), given) is False
