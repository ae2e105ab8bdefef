"""Loaders facing hostile or oversized checkpoints: index shard names stay in
the checkpoint directory (symlinked shards, as in the Hugging Face cache, still load), RoPE
tables are sized by the served length, impossible config sizes are a ConfigError naming the
field, and Llama-3 GGUF files load with their RoPE scaling. Config fields and weights dflash would
compute another model from (quantization, activations, sliding windows, non-float or surplus
tensors, broken RoPE or MoE fields) are refused by name; a NaN draft cannot change the output.
(A planted trainer checkpoint.pt: tests/test_trainer.py.)"""

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash import LLM, SamplingParams
from dflash.models import load_draft, load_target, loader
from dflash.models.config import ConfigError, DraftConfig, TargetConfig
from dflash.models.layers import DEFAULT_ROPE_POSITIONS, rope_cos_sin
from dflash.models.loader import CheckpointError
from dflash.train import TrainConfig, Trainer

from helpers import (
    make_tiny_draft,
    make_tiny_pair,
    make_tiny_target,
    sequence_metadata,
    write_llama_gguf,
)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny target claiming a 1M-token context, and a two-shard draft for it."""
    root = tmp_path_factory.mktemp("hardening")
    make_tiny_target(root / "target", "qwen3", max_position_embeddings=10**6)
    make_tiny_draft(root / "draft", root / "target", shards=2, max_position_embeddings=10**6)
    return root / "target", root / "draft"


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _target_cfg(pair) -> dict:
    return json.loads((pair[0] / "config.json").read_text())


# ------------------------------------------------------------------------------ b. shard names

@pytest.mark.parametrize("shard", ["../x.safetensors", "/etc/passwd", "sub/../../x.safetensors"])
def test_index_shards_outside_the_directory_are_refused_by_name(pair, tmp_path, shard):
    draft = _copy(pair[1], tmp_path / "draft")
    (tmp_path / "x.safetensors").write_bytes(next(draft.glob("*.safetensors")).read_bytes())
    index = draft / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    index.write_text(json.dumps({"weight_map": {**weight_map, "fc.weight": shard}}))
    with pytest.raises(CheckpointError, match="outside the checkpoint directory") as e:
        load_draft(draft, TargetConfig.from_hf(_target_cfg(pair)), torch.float32)
    assert repr(shard) in str(e.value)


def test_symlinked_shards_load_as_in_the_hugging_face_cache(pair, tmp_path):
    """The cache's snapshot files are links to ../../blobs/<hash>: outside the directory once
    resolved, yet the checkpoint's own."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "rev"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    for f in pair[1].iterdir():
        (blobs / f.name).write_bytes(f.read_bytes())
        (snapshot / f.name).symlink_to(Path("../..") / "blobs" / f.name)
    target = TargetConfig.from_hf(_target_cfg(pair))
    linked = load_draft(snapshot, target, torch.float32, max_positions=64)
    direct = load_draft(pair[1], target, torch.float32, max_positions=64)
    for p, q in zip(linked.parameters(), direct.parameters()):
        assert torch.equal(p, q)


# --------------------------------------------------------------------------- c. RoPE table rows

def test_rope_tables_cover_the_served_positions_not_max_position_embeddings(pair):
    target = load_target(pair[0], torch.float32, max_positions=600)
    draft = load_draft(pair[1], target.cfg, torch.float32, max_positions=600)
    full = rope_cos_sin(target.cfg.attn, 600)   # the first rows of the 10**6-row table
    assert torch.equal(target.cos_sin, full)
    assert torch.equal(draft.cos_sin, rope_cos_sin(draft.cfg.attn, 600))


def test_rope_tables_never_exceed_max_position_embeddings(tmp_path):
    make_tiny_target(tmp_path / "target", "qwen3")   # max_position_embeddings 512
    assert load_target(tmp_path / "target", torch.float32,
                       max_positions=10**6).cos_sin.shape[0] == 512


