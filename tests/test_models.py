"""Target and draft models against independent oracles: Hugging Face `transformers` for the
targets, a from-scratch non-paged forward written from docs/design.md section 1 for the draft."""

import json

import pytest
import torch
import torch.nn.functional as F

from dflash.models import (
    CheckpointError,
    ConfigError,
    default_target_layer_ids,
    load_draft,
    load_target,
)
from dflash.models.layers import is_panels, linear, pack_linear_weight, unpacked
from dflash.ops.cases import rope_cache

from helpers import (
    TINY_TARGETS,
    make_tiny_draft,
    make_tiny_target,
    packed_weight_dtypes,
    sequence_metadata,
)

BLOCK = 4  # small cache blocks so sequences span many of them


@pytest.fixture(scope="module", params=list(TINY_TARGETS))
def target_pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_target(path, request.param)
    return hf, load_target(path, dtype=torch.float32), path


def _cache(model, num_blocks=64):
    return torch.zeros(model.kv_cache_shape(num_blocks, BLOCK))


def _blocks(n, seed=0):
    return torch.randperm(64, generator=torch.Generator().manual_seed(seed))[:n].tolist()


def test_prefill_logits_and_features_match_transformers(target_pair):
    hf, ours, _ = target_pair
    ids = torch.randint(0, 96, (21,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None], output_hidden_states=True)
    layers = tuple(range(ours.cfg.num_layers - 1))   # the last HF entry is after the final norm
    blocks = _blocks(8)
    cache = _cache(ours)
    # two chunks: the second attends to the first through the paged cache
    hidden_a, feats_a = ours(ids[:13], sequence_metadata(0, 13, blocks, BLOCK), cache, layers)
    hidden_b, feats_b = ours(ids[13:], sequence_metadata(13, 8, blocks, BLOCK), cache, layers)
    logits = ours.logits(torch.cat([hidden_a, hidden_b]))
    torch.testing.assert_close(logits, ref.logits[0], atol=1e-4, rtol=1e-4)
    features = torch.cat([feats_a, feats_b]).view(21, len(layers), -1)
    for j, layer in enumerate(layers):
        torch.testing.assert_close(features[:, j], ref.hidden_states[layer + 1][0],
                                   atol=1e-4, rtol=1e-4)


