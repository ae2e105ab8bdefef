"""The draft trainer: its objective equals the inference draft, it learns, it resumes exactly."""

import json
from pathlib import Path

import pytest
import torch

from dflash.models import load_draft, load_target
from dflash.models.layers import build_metadata, prefill_metadata
from dflash.train import TrainConfig, Trainer, heldout_tau, init_draft
from dflash.train.features import cached_features
from dflash.train.objective import Batch, block_logits, target_features
from dflash.train.trainer import copy_target_layers, draft_config, frequent_tokens

from helpers import make_tiny_draft, make_tiny_target, packed_weight_dtypes


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    make_tiny_target(root / "target", "qwen3")
    make_tiny_draft(root / "draft", root / "target", num_layers=2, block_size=8,
                    target_layer_ids=[0, 2])
    target = load_target(root / "target", dtype=torch.float32)
    return root, target, load_draft(root / "draft", target.cfg, dtype=torch.float32)


def test_training_forward_equals_the_paged_inference_draft(tiny):
    """Each anchor's block, computed with every other anchor in the same packed forward, gives
    the logits the inference path gives for that block alone."""
    _, target, draft = tiny
    tokens = [torch.randint(0, 96, (30,), generator=torch.Generator().manual_seed(s))
              for s in (0, 1)]
    anchors = [torch.tensor([4, 11, 20, 28]), torch.tensor([7, 9])]
    features = target_features(target, tokens, draft.cfg.target_layer_ids)
    logits, labels = block_logits(draft, target, Batch(tokens, anchors), features)
    b, row, offset = 8, 0, 0
    for seq, anc in zip(tokens, anchors):
        feats = features[offset:offset + len(seq)]
        offset += len(seq)
        for a in anc.tolist():
            cache = torch.zeros(draft.kv_cache_shape(16, 4))
            blocks = list(range(16))
            ctx = build_metadata([blocks], [0], [a], 4)
            draft.write_context(feats[:a], ctx.positions, ctx.slot_mapping, cache)
            block = torch.full((b,), draft.cfg.mask_token_id)
            block[0] = seq[a]
            meta = build_metadata([blocks], [a], [b], 4)
            hidden = draft(torch.nn.functional.embedding(block, target.embed), meta, cache)
            expected = target.logits(hidden)[1:]
            torch.testing.assert_close(logits[row], expected, atol=1e-4, rtol=1e-4)
            want = [int(seq[i]) if i < len(seq) else -1 for i in range(a + 1, a + b)]
            assert labels[row].tolist() == want
            row += 1


def _answers(n=24, length=40):
    """A learnable language: answers count up by a per-prompt stride."""
    rows = []
    for i in range(n):
        stride = 1 + i % 3
        rows.append({"index": i, "prompt_ids": [90, 91, i % 7 + 1],
                     "answer_ids": [(5 + stride * k) % 80 + 1 for k in range(length)]})
    return rows


def _config(**kw):
    base = dict(num_layers=1, intermediate_size=64, block_size=8, mask_token_id=95,
                target_layer_ids=[1, 3], total_steps=30, warmup_steps=2, seqs_per_step=4,
                anchors_per_seq=8, heldout=4, checkpoint_every=10, eval_every=10, lr=1e-2,
                draft_vocab_size=60)
    base.update(kw)
    return TrainConfig(**base)


def test_training_learns_and_resumes_exactly(tiny, tmp_path):
    _, target, _ = tiny
    straight = Trainer(target, _answers(), tmp_path / "a", _config())
    tau_before = heldout_tau(straight.draft, target, straight.heldout)
    straight.run()
    first = straight.log[0]["loss"]
    assert straight.log[-1]["loss"] < 0.8 * first
    assert straight.log[-1]["heldout_tau"] > tau_before

    interrupted = Trainer(target, _answers(), tmp_path / "b", _config())
    interrupted.run(max_minutes=0)   # stops at once: nothing trained, state saved
    interrupted.run(stop_at=20)      # killed mid-schedule, right after a checkpoint
    resumed = Trainer(target, _answers(), tmp_path / "b", _config())
    assert resumed.step == 20
    resumed.run()
    for (name, p), q in zip(straight.draft.named_parameters(), resumed.draft.parameters()):
        assert torch.equal(p, q), name
    exported = json.loads((tmp_path / "b" / "draft" / "config.json").read_text())
    assert exported["dflash_config"] == {"block_size": 8, "mask_token_id": 95,
                                         "target_layer_ids": [1, 3]}
    reloaded = load_draft(tmp_path / "b" / "draft", target.cfg)
    assert reloaded.cfg.num_layers == 1
    answer_tokens = {t for r in _answers() for t in r["answer_ids"]}
    assert len(reloaded.draft_vocab) == 60 and set(reloaded.draft_vocab.tolist()) <= answer_tokens


