"""Loading untrusted checkpoints: shard names stay inside the checkpoint directory, configs with
impossible or absurd sizes are a ConfigError naming the field, a long-context config does not
size its RoPE table by max_position_embeddings, and a Llama-3 GGUF (RoPE frequency factors the
engine does not apply) is refused rather than decoded wrongly. (A planted trainer checkpoint:
tests/test_trainer.py.)"""

import json

import numpy as np
import pytest
import torch

from dflash import LLM
from dflash.models import load_target
from dflash.models.config import ConfigError, TargetConfig
from dflash.models.loader import CheckpointError
from dflash.testing import make_tiny_draft, make_tiny_target


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("safety")
    make_tiny_target(root / "target", "qwen3")
    return root / "target"


def _config(target_dir) -> dict:
    return json.loads((target_dir / "config.json").read_text())


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd",
                                   "sub/../../outside.safetensors"])
def test_shards_outside_the_checkpoint_directory_are_refused(target_dir, tmp_path, shard):
    copy = tmp_path / "ckpt"
    copy.mkdir()
    for f in target_dir.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    (tmp_path / "outside.safetensors").write_bytes((copy / "model.safetensors").read_bytes())
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": shard,
                                            "model.norm.weight": "model.safetensors"}}
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="outside the checkpoint directory") as e:
        load_target(copy, torch.float32)
    assert repr(shard) in str(e.value)


@pytest.mark.parametrize("field,value", [
    ("num_attention_heads", 0), ("num_attention_heads", -4), ("hidden_size", 0),
    ("num_key_value_heads", 0), ("vocab_size", 0), ("num_hidden_layers", 0),
    ("hidden_size", 2**40), ("vocab_size", 2**40), ("num_hidden_layers", 10**6),
    ("intermediate_size", -1), ("max_position_embeddings", 0), ("head_dim", 0),
    ("num_attention_heads", "4"), ("hidden_size", 64.0), ("num_attention_heads", True)])
def test_impossible_or_absurd_sizes_are_a_config_error_naming_the_field(target_dir, field,
                                                                         value):
    cfg = {**_config(target_dir), field: value}
    with pytest.raises(ConfigError, match=field):
        TargetConfig.from_hf(cfg)


def test_heads_that_do_not_divide_are_a_config_error(target_dir):
    cfg = {**_config(target_dir), "head_dim": None, "hidden_size": 66}
    with pytest.raises(ConfigError, match="hidden_size 66 is not a multiple"):
        TargetConfig.from_hf(cfg)
    cfg = {**_config(target_dir), "num_key_value_heads": 3}
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        TargetConfig.from_hf(cfg)


def test_a_long_context_config_sizes_rope_by_the_served_length(tmp_path):
    make_tiny_target(tmp_path / "target", "qwen3", max_position_embeddings=10**7)
    make_tiny_draft(tmp_path / "draft", tmp_path / "target", block_size=8)
    llm = LLM(tmp_path / "target", tmp_path / "draft", dtype="float32", max_model_len=300,
              speculation="fixed")
    assert llm.max_model_len == 300
    assert llm.target.cos_sin.shape[0] == 300 and llm.draft.cos_sin.shape[0] == 300
    # a loader user who names no length gets a bounded table, not 10**7 rows
    assert load_target(tmp_path / "target", torch.float32).cos_sin.shape[0] <= 32768


def test_a_llama3_gguf_is_refused_with_a_clear_error(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "llama3.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    writer.add_tensor("rope_freqs.weight", np.ones(2, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConfigError, match=r"Llama-3 RoPE scaling \(rope_freqs.weight\)"):
        load_target(path, torch.float32)