def test_a_trained_draft_covers_every_position_of_its_target(pair, tmp_path):
    """Training rows are as long as the length the target served (dflash train's
    --max-model-len), which may pass the rows a loader told no length gives (32768)."""
    served = DEFAULT_ROPE_POSITIONS + 100
    target = load_target(pair[0], torch.float32, max_positions=served)
    rows = [{"index": i, "prompt_ids": [1, 2], "answer_ids": [3, 4, 5]} for i in range(2)]
    trainer = Trainer(target, rows, tmp_path, TrainConfig(num_layers=1, heldout=1,
                                                          cache_features=False))
    assert trainer.draft.cos_sin.shape[0] == target.cos_sin.shape[0] == served


# -------------------------------------------------------------------------- d. config fields

@pytest.mark.parametrize("field,value", [
    ("hidden_size", 0), ("hidden_size", -64), ("num_attention_heads", 0),
    ("num_key_value_heads", -2), ("head_dim", 0), ("vocab_size", 0), ("num_hidden_layers", 0),
    ("intermediate_size", -1), ("max_position_embeddings", 0), ("vocab_size", 2**31 + 1),
    ("hidden_size", 2**32), ("num_hidden_layers", 2**31), ("num_attention_heads", 2**40),
    ("max_position_embeddings", 2**40), ("vocab_size", 96.5), ("hidden_size", "64")])
def test_bad_target_sizes_are_a_config_error_naming_the_field(pair, field, value):
    with pytest.raises(ConfigError, match=field):
        TargetConfig.from_hf({**_target_cfg(pair), field: value})


@pytest.mark.parametrize("field,value", [("num_hidden_layers", 0), ("intermediate_size", 0),
                                         ("num_attention_heads", -4), ("head_dim", 2**31)])
def test_bad_draft_sizes_are_a_config_error_naming_the_field(pair, field, value):
    target = TargetConfig.from_hf(_target_cfg(pair))
    cfg = json.loads((pair[1] / "config.json").read_text())
    with pytest.raises(ConfigError, match=field):
        DraftConfig.from_hf({**cfg, field: value}, target)


def test_heads_that_do_not_divide_are_a_config_error(pair):
    cfg = _target_cfg(pair)   # 4 heads, 2 KV heads, hidden 64, head_dim 16
    with pytest.raises(ConfigError, match="hidden_size 66 is not a multiple of "
                                          "num_attention_heads 4"):
        TargetConfig.from_hf({**cfg, "hidden_size": 66, "head_dim": None})
    TargetConfig.from_hf({**cfg, "hidden_size": 66})   # an explicit head_dim needs no division
    with pytest.raises(ConfigError, match="num_key_value_heads 3"):
        TargetConfig.from_hf({**cfg, "num_key_value_heads": 3})


def test_a_bad_size_is_refused_before_any_weight_is_read(pair, tmp_path):
    target = _copy(pair[0], tmp_path / "target")
    (target / "config.json").write_text(json.dumps({**_target_cfg(pair), "vocab_size": 2**40}))
    with pytest.raises(ConfigError, match="vocab_size"):
        load_target(target, torch.float32)


# ------------------------------------------------------------------------------- e. GGUF RoPE