def test_warm_start_from_an_exported_draft(tiny, tmp_path):
    _, target, _ = tiny
    first = Trainer(target, _answers(), tmp_path / "a", _config())
    first.run(stop_at=10)
    warm = Trainer(target, _answers(), tmp_path / "b",
                   _config(init_from=str(tmp_path / "a" / "draft")))
    assert warm.step == 0
    for p, q in zip(first.draft.parameters(), warm.draft.parameters()):
        torch.testing.assert_close(p.to(torch.bfloat16).float(), q)   # exported in bf16
    assert torch.equal(warm.draft.draft_vocab, first.draft.draft_vocab)


def test_warm_start_keeps_the_draft_vocabulary_unless_another_size_is_asked(tiny, tmp_path):
    _, target, _ = tiny
    first = Trainer(target, _answers(), tmp_path / "a", _config())
    first.run(stop_at=1)
    source = str(tmp_path / "a" / "draft")
    other_answers = _answers(length=20)   # fewer distinct tokens, other frequencies
    same = Trainer(target, other_answers, tmp_path / "b", _config(init_from=source))
    assert torch.equal(same.draft.draft_vocab, first.draft.draft_vocab)
    assert not torch.equal(same.draft.draft_vocab, frequent_tokens(same.train_rows, 60))
    same.run(stop_at=10)
    resumed = Trainer(target, other_answers, tmp_path / "b", _config(init_from=source))
    assert resumed.step == 10
    assert torch.equal(resumed.draft.draft_vocab, first.draft.draft_vocab)
    bigger = Trainer(target, other_answers, tmp_path / "c",
                     _config(init_from=source, draft_vocab_size=70))
    assert torch.equal(bigger.draft.draft_vocab, frequent_tokens(bigger.train_rows, 70))
    assert not torch.equal(bigger.draft.draft_vocab, first.draft.draft_vocab)


def test_a_draft_grown_deeper_starts_as_the_shallower_draft(tiny, tmp_path):
    """Warm start from a draft with fewer layers: same block logits before training, and the
    extra layers train (their zeroed output projections get gradients)."""
    _, target, _ = tiny
    first = Trainer(target, _answers(), tmp_path / "a", _config())
    first.run(stop_at=10)
    source = load_draft(tmp_path / "a" / "draft", target.cfg, dtype=torch.float32)
    grown = Trainer(target, _answers(), tmp_path / "b",
                    _config(num_layers=3, init_from=str(tmp_path / "a" / "draft")))
    tokens = [torch.tensor(r["prompt_ids"] + r["answer_ids"]) for r in _answers(n=2)]
    batch = Batch(tokens, [torch.tensor([3, 10, 25])] * 2)
    features = target_features(target, batch.tokens, source.cfg.target_layer_ids)
    expected, _ = block_logits(source, target, batch, features)
    got, _ = block_logits(grown.draft, target, batch, features)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    grown.run(stop_at=2)
    assert grown.draft.layers[2].o.abs().sum() > 0
    with pytest.raises(ValueError, match="fewer layers"):
        Trainer(target, _answers(), tmp_path / "c",
                _config(intermediate_size=32, init_from=str(tmp_path / "a" / "draft")))


