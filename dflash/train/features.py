"""Target features of the training rows, computed once and kept on disk.

The target is frozen, so the hidden states it captures for a row never change. Computing them once
(in the target's deployment dtype) instead of at every step leaves a training step with only the
draft's forward and backward, and the file is reused when training resumes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from ..models import TargetModel
from .objective import target_features


def cached_features(target: TargetModel, rows: list[dict], layer_ids, path,
                    chunk_tokens: int = 8192) -> list[torch.Tensor]:
    """Per row [len(prompt_ids) + len(answer_ids), n_aux * H] features, loaded from `path` when it
    holds exactly these rows, layers and dtype, else computed in chunks and saved there."""
    path = Path(path)
    tokens = [r["prompt_ids"] + r["answer_ids"] for r in rows]
    key = hashlib.sha256(json.dumps([list(layer_ids), str(target.dtype), tokens])
                         .encode()).hexdigest()
    if path.exists():
        with safe_open(path, "pt") as f:
            if f.metadata().get("key") == key:
                return _split(f.get_tensor("features"), tokens)
    lengths = [len(t) for t in tokens]
    width = len(layer_ids) * target.cfg.attn.hidden_size
    features = torch.empty(sum(lengths), width, dtype=target.dtype)
    row = written = 0
    with tqdm(total=len(rows), desc="target features", unit="row") as bar:
        while row < len(rows):
            end, budget = row, 0
            while end < len(rows) and (end == row or budget + lengths[end] <= chunk_tokens):
                budget += lengths[end]
                end += 1
            chunk = [torch.tensor(t) for t in tokens[row:end]]
            features[written:written + budget] = target_features(target, chunk, layer_ids)
            row, written = end, written + budget
            bar.update(len(chunk))
    tmp = path.with_suffix(".tmp")
    save_file({"features": features}, tmp, metadata={"key": key})
    tmp.replace(path)
    return _split(features, tokens)


def _split(features: torch.Tensor, tokens: list[list[int]]) -> list[torch.Tensor]:
    return list(features.split([len(t) for t in tokens]))