def _llama_cpp_rope_freqs(rope: dict, theta: float, head_dim: int) -> np.ndarray:
    """rope_freqs.weight as llama.cpp's convert_hf_to_gguf.py computes it for rope_type llama3."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    old = rope["original_max_position_embeddings"]
    low, high, factor = rope["low_freq_factor"], rope["high_freq_factor"], rope["factor"]
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def test_a_llama3_gguf_gets_its_rope_scaling_back_and_matches_transformers(tmp_path):
    hf = make_tiny_target(tmp_path / "hf", "llama")   # rope_type llama3, 2 blended frequencies
    rope, theta = hf.config.rope_parameters, hf.config.rope_parameters["rope_theta"]
    write_llama_gguf(hf, tmp_path / "llama3.gguf",
                      _llama_cpp_rope_freqs(rope, theta, hf.config.head_dim))
    ours = load_target(tmp_path / "llama3.gguf", torch.float32)
    assert ours.cfg.attn.rope_scaling == {k: rope[k] for k in (
        "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
    ids = torch.randint(0, 96, (100,), generator=torch.Generator().manual_seed(0))
    cache = torch.zeros(ours.kv_cache_shape(32, 4))
    hidden, _ = ours(ids, sequence_metadata(0, 100, list(range(25)), 4), cache, ())
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    torch.testing.assert_close(ours.logits(hidden), ref, atol=1e-4, rtol=1e-4)


def test_rope_freqs_that_are_no_llama3_scaling_are_refused(tmp_path):
    hf = make_tiny_target(tmp_path / "hf", "llama")
    path = tmp_path / "odd.gguf"
    write_llama_gguf(hf, path, np.array([1, 3, 1, 2, 5, 8, 8, 8], dtype=np.float32))
    with pytest.raises(ConfigError, match=r"odd.gguf: rope_freqs.weight \[1.0, 3.0, .* is not "
                                          r"a Llama-3 RoPE scaling"):
        load_target(path, torch.float32)


def test_an_engine_over_a_long_context_config_sizes_rope_by_max_model_len(tmp_path):
    make_tiny_target(tmp_path / "target", "qwen3", max_position_embeddings=10**7)
    make_tiny_draft(tmp_path / "draft", tmp_path / "target", block_size=8)
    llm = LLM(tmp_path / "target", tmp_path / "draft", dtype="float32", max_model_len=300,
              speculation="fixed")
    assert llm.max_model_len == 300
    assert llm.target.cos_sin.shape[0] == 300 and llm.draft.cos_sin.shape[0] == 300


# ------------------------------------------------------------ f. what dflash would compute wrong

Q = "model.layers.0.self_attn.q_proj.weight"


def _rewrite(path: Path, change) -> None:
    """Apply `change(tensors)` to path's model.safetensors."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors")


def _set(name: str, convert):
    return lambda tensors: tensors.__setitem__(name, convert(tensors[name]))


def test_a_quantization_config_is_a_config_error_naming_it(pair, tmp_path):
    """An FP8 checkpoint as Qwen ships it: its scales would be ignored."""
    target = _copy(pair[0], tmp_path / "target")
    (target / "config.json").write_text(json.dumps({**_target_cfg(pair), "quantization_config": {
        "quant_method": "fp8", "weight_block_size": [128, 128]}}))
    with pytest.raises(ConfigError, match="quantization_config .quant_method 'fp8'"):
        load_target(target, torch.float32)


@pytest.mark.parametrize("name,convert,dtype", [
    (Q, lambda w: (w * 100).to(torch.int32), "I32"),
    ("model.embed_tokens.weight", lambda w: (w * 10).to(torch.int8), "I8"),
    (Q, lambda w: w > 0, "BOOL"),
    (Q, lambda w: w.to(torch.float8_e4m3fn), "F8_E4M3")])
def test_non_float_weights_are_a_checkpoint_error_naming_tensor_and_dtype(pair, tmp_path, name,
                                                                          convert, dtype):
    target = _copy(pair[0], tmp_path / "target")
    _rewrite(target, _set(name, convert))
    with pytest.raises(CheckpointError, match=f"tensor {name!r} has dtype {dtype}"):
        load_target(target, torch.float32)


def test_a_draft_vocabulary_of_float_ids_is_a_checkpoint_error(pair, tmp_path):
    draft = tmp_path / "draft"
    make_tiny_draft(draft, pair[0])
    _rewrite(draft, lambda t: t.update({"d2t": torch.zeros(4) + 0.7,
                                        "lm_head.weight": torch.randn(4, 64)}))
    cfg = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**cfg, "draft_vocab_size": 4}))
    with pytest.raises(CheckpointError, match="tensor 'd2t' has dtype F32"):
        load_draft(draft, TargetConfig.from_hf(_target_cfg(pair)), torch.float32)