def test_no_training_row_shares_a_question_with_a_held_out_row(tiny, tmp_path):
    _, target, _ = tiny
    rows = _answers(n=12)
    variants = [dict(r, index=12 + i, group=r["index"]) for i, r in enumerate(rows)]
    trainer = Trainer(target, rows + variants, tmp_path, _config(cache_features=False))
    held = {r["index"] for r in trainer.heldout}
    assert held == {0, 1, 2, 3}
    assert not held & {r.get("group", r["index"]) for r in trainer.train_rows}
    assert len(trainer.train_rows) == 2 * 12 - 2 * len(held)


def test_training_without_the_feature_cache_takes_the_same_steps(tiny, tmp_path):
    _, target, _ = tiny
    cached = Trainer(target, _answers(), tmp_path / "a", _config())
    online = Trainer(target, _answers(), tmp_path / "b", _config(cache_features=False))
    assert online.features is None and not (tmp_path / "b" / "features.safetensors").exists()
    cached.run(stop_at=3)
    online.run(stop_at=3)
    for (name, p), q in zip(cached.draft.named_parameters(), online.draft.parameters()):
        torch.testing.assert_close(p, q, atol=1e-4, rtol=1e-4, msg=name)


def test_cached_features_equal_on_the_fly_features_and_follow_the_rows(tiny, tmp_path):
    _, target, _ = tiny
    rows = _answers(n=6)
    path = tmp_path / "features.safetensors"
    cached = cached_features(target, rows, (0, 2), path, chunk_tokens=100)   # several chunks
    for row, got in zip(rows, cached):
        tokens = torch.tensor(row["prompt_ids"] + row["answer_ids"])
        torch.testing.assert_close(got, target_features(target, [tokens], (0, 2)),
                                   atol=1e-5, rtol=1e-5)
    stamp = path.stat().st_mtime_ns
    cached_features(target, rows, (0, 2), path)
    assert path.stat().st_mtime_ns == stamp               # reused
    other = cached_features(target, rows, (1, 3), path)   # other layers: recomputed
    assert path.stat().st_mtime_ns != stamp
    assert not torch.equal(other[0], cached[0])


def test_draft_layers_copied_from_the_target_compute_the_target_layers(tiny):
    """With causal attention over its own block, a copied draft layer is the target layer."""
    _, target, _ = tiny
    tc = _config(num_layers=2, intermediate_size=target.cfg.intermediate_size)
    draft = init_draft(draft_config(target, tc), target.cfg.attn.hidden_size, seed=0)
    copy_target_layers(draft, target, [3, 1])
    x = torch.randn(5, target.cfg.attn.hidden_size, generator=torch.Generator().manual_seed(0))
    meta = prefill_metadata([5], 4)
    cos_sin = target.cos_sin[meta.positions]
    for i, index in enumerate([3, 1]):
        cache = torch.zeros(target.kv_cache_shape(4, 4))[index]
        out, residual = target.layers[index](x, None, cos_sin, meta, cache[0], cache[1])
        expected = residual + out

        def causal(q, k, v):
            group = q.shape[1] // k.shape[1]
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1), k.repeat_interleave(group, 1).transpose(0, 1),
                v.repeat_interleave(group, 1).transpose(0, 1), is_causal=True).transpose(0, 1)

        got = draft.layers[i](x, cos_sin, *draft.layer_kv(i), draft.k_norm[i], causal)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="names 1 layers"):
        copy_target_layers(draft, target, [0])


def test_exported_draft_has_a_model_card(tiny, tmp_path):
    _, target, _ = tiny
    trainer = Trainer(target, _answers(), tmp_path, _config(total_steps=20),
                      target_name="tiny-qwen3", command="dflash train --out x")
    trainer.run()
    card = (tmp_path / "draft" / "README.md").read_text()
    assert "tiny-qwen3" in card and "dflash train --out x" in card
    assert f"{trainer.log[-1]['loss']:.3f}" in card
    for entry in trainer.log:
        assert f"| {entry['step']} |" in card and f"{entry['heldout_tau']:.3f}" in card
    assert (tmp_path / "draft" / "training_curve.png").stat().st_size > 0
    # the card is rendered from the metadata saved next to it, and can be regenerated from it
    from dflash.train.card import write_model_card

    (tmp_path / "draft" / "README.md").unlink()
    write_model_card(tmp_path / "draft", plot=False)
    assert (tmp_path / "draft" / "README.md").read_text() == card


