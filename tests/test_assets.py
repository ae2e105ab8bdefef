"""The draft bundled in the package: present, small, with a model card (no network needed)."""

import json

from dflash import assets

MAX_BYTES = 40 << 20


def test_bundled_draft_is_complete_and_small():
    path = assets.bundled_draft()
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"]["block_size"] == 16
    total = sum(f.stat().st_size for f in path.iterdir())
    assert total <= MAX_BYTES
    card = (path / "README.md").read_text()
    for needed in ("## Data", "## Recipe", "## Progress", "held-out tau", "## Reproduce",
                   "dflash train"):
        assert needed in card
    assert (path / "training_curve.png").stat().st_size > 0