@pytest.mark.parametrize("kind,overrides,pattern", [
    ("llama", {"mlp_bias": True}, "mlp_bias=True"),
    ("qwen2", {"attention_bias": True}, "attention_bias=True"),
    ("qwen3", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0},
     "layer_types has \\['sliding_attention'\\]"),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0},
     "layer_types has \\['sliding_attention'\\]")])
def test_unimplemented_fields_that_change_the_output_are_a_config_error(tmp_path, kind,
                                                                        overrides, pattern):
    """Configs as transformers writes them (it honours each field, so its outputs differ from
    the model dflash would compute)."""
    make_tiny_target(tmp_path, kind, **overrides)
    with pytest.raises(ConfigError, match=pattern):
        load_target(tmp_path, torch.float32)


def test_a_target_sliding_window_without_layer_types_is_a_config_error(pair):
    cfg = {**_target_cfg(pair), "use_sliding_window": True}
    cfg.pop("layer_types", None)
    with pytest.raises(ConfigError, match="use_sliding_window=True"):
        TargetConfig.from_hf(cfg)


def test_tensors_of_layers_beyond_the_config_are_a_checkpoint_error(pair, tmp_path):
    target = _copy(pair[0], tmp_path / "target")
    (target / "config.json").write_text(json.dumps(
        {**_target_cfg(pair), "num_hidden_layers": 3, "layer_types": ["full_attention"] * 3}))
    with pytest.raises(CheckpointError, match="tensor 'model.layers.3.* is of layer 3, but "
                                              "the config has 3 layers"):
        load_target(target, torch.float32)


def test_gguf_blocks_beyond_block_count_are_a_checkpoint_error(tmp_path, monkeypatch):
    import gguf

    hf = make_tiny_target(tmp_path / "hf", "llama", rope_scaling=None)
    write_block_count = gguf.GGUFWriter.add_block_count
    monkeypatch.setattr(gguf.GGUFWriter, "add_block_count",
                        lambda writer, n: write_block_count(writer, n - 1))
    write_llama_gguf(hf, tmp_path / "short.gguf")
    with pytest.raises(CheckpointError, match="is of layer 3, but the config has 3 layers"):
        load_target(tmp_path / "short.gguf", torch.float32)


