"""`dflash export-gguf`: a draft written as llama.cpp's DFlash GGUF. Oracles: the draft's own
checkpoint (values), gguf-py's Qwen3 tensor-name map (llama.cpp's names for the layers), our
loader's draft vocabulary (d2t as absolute target ids) and the target GGUF (tokenizer). llama.cpp
itself runs the exported bundled draft in test_llamacpp.py (optional group)."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from dflash.cli import GGUF_OUTTYPES, main
from dflash.models import load_draft, load_target
from dflash.models.config import TargetConfig
from dflash.models.gguf_draft import OUTTYPES, export_draft_gguf
from dflash.models.loader import CheckpointError, read_gguf

from helpers import make_tiny_draft, make_tiny_target, write_llama_gguf

gguf = pytest.importorskip("gguf")

DRAFT_VOCAB = 24


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny Llama target GGUF with a tokenizer and a 2-layer draft with a reduced vocabulary."""
    root = tmp_path_factory.mktemp("gguf_draft")
    write_llama_gguf(make_tiny_target(root / "hf", "llama"), root / "target.gguf",
                     tokenizer=True)
    tensors = make_tiny_draft(root / "draft", root / "hf", mask_token_id=90)
    g = torch.Generator().manual_seed(1)
    ids = torch.randperm(96, generator=g)[:DRAFT_VOCAB].sort().values
    tensors["d2t"] = ids - torch.arange(DRAFT_VOCAB)     # target id - draft id, as we store it
    tensors["lm_head.weight"] = torch.randn(DRAFT_VOCAB, 64, generator=g)
    save_file(tensors, root / "draft" / "model.safetensors")
    config = json.loads((root / "draft" / "config.json").read_text())
    (root / "draft" / "config.json").write_text(json.dumps({**config,
                                                            "draft_vocab_size": DRAFT_VOCAB}))
    return root, tensors


def _read(path):
    reader = gguf.GGUFReader(str(path))
    fields = {f.name: f.contents() for f in reader.fields.values()}
    tensors = {t.name: t for t in reader.tensors}
    return fields, tensors


@pytest.mark.parametrize("outtype", OUTTYPES)
def test_every_draft_tensor_is_written_under_llama_cpp_names(pair, tmp_path, outtype):
    root, tensors = pair
    out = export_draft_gguf(root / "draft", root / "target.gguf", tmp_path / "d.gguf", outtype)
    fields, written = _read(out)
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.QWEN3, 2)
    expected = {"fc.weight": "fc.weight", "hidden_norm.weight": "enc.output_norm.weight",
                "norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    for name in tensors:
        if name.startswith("layers."):
            expected[name] = names.get_name("model." + name, try_suffixes=(".weight",))
    assert set(written) == set(expected.values()) | {"d2t"}
    kind = gguf.GGMLQuantizationType[outtype.upper()]
    for ours, theirs in expected.items():
        t = written[theirs]
        want = tensors[ours].float()
        got = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type)))
        assert got.shape == want.shape, theirs
        if want.dim() == 1 or outtype == "f32":
            assert t.tensor_type == gguf.GGMLQuantizationType.F32
            assert torch.equal(got, want), theirs
        else:
            assert t.tensor_type == kind
            rounded = want.to(torch.bfloat16 if outtype == "bf16" else torch.float16).float()
            assert torch.equal(got, rounded), theirs


def test_metadata_names_the_block_target_layers_mask_and_target_tokenizer(pair, tmp_path):
    root, _ = pair
    out = export_draft_gguf(root / "draft", root / "target.gguf", tmp_path / "d.gguf")
    fields, written = _read(out)
    target_fields, _ = _read(root / "target.gguf")
    draft_config = json.loads((root / "draft" / "config.json").read_text())
    dflash = draft_config["dflash_config"]
    assert fields["general.architecture"] == "dflash"
    assert fields["dflash.block_size"] == dflash["block_size"]
    # llama.cpp indexes hidden states with 0 = the embeddings: the stream after layer i is i + 1
    assert fields["dflash.target_layers"] == [i + 1 for i in dflash["target_layer_ids"]]
    assert fields["tokenizer.ggml.mask_token_id"] == dflash["mask_token_id"]
    for key in ("block_count", "embedding_length", "feed_forward_length",
                "attention.head_count", "attention.head_count_kv", "attention.key_length"):
        assert fields[f"dflash.{key}"] == {
            "block_count": draft_config["num_hidden_layers"],
            "embedding_length": draft_config["hidden_size"],
            "feed_forward_length": draft_config["intermediate_size"],
            "attention.head_count": draft_config["num_attention_heads"],
            "attention.head_count_kv": draft_config["num_key_value_heads"],
            "attention.key_length": draft_config["head_dim"]}[key]
    for key, value in target_fields.items():
        if key.startswith("tokenizer."):
            assert fields[key] == value, key


