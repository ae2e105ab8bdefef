"""The Python API and the command line facing bad arguments: each is refused with an error that
names it, before anything runs, and the engine serves the next request as a fresh one does."""

import json
import re

import numpy as np
import pytest

from dflash import LLM, SamplingParams, cli

from helpers import (
    CharTokenizer,
    make_tiny_draft,
    make_tiny_pair,
    make_tiny_target,
    save_byte_tokenizer,
)

B = 8


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("api"), B)


@pytest.fixture(scope="module")
def llm(models):
    return LLM(models[0], models[1], dtype="float32", max_num_seqs=4, speculation="fixed",
               tokenizer=CharTokenizer())


@pytest.fixture(scope="module")
def reference(llm):
    return llm.generate(["hello", [5, 12, 7]], SamplingParams(max_tokens=12))


def _serves_as_before(llm, reference):
    assert llm.allocator.num_free == llm.allocator.num_blocks
    again = llm.generate(["hello", [5, 12, 7]], SamplingParams(max_tokens=12))
    assert [o.token_ids for o in again] == [o.token_ids for o in reference]


@pytest.mark.parametrize("prompts", [[""], ["hello", ""]])
def test_a_text_that_encodes_to_no_tokens_is_an_empty_prompt(llm, reference, prompts):
    # it used to run with no prompt row: alone an IndexError, beside another prompt that
    # prompt's last hidden state, so it answered as the other prompt would
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate(prompts, SamplingParams(max_tokens=4))
    _serves_as_before(llm, reference)


def test_text_whose_ids_the_target_lacks_is_refused(models):
    class WideTokenizer(CharTokenizer):
        def encode(self, text, add_special_tokens=False):
            return [500 + ord(c) for c in text]

    wide = LLM(models[0], dtype="float32", tokenizer=WideTokenizer())
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 96\)"):
        wide.generate("hi", SamplingParams(max_tokens=2))


@pytest.mark.parametrize("prompt, error, message", [
    ([5.9, 12.7], TypeError, "token ids must be integers, got float 5.9"),
    ([5, True], TypeError, "token ids must be integers, got bool True"),
    ([5, None], TypeError, "token ids must be integers, got NoneType None"),
    ([["5", "12"]], TypeError, "token ids must be integers, got str '5'"),
    ([b"\x05\x0c"], TypeError, "must be a string or a list of token ids, got bytes"),
    (np.array([5, 12]), TypeError, "prompts must be a string, a list of token ids or a list "
                                   "of those, got ndarray"),
    (None, TypeError, "got NoneType"),
    ([[5, 12], 3], TypeError, "must be a string or a list of token ids, got int"),
])
def test_prompts_that_are_not_text_or_token_ids_are_refused(llm, reference, prompt, error,
                                                            message):
    # ids were coerced with int(): 5.9 ran as 5, "5" as 5, True as 1
    with pytest.raises(error, match=message):
        llm.generate(prompt, SamplingParams(max_tokens=4))
    _serves_as_before(llm, reference)


@pytest.mark.parametrize("message", [None, 123, ["hi"]])
def test_a_chat_message_must_be_text(llm, message):
    # None reached the template (a jinja UndefinedError), 123 a str concatenation
    with pytest.raises(TypeError, match="a chat message must be a string, got"):
        llm.chat_prompt(message)


def test_numpy_integer_ids_are_token_ids(llm, reference):
    ids = [np.int64(5), np.int32(12), np.int16(7)]
    assert llm.generate(ids, SamplingParams(max_tokens=12))[0].token_ids == \
        reference[1].token_ids


def test_sampling_params_must_be_one_or_one_per_prompt(llm, reference):
    # an empty list used to mean the defaults for every prompt
    with pytest.raises(ValueError, match="2 prompts but 0 sampling params"):
        llm.generate(["hello", "hi"], [])
    with pytest.raises(TypeError, match="sampling_params must be SamplingParams .* got dict"):
        llm.generate("hello", {"max_tokens": 3})
    with pytest.raises(TypeError, match="sampling_params must be SamplingParams .* NoneType"):
        llm.generate(["hello", "hi"], [SamplingParams(), None])
    _serves_as_before(llm, reference)


@pytest.mark.parametrize("change, message", [
    ({"kv_block_size": 0}, "kv_block_size must be an integer >= 1, got 0"),
    ({"max_num_seqs": 2.5}, "max_num_seqs must be an integer >= 1, got 2.5"),
    ({"max_num_seqs": "4"}, "max_num_seqs must be an integer >= 1, got '4'"),
    ({"block_size": 8.0}, "block_size must be None or an integer >= 1, got 8.0"),
    # 0 used to mean the default length and the default block count
    ({"max_model_len": 0}, "max_model_len must be None or an integer >= 2, got 0"),
    ({"max_model_len": -5}, "max_model_len must be None or an integer >= 2, got -5"),
    ({"num_kv_blocks": 0}, "num_kv_blocks must be None or an integer >= 1, got 0"),
])
def test_engine_sizes_are_checked_before_loading(models, change, message):
    with pytest.raises(ValueError, match=message):
        LLM(models[0], models[1], dtype="float32", **change)