def test_gguf_integer_weights_are_a_checkpoint_error(tmp_path, monkeypatch):
    import gguf

    hf = make_tiny_target(tmp_path / "hf", "llama", rope_scaling=None)
    add_tensor = gguf.GGUFWriter.add_tensor

    def as_int8(writer, name, w, *args, **kwargs):   # llama.cpp's I8 type: the values cast
        add_tensor(writer, name, (w * 50).astype(np.int8) if name == "blk.0.attn_q.weight"
                   else w, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", as_int8)
    write_llama_gguf(hf, tmp_path / "int8.gguf")
    with pytest.raises(CheckpointError, match="q_proj.weight' has dtype I8"):
        load_target(tmp_path / "int8.gguf", torch.float32)


def test_beside_model_safetensors_other_files_are_not_read(pair, tmp_path):
    """As transformers: a leftover file next to model.safetensors is no part of the weights."""
    from safetensors.torch import save_file

    target = _copy(pair[0], tmp_path / "target")
    save_file({Q: torch.zeros(64, 64)}, target / "zz-leftover.safetensors")
    with_leftover = load_target(target, torch.float32, max_positions=64)
    for p, q in zip(with_leftover.parameters(),
                    load_target(pair[0], torch.float32, max_positions=64).parameters()):
        assert torch.equal(p, q)


def test_a_tensor_in_two_unindexed_shards_is_a_checkpoint_error_naming_both(pair, tmp_path):
    from safetensors.torch import load_file, save_file

    target = _copy(pair[0], tmp_path / "target")
    tensors = load_file(target / "model.safetensors")
    (target / "model.safetensors").unlink()
    save_file(tensors, target / "a.safetensors")
    save_file({Q: torch.zeros(64, 64)}, target / "b.safetensors")
    with pytest.raises(CheckpointError, match=f"tensor {Q!r} is in both a.safetensors and "
                                              f"b.safetensors"):
        load_target(target, torch.float32)


@pytest.fixture(scope="module")
def moe_cfg(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("moe")
    make_tiny_target(root, "qwen3_moe")   # 8 experts, top 2
    return json.loads((root / "config.json").read_text())


@pytest.mark.parametrize("field,value", [
    ("num_experts_per_tok", None), ("num_experts_per_tok", 0), ("num_experts_per_tok", -1),
    ("num_experts_per_tok", 9), ("num_experts", 10**9), ("num_experts", "8"),
    ("moe_intermediate_size", None)])
def test_bad_moe_fields_are_a_config_error_naming_the_field(moe_cfg, field, value):
    cfg = {k: v for k, v in moe_cfg.items() if k != field}
    with pytest.raises(ConfigError, match=field):
        TargetConfig.from_hf(cfg if value is None else {**cfg, field: value})


@pytest.mark.parametrize("change,field", [
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 0}}, "rope_theta"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": -1e4}}, "rope_theta"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": math.nan}}, "rope_theta"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": math.inf}}, "rope_theta"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": "abc"}}, "rope_theta"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 0.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
     "factor"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
     "low_freq_factor 4.0 must be below high_freq_factor"),
    ({"rms_norm_eps": -1.0}, "rms_norm_eps"), ({"rms_norm_eps": "1e-6"}, "rms_norm_eps"),
    ({"rms_norm_eps": math.nan}, "rms_norm_eps"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings")])
def test_bad_rope_norm_and_tie_fields_are_a_config_error_naming_the_field(pair, change, field):
    with pytest.raises(ConfigError, match=field):
        TargetConfig.from_hf({**_target_cfg(pair), **change})


def test_shapes_are_checked_before_a_model_or_its_rope_table_is_built(pair, tmp_path,
                                                                      monkeypatch):
    """A head_dim of 2**20 its tensors do not have would size a RoPE table of 32768 x 2**20."""
    def build(*args, **kwargs):
        raise AssertionError("a model was built before its tensors were checked")

    monkeypatch.setattr(loader, "TargetModel", build)
    monkeypatch.setattr(loader, "DFlashDraft", build)
    target = _copy(pair[0], tmp_path / "target")
    (target / "config.json").write_text(json.dumps({**_target_cfg(pair), "head_dim": 2**20}))
    with pytest.raises(CheckpointError, match="q_proj.weight' has shape"):
        load_target(target, torch.float32)
    draft = _copy(pair[1], tmp_path / "draft")
    cfg = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**cfg, "head_dim": 2**20}))
    with pytest.raises(CheckpointError, match="has shape"):
        load_draft(draft, TargetConfig.from_hf(_target_cfg(pair)), torch.float32)


def test_a_draft_proposing_nan_leaves_adaptive_greedy_output_the_targets(tmp_path):
    """A draft only proposes: one Inf weight makes its probabilities NaN, which must count as
    no confidence, not break the adaptive tree's calibration."""
    target, draft, _ = make_tiny_pair(tmp_path, block_size=4)
    _rewrite(draft, lambda t: t["fc.weight"].__setitem__((0, 0), math.inf))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompt = [[3, 1, 4, 1, 5, 9, 2, 6]]
    alone = LLM(target, dtype="float32").generate(prompt, params)[0].token_ids
    speculated = LLM(target, draft, dtype="float32", speculation="adaptive").generate(
        prompt, params)[0].token_ids
    assert speculated == alone


# ------------------------------------------------------------------------- damaged files

def _truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])


def _unindexed_target(pair, tmp_path) -> Path:
    target = _copy(pair[0], tmp_path / "target")
    assert (target / "model.safetensors").exists()
    return target