def test_warm_started_card_lists_the_lineage(tiny, tmp_path):
    _, target, _ = tiny
    first = Trainer(target, _answers(), tmp_path / "a", _config(total_steps=10),
                    target_name="tiny-qwen3", command="dflash train --out a")
    first.run()
    second = Trainer(target, _answers(), tmp_path / "b",
                     _config(total_steps=10, init_from=str(tmp_path / "a" / "draft")),
                     target_name="tiny-qwen3", command="dflash train --out b --init-from a/draft")
    second.run(stop_at=5)
    card = (tmp_path / "b" / "draft" / "README.md").read_text()
    assert "## Lineage" in card and "| 1 | " in card and "| 2 | " in card
    assert card.index("dflash train --out a\n") < card.index("dflash train --out b --init-from")
    # a resumed run keeps the lineage it started with, even if its source has gone
    import shutil

    shutil.rmtree(tmp_path / "a")
    Trainer(target, _answers(), tmp_path / "b",
            _config(total_steps=10, init_from=str(tmp_path / "a" / "draft")),
            target_name="tiny-qwen3", command="dflash train --out b --init-from a/draft").run()
    assert "dflash train --out a\n" in (tmp_path / "b" / "draft" / "README.md").read_text()


@pytest.mark.parametrize("dtype", packed_weight_dtypes(), ids=str)
def test_copying_layers_from_a_packed_target(tiny, dtype):
    """`dflash train` trains against the engine's target, whose weights are packed."""
    root, _, _ = tiny
    plain = load_target(root / "target", dtype=dtype)
    packed = load_target(root / "target", dtype=dtype)
    packed.pack_weights()
    tc = _config(num_layers=1, intermediate_size=plain.cfg.intermediate_size)
    drafts = [init_draft(draft_config(plain, tc), plain.cfg.attn.hidden_size, seed=0)
              for _ in range(2)]
    copy_target_layers(drafts[0], plain, [2])
    copy_target_layers(drafts[1], packed, [2])
    for p, q in zip(drafts[0].parameters(), drafts[1].parameters()):
        assert torch.equal(p, q)


