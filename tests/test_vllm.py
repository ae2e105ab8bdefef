"""dflash inside vLLM (its CPU build): the plugin, the draft format, vLLM's own context K/V
function as the oracle. Optional group: `pytest -m vllm` in the environment of .ci/vllm-env;
skipped when vLLM is not importable."""

import json
import logging
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

vllm = pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm

from vllm import _custom_ops as vllm_ops  # noqa: E402
from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model  # noqa: E402
from vllm.v1.attention.backend import AttentionType  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl  # noqa: E402

from dflash.integrations import vllm as plugin  # noqa: E402
from dflash.ops.cases import rope_cache  # noqa: E402

ENGINE = Path(__file__).resolve().parents[1] / "tools" / "vllm_engine.py"
STOCK = getattr(DFlashQwen3Model.precompute_and_store_context_kv, "dflash_stock",
                DFlashQwen3Model.precompute_and_store_context_kv)


# ------------------------------------------------------------------ context K/V vs vLLM's own

class StandIn:
    """The attributes of a DFlashQwen3Model that its context K/V function reads, over vLLM's CPU
    attention implementation and KV caches of vLLM's CPU layout [num_blocks, Hkv, bs, 2 * D]."""

    _project_context_kv = DFlashQwen3Model._project_context_kv
    _normalize_context_k = DFlashQwen3Model._normalize_context_k

    def __init__(self, layers, hkv, d, h, num_blocks, block_size, dtype, isa, k_norm_weights,
                 seed=0, npu_layout=False):
        g = torch.Generator().manual_seed(seed)
        rows = layers * 2 * hkv * d
        self._num_attn_layers, self._num_kv_heads, self._head_dim = layers, hkv, d
        self._kv_size, self._rms_norm_eps = hkv * d, 1e-6
        self._hidden_norm_weight = (1 + 0.1 * torch.randn(h, generator=g)).to(dtype)
        self._fused_kv_weight = (torch.randn(rows, h, generator=g) / h**0.5).to(dtype)
        self._fused_kv_bias = None
        self._k_norm_weights = k_norm_weights.to(dtype).contiguous()
        self._rope_head_size, self._rope_is_neox = d, True
        self._rope_cos_sin_cache = rope_cache(4096, d)
        # vLLM's own cache write (do_kv_cache_update reads only these two attributes)
        impl = CPUAttentionBackendImpl.__new__(CPUAttentionBackendImpl)
        impl.attn_type, impl.kv_cache_dtype = AttentionType.DECODER, "auto"
        self._attn_layers = [SimpleNamespace(
            impl=impl, isa=isa, _k_scale_float=1.0, _v_scale_float=1.0,
            kv_cache=tuple(torch.zeros(num_blocks, block_size, hkv, d, dtype=dtype)
                           for _ in range(2)) if npu_layout else
            torch.zeros(num_blocks, hkv, block_size, 2 * d, dtype=dtype))
            for _ in range(layers)]
        attn = SimpleNamespace(v_scale=None, rotary_emb=SimpleNamespace(rotary_dim=d))
        self.layers = [SimpleNamespace(self_attn=attn)]


def _inputs(n, h, num_blocks, block_size, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:n]
    return (torch.randn(n, h, generator=g).to(dtype), torch.randint(0, 4096, (n,), generator=g),
            slots.long())


def per_layer_k_norm(self, all_k):
    """vLLM's own rms_norm op, one call per layer (its CPU op ignores all rows of a [L, D] weight
    but the first; see test_vllm_cpu_rms_norm_uses_only_the_first_row_of_a_grouped_weight)."""
    out = torch.empty_like(all_k)
    for layer in range(all_k.shape[0]):
        vllm_ops.rms_norm(out[layer], all_k[layer], self._k_norm_weights[layer].contiguous(),
                          self._rms_norm_eps)
    return out


def _exact_norm_states(n, h, seed=2):
    """Rows of +-2^k (k per row): with eps = 0 their RMSNorm is exact in any summation order."""
    g = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (n, h), generator=g) * 2 - 1
    return signs.float() * 2.0 ** torch.randint(-3, 4, (n, 1), generator=g)