@pytest.mark.parametrize("speculation", ["adaptive", "fixed"])
@pytest.mark.parametrize("max_model_len", [B - 3, B])
def test_a_max_model_len_within_one_block_is_refused(models, speculation, max_model_len):
    # adaptive calibrated past the RoPE table (an IndexError); fixed never drafted
    with pytest.raises(ValueError, match=f"max_model_len must be above the block size \\({B}"):
        LLM(models[0], models[1], dtype="float32", max_model_len=max_model_len,
            speculation=speculation)


def test_a_max_model_len_beyond_the_models_positions_is_refused(models, tmp_path):
    # it was silently lowered to the models' max_position_embeddings (512 here), so a server
    # started with --max-model-len 1000 refused prompts of 600 tokens as too long
    with pytest.raises(ValueError, match=r"max_model_len 1000 is beyond the target's "
                                         r"max_position_embeddings \(512\)"):
        LLM(models[0], dtype="float32", max_model_len=1000)
    short = tmp_path / "draft"
    make_tiny_draft(short, models[0], block_size=B, max_position_embeddings=300)
    with pytest.raises(ValueError, match=r"max_model_len 400 is beyond the draft's "
                                         r"max_position_embeddings \(300\)"):
        LLM(models[0], short, dtype="float32", max_model_len=400, speculation="fixed")
    # without max_model_len the engine serves what both models reach
    assert LLM(models[0], short, dtype="float32", speculation="fixed").max_model_len == 300
    assert LLM(models[0], dtype="float32", max_model_len=512).max_model_len == 512


def test_target_only_decoding_serves_the_shortest_max_model_len(models):
    llm = LLM(models[0], dtype="auto", max_model_len=2)
    assert len(llm.generate([[5]], SamplingParams(max_tokens=8))[0].token_ids) == 1


@pytest.mark.parametrize("change, message", [
    ({"stop": None}, "stop must be a string or a list"),
    ({"stop": 5}, "stop must be a string or a list"),
    ({"stop_token_ids": 5}, "stop_token_ids must be a list of token ids"),
    ({"stop_token_ids": "12"}, "stop_token_ids must be a list of token ids"),
    ({"temperature": True}, "temperature must be a finite number"),
    ({"top_p": True}, "top_p must be in"),
    ({"ignore_eos": "no"}, "ignore_eos must be True or False"),
])
def test_sampling_params_of_the_wrong_type_are_named(change, message):
    with pytest.raises(ValueError, match=message) as e:
        SamplingParams(**change)
    assert e.value.param == next(iter(change))


def test_sampling_params_take_iterators_and_numpy_scalars():
    # a generator of stop ids used to be consumed by the check and kept empty
    sp = SamplingParams(stop_token_ids=(t for t in [3, 4]), seed=np.uint64(2**63 + 1),
                        max_tokens=np.int64(5), temperature=np.float32(0.5))
    assert sp.stop_token_ids == (3, 4)
    assert (sp.seed, sp.max_tokens, sp.temperature) == (2**63 + 1, 5, 0.5)
    assert all(type(x) in (int, float) for x in (sp.seed, sp.max_tokens, sp.temperature))


@pytest.mark.parametrize("field, value", [
    ("temperature", -1.0), ("max_tokens", 0), ("top_k", -3), ("top_p", 0.0), ("stop", None),
    ("stop_token_ids", [-1]), ("seed", -1)])
def test_sampling_params_changed_after_construction_are_checked_again(llm, reference, field,
                                                                     value):
    # each ran as if valid: max_tokens 0 gave one token, temperature -1 greedy output
    params = SamplingParams(max_tokens=12)
    setattr(params, field, value)
    with pytest.raises(ValueError, match=f"^{field} must") as e:
        llm.generate("hello", params)
    assert e.value.param == field
    _serves_as_before(llm, reference)


def test_a_request_keeps_the_sampling_params_it_was_added_with(llm, reference):
    params = SamplingParams(max_tokens=12)
    request_id = llm.engine.add_request("hello", params)
    params.max_tokens, params.stop = 2, ("a", "b")   # the caller's object, not the request's
    outputs = []
    while llm.engine.has_unfinished():
        outputs += [out.output for out in llm.engine.step() if out.finished]
    assert [(o.request_id, o.token_ids) for o in outputs] == \
        [(request_id, reference[0].token_ids)]
    with pytest.raises(TypeError, match="SamplingParams, got dict"):
        llm.engine.add_request("hello", {"max_tokens": 2})
    _serves_as_before(llm, reference)