def test_d2t_holds_the_absolute_target_ids_our_loader_uses(pair, tmp_path):
    root, _ = pair
    out = export_draft_gguf(root / "draft", root / "target.gguf", tmp_path / "d.gguf")
    _, written = _read(out)
    target = TargetConfig.from_hf(read_gguf(root / "target.gguf")[0])
    vocab = load_draft(root / "draft", target, torch.float32).draft_vocab
    assert written["d2t"].tensor_type == gguf.GGMLQuantizationType.I64
    assert torch.equal(torch.from_numpy(np.array(written["d2t"].data)), vocab)


def test_bad_inputs_are_named(pair, tmp_path):
    root, tensors = pair
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        export_draft_gguf(root / "draft", root / "hf", tmp_path / "d.gguf")
    with pytest.raises(ValueError, match="outtype 'q4_0'"):
        export_draft_gguf(root / "draft", root / "target.gguf", tmp_path / "d.gguf", "q4_0")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((root / "draft" / "config.json").read_text())
    save_file({k: v for k, v in tensors.items() if k != "d2t"}, broken / "model.safetensors")
    with pytest.raises(CheckpointError, match="lacks d2t"):
        export_draft_gguf(broken, root / "target.gguf", tmp_path / "d.gguf")
    assert not (tmp_path / "d.gguf").exists() and not (tmp_path / "d.gguf.part").exists()


def test_the_command_line_writes_the_same_file(pair, tmp_path, capsys):
    root, _ = pair
    assert GGUF_OUTTYPES == list(OUTTYPES)
    export_draft_gguf(root / "draft", root / "target.gguf", tmp_path / "api.gguf")
    assert main(["export-gguf", str(root / "draft"), "--target", str(root / "target.gguf"),
                 "-o", str(tmp_path / "cli.gguf")]) == 0
    assert "--spec-type draft-dflash" in capsys.readouterr().out
    assert (tmp_path / "cli.gguf").read_bytes() == (tmp_path / "api.gguf").read_bytes()


def test_a_draft_vocab_json_draft_keeps_its_vocabulary(pair, tmp_path):
    """A draft may keep its vocabulary in draft_vocab.json (its lm_head rows are the target's):
    the GGUF holds those ids and the target GGUF's rows, not a full-vocabulary draft."""
    root, tensors = pair
    draft = tmp_path / "draft"
    draft.mkdir()
    config = json.loads((root / "draft" / "config.json").read_text())
    del config["draft_vocab_size"]
    (draft / "config.json").write_text(json.dumps(config))
    save_file({k: v for k, v in tensors.items() if k not in ("d2t", "lm_head.weight")},
              draft / "model.safetensors")
    ids = [1, 5, 9, 20]
    (draft / "draft_vocab.json").write_text(json.dumps({"token_ids": ids}))
    out = export_draft_gguf(draft, root / "target.gguf", tmp_path / "d.gguf", "f32")
    _, written = _read(out)
    assert np.array(written["d2t"].data).tolist() == ids
    head = load_target(root / "hf", dtype=torch.float32).output_embedding   # tied: embeddings
    got = torch.from_numpy(np.array(written["output.weight"].data)).reshape(len(ids), -1)
    assert torch.equal(got, head[ids])


def test_a_d2t_outside_the_target_vocabulary_is_refused(pair, tmp_path):
    """llama.cpp scatters draft logits to the d2t rows: ids past the vocabulary must not pass."""
    root, tensors = pair
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((root / "draft" / "config.json").read_text())
    d2t = tensors["d2t"].clone()
    d2t[-1] = 96 - (DRAFT_VOCAB - 1)   # the last draft id proposes target id 96
    save_file({**tensors, "d2t": d2t}, bad / "model.safetensors")
    with pytest.raises(CheckpointError, match="d2t must map"):
        export_draft_gguf(bad, root / "target.gguf", tmp_path / "d.gguf")
    assert not (tmp_path / "d.gguf").exists()


def test_a_truncated_target_gguf_is_named(pair, tmp_path):
    root, _ = pair
    truncated = tmp_path / "target.gguf"
    truncated.write_bytes((root / "target.gguf").read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        export_draft_gguf(root / "draft", truncated, tmp_path / "d.gguf")
