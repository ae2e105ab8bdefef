"""The online engine (`LLMEngine`) on tiny random checkpoints (float32): requests joining and
leaving between steps, aborts, stop strings, incremental detokenization, error isolation."""

import tracemalloc

import pytest
import torch

from dflash import LLM, SamplingParams
from dflash.engine.detokenizer import IncrementalDetokenizer

from helpers import CharTokenizer, make_tiny_pair, save_byte_tokenizer, serving_engine

B = 8
PROMPTS = [[(7 * i + 3 * j) % 90 + 1 for j in range(n)]
           for i, n in enumerate([5, 12, 3, 20, 9, 1, 15, 7])]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("online"), B)[:2]


@pytest.fixture(scope="module")
def llm(models):
    return LLM(*models, dtype="float32", max_num_seqs=4, speculation="fixed",
               tokenizer=CharTokenizer())


@pytest.fixture(scope="module")
def reference(llm):
    """Offline greedy outputs of 48 tokens for every prompt."""
    return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=48))]


def _run(engine):
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def test_requests_join_between_steps_and_match_offline(llm, reference):
    engine = llm.engine
    first = [engine.add_request(p, SamplingParams(max_tokens=48)) for p in PROMPTS[:3]]
    streamed = {i: [] for i in first}
    for _ in range(3):
        for request_id, new, _finished, _reason in engine.step():
            streamed[request_id] += new
    late = [engine.add_request(p, SamplingParams(max_tokens=48)) for p in PROMPTS[3:]]
    streamed.update({i: [] for i in late})
    finals = {}
    while engine.has_unfinished():
        assert engine.num_running <= llm.max_num_seqs
        for out in engine.step():
            streamed[out.request_id] += out.new_token_ids
            if out.finished:
                finals[out.request_id] = out.output
    ids = first + late
    assert [streamed[i] for i in ids] == reference
    assert [finals[i].token_ids for i in ids] == reference
    assert all(finals[i].finish_reason == "length" for i in ids)
    assert llm.allocator.num_free == llm.allocator.num_blocks


def test_abort_frees_blocks_before_the_next_step(llm, reference):
    engine = llm.engine
    ids = [engine.add_request(p, SamplingParams(max_tokens=48)) for p in PROMPTS[:6]]
    engine.step()   # 4 run, 2 wait
    running = {r.request_id for r in engine.running}
    victim, waiting_victim = ids[1], ids[5]
    assert victim in running and waiting_victim not in running
    held = len(next(r for r in engine.running if r.request_id == victim).block_table)
    free = llm.allocator.num_free
    assert engine.abort(victim) and engine.abort(waiting_victim)
    assert llm.allocator.num_free == free + held   # at once, before any step
    assert not engine.abort(victim)                # already over
    outs = engine.step()
    aborted = {o.request_id: o for o in outs if o.finish_reason == "abort"}
    assert set(aborted) == {victim, waiting_victim} and all(o.finished for o in aborted.values())
    assert victim not in {r.request_id for r in engine.running}
    rest = _run(engine)
    for i in (0, 2, 3, 4):
        assert rest[ids[i]][-1].output.token_ids == reference[i]
    assert llm.allocator.num_free == llm.allocator.num_blocks


class FullAcceptance:
    """Proposes the target's own greedy continuation: every draft of a block is accepted."""

    def __init__(self, continuation):
        self.continuation = continuation

    def __call__(self, inputs):
        rows = []
        for r in inputs.requests:
            n = len(r.output_ids)
            rows.append(self.continuation[n:n + inputs.block_size - 1])
        return torch.tensor(rows), None