def test_64_greedy_tokens_match_transformers(target_pair):
    hf, ours, _ = target_pair
    prompt = torch.randint(0, 96, (7,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf.generate(prompt[None], max_new_tokens=64, do_sample=False,
                               min_new_tokens=64)[0, 7:].tolist()
    blocks, cache = _blocks(20), _cache(ours)
    hidden, _ = ours(prompt, sequence_metadata(0, 7, blocks, BLOCK), cache)
    tokens = [int(ours.logits(hidden[-1]).argmax())]
    while len(tokens) < 64:
        pos = 7 + len(tokens) - 1
        hidden, _ = ours(torch.tensor(tokens[-1:]), sequence_metadata(pos, 1, blocks, BLOCK),
                         cache)
        tokens.append(int(ours.logits(hidden[-1]).argmax()))
    assert tokens == expected


def test_moe_routes_only_selected_experts(tmp_path):
    make_tiny_target(tmp_path, "qwen3_moe")
    model = load_target(tmp_path, dtype=torch.float32)
    moe = model.layers[0].mlp
    x = torch.randn(5, 64)
    calls = []
    original = F.linear

    def spy(inp, weight, bias=None):
        calls.append(inp.shape[0])
        return original(inp, weight, bias)

    torch.nn.functional.linear = spy
    try:
        moe(x)
    finally:
        torch.nn.functional.linear = original
    # router on 5 tokens, then 2 GEMMs per used expert covering 5 * top_k = 10 rows in total
    assert calls[0] == 5 and sum(calls[1:]) == 2 * 5 * 2


# ------------------------------------------------------------------------------ the draft

def _spec_draft_forward(tensors, cfg, features, ctx_positions, block_embeds, block_positions,
                        eps=1e-6):
    """docs/design.md section 1 in plain PyTorch: context K/V recomputed from scratch, no paging."""
    layers, heads, kv_heads, d = cfg["num_hidden_layers"], 4, 2, 16
    cos_sin = rope_cache(512, d, theta=cfg["rope_theta"])

    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def rope(x, pos):
        cs = cos_sin[pos][:, None]
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return torch.cat([x1 * cs[..., : d // 2] - x2 * cs[..., d // 2:],
                          x2 * cs[..., : d // 2] + x1 * cs[..., d // 2:]], -1)

    c = norm(features @ tensors["fc.weight"].T, tensors["hidden_norm.weight"])
    x = block_embeds
    for i in range(layers):
        t = {k[len(f"layers.{i}."):]: v for k, v in tensors.items()
             if k.startswith(f"layers.{i}.")}
        h = norm(x, t["input_layernorm.weight"])
        q = (h @ t["self_attn.q_proj.weight"].T).view(-1, heads, d)
        k_blk = (h @ t["self_attn.k_proj.weight"].T).view(-1, kv_heads, d)
        v_blk = (h @ t["self_attn.v_proj.weight"].T).view(-1, kv_heads, d)
        k_ctx = (c @ t["self_attn.k_proj.weight"].T).view(-1, kv_heads, d)
        v_ctx = (c @ t["self_attn.v_proj.weight"].T).view(-1, kv_heads, d)
        q = rope(norm(q, t["self_attn.q_norm.weight"]), block_positions)
        k_blk = rope(norm(k_blk, t["self_attn.k_norm.weight"]), block_positions)
        k_ctx = rope(norm(k_ctx, t["self_attn.k_norm.weight"]), ctx_positions)
        keys = torch.cat([k_ctx, k_blk]).repeat_interleave(heads // kv_heads, 1)
        values = torch.cat([v_ctx, v_blk]).repeat_interleave(heads // kv_heads, 1)
        attn = torch.softmax(torch.einsum("qhd,khd->hqk", q, keys) * d**-0.5, -1)
        o = torch.einsum("hqk,khd->qhd", attn, values).reshape(len(x), -1)
        x = x + o @ t["self_attn.o_proj.weight"].T
        h = norm(x, t["post_attention_layernorm.weight"])
        x = x + (F.silu(h @ t["mlp.gate_proj.weight"].T) * (h @ t["mlp.up_proj.weight"].T)) \
            @ t["mlp.down_proj.weight"].T
    return norm(x, tensors["norm.weight"])


@pytest.mark.parametrize("shards", [1, 3])
def test_paged_draft_matches_spec_forward(tmp_path, shards):
    make_tiny_target(tmp_path / "t", "qwen3")
    target = load_target(tmp_path / "t", dtype=torch.float32)
    tensors = make_tiny_draft(tmp_path / "d", tmp_path / "t", num_layers=2, block_size=8,
                              shards=shards)
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    draft = load_draft(tmp_path / "d", target.cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    n_aux = len(cfg["dflash_config"]["target_layer_ids"])
    cache = torch.zeros(draft.kv_cache_shape(32, BLOCK))
    # two sequences with different context lengths, context written in two appends each
    ctx_lens, blocks = (11, 5), ([3, 9, 1, 20, 7, 30], [12, 4, 25, 8])
    feats = [torch.randn(n, n_aux * 64, generator=g) for n in ctx_lens]
    for seq in range(2):
        for lo, hi in ((0, 4), (4, ctx_lens[seq])):
            meta = sequence_metadata(lo, hi - lo, blocks[seq], BLOCK)
            draft.write_context(feats[seq][lo:hi], meta.positions, meta.slot_mapping, cache)
    block_embeds = torch.randn(16, 64, generator=g)
    m0 = sequence_metadata(ctx_lens[0], 8, blocks[0], BLOCK)
    m1 = sequence_metadata(ctx_lens[1], 8, blocks[1], BLOCK)
    from dflash.models import AttentionMetadata
    width = max(len(b) for b in blocks)
    table = torch.tensor([b + [0] * (width - len(b)) for b in blocks], dtype=torch.int32)
    meta = AttentionMetadata(positions=torch.cat([m0.positions, m1.positions]),
                             slot_mapping=torch.cat([m0.slot_mapping, m1.slot_mapping]),
                             block_table=table,
                             context_lens=torch.tensor(ctx_lens, dtype=torch.int32),
                             cu_query_lens=torch.tensor([0, 8, 16], dtype=torch.int32))
    out = draft(block_embeds, meta, cache)
    for seq, rows in ((0, slice(0, 8)), (1, slice(8, 16))):
        expected = _spec_draft_forward(tensors, cfg, feats[seq], torch.arange(ctx_lens[seq]),
                                       block_embeds[rows], meta.positions[rows])
        torch.testing.assert_close(out[rows], expected, atol=1e-4, rtol=1e-4)
    some = torch.tensor([1, 2, 9, 15])   # a few rows of each block: what a step's lm_head reads
    torch.testing.assert_close(draft(block_embeds, meta, cache, some), out[some],
                               atol=1e-6, rtol=1e-6)


# ------------------------------------------------------------------ config and bad input

def test_default_target_layer_ids_rule():
    assert default_target_layer_ids(36, 1) == [18]
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]   # round(1 + i * 32 / 4)
    assert default_target_layer_ids(30, 2) == [1, 27]


def _write_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    make_tiny_target(path, "qwen3")
    return path, load_target(path, dtype=torch.float32)


@pytest.mark.parametrize("change, error, pattern", [
    ({"dflash_config": {"block_size": 8, "mask_token_id": 96, "target_layer_ids": [1]}},
     ConfigError, "mask_token_id 96 is outside the target vocabulary of 96"),
    ({"dflash_config": {"block_size": 8, "mask_token_id": 5, "target_layer_ids": [1, 4]}},
     ConfigError, "id 4 is outside the target's 4 layers"),
    ({"dflash_config": {"block_size": 8, "mask_token_id": 5, "target_layer_ids": [1]}},
     CheckpointError, "tensor 'fc.weight' has shape \\[64, 128\\], expected \\[64, 64\\]"),
    ({"hidden_size": 32}, ConfigError, "draft hidden_size 32 != target hidden_size 64"),
    ({"architectures": ["Qwen3ForCausalLM"]}, ConfigError, "DFlashDraftModel"),
    ({"dflash_config": {"block_size": 8, "target_layer_ids": [1, 2]}, "mask_token_id": None},
     ConfigError, "no 'mask_token_id'"),
])
def test_bad_draft_config_is_named(tmp_path, tiny_target, change, error, pattern):
    target_dir, target = tiny_target
    make_tiny_draft(tmp_path, target_dir, num_layers=2)
    _write_config(tmp_path, **change)
    with pytest.raises(error, match=pattern):
        load_draft(tmp_path, target.cfg, dtype=torch.float32)


def test_top_level_fields_and_default_layer_ids(tmp_path, tiny_target):
    target_dir, target = tiny_target
    make_tiny_draft(tmp_path, target_dir, num_layers=2, use_dflash_config=False)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["target_layer_ids"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    draft = load_draft(tmp_path, target.cfg, dtype=torch.float32)
    assert draft.cfg.target_layer_ids == (1, 1) and draft.cfg.block_size == 8   # L = 4, n = 2


def test_sliding_window_warns(tmp_path, tiny_target):
    target_dir, target = tiny_target
    make_tiny_draft(tmp_path, target_dir, use_sliding_window=True)
    with pytest.warns(UserWarning, match="sliding window is not applied"):
        load_draft(tmp_path, target.cfg, dtype=torch.float32)


def test_missing_tensor_is_named(tmp_path, tiny_target):
    from safetensors.torch import load_file, save_file
    target_dir, target = tiny_target
    make_tiny_draft(tmp_path, target_dir)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["layers.1.self_attn.v_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="missing tensor 'layers.1.self_attn.v_proj.weight'"):
        load_draft(tmp_path, target.cfg, dtype=torch.float32)


@pytest.mark.parametrize("change, pattern", [
    ({"architectures": ["MistralForCausalLM"]}, "'MistralForCausalLM' is not supported"),
    ({"architectures": ["Qwen3NextForCausalLM"]}, "linear-attention"),
    ({"layer_types": ["full_attention", "linear_attention"]}, "'linear_attention'"),
])
def test_unsupported_targets_are_rejected(tmp_path, tiny_target, change, pattern):
    target_dir, _ = tiny_target
    for f in target_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    _write_config(tmp_path, **change)
    with pytest.raises(ConfigError, match=pattern):
        load_target(tmp_path)


def test_target_wrong_shape_is_named(tmp_path, tiny_target):
    target_dir, _ = tiny_target
    for f in target_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    _write_config(tmp_path, intermediate_size=100)
    with pytest.raises(CheckpointError, match="'model.layers.0.mlp.gate_proj.weight' has shape "
                                              "\\[128, 64\\], expected \\[100, 64\\]"):
        load_target(tmp_path)


def test_saved_draft_round_trips_to_the_same_tensors(tmp_path, tiny_target):
    from safetensors.torch import load_file

    from dflash.models.loader import save_draft
    target_dir, target = tiny_target
    original = make_tiny_draft(tmp_path / "a", target_dir, num_layers=3, attention_bias=True,
                               shards=2)
    save_draft(load_draft(tmp_path / "a", target.cfg, dtype=torch.float32), tmp_path / "b",
               target, dtype=torch.float32)
    saved = load_file(tmp_path / "b" / "model.safetensors")
    assert sorted(saved) == sorted(original)
    assert all(torch.equal(saved[k], original[k]) for k in original)
    assert load_draft(tmp_path / "b", target.cfg).cfg.target_layer_ids == \
        load_draft(tmp_path / "a", target.cfg).cfg.target_layer_ids


def test_draft_vocabulary_is_exported_as_vllm_reads_it(tmp_path, tiny_target):
    """draft_vocab_size + lm_head [N, H] + d2t (target id - draft id, int64), as vLLM's
    qwen3_dflash loader and SGLang read it; dflash reads it back, and older draft_vocab.json
    exports still load."""
    from safetensors.torch import load_file

    from dflash.models.loader import save_draft
    target_dir, target = tiny_target
    make_tiny_draft(tmp_path / "a", target_dir, num_layers=2)
    vocab = [90, 3, 17, 5, 64]
    (tmp_path / "a" / "draft_vocab.json").write_text(json.dumps({"token_ids": vocab}))
    old = load_draft(tmp_path / "a", target.cfg, dtype=torch.float32)
    assert old.draft_vocab.tolist() == vocab and old.lm_head is None
    save_draft(old, tmp_path / "b", target, dtype=torch.float32)
    config = json.loads((tmp_path / "b" / "config.json").read_text())
    assert config["draft_vocab_size"] == 5 and config["vocab_size"] == target.cfg.vocab_size
    assert config["num_target_layers"] == target.cfg.num_layers
    assert config["layer_types"] == ["full_attention"] * 2
    tensors = load_file(tmp_path / "b" / "model.safetensors")
    assert tensors["d2t"].dtype == torch.int64
    assert (tensors["d2t"] + torch.arange(5)).tolist() == vocab
    assert torch.equal(tensors["lm_head.weight"], target.output_embedding[vocab])
    assert not (tmp_path / "b" / "draft_vocab.json").exists()
    new = load_draft(tmp_path / "b", target.cfg, dtype=torch.float32)
    assert new.draft_vocab.tolist() == vocab
    assert torch.equal(new.lm_head, target.output_embedding[vocab])


@pytest.mark.parametrize("tensor, value, pattern", [
    ("d2t", torch.tensor([0, 0, 94, 0, 0]), "distinct target ids in \\[0, 96\\)"),
    ("d2t", torch.tensor([0, 0, 0, 0, 0, 0]), "'d2t' has shape \\[6\\], expected \\[5\\]"),
    ("lm_head.weight", None, "\\(draft_vocab_size 5\\) is missing tensor 'lm_head.weight'"),
])
def test_bad_reduced_vocabulary_is_an_error_naming_it(tmp_path, tiny_target, tensor, value,
                                                      pattern):
    from safetensors.torch import load_file, save_file
    target_dir, target = tiny_target
    make_tiny_draft(tmp_path, target_dir, num_layers=1)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["d2t"] = torch.zeros(5, dtype=torch.int64)
    tensors["lm_head.weight"] = torch.zeros(5, target.cfg.attn.hidden_size)
    if value is None:
        del tensors[tensor]
    else:
        tensors[tensor] = value
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "draft_vocab_size": 5}))
    with pytest.raises(CheckpointError, match=pattern):
        load_draft(tmp_path, target.cfg)


@pytest.mark.parametrize("path", [
    pytest.param("onednn", marks=pytest.mark.skipif(
        not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no oneDNN bf16 GEMMs here")),
    "pairs", "panels"])
@pytest.mark.parametrize("rows", [1, 5, 16, 40])
def test_packed_bf16_weights_compute_the_same_gemm(monkeypatch, rows, path):
    from dflash.models import layers

    monkeypatch.setattr(layers.host, "bf16_gemm", lambda: path)
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=g).bfloat16()
    bias = torch.randn(96, generator=g).bfloat16()
    x = torch.randn(rows, 64, generator=g).bfloat16()
    packed = pack_linear_weight(weight)
    shapes = {"pairs": (6, 32, 16, 2), "panels": (6, 64, 16)}
    assert packed.is_mkldnn if path == "onednn" else packed.shape == shapes[path]
    assert pack_linear_weight(packed) is packed and torch.equal(unpacked(packed), weight)
    expected = (x.double() @ weight.double().T + bias.double())
    got = linear(x, packed, bias).double()
    assert (got - expected).abs().max() <= (expected.abs() * 2**-8).max()   # bf16 output rounding
    torch.testing.assert_close(got, F.linear(x, weight, bias).double(), atol=0.06, rtol=2**-7)
    if path != "onednn":   # panel_linear computes each row alone: a row count changes no bit
        assert torch.equal(linear(x[-1:], packed, bias), linear(x, packed, bias)[-1:])


@pytest.mark.parametrize("rows", [1, 5, 16, 40])
def test_packed_float32_weights_compute_the_same_gemm(rows):
    g = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    x = torch.randn(rows, 64, generator=g)
    packed = pack_linear_weight(weight)
    assert packed.shape == (6, 64, 16) and pack_linear_weight(packed) is packed
    assert torch.equal(unpacked(packed), weight)
    torch.testing.assert_close(linear(x, packed, bias), F.linear(x, weight, bias))


def test_packed_float32_weights_take_the_blocked_gemm_for_long_prefills(monkeypatch):
    from dflash.models import layers

    g = torch.Generator().manual_seed(0)
    weight, x = torch.randn(32, 64, generator=g), torch.randn(9, 64, generator=g)
    packed = pack_linear_weight(weight)
    calls = []
    monkeypatch.setattr(layers.ops, "panel_linear", lambda *a: calls.append(a) or F.linear(
        a[0], unpacked(a[1]), a[2]))
    monkeypatch.setattr(layers, "PANEL_MAX_ROWS", 8)
    torch.testing.assert_close(linear(x, packed), F.linear(x, weight))
    assert not calls
    linear(x[:8], packed)
    assert len(calls) == 1


@pytest.mark.parametrize("layout, gemm_dtype", [("to_panels", torch.float32),
                                                 ("to_pair_panels", torch.bfloat16)])
def test_bf16_panels_of_long_prefills_multiply_as_their_cpu_does_best(monkeypatch, layout,
                                                                      gemm_dtype):
    """Past PANEL_MAX_ROWS a bf16 weight in column panels (a CPU without bf16 units) goes through
    torch's float32 GEMM, as panel_linear multiplies, not its bf16 one, which such a CPU emulates
    several times slower; pair panels (a CPU with AVX512-BF16) keep the bf16 GEMM."""
    from dflash.models import layers

    g = torch.Generator().manual_seed(1)
    weight, bias, x = (torch.randn(*shape, generator=g).bfloat16()
                       for shape in ((32, 64), (32,), (9, 64)))
    packed = getattr(layers.ops, layout)(weight)
    monkeypatch.setattr(layers, "PANEL_MAX_ROWS", 8)
    gemm, dtypes = F.linear, []
    monkeypatch.setattr(F, "linear", lambda *a: dtypes.append(a[0].dtype) or gemm(*a))
    out = linear(x, packed, bias)
    assert dtypes == [gemm_dtype] and out.dtype == torch.bfloat16
    # the dense GEMM in that dtype (bf16 GEMMs may sum in another order than a float32 one)
    expected = gemm(x.to(gemm_dtype), weight.to(gemm_dtype), bias.to(gemm_dtype))
    assert torch.equal(out, expected.bfloat16())


def test_packing_is_a_noop_where_no_faster_layout_exists():
    for weight in (torch.randn(8, 4), torch.randn(16, 4).half(), torch.randn(2, 8, 4).bfloat16(),
                   torch.randn(2, 16, 4)):
        assert pack_linear_weight(weight) is weight


def _is_packed(weight):
    return weight.is_mkldnn or is_panels(weight)


def _packed_tolerance(dtype):
    """GEMMs summing in another order: float32 ulps, or bf16 ulps after rounding."""
    return {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else \
        {"atol": 0.1, "rtol": 0.05}


@pytest.mark.parametrize("dtype", packed_weight_dtypes(), ids=str)
def test_packed_target_decodes_like_the_unpacked_one(tmp_path, dtype):
    """Packing changes the GEMM layout only: logits agree to the dtype's rounding and the greedy
    tokens of a decoding loop are the same."""
    make_tiny_target(tmp_path, "qwen3")
    plain = load_target(tmp_path, dtype=dtype)
    packed = load_target(tmp_path, dtype=dtype)
    packed.pack_weights()
    assert _is_packed(packed.layers[0].attn.qkv) and _is_packed(packed.packed_head)
    ids = torch.randint(0, 96, (9,), generator=torch.Generator().manual_seed(0))
    outputs = []
    for model in (plain, packed):
        cache, tokens = _cache(model).to(dtype), ids.tolist()
        hidden, _ = model(ids, sequence_metadata(0, 9, _blocks(8), BLOCK), cache)
        logits = [model.logits(hidden[-1:])]
        for _ in range(12):
            tokens.append(int(logits[-1].argmax()))
            meta = sequence_metadata(len(tokens) - 1, 1, _blocks(8), BLOCK)
            hidden, _ = model(torch.tensor(tokens[-1:]), meta, cache)
            logits.append(model.logits(hidden))
        outputs.append((tokens, torch.cat(logits).float()))
    assert outputs[0][0] == outputs[1][0]
    torch.testing.assert_close(outputs[0][1], outputs[1][1], **_packed_tolerance(dtype))


@pytest.mark.parametrize("dtype", packed_weight_dtypes(), ids=str)
def test_packed_draft_computes_the_unpacked_block_forward(tmp_path, dtype):
    make_tiny_target(tmp_path / "t", "qwen3")
    target = load_target(tmp_path / "t", dtype=dtype)
    make_tiny_draft(tmp_path / "d", tmp_path / "t", num_layers=2, block_size=8)
    plain, packed = (load_draft(tmp_path / "d", target.cfg, dtype=dtype) for _ in range(2))
    packed.pack_weights()
    assert _is_packed(packed.layers[1].q) and _is_packed(packed.packed_kv[1])
    g = torch.Generator().manual_seed(0)
    n_aux = len(plain.cfg.target_layer_ids)
    feats = torch.randn(13, n_aux * 64, generator=g).to(dtype)
    embeds = torch.randn(8, 64, generator=g).to(dtype)
    outputs = []
    for draft in (plain, packed):
        cache = torch.zeros(draft.kv_cache_shape(64, BLOCK), dtype=dtype)
        ctx = sequence_metadata(0, 13, _blocks(6), BLOCK)
        draft.write_context(feats, ctx.positions, ctx.slot_mapping, cache)
        outputs.append(draft(embeds, sequence_metadata(13, 8, _blocks(6), BLOCK), cache))
    torch.testing.assert_close(outputs[1], outputs[0], **_packed_tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_layer_functions_use_the_fused_ops_for_inference_and_autograd_for_training(dtype):
    from dflash import ops
    from dflash.models.layers import add_rms_norm, rms_norm, rope, silu_and_mul
    from dflash.ops import reference

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(16, 9, 64, generator=g) * 3).to(dtype)
    weight = (torch.randn(64, generator=g) * 0.5 + 1).to(dtype)
    cos_sin = torch.randn(16, 64, generator=g)
    with torch.inference_mode():
        assert torch.equal(rms_norm(x, weight, 1e-6), ops.rms_norm(x, weight, 1e-6))
        assert torch.equal(add_rms_norm(x, x, weight, 1e-6)[0], ops.add_rms_norm(x, x, weight,
                                                                                 1e-6)[0])
        assert torch.equal(rope(x, cos_sin), ops.rope(x, cos_sin))
        assert torch.equal(silu_and_mul(x), ops.silu_and_mul(x))
    w = weight.float().requires_grad_()   # training: float32 weights under autocast
    out = rms_norm(x, w, 1e-6)
    assert torch.equal(out, reference.rms_norm_float32(x, w, 1e-6).to(dtype))
    out.float().sum().backward()
    assert w.grad is not None and torch.isfinite(w.grad).all()
