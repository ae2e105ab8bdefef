"""The draft bundled in the package: present, small, with a model card (no network needed)."""

import json

from dflash import assets

# the weights in bf16 plus the draft vocabulary's lm_head rows in float32 (the target's own values)
MAX_BYTES = 48 << 20


def test_bundled_draft_is_complete_and_small():
    path = assets.bundled_draft()
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"]["block_size"] == 16
    # the fields vLLM and SGLang read for a reduced draft vocabulary (docs/design.md section 2)
    assert config["draft_vocab_size"] == 8192 and config["vocab_size"] == 49152
    assert config["num_target_layers"] == 30
    assert config["layer_types"] == ["full_attention"] * config["num_hidden_layers"]
    assert not (path / "draft_vocab.json").exists()
    total = sum(f.stat().st_size for f in path.iterdir())
    assert total <= MAX_BYTES
    card = (path / "README.md").read_text()
    for needed in ("## Data", "## Recipe", "## Progress", "held-out tau", "## Reproduce",
                   "dflash train"):
        assert needed in card
    assert (path / "training_curve.png").stat().st_size > 0


def test_bundled_model_card_is_generated_from_its_metadata():
    """README.md of the bundled draft is exactly what train/card.py renders from training.json,
    including the lineage of warm starts with each stage's command."""
    from dflash.train.card import METADATA, render_model_card

    path = assets.bundled_draft()
    meta = json.loads((path / METADATA).read_text())
    assert (path / "README.md").read_text() == render_model_card(meta)
    config = json.loads((path / "config.json").read_text())
    assert meta["last"]["step"] == config["dflash_training"]["step"]
    assert meta["recipe"]["num_layers"] == config["num_hidden_layers"]
    assert meta["recipe"]["target_layer_ids"] == config["dflash_config"]["target_layer_ids"]
    # the chain starts from random weights and each stage starts from the previous one's output
    commands = [s["command"] for s in meta["lineage"]] + [meta["command"]]
    assert "--init-from" not in commands[0]
    for previous, command in zip(commands, commands[1:]):
        out = previous.split("--out ")[1].split()[0]
        assert f"--init-from {out}/draft" in command
    for command in commands:   # every path a command reads exists in a clone
        assert "data/gsm8k/train.jsonl" in command and "../" not in command
