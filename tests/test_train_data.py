"""Training data: number variants of prompts, and answer generation that resumes safely."""

import json
import re

import pytest

from dflash import LLM, SamplingParams
from dflash.train import generate_answers, load_prompts, number_variants, read_answers

from helpers import CharTokenizer, make_tiny_target

PROMPTS = ["Ann has 12 apples and buys 7 more for $1,250.", "No numbers here.", "Bo ran 3 km."]


def test_number_variants_redraw_every_number_and_nothing_else():
    variants = number_variants(PROMPTS, count=2, seed=0)
    assert [source for source, _ in variants] == [0, 2, 0, 2]   # variant-major, digitless skipped
    for source, text in variants:
        original = PROMPTS[source]
        assert re.sub(r"\d", "#", text) == re.sub(r"\d", "#", original)   # same digit runs
        assert text != original and not re.search(r"\b0\d", text)         # no leading zeros
    assert variants[0][1] != variants[2][1]                               # variants differ
    assert number_variants(PROMPTS, count=2, seed=0) == variants          # reproducible
    assert number_variants(PROMPTS, count=2, seed=1) != variants
    assert number_variants(PROMPTS[:1], count=1, seed=0) == variants[:1]  # per-prompt seeding


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    target = tmp_path_factory.mktemp("data") / "target"
    make_tiny_target(target, "qwen3")
    return LLM(target, dtype="float32", tokenizer=CharTokenizer(), max_model_len=128)


def test_generate_answers_resumes_and_refuses_another_prompt_list(llm, tmp_path):
    out = tmp_path / "answers.jsonl"
    generate_answers(llm, PROMPTS[:2], out, max_tokens=5)
    generate_answers(llm, PROMPTS, out, max_tokens=5)   # resumes: answers only the third
    rows = read_answers(out)
    assert [r["index"] for r in rows] == [0, 1, 2]
    for row, prompt in zip(rows, PROMPTS):
        expected = llm.generate(prompt, SamplingParams(max_tokens=5))[0]
        assert row["prompt_ids"] == expected.prompt_token_ids
        assert row["answer_ids"] == expected.token_ids
    stamp = out.read_text()
    with pytest.raises(ValueError, match="index 0 was generated for another prompt"):
        generate_answers(llm, ["Ann has 13 apples"] + PROMPTS[1:], out, max_tokens=5)
    assert out.read_text() == stamp
    assert len(json.loads(stamp.splitlines()[0])["answer_ids"]) == 5


@pytest.mark.parametrize("content, message", [
    (b'{"question": "a"}\nnot json\n', r":2 is not JSON \(Expecting value"),
    (b'"a question"\n', ":1 is not a JSON object"),
    (b'5\n', ":1 is not a JSON object"),
    (b'{"question": null}\n', ":1: 'question' is not a string"),
    (b'{"prompt": ["a"]}\n', ":1: 'prompt' is not a string"),
    (b'{"question": "a"}\n{"question": "caf\xe9"}\n', ":2 is not UTF-8"),
    (b"", " has no prompts"),
    (b"\n  \n", " has no prompts"),
])
def test_a_bad_prompts_file_names_the_file_and_line(tmp_path, content, message):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=re.escape(str(path)) + message):
        load_prompts(path)


def test_load_prompts_reads_each_field_it_documents(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"question": "q", "answer": "x"}\n\n{"prompt": "p"}\n{"text": "t é"}\n')
    assert load_prompts(path) == ["q", "p", "t é"]


def test_a_run_directory_refuses_another_target(tmp_path, capsys):
    """Rerunning `dflash train` on OUT with another target (same tokenizer) or answer length
    must not reuse the first run's answers, feature cache and checkpoint under its command."""
    from dflash import cli

    from helpers import save_byte_tokenizer

    for name, seed in (("a", 0), ("b", 1)):
        tok = save_byte_tokenizer(tmp_path / name)
        make_tiny_target(tmp_path / name, seed=seed, vocab_size=len(tok), num_hidden_layers=2)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"question": "What is 2 + 2?"}\n')
    out = tmp_path / "run"
    run = ["train", "--prompts", str(prompts), "--out", str(out), "--only-data",
           "--max-answer-tokens", "4"]
    assert cli.main([*run, "--target", str(tmp_path / "a"), "--dtype", "float32"]) == 0
    answers = (out / "answers.jsonl").read_text()
    assert cli.main([*run, "--target", str(tmp_path / "a"), "--dtype", "float32"]) == 0
    capsys.readouterr()
    for other in (["--target", str(tmp_path / "b"), "--dtype", "float32"],
                  ["--target", str(tmp_path / "a"), "--dtype", "bfloat16"],
                  ["--target", str(tmp_path / "a"), "--dtype", "float32",
                   "--quantization", "int8"],
                  # answers kept at 4 tokens, which the card would state as 8
                  ["--target", str(tmp_path / "a"), "--dtype", "float32",
                   "--max-answer-tokens", "8"],
                  # the default is the target's 512 positions
                  ["--target", str(tmp_path / "a"), "--dtype", "float32",
                   "--max-model-len", "256"]):
        assert cli.main([*run, *other]) == 2
        assert "answers were generated with" in capsys.readouterr().err
    assert (out / "answers.jsonl").read_text() == answers
