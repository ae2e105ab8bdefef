"""Loaders facing hostile or oversized checkpoints: index shard names stay in
the checkpoint directory (symlinked shards, as in the Hugging Face cache, still load), RoPE
tables are sized by the served length, impossible config sizes are a ConfigError naming the
field, and Llama-3 GGUF files load with their RoPE scaling. (A planted trainer checkpoint.pt:
tests/test_trainer.py.)"""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash import LLM
from dflash.models import load_draft, load_target
from dflash.models.config import ConfigError, DraftConfig, TargetConfig
from dflash.models.layers import DEFAULT_ROPE_POSITIONS, rope_cos_sin
from dflash.models.loader import CheckpointError
from dflash.train import TrainConfig, Trainer

from helpers import make_tiny_draft, make_tiny_target, sequence_metadata, write_llama_gguf


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
