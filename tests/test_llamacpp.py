"""llama.cpp as the oracle (optional group: `pytest -m llamacpp`; the first run builds llama.cpp
from its sdist into the dflash cache, about 20 minutes on 2 cores, through
bench/bench_llamacpp.py): llama.cpp runs our exported draft, and dflash's greedy decoding follows
llama.cpp's on the same GGUF files: exactly in float32, at 97% of positions or more for Q8_0."""

import shutil
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.llamacpp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import bench_llamacpp as peer  # noqa: E402
from dflash import LLM, assets  # noqa: E402
from dflash.bench import load_dataset  # noqa: E402
from dflash.models.gguf_draft import export_draft_gguf  # noqa: E402

QUESTIONS = Path(__file__).resolve().parents[1] / "data" / "gsm8k" / "train.jsonl"


@pytest.fixture(scope="module")
def llama():
    cache = assets.cache_dir() / "llama.cpp"
    bin_dir = peer.build(cache)
    targets, draft = peer.convert(bin_dir, cache)
    with LLM(targets["Q4_0"], None) as llm:
        prompts = [llm.chat_prompt(q) for q in load_dataset(str(QUESTIONS), 4)]
    return bin_dir, targets, draft, prompts


def test_llama_cpp_runs_our_exported_draft(llama, tmp_path):
    """Its DFlash accepts our draft's blocks (tau about 3 with the bundled draft); the negative
    control, the same draft with its vocabulary map reversed, gets almost nothing accepted."""
    bin_dir, targets, draft, prompts = llama
    _, _, tau = peer.llama_dflash(bin_dir, targets["F32"], draft, prompts[:2], 64, 2, 16)
    assert tau > 2.0
    broken = tmp_path / "draft"
    shutil.copytree(assets.bundled_draft(), broken)
    from safetensors.torch import load_file, save_file

    tensors = load_file(broken / "model.safetensors")
    ids = torch.arange(len(tensors["d2t"])) + tensors["d2t"]
    tensors["d2t"] = ids.flip(0) - torch.arange(len(ids))
    save_file(tensors, broken / "model.safetensors")
    wrong = export_draft_gguf(broken, assets.smollm2_target(), tmp_path / "wrong.gguf")
    _, _, tau = peer.llama_dflash(bin_dir, targets["F32"], wrong, prompts[:2], 64, 2, 16)
    assert tau < 1.3


def test_float32_greedy_texts_equal_llama_cpp(llama):
    bin_dir, targets, _, prompts = llama
    greedy = peer.llama_greedy(bin_dir, targets["F32"], prompts, 128, 2)
    with LLM(targets["F32"], None, dtype="float32", max_num_seqs=1) as llm:
        ids, _, _ = peer.decode(llm, prompts, 128)
        ours = [llm.tokenizer.decode(t, skip_special_tokens=True) for t in ids]
    assert peer.equal(ours, greedy) == f"{len(prompts)}/{len(prompts)}"


def test_q8_0_agrees_with_llama_cpp(llama):
    """Teacher-forced on llama.cpp's greedy Q8_0 texts, the int8 target's argmax agrees at 97%
    of positions or more (bench/results/llamacpp.json has the rate on held-out questions). This
    catches a wrong grid or layout, which falls far lower; it cannot tell llama.cpp's activation
    rounding from a close variant (unquantized activations measured about 98% too)."""
    bin_dir, targets, _, prompts = llama
    greedy = peer.llama_greedy(bin_dir, targets["Q8_0"], prompts, 128, 2)
    with LLM(targets["Q8_0"], None, dtype="float32", quantization="int8") as llm:
        assert peer.teacher_forced(llm, prompts, greedy) >= 0.97