class _Planted:
    """A pickle that runs code when loaded: what a planted checkpoint.pt would hold."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_planted_checkpoint_is_refused_without_running_its_code(tiny, tmp_path):
    target = tiny[1]
    out = tmp_path / "run"
    out.mkdir()
    marker = tmp_path / "code-ran"
    torch.save({"step": 1, "config": _Planted(marker)}, out / "checkpoint.pt")
    with pytest.raises(ValueError, match="checkpoint.pt holds objects other than tensors"):
        Trainer(target, _answers(), out, _config())
    assert not marker.exists()


def test_answers_that_reach_the_served_length_train_and_evaluate(tiny):
    """An answer that stops at max_model_len (the target's RoPE table) has anchors whose block
    would run past it: the engine drafts no such block, so training samples none."""
    root, _, _ = tiny
    target = load_target(root / "target", dtype=torch.float32, max_positions=43)
    rows = _answers(length=40)   # 3 prompt + 40 answer tokens: the whole served length
    trainer = Trainer(target, rows, root / "full-length", _config(total_steps=2, eval_every=2))
    trainer.run()
    assert trainer.log[-1]["step"] == 2 and trainer.log[-1]["heldout_tau"] >= 1


@pytest.mark.parametrize("option, message", [
    (dict(target_layer_ids=[1, 4]), r"target_layer_ids \[1, 4\]: id 4 is outside the target's 4"),
    (dict(target_layer_ids=[-1]), r"id -1 is outside"),
    (dict(mask_token_id=96), "mask_token_id 96 is outside the target vocabulary of 96"),
    (dict(block_size=600), "block_size 600 is longer than the served length 512"),
    (dict(draft_vocab_size=97), "draft_vocab_size 97 is larger than the target vocabulary"),
    (dict(num_layers=2, intermediate_size=128, init_from_target_layers=[0, 4]),
     r"init_from_target_layers \[0, 4\]: id 4 is outside"),
])
def test_bad_options_are_named_before_any_work(tiny, tmp_path, option, message):
    _, target, _ = tiny
    with pytest.raises(ValueError, match=message):
        Trainer(target, _answers(), tmp_path, _config(**option))
    assert not (tmp_path / "features.safetensors").exists()


def test_a_warm_start_of_another_shape_is_refused_before_features_are_computed(tiny, tmp_path):
    root, target, _ = tiny
    with pytest.raises(ValueError, match="or the same with fewer layers"):
        Trainer(target, _answers(), tmp_path, _config(init_from=str(root / "draft")))
    assert not (tmp_path / "features.safetensors").exists()


def test_the_command_line_checks_options_before_generating_answers(tmp_path, capsys):
    from dflash import cli

    from helpers import save_byte_tokenizer

    target = tmp_path / "target"
    make_tiny_target(target, vocab_size=len(save_byte_tokenizer(target)), num_hidden_layers=2)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"question": "What is 2 + 2?"}\n')
    assert cli.main(["train", "--target", str(target), "--prompts", str(prompts),
                     "--out", str(tmp_path / "run"), "--dtype", "float32",
                     "--target-layer-ids", "0,2"]) == 2
    assert "id 2 is outside the target's 2 layers" in capsys.readouterr().err
    assert not (tmp_path / "run" / "answers.jsonl").exists()


@pytest.mark.parametrize("option", [dict(draft_vocab_size=30), dict(seed=5),
                                    dict(init_from_target_layers=[1])])
def test_a_resume_refuses_options_its_checkpoint_would_ignore(tiny, tmp_path, option):
    """The checkpoint keeps its vocabulary, RNG and initial weights: a rerun that asks for others
    would train on, while training.json and the card stated the new values."""
    _, target, _ = tiny
    Trainer(target, _answers(), tmp_path, _config()).run(stop_at=1)
    key = next(iter(option))
    with pytest.raises(ValueError, match=f"was trained with {key}="):
        Trainer(target, _answers(), tmp_path, _config(**option))


def test_training_json_states_the_layers_sizes_and_vocabulary_actually_used(tiny, tmp_path):
    """Defaults resolve against the target, and a draft vocabulary is at most the distinct
    answer tokens: the recipe states the values the draft was trained with, not None."""
    _, target, _ = tiny
    trainer = Trainer(target, _answers(), tmp_path,
                      _config(target_layer_ids=None, intermediate_size=None,
                              draft_vocab_size=95))
    trainer.run(stop_at=1)
    recipe = json.loads((tmp_path / "draft" / "training.json").read_text())["recipe"]
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert recipe["target_layer_ids"] == config["dflash_config"]["target_layer_ids"] == [2]
    assert recipe["intermediate_size"] == config["intermediate_size"] == 128
    assert recipe["draft_vocab_size"] == config["draft_vocab_size"] < 95
    card = (tmp_path / "draft" / "README.md").read_text()
    assert "| target_layer_ids | [2] |" in card


def test_a_resume_refuses_other_answers(tiny, tmp_path):
    """The checkpoint's data order indexes its training rows: resumed on other rows (a rerun
    with more --num-prompts) it would go on with another data set under the same card."""
    _, target, _ = tiny
    Trainer(target, _answers(), tmp_path, _config()).run(stop_at=10)
    with pytest.raises(ValueError, match="was trained on other answers"):
        Trainer(target, _answers(n=30), tmp_path, _config())
    assert Trainer(target, _answers(), tmp_path, _config()).step == 10


@pytest.mark.parametrize("option", ["--target-layer-ids", "--init-from-target-layers"])
def test_a_layer_list_that_is_not_integers_names_its_option(tmp_path, capsys, option):
    from dflash import cli

    with pytest.raises(SystemExit):
        cli.main(["train", "--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path),
                  option, "1,a"])
    assert f"argument {option}: invalid layer id list value: '1,a'" in capsys.readouterr().err


def test_too_few_answers_says_how_many_are_held_out(tiny, tmp_path):
    _, target, _ = tiny
    with pytest.raises(ValueError, match="of 4 usable answers the first 4 are held out"):
        Trainer(target, _answers(n=4), tmp_path, _config())