@pytest.mark.parametrize("at_token", [1, 3])
def test_abort_from_a_request_s_own_callback(llm, reference, at_token):
    """on_tokens may abort its request: while its first token is committed (it is being
    admitted) or a later one. It ends once, reported once, its blocks free, the others exact."""
    engine = llm.engine
    before = llm.metrics()["requests"]
    seen = []

    def on_tokens(new, seen=seen):
        seen.extend(new)
        if len(seen) >= at_token:
            engine.abort(victim)

    victim = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=48), on_tokens=on_tokens)
    other = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=48))
    outputs = _run(engine)
    ends = [o for o in outputs[victim] if o.finished]
    assert len(ends) == 1 and ends[0].finish_reason == "abort"
    streamed = [t for o in outputs[victim] for t in o.new_token_ids]
    assert streamed == ends[0].output.token_ids == reference[0][:len(streamed)]
    assert len(streamed) >= at_token
    assert outputs[other][-1].output.token_ids == reference[1]
    assert llm.metrics()["requests"] == before + 2
    assert llm.allocator.num_free == llm.allocator.num_blocks


def test_stop_string_across_tokens_and_inside_an_accepted_block(models, reference):
    target, _ = models
    tok = CharTokenizer()
    ref = reference[3]
    text = tok.decode(ref)
    stop = text[13:16]             # three tokens, found mid-block
    first = text.index(stop)
    llm = LLM(target, dtype="float32", block_size=B, tokenizer=tok)
    llm.worker.proposer = FullAcceptance(ref + [0] * B)
    out = llm.generate(PROMPTS[3], SamplingParams(max_tokens=48, stop=[stop, "never-seen"]))[0]
    assert out.text == text[:first] and out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == ref[:first + len(stop)]    # tokens after the match are dropped
    assert out.metrics.num_accepted_tokens > 0
    # the whole output when nothing matches; a stop string at the first token
    out = llm.generate(PROMPTS[3], SamplingParams(max_tokens=20, stop="\x00\x00"))[0]
    assert out.text == text[:20] and out.finish_reason == "length"
    out = llm.generate(PROMPTS[3], SamplingParams(max_tokens=20, stop=text[0]))[0]
    assert out.text == "" and out.token_ids == ref[:1]


