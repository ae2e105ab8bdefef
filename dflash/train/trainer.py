"""`dflash train`: train a DFlash draft for a frozen target on the target's own answers.

Resumable: everything (draft, optimizer, schedule position, data order, RNG, the log) lives in
`<out>/checkpoint.pt`, written atomically every `checkpoint_every` steps; rerunning the same command
continues where it stopped. Every checkpoint also exports `<out>/draft/`, a DFlashDraftModel
directory any loader of z-lab drafts can read.
"""

from __future__ import annotations

import hashlib
import json
import math
import pickle
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

from .._optional import require
from ..models import DFlashDraft, DraftConfig, TargetModel, default_target_layer_ids
from ..models.config import AttentionConfig
from ..models.layers import unpacked
from ..models.loader import load_draft, save_draft
from .card import inherited_lineage, save_training_metadata, training_metadata, write_model_card
from .features import cached_features
from .objective import (
    Batch,
    anchor_end,
    block_logits,
    draft_loss,
    predictions,
    sample_anchors,
    target_features,
)


@dataclass
class TrainConfig:
    num_layers: int = 2
    intermediate_size: int | None = None       # default: the target's
    block_size: int = 16
    mask_token_id: int = 0
    target_layer_ids: list[int] | None = None  # default: docs/design.md section 2 rule
    gamma: float = 7.0
    lr: float = 6e-4
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    warmup_steps: int = 100
    total_steps: int = 4000
    seqs_per_step: int = 4
    anchors_per_seq: int = 32
    grad_clip: float = 1.0
    heldout: int = 16                          # answers kept out of training for tau estimates
    draft_vocab_size: int = 0                  # > 0: export the most frequent answer tokens
    init_from: str | None = None               # start from this draft's weights (no checkpoint)
    init_from_target_layers: list[int] | None = None   # copy these target layers into the draft
    cache_features: bool = True                # target features computed once, kept on disk
    checkpoint_every: int = 50
    eval_every: int = 250
    seed: int = 0
    extra: dict = field(default_factory=dict)


def check_options(target: TargetModel, tc: TrainConfig) -> None:
    """A ValueError naming the first option that does not fit `target`, before any work (answer
    generation and feature caching take long; training would fail past them on these)."""
    layers, vocab = target.cfg.num_layers, target.cfg.vocab_size
    for name in ("target_layer_ids", "init_from_target_layers"):
        ids = getattr(tc, name) or []
        for i in ids:
            if not 0 <= i < layers:
                raise ValueError(f"{name} {ids}: id {i} is outside the target's {layers} layers "
                                 f"[0, {layers})")
    if not 0 <= tc.mask_token_id < vocab:
        raise ValueError(f"mask_token_id {tc.mask_token_id} is outside the target vocabulary "
                         f"of {vocab}")
    served = target.cos_sin.shape[0]
    if tc.block_size > served:
        raise ValueError(f"block_size {tc.block_size} is longer than the served length {served}")
    if tc.draft_vocab_size > vocab:
        raise ValueError(f"draft_vocab_size {tc.draft_vocab_size} is larger than the target "
                         f"vocabulary of {vocab}")


def draft_config(target: TargetModel, tc: TrainConfig) -> DraftConfig:
    t = target.cfg.attn
    ids = tc.target_layer_ids or default_target_layer_ids(target.cfg.num_layers, tc.num_layers)
    attn = AttentionConfig(hidden_size=t.hidden_size, num_heads=t.num_heads,
                           num_kv_heads=t.num_kv_heads, head_dim=t.head_dim,
                           rms_norm_eps=t.rms_norm_eps, rope_theta=t.rope_theta,
                           rope_scaling=t.rope_scaling,
                           max_position_embeddings=t.max_position_embeddings,
                           attention_bias=False)
    return DraftConfig(attn=attn, num_layers=tc.num_layers,
                       intermediate_size=tc.intermediate_size or target.cfg.intermediate_size,
                       block_size=tc.block_size, mask_token_id=tc.mask_token_id,
                       target_layer_ids=tuple(ids))