@pytest.mark.parametrize("damage,pattern", [
    (lambda d: _truncate(d / "model.safetensors"), r"model\.safetensors: not a readable "
                                                   r"safetensors file"),
    (lambda d: (d / "model.safetensors").write_bytes(b"\xff" * 64),
     r"model\.safetensors: not a readable safetensors file"),
    (lambda d: (d / "config.json").write_text("[1, 2]"), r"config\.json must hold a JSON "
                                                         r"object, got list"),
    (lambda d: (d / "config.json").write_bytes(b'{"a": "\xff"}'),
     r"config\.json is not valid JSON"),
    (lambda d: (d / "model.safetensors.index.json").write_text("{}"),
     r"index\.json has no weight_map"),
    (lambda d: (d / "model.safetensors.index.json").write_text('{"weight_map": ["a"]}'),
     r"index\.json has no weight_map"),
    (lambda d: (d / "model.safetensors.index.json").write_text("{"),
     r"index\.json is not valid JSON"),
])
def test_a_damaged_checkpoint_file_is_named(pair, tmp_path, damage, pattern):
    # each raised an error from inside safetensors, json or the loader that named no file
    # (SafetensorError, KeyError, AttributeError, UnicodeDecodeError)
    target = _unindexed_target(pair, tmp_path)
    damage(target)
    with pytest.raises(CheckpointError, match=pattern):
        load_target(target, torch.float32)


@pytest.mark.parametrize("content", ["[1, 2]", "{", '{"token_ids": 5}'])
def test_a_damaged_draft_vocabulary_file_is_named(pair, tmp_path, content):
    draft = _copy(pair[1], tmp_path / "draft")
    (draft / "draft_vocab.json").write_text(content)
    target = load_target(pair[0], torch.float32)
    with pytest.raises(CheckpointError, match=r"draft_vocab\.json"):
        load_draft(draft, target.cfg, torch.float32)


@pytest.mark.parametrize("keep", [0.9, 0.5, 0.01])
def test_a_truncated_gguf_file_is_named(tmp_path, keep):
    # it failed inside numpy or gguf (a reshape, an index, a dtype), naming no file
    hf = make_tiny_target(tmp_path / "hf", "llama")
    write_llama_gguf(hf, tmp_path / "t.gguf")
    _truncate(tmp_path / "t.gguf", keep)
    with pytest.raises(CheckpointError, match=r"t\.gguf: not a readable GGUF file"):
        load_target(tmp_path / "t.gguf", torch.float32)


def test_a_gguf_path_that_is_a_directory_is_named(tmp_path):
    (tmp_path / "x.gguf").mkdir()
    with pytest.raises(CheckpointError, match=r"x\.gguf: not a readable GGUF file"):
        load_target(tmp_path / "x.gguf", torch.float32)


@pytest.mark.parametrize("field,value", [
    ("mask_token_id", True), ("target_layer_ids", [True, 1]), ("target_layer_ids", 2),
    ("target_layer_ids", ["1"]), ("block_size", "4")])
def test_draft_ids_that_are_not_integers_are_a_config_error_naming_the_field(pair, field,
                                                                           value):
    # true passed as 1, a bare id raised TypeError, and "1" was reported without its quotes
    target = TargetConfig.from_hf(_target_cfg(pair))
    cfg = json.loads((pair[1] / "config.json").read_text())
    cfg["dflash_config"] = {**cfg["dflash_config"], field: value}
    with pytest.raises(ConfigError, match=rf"{field}.*{re.escape(repr(value))}"):
        DraftConfig.from_hf(cfg, target)


@pytest.mark.parametrize("value", [{"id": 2}, "2", [1, True], -1])
def test_an_eos_token_id_that_is_not_a_token_id_is_a_config_error(pair, value):
    # a dict raised TypeError (unhashable) when the engine built its stop set; "2", true and
    # -1 were kept as stop ids no token can equal
    with pytest.raises(ConfigError, match=r"eos_token_id"):
        TargetConfig.from_hf({**_target_cfg(pair), "eos_token_id": value})