def test_stop_string_inside_multi_character_tokens(models):
    """A WordLevel tokenizer ("w5 w17 ..."): the stop string starts inside one token and ends
    inside another, and the text is cut at its first character."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tok_models
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(tok_models.WordLevel({f"w{i}": i for i in range(96)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0")
    target, draft = models
    llm = LLM(target, draft, dtype="float32", tokenizer=tok, speculation="fixed")
    prompt = "w5 w17 w3 w40 w8"
    full = llm.generate(prompt, SamplingParams(max_tokens=30))[0]
    words_out = full.text.split(" ")
    cut = len(" ".join(words_out[:6]))          # from the end of word 6 into word 7
    stop = full.text[cut - 1: cut + 4]
    first = full.text.index(stop)
    out = llm.generate(prompt, SamplingParams(max_tokens=30, stop=stop))[0]
    assert out.text == full.text[:first] and out.stop_reason == stop
    assert tok.decode(out.token_ids).startswith(out.text + stop[: 1])
    assert out.token_ids == full.token_ids[:len(out.token_ids)]


def _byte_tokenizer(tmp_path):
    return save_byte_tokenizer(tmp_path)


def _stream(tok, ids, stop=()):
    """Feed `ids` one token at a time until a stop string ends it; the detokenizer and every
    delta it gave (the last after finish())."""
    detok = IncrementalDetokenizer(tok, stop=stop)
    deltas = []
    for i in ids:
        stopped = detok.add(i)
        deltas.append(detok.take_delta())
        if stopped:
            break
    detok.finish()
    deltas.append(detok.take_delta())
    return detok, deltas


@pytest.mark.parametrize("text", ["plain ascii", "café 世界 🙂 naïve", "日本語のテキスト🙂🙂"])
def test_incremental_detokenization_never_splits_characters(tmp_path, text):
    tok = _byte_tokenizer(tmp_path)
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text) or text.isascii()   # multi-byte characters span tokens
    detok, deltas = _stream(tok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text == detok.text == tok.decode(ids)


def test_byte_fallback_tokens_decode_incrementally():
    """SentencePiece-style byte fallback (<0xE4> tokens) and a leading-space marker."""
    from tokenizers import Tokenizer, decoders
    from tokenizers import models as tok_models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "▁a": 257, "b": 258,
             "▁": 259}
    sp = Tokenizer(tok_models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    sp.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                    decoders.Fuse()])
    tok = PreTrainedTokenizerFast(tokenizer_object=sp, unk_token="<unk>")
    ids = [257, 258, 259] + [1 + b for b in "世🙂".encode()] + [257]
    detok, deltas = _stream(tok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == " ab 世🙂 a"


def test_stop_string_holds_back_streamed_text(tmp_path):
    tok = _byte_tokenizer(tmp_path)
    ids = tok.encode("one\ntwo\n\nthree", add_special_tokens=False)
    detok, deltas = _stream(tok, ids, stop=("\n\n",))
    assert "".join(deltas[:4]) == "one"   # the "\n" after "one" waits: it may start the stop
    assert "".join(deltas) == "one\ntwo" == detok.text and detok.stop_reason == "\n\n"


def test_a_failing_request_is_isolated(llm, reference, monkeypatch):
    engine = llm.engine
    monkeypatch.setattr(engine, "isolate_errors", True)
    original = llm.worker.step
    bad = [3, 3, 3]

    def step(requests, *args, **kw):
        if any(r.prompt_ids == bad for r in requests):
            raise RuntimeError("injected fault")
        return original(requests, *args, **kw)

    llm.worker.step = step
    try:
        ids = [engine.add_request(p, SamplingParams(max_tokens=48)) for p in PROMPTS[:2]]
        bad_id = engine.add_request(bad, SamplingParams(max_tokens=48))
        outs = _run(engine)
    finally:
        del llm.worker.step
    failed = outs[bad_id][-1]
    assert failed.finish_reason == "error" and "injected fault" in failed.output.error
    assert [outs[i][-1].output.token_ids for i in ids] == reference[:2]
    assert llm.allocator.num_free == llm.allocator.num_blocks
    # without isolation (generate) the error propagates and no block leaks
    monkeypatch.setattr(engine, "isolate_errors", False)
    llm.worker.step = step
    try:
        with pytest.raises(RuntimeError, match="injected fault"):
            llm.generate([PROMPTS[0], bad], SamplingParams(max_tokens=8))
    finally:
        del llm.worker.step
    assert llm.allocator.num_free == llm.allocator.num_blocks


def test_stop_strings_need_a_tokenizer(models):
    llm = LLM(models[0], dtype="float32")
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.generate(PROMPTS[0], SamplingParams(stop="x"))
    with pytest.raises(ValueError, match="stop must be"):
        SamplingParams(stop=[""])


def test_a_request_whose_commit_fails_is_isolated(llm, reference, monkeypatch):
    """Committing tokens (detokenizer, stop strings, on_tokens) fails one request, not all."""

    def on_tokens(new):
        raise RuntimeError("commit fault")

    engine = llm.engine
    monkeypatch.setattr(engine, "isolate_errors", True)
    ids = [engine.add_request(p, SamplingParams(max_tokens=48), detokenize=True,
                              on_tokens=on_tokens if i == 1 else None)
           for i, p in enumerate(PROMPTS[:3])]
    outs = _run(engine)
    failed = outs[ids[1]][-1]
    assert failed.finish_reason == "error" and "commit fault" in failed.output.error
    assert [outs[i][-1].output.token_ids for i in (ids[0], ids[2])] == \
        [reference[0], reference[2]]
    assert llm.allocator.num_free == llm.allocator.num_blocks


def test_10000_requests_leave_the_engine_s_memory_flat(models):
    """Finished requests leave running totals behind, not per-request records."""
    engine = serving_engine(models[0], dtype="float32", max_num_seqs=16,
                            tokenizer=CharTokenizer())
    params = SamplingParams(max_tokens=1, stop=("zz",))

    def serve(n):
        for i in range(n):
            engine.add_request(PROMPTS[i % len(PROMPTS)], params, detokenize=True)
            if engine.num_waiting >= 64:
                while engine.has_unfinished():
                    engine.step()
        while engine.has_unfinished():
            engine.step()

    serve(1000)   # warm: every cache and lazily built table exists
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        serve(9000)
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
    assert engine.metrics()["requests"] == 10000
    assert grown < 100_000, [str(s) for s in after.compare_to(before, "lineno")[:5]]