def init_draft(cfg: DraftConfig, target_hidden: int, seed: int,
               max_positions: int | None = None) -> DFlashDraft:
    """A trainable draft: float32 weights ~ N(0, 0.02), norm weights 1. `max_positions`: the
    longest training sequence (its RoPE table's rows, as for DFlashDraft)."""
    draft = DFlashDraft(cfg, target_hidden, max_positions)
    g = torch.Generator().manual_seed(seed)
    for name, p in list(draft.named_parameters()):
        value = torch.ones(p.shape) if name.endswith("norm") else \
            torch.randn(p.shape, generator=g) * 0.02
        *parent, leaf = name.split(".")
        module = draft.get_submodule(".".join(parent)) if parent else draft
        setattr(module, leaf, torch.nn.Parameter(value))
    return draft


def copy_target_layers(draft: DFlashDraft, target: TargetModel, layers: list[int]) -> None:
    """Start draft layer i from target layer layers[i]: a language-model prior instead of noise.
    The draft has the target's attention shapes; the layers must be dense with the draft's
    intermediate size. Attention biases (Qwen2) are not copied: the draft has none."""
    if len(layers) != draft.cfg.num_layers:
        raise ValueError(f"init_from_target_layers names {len(layers)} layers; the draft has "
                         f"{draft.cfg.num_layers}")
    for index in layers:
        if target.cfg.is_moe_layer(index) or \
                draft.cfg.intermediate_size != target.cfg.intermediate_size:
            raise ValueError(f"init_from_target_layers: target layer {index} is not a dense "
                             f"layer with the draft's intermediate size")
    q_rows = draft.layers[0].q.shape[0]
    with torch.no_grad():
        for i, index in enumerate(layers):
            mine, theirs = draft.layers[i], target.layers[index]
            qkv = unpacked(theirs.attn.qkv).float()   # an engine's target may be packed
            mine.q.copy_(qkv[:q_rows])
            draft.layer_kv(i)[0].copy_(qkv[q_rows:])
            mine.o.copy_(unpacked(theirs.attn.o))
            mine.mlp.gate_up.copy_(unpacked(theirs.mlp.gate_up))
            mine.mlp.down.copy_(unpacked(theirs.mlp.down))
            mine.input_norm.copy_(theirs.input_norm)
            mine.post_norm.copy_(theirs.post_norm)
            if theirs.attn.q_norm is not None:   # without qk-norm the draft's norms stay at 1
                mine.q_norm.copy_(theirs.attn.q_norm)
                draft.k_norm[i].copy_(theirs.attn.k_norm)


def learning_rate(tc: TrainConfig, step: int) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio * lr."""
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    progress = min(1.0, (step - tc.warmup_steps) / max(1, tc.total_steps - tc.warmup_steps))
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return tc.lr * (tc.min_lr_ratio + (1 - tc.min_lr_ratio) * cosine)


def frequent_tokens(rows: list[dict], count: int) -> torch.Tensor:
    """The `count` most frequent answer tokens (ascending ids): the draft vocabulary."""
    counts = torch.bincount(torch.tensor([t for r in rows for t in r["answer_ids"]]))
    return counts.topk(min(count, int((counts > 0).sum()))).indices.sort().values


def heldout_tau(draft: DFlashDraft, target: TargetModel, rows: list[dict]) -> float:
    """Mean acceptance length of greedy DFlash decoding of held-out target answers, simulated
    from the draft's block predictions at every answer position (no engine needed)."""
    steps = committed = 0
    for row in rows:
        tokens = torch.tensor(row["prompt_ids"] + row["answer_ids"])
        start = len(row["prompt_ids"])
        anchors = torch.arange(start, min(len(tokens) - 1, anchor_end(draft)))
        if not len(anchors):
            continue
        batch = Batch([tokens], [anchors])
        features = target_features(target, batch.tokens, draft.cfg.target_layer_ids)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            logits, labels = block_logits(draft, target, batch, features)
        hits = (predictions(draft, logits) == labels).int()
        pos = start   # the block anchored at pos re-feeds the last committed token
        while pos < len(tokens) - 1:
            # past anchor_end the engine drafts nothing: the step commits one token
            accepted = int(hits[pos - start].cumprod(0).sum()) if pos - start < len(hits) else 0
            steps, committed = steps + 1, committed + accepted + 1
            pos += accepted + 1
    return committed / steps if steps else 1.0