def test_generate_refuses_an_engine_that_runs_other_requests(llm, reference):
    # it ran them and then raised KeyError on their outputs, which were lost
    request_id = llm.engine.add_request("hello", SamplingParams(max_tokens=12))
    with pytest.raises(RuntimeError, match=r"llm.engine are unfinished \(1 waiting, 0 running"):
        llm.generate("hi", SamplingParams(max_tokens=4))
    assert llm.engine.num_waiting == 1
    assert llm.engine.abort(request_id)
    while llm.engine.has_unfinished():
        llm.engine.step()
    _serves_as_before(llm, reference)


def test_generate_checks_its_sampling_flags_before_loading_anything(monkeypatch, capsys):
    import dflash.engine

    monkeypatch.setattr(dflash.engine, "LLM", lambda *a, **k: pytest.fail("the engine loaded"))
    assert cli.main(["generate", "--max-tokens", "0", "hi"]) == 2
    err = capsys.readouterr().err
    assert "dflash generate: error: max_tokens must be an integer >= 1, got 0" in err
    assert "Traceback" not in err
    assert cli.main(["generate", "--prompts-file", "/no/such/file"]) == 2
    assert "No such file or directory" in capsys.readouterr().err


TRAIN = ["train", "--prompts", "questions.jsonl", "--out", "runs/x"]


@pytest.mark.parametrize("argv, message", [
    (["serve", "--stream-timeout", "-1"], "--stream-timeout: must be a finite number of "
                                          "seconds > 0, got -1"),
    (["serve", "--body-timeout", "inf"], "--body-timeout: must be a finite number"),
    (["serve", "--grace-period", "nan"], "--grace-period: must be a finite number of seconds "
                                         ">= 0"),
    (["serve", "--port", "70000"], "--port: must be in \\[0, 65535\\], got 70000"),
    (["serve", "--max-model-len", "-3"], "--max-model-len: must be an integer >= 2"),
    (["serve", "--max-num-seqs", "0"], "--max-num-seqs: must be an integer >= 1"),
    (["bench", "--dataset", "x", "--concurrency", "1,0"], "--concurrency: must be an integer "
                                                          ">= 1, got 0"),
    (["bench", "--dataset", "x", "--num-prompts", "-1"], "--num-prompts: must be an integer"),
    (["generate", "--max-num-seqs", "0", "hi"], "--max-num-seqs: must be an integer >= 1"),
    (TRAIN + ["--num-prompts", "-1"], "--num-prompts: must be an integer >= 1, got -1"),
    (TRAIN + ["--gen-batch", "0"], "--gen-batch: must be an integer >= 1"),
    (TRAIN + ["--max-answer-tokens", "0"], "--max-answer-tokens: must be an integer >= 1"),
    (TRAIN + ["--number-variants", "-2"], "--number-variants: must be an integer >= 0"),
    (TRAIN + ["--layers", "0"], "--layers: must be an integer >= 1"),
    (TRAIN + ["--block-size", "1"], "--block-size: must be an integer >= 2"),
    (TRAIN + ["--steps", "0"], "--steps: must be an integer >= 1"),
    (TRAIN + ["--lr", "nan"], "--lr: must be a finite number > 0, got nan"),
    (TRAIN + ["--max-minutes", "-5"], "--max-minutes: must be a finite number of minutes > 0"),
    (TRAIN + ["--eval-every", "0"], "--eval-every: must be an integer >= 1"),
])
def test_command_line_values_are_checked_as_they_are_parsed(argv, message, capsys):
    # a negative --stream-timeout used to give every stream a 500; --concurrency 0 failed a
    # benchmark after a minute of work with an internal error
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(argv)
    assert e.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_train_answers_with_the_target_and_weights_it_is_given(tmp_path):
    # `dflash train` failed on an attribute its parser never defined (--quantization)
    target = tmp_path / "target"
    tok = save_byte_tokenizer(target)
    make_tiny_target(target, vocab_size=len(tok), num_hidden_layers=2)
    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(f'{{"question": "What is {a} + {a}?"}}\n' for a in (2, 7)))
    out = tmp_path / "run"
    assert cli.main(["train", "--target", str(target), "--prompts", str(questions),
                     "--out", str(out), "--only-data", "--dtype", "float32",
                     "--quantization", "int8", "--max-answer-tokens", "6"]) == 0
    rows = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    llm = LLM(target, dtype="float32", quantization="int8")
    expected = llm.generate([llm.chat_prompt(f"What is {a} + {a}?") for a in (2, 7)],
                            SamplingParams(max_tokens=6))
    unquantized = LLM(target, dtype="float32").generate(
        [o.prompt_token_ids for o in expected], SamplingParams(max_tokens=6))
    assert [o.token_ids for o in unquantized] != [o.token_ids for o in expected]
    assert [(r["prompt_ids"], r["answer_ids"]) for r in sorted(rows, key=lambda r: r["index"])] \
        == [(o.prompt_token_ids, o.token_ids) for o in expected]