@pytest.mark.parametrize("isa, block_size", [("vec", 128), ("vec", 32), ("vec16", 16)])
@pytest.mark.parametrize("shared_k_norm", [True, False])
@pytest.mark.parametrize("exact_norm", [False, True])
def test_context_kv_into_vllm_caches_equals_vllms_function(isa, block_size, shared_k_norm,
                                                           exact_norm):
    """float32: vLLM's precompute_and_store_context_kv writes its caches; the plugin's body writes
    a second set of caches through strided views (K transposed in each block), in place. K within
    1e-5. V: vLLM's CPU rms_norm and dflash's (the PyTorch reference's) round the normed hidden
    state differently in the last bit, so V is within 1e-5 on random inputs and bit-identical
    where that norm is exact (rows of +-2^k, eps 0). With distinct k_norm weights per layer,
    vLLM's grouped k_norm runs one layer at a time (its CPU op would use layer 0's weight)."""
    layers, hkv, d, h, nb = 3, 2, 64, 96, 6
    k_norm = 1 + 0.3 * torch.randn(layers, d, generator=torch.Generator().manual_seed(5))
    if shared_k_norm:
        k_norm = k_norm[:1].expand(layers, d)
    ours, theirs = (StandIn(layers, hkv, d, h, nb, block_size, torch.float32, isa, k_norm)
                    for _ in range(2))
    if not shared_k_norm:
        theirs._normalize_context_k = per_layer_k_norm.__get__(theirs)
    states, positions, slots = _inputs(2 * block_size + 7, h, nb, block_size, torch.float32)
    if exact_norm:
        states = _exact_norm_states(len(states), h)
        for model in (ours, theirs):
            model._rms_norm_eps = 0.0
            model._hidden_norm_weight = torch.ones(h)
    STOCK(theirs, states, positions, slots)
    pointers = [a.kv_cache.data_ptr() for a in ours._attn_layers]
    assert plugin.context_kv(ours, states, positions, slots)
    assert [a.kv_cache.data_ptr() for a in ours._attn_layers] == pointers
    for a, b in zip(ours._attn_layers, theirs._attn_layers):
        got, want = (x.kv_cache.view(nb, hkv, 2, -1) for x in (a, b))
        if exact_norm:
            assert torch.equal(got[:, :, 1], want[:, :, 1])
        else:
            torch.testing.assert_close(got[:, :, 1], want[:, :, 1], rtol=0, atol=1e-5)
        torch.testing.assert_close(got[:, :, 0], want[:, :, 0], rtol=0, atol=1e-5)


# A stand-in for vllm-ascend's worker patch of the method (it cannot run here): importing it
# replaces the method with an unfused loop in plain torch writing (key, value) caches
# [num_blocks, block_size, Hkv, D] per layer, as vllm-ascend does on NPU.
ASCEND_PATCH = """
import torch
from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model


def _rms(x, weight, eps):
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def precompute_and_store_context_kv(self, context_states, context_positions,
                                    context_slot_mapping=None):
    layers, hkv, d, eps = self._num_attn_layers, self._num_kv_heads, self._head_dim, \\
        self._rms_norm_eps
    c = _rms(context_states, self._hidden_norm_weight, eps).to(context_states.dtype)
    kv = torch.nn.functional.linear(c, self._fused_kv_weight).view(-1, layers, 2, hkv, d)
    cos, sin = self._rope_cos_sin_cache[context_positions].float()[:, None].chunk(2, -1)
    for i in range(layers):
        k1, k2 = _rms(kv[:, i, 0], self._k_norm_weights[i], eps).chunk(2, -1)
        k = torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], -1)
        if context_slot_mapping is None:
            continue
        key_cache, value_cache = self._attn_layers[i].kv_cache
        key_cache.view(-1, hkv, d)[context_slot_mapping] = k.to(key_cache.dtype)
        value_cache.view(-1, hkv, d)[context_slot_mapping] = kv[:, i, 1]


DFlashQwen3Model.precompute_and_store_context_kv = precompute_and_store_context_kv
"""


@pytest.fixture
def ascend_stand_in(tmp_path, monkeypatch):
    package = tmp_path / "vllm_ascend" / "patch" / "worker"
    package.mkdir(parents=True)
    for folder in (package, package.parent, package.parent.parent):
        (folder / "__init__.py").write_text("")
    (package / "patch_qwen3_dflash.py").write_text(ASCEND_PATCH)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(DFlashQwen3Model, "precompute_and_store_context_kv", STOCK)
    yield "vllm_ascend.patch.worker.patch_qwen3_dflash"
    for name in [m for m in sys.modules if m.startswith("vllm_ascend")]:
        del sys.modules[name]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vllm_ascend_module_replaces_its_unfused_patch(ascend_stand_in, dtype):
    """On vllm-ascend the plugin installs over vllm-ascend's own patch (imported first, so its
    later import changes nothing) and writes the same (key, value) caches in place as the
    unfused loop: within 1e-5 in float32, within 1% (about one rounding) in bfloat16."""
    import importlib

    from dflash.integrations import vllm_ascend
    vllm_ascend.apply()
    replaced = DFlashQwen3Model.precompute_and_store_context_kv
    unfused = replaced.dflash_stock
    assert unfused.__module__ == ascend_stand_in
    importlib.import_module(ascend_stand_in)
    assert DFlashQwen3Model.precompute_and_store_context_kv is replaced
    layers, hkv, d, h, nb, bs = 3, 2, 64, 96, 9, 16
    k_norm = 1 + 0.3 * torch.randn(layers, d, generator=torch.Generator().manual_seed(7))
    ours, theirs = (StandIn(layers, hkv, d, h, nb, bs, dtype, "vec", k_norm, npu_layout=True)
                    for _ in range(2))
    states, positions, slots = _inputs(5 * bs + 3, h, nb, bs, dtype)
    unfused(theirs, states, positions, slots)
    pointers = [t.data_ptr() for a in ours._attn_layers for t in a.kv_cache]
    assert plugin.context_kv(ours, states, positions, slots)
    assert [t.data_ptr() for a in ours._attn_layers for t in a.kv_cache] == pointers
    for a, b in zip(ours._attn_layers, theirs._attn_layers):
        (k_got, v_got), (k_want, v_want) = a.kv_cache, b.kv_cache
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(k_got.float(), k_want.float(), rtol=tol, atol=tol)
        torch.testing.assert_close(v_got.float(), v_want.float(), rtol=tol, atol=tol)