def answers_key(rows: list[dict]) -> str:
    """A digest of the rows a run trains and evaluates on (its checkpoint's data order indexes
    them)."""
    return hashlib.sha256(json.dumps([[r["prompt_ids"], r["answer_ids"]] for r in rows])
                          .encode()).hexdigest()


def _group(row: dict) -> int:
    return row.get("group", row["index"])


class Trainer:
    def __init__(self, target: TargetModel, answers: list[dict], out_dir, tc: TrainConfig,
                 target_name: str = "its target", command: str | None = None):
        """`target_name` and `command` (the command line that reproduces the run) go into the
        exported draft's model card."""
        self.target, self.tc, self.out = target, tc, Path(out_dir)
        self.target_name, self.command = target_name, command
        require("matplotlib", "train", "dflash train (the model card's training curve)")
        # the runs this one continues (from --init-from's metadata); kept in the checkpoint
        check_options(target, tc)
        self.lineage = inherited_lineage(tc.init_from)
        self.out.mkdir(parents=True, exist_ok=True)
        self.cfg = draft_config(target, tc)
        # the draft sees every position its target does (the target's table: the length served
        # when the answers were generated), not the loaders' default bound
        self.draft = init_draft(self.cfg, target.cfg.attn.hidden_size, tc.seed,
                                target.cos_sin.shape[0])
        # a row needs an anchor: two answer tokens, and a prompt that leaves room for a block
        usable = [r for r in answers if len(r["answer_ids"]) >= 2
                  and len(r["prompt_ids"]) < anchor_end(self.draft)]
        # rows may name the question they derive from (`group`, e.g. a number variant): no
        # training row shares a question with a held-out row
        self.heldout = usable[:tc.heldout]
        held = {_group(r) for r in self.heldout}
        self.train_rows = [r for r in usable[tc.heldout:] if _group(r) not in held]
        if not self.train_rows:
            raise ValueError(f"no training answers: of {len(usable)} usable answers the first "
                             f"{len(self.heldout)} are held out, and the rest share their "
                             f"questions (of {len(answers)} answers, a usable one has at least "
                             f"2 answer tokens and a block after its prompt within the served "
                             f"length)")
        self.answers_key = answers_key(self.heldout + self.train_rows)
        if tc.draft_vocab_size:
            self.draft.draft_vocab = frequent_tokens(self.train_rows, tc.draft_vocab_size)
        self.optimizer = torch.optim.AdamW(self.draft.parameters(), lr=tc.lr,
                                           weight_decay=tc.weight_decay, betas=(0.9, 0.95))
        self.step, self.elapsed, self.log = 0, 0.0, []
        self.generator = torch.Generator().manual_seed(tc.seed)
        self.order: list[int] = []
        self._resume()   # first: it refuses a checkpoint or warm start of another shape
        self.features = cached_features(target, self.train_rows, self.cfg.target_layer_ids,
                                        self.out / "features.safetensors") \
            if tc.cache_features else None

    # ----------------------------------------------------------------------- checkpoints
    def _resume(self) -> None:
        path = self.out / "checkpoint.pt"
        if not path.exists():
            if self.tc.init_from:
                self._warm_start(self.tc.init_from)
            elif self.tc.init_from_target_layers:
                copy_target_layers(self.draft, self.target, self.tc.init_from_target_layers)
            return
        try:   # tensors and plain containers only: unpickling anything else could run code
            state = torch.load(path, weights_only=True)
        except pickle.UnpicklingError as e:
            raise ValueError(f"{path} holds objects other than tensors and plain data, which "
                             f"dflash does not load (a checkpoint.pt it wrote never does): "
                             f"{str(e).splitlines()[0]}") from None
        saved = state["config"]
        # the shape, and what the checkpoint fixed when the run started (its vocabulary, RNG and
        # initial weights): another value would be ignored while training.json states it
        for key in ("num_layers", "intermediate_size", "block_size", "mask_token_id",
                    "target_layer_ids", "draft_vocab_size", "seed", "init_from",
                    "init_from_target_layers"):
            if saved.get(key, getattr(self.tc, key)) != getattr(self.tc, key):
                raise ValueError(f"{path} was trained with {key}={saved[key]}, not "
                                 f"{getattr(self.tc, key)}: use another output directory")
        if state.get("answers", self.answers_key) != self.answers_key:
            raise ValueError(f"{path} was trained on other answers than these "
                             f"{len(self.heldout)} held-out and {len(self.train_rows)} training "
                             f"answers (a run with other --num-prompts or --number-variants?): "
                             f"use another output directory (or --init-from its draft)")
        self.draft.load_state_dict(state["draft"])
        # a warm start may have kept its source's vocabulary rather than this run's choice
        if "draft_vocab" in state:   # checkpoints written before it was saved recompute it
            self.draft.draft_vocab = state["draft_vocab"]
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.elapsed, self.log = state["step"], state["elapsed"], state["log"]
        self.order = state["order"]
        self.generator.set_state(state["generator"])
        self.lineage = state.get("lineage", self.lineage)

    def _warm_start(self, directory) -> None:
        """Weights of an exported draft with the same configuration, or with fewer layers: a
        draft grown deeper starts as the shallower one, because its extra layers begin with zero
        output projections (each adds nothing to the residual stream). The draft vocabulary is
        the source's unless this run asks for another size: then it is this run's most frequent
        answer tokens (the vocabulary only selects lm_head rows; no trained weight depends on
        it)."""
        source = load_draft(directory, self.target.cfg, dtype=torch.float32)
        n = source.cfg.num_layers
        same_but_depth = replace(source.cfg, num_layers=self.cfg.num_layers) == self.cfg
        if not same_but_depth or n > self.cfg.num_layers:
            raise ValueError(f"{directory} has config {source.cfg}; expected {self.cfg} "
                             f"(or the same with fewer layers)")
        grown = self.draft
        with torch.no_grad():
            for name in ("fc", "hidden_norm", "norm"):
                getattr(grown, name).copy_(getattr(source, name))
            grown.kv_weight[:len(source.kv_weight)].copy_(source.kv_weight)
            if source.kv_bias is not None:
                grown.kv_bias[:len(source.kv_bias)].copy_(source.kv_bias)
            grown.k_norm[:n].copy_(source.k_norm)
            for mine, theirs in zip(grown.layers, source.layers):
                for p, q in zip(mine.parameters(), theirs.parameters()):
                    p.copy_(q)
            for layer in grown.layers[n:]:
                layer.o.zero_()
                layer.mlp.down.zero_()
        if source.draft_vocab is not None and \
                self.tc.draft_vocab_size in (0, len(source.draft_vocab)):
            grown.draft_vocab = source.draft_vocab

    def save(self) -> None:
        state = {"draft": self.draft.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "step": self.step, "elapsed": self.elapsed, "log": self.log,
                 "order": self.order, "generator": self.generator.get_state(),
                 "draft_vocab": self.draft.draft_vocab, "config": asdict(self.tc),
                 "lineage": self.lineage, "answers": self.answers_key}
        tmp = self.out / "checkpoint.pt.tmp"
        torch.save(state, tmp)
        tmp.replace(self.out / "checkpoint.pt")
        save_draft(self.draft, self.out / "draft", self.target,
                   extra_config={"dflash_training": {"step": self.step,
                                                     "elapsed_s": round(self.elapsed)}})
        (self.out / "log.jsonl").write_text("".join(json.dumps(e) + "\n" for e in self.log))
        # the recipe states what was trained: defaults as resolved against the target, and the
        # vocabulary as chosen (at most the distinct answer tokens, or a warm start's)
        vocab = self.draft.draft_vocab
        recipe = replace(self.tc, intermediate_size=self.cfg.intermediate_size,
                         target_layer_ids=list(self.cfg.target_layer_ids),
                         draft_vocab_size=0 if vocab is None else len(vocab))
        save_training_metadata(self.out / "draft", training_metadata(
            recipe, self.log, self.train_rows, self.heldout, self.target_name, self.command,
            self.lineage))
        write_model_card(self.out / "draft")

    # ---------------------------------------------------------------------------- train
    def _next_batch(self) -> tuple[Batch, list[int]]:
        tokens, anchors, picked = [], [], []
        for _ in range(self.tc.seqs_per_step):
            if not self.order:   # a new epoch: fresh shuffle from the saved generator
                self.order = torch.randperm(len(self.train_rows),
                                            generator=self.generator).tolist()
            picked.append(self.order.pop())
            row = self.train_rows[picked[-1]]
            t = torch.tensor(row["prompt_ids"] + row["answer_ids"])
            tokens.append(t)
            anchors.append(sample_anchors(len(row["prompt_ids"]), len(t),
                                          self.tc.anchors_per_seq, self.generator,
                                          anchor_end(self.draft)))
        return Batch(tokens, anchors), picked

    def train_step(self) -> dict:
        batch, picked = self._next_batch()
        features = target_features(self.target, batch.tokens, self.cfg.target_layer_ids) \
            if self.features is None else torch.cat([self.features[i] for i in picked])
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(self.tc, self.step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, correct, counts = draft_loss(self.draft, self.target, batch, features,
                                               self.tc.gamma)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.draft.parameters(), self.tc.grad_clip)
        self.optimizer.step()
        self.step += 1
        return {"loss": loss.item(), "correct": correct, "counts": counts}

    def run(self, max_minutes: float | None = None, stop_at: int | None = None) -> None:
        """Train to total_steps, or until `max_minutes` pass or step `stop_at` is reached
        (the learning-rate schedule always follows total_steps)."""
        deadline = None if max_minutes is None else time.time() + 60 * max_minutes
        last = min(self.tc.total_steps, stop_at or self.tc.total_steps)
        window: list[dict] = []
        bar = tqdm(total=self.tc.total_steps, initial=self.step, desc="train", unit="step")
        while self.step < last and (deadline is None or time.time() < deadline):
            start = time.perf_counter()
            window.append(self.train_step())
            self.elapsed += time.perf_counter() - start
            bar.update(1)
            correct = sum(w["correct"] for w in window)
            counts = sum(w["counts"] for w in window).clamp(min=1)
            acc = (correct / counts).tolist()
            bar.set_postfix(loss=f"{sum(w['loss'] for w in window) / len(window):.3f}",
                            acc1=f"{acc[0]:.2f}", acc=" ".join(f"{a:.2f}" for a in acc[:6]))
            if self.step % self.tc.eval_every == 0 or self.step % self.tc.checkpoint_every == 0:
                entry = {"step": self.step, "elapsed_s": round(self.elapsed, 1),
                         "loss": sum(w["loss"] for w in window) / len(window),
                         "acc_per_position": [round(a, 4) for a in acc]}
                if self.step % self.tc.eval_every == 0 and self.heldout:
                    entry["heldout_tau"] = round(heldout_tau(self.draft, self.target,
                                                             self.heldout), 3)
                    tqdm.write(f"step {self.step}: held-out tau {entry['heldout_tau']}")
                self.log.append(entry)
                window = []
                self.save()
        bar.close()
        self.save()