def test_vllm_cpu_rms_norm_uses_only_the_first_row_of_a_grouped_weight():
    """The vLLM behaviour behind its lower DFlash acceptance on CPU (docs/vllm.md): ops.rms_norm
    with x [L, N, Hkv, D] and weight [L, D] normalizes every layer with weight[0]."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 5, 2, 64, generator=g), 1 + 0.5 * torch.randn(3, 64, generator=g)
    out = torch.empty_like(x)
    vllm_ops.rms_norm(out, x, w, 1e-6)
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(out, normed * w[0], rtol=1e-5, atol=1e-5)
    assert (out - normed * w[:, None, None]).abs().max() > 0.1


def test_an_untested_vllm_version_gets_a_warning_and_no_change(monkeypatch, caplog):
    monkeypatch.setattr(vllm, "__version__", "0.31.9")
    before = DFlashQwen3Model.precompute_and_store_context_kv
    with caplog.at_level(logging.WARNING, logger="vllm.dflash"):
        caplog.handler.setLevel(logging.WARNING)
        logging.getLogger("vllm.dflash").addHandler(caplog.handler)
        plugin.register()
    assert DFlashQwen3Model.precompute_and_store_context_kv is before
    assert "vLLM 0.31.9 is not a version it was tested with (0.32.0); it replaces nothing" \
        in caplog.text


def test_plugin_is_registered_under_vllms_entry_point_group():
    from importlib.metadata import entry_points

    found = [e for e in entry_points(group="vllm.general_plugins") if e.name == "dflash"]
    assert [e.value for e in found] == ["dflash.integrations.vllm:register"]


# ------------------------------------------------------------------------- end to end

def _run(tmp_path, mode, dtype="float32", prompts=8, max_tokens=64):
    out = tmp_path / f"{mode}-{dtype}.json"
    proc = subprocess.run([sys.executable, str(ENGINE), "--mode", mode, "--dtype", dtype,
                           "--prompts", str(prompts), "--max-tokens", str(max_tokens),
                           "--out", str(out)], capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text()), proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def float32_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm")
    return {mode: _run(tmp, mode) for mode in ("stock", "plugin", "per-layer-k-norm")}


def test_plugin_keeps_vllms_output_and_logs_what_it_replaced(float32_runs):
    """Bundled pair, float32, 8 held-out prompts, greedy: the bundled draft loads in stock vLLM
    as it ships; with the plugin the tokens are the same and the INFO line names the function."""
    (stock, stock_log), (ours, ours_log) = float32_runs["stock"], float32_runs["plugin"]
    assert ours["token_ids"] == stock["token_ids"]
    assert all(len(t) > 0 for t in stock["token_ids"])
    line = f"dflash plugin: {plugin.REPLACED} replaced by torch.ops.dflash.context_kv"
    assert ours_log.count(line) == 1 and line not in stock_log
    assert stock["spec"]["drafts"] > 0


def test_plugin_accepts_what_vllm_accepts_with_per_layer_k_norm(float32_runs):
    """Same acceptance counts as stock vLLM whose context k_norm is run per layer (its own op);
    stock vLLM on CPU norms every layer's context K with layer 0's weight and accepts less."""
    ours = float32_runs["plugin"][0]["spec"]
    fixed = float32_runs["per-layer-k-norm"][0]["spec"]
    stock = float32_runs["stock"][0]["spec"]
    for key in ("drafts", "draft_tokens", "accepted", "accepted_per_pos"):
        assert ours[key] == fixed[key], key
    assert ours["accepted"] > stock["accepted"]


def test_bfloat16_acceptance_within_two_percent(tmp_path):
    ours, _ = _run(tmp_path, "plugin", "bfloat16")
    fixed, _ = _run(tmp_path, "per-layer-k-norm", "bfloat16")
    a, b = ours["spec"], fixed["spec"]
    rate = lambda s: s["accepted"] / s["draft_tokens"]  # noqa: E731
    assert abs(rate(a) - rate(b)) <= 0.02 * rate(b)
