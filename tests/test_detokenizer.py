"""IncrementalDetokenizer and `decode` (dflash/engine/detokenizer.py) against real, locally built
`transformers` tokenizers: the streamed text is the decode without `clean_up_tokenization_spaces`
(whatever the tokenizer's config says), and stop strings are found as a per-token search of every
string would find them."""

from __future__ import annotations

import json
import random

import pytest

from dflash.engine.detokenizer import IncrementalDetokenizer, decode

from helpers import CharTokenizer

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

ASCII = ["x = 'string' , isn't it ? don't . I'm here , you're there ; it's fine ! we've 'quoted' "
         "words . print('string' , 'b') ; I'm sure you're right , aren't you ?"]
UNICODE = ["héllo wörld 你好 🙂 🚀 naïve café — ünïcödé ✓ , 'naïve' !"]
TEXTS = ["x = 'string' , isn't it ? don't .",
         "print('string' , 'b') ; I'm sure you're right , aren't you ?",
         "héllo 🙂 wörld 你好 , 'naïve' café 🚀 !"]
# transformers 5.x ignores clean_up_tokenization_spaces for BPE models unless forced; 4.x applied
# it (Llama-3's tokenizer ships with it on): force it, so the tokenizers behave as those did.
FORCE_BPE_CLEANUP = {
    "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output": True}
# Pieces of the SentencePiece-like vocabularies: "▁," and "▁'" are what the cleanup rewrites.
PIECES = ["▁x", "▁=", "▁'", "string", "'", "▁,", "▁isn", "'t", "▁it", "▁?", "▁don", "▁.", "▁I",
          "'m", "▁you", "'re", "▁'b'", "▁sure", "▁right", "▁aren", "print(", "▁;", "▁!", "▁héllo",
          "▁wörld", "▁🙂", "▁你好", "'naïve'", "▁café", "▁🚀"]


def _fast(tok, **kw):
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok,
                                                clean_up_tokenization_spaces=True, **kw)


def byte_level_bpe():
    """GPT-2 / Llama-3 / Qwen style: byte-level BPE trained on the corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator((ASCII + UNICODE) * 20, trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"], show_progress=False))
    return _fast(tok, eos_token="<|endoftext|>", **FORCE_BPE_CLEANUP)


def metaspace_unigram():
    """SentencePiece-like: a Unigram model with the ▁ marker (Metaspace pre-tokenizer/decoder)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = sorted(set("".join(ASCII + UNICODE + TEXTS).replace(" ", "")) | {"▁"})
    vocab = [("<unk>", 0.0), ("</s>", 0.0)] + [(p, -1.0) for p in PIECES] \
        + [(c, -10.0) for c in chars if c not in PIECES]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return _fast(tok, unk_token="<unk>", eos_token="</s>")


def byte_fallback():
    """Llama-2 / Mistral style: ASCII pieces, every other character as <0xNN> byte tokens, the
    decoder chain Replace(▁) + ByteFallback + Fuse + Strip(one leading space)."""
    from tokenizers import Tokenizer, models, normalizers

    chars = sorted(set("".join(ASCII + TEXTS)) - {" "} | {"▁"})
    chars = [c for c in chars if c.isascii() or c == "▁"]
    vocab = [("<unk>", 0.0), ("</s>", 0.0)] + [(f"<0x{b:02X}>", -20.0) for b in range(256)] \
        + [(p, -1.0) for p in PIECES if p.strip("▁").isascii()] \
        + [(c, -10.0) for c in chars if c not in PIECES]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    spec = json.loads(tok.to_str())
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    return _fast(Tokenizer.from_str(json.dumps(spec)), unk_token="<unk>", eos_token="</s>",
                 **FORCE_BPE_CLEANUP)


def wordpiece():
    """BERT style: WordPiece with ## continuations; its decoder has a cleanup of its own."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=False)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator((ASCII + UNICODE + TEXTS) * 20, trainers.WordPieceTrainer(
        vocab_size=200, special_tokens=["[UNK]", "[SEP]"], show_progress=False))
    return _fast(tok, unk_token="[UNK]", eos_token="[SEP]")


KINDS = {"byte-level-bpe": byte_level_bpe, "metaspace-unigram": metaspace_unigram,
         "byte-fallback": byte_fallback, "wordpiece": wordpiece}


@pytest.fixture(scope="module")
def toks():
    return {kind: make() for kind, make in KINDS.items()}


def _stream(tok, ids, stop=()):
    """Feed `ids` one at a time (as the engine does) until a stop string ends the request; the
    detokenizer, every delta (the last after finish()) and the index of the stopping token."""
    detok = IncrementalDetokenizer(tok, stop=stop)
    deltas, stopped_at = [], None
    for k, i in enumerate(ids):
        if detok.add(i):
            stopped_at = k
        deltas.append(detok.take_delta())
        if stopped_at is not None:
            break
    detok.finish()
    deltas.append(detok.take_delta())
    return detok, deltas, stopped_at


# ------------------------------------------------------------------ text = decode without cleanup

@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("kind", KINDS)
def test_streamed_text_is_the_decode_without_cleanup(toks, kind, text):
    tok = toks[kind]
    ids = tok.encode(text, add_special_tokens=False)
    full = decode(tok, ids)
    assert full == tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    if " ," in full:
        assert tok.decode(ids) != full   # the tokenizer's config asks for the cleanup
    detok, deltas, _ = _stream(tok, ids)
    assert "".join(deltas) == detok.text == full
    assert all("\ufffd" not in d for d in deltas)   # no character streamed half-decoded
    if kind != "wordpiece":   # BERT's pre-tokenizer splits punctuation: "' string '"
        assert full == text   # the model's text, spaces before punctuation included
        if "'string'" in text:
            assert "'string'" in "".join(deltas)   # not 'tring'


@pytest.mark.parametrize("kind", ["byte-level-bpe", "metaspace-unigram", "wordpiece"])
def test_any_token_sequence_streams_as_its_decode(toks, kind):
    """Random ids (special tokens, partial and invalid UTF-8 included)."""
    tok, rng = toks[kind], random.Random(kind)
    for _ in range(150):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 30))]
        detok, deltas, _ = _stream(tok, ids)
        assert "".join(deltas) == detok.text == decode(tok, ids), ids


class CountingTokenizer:
    """A tokenizer that counts the ids it is asked to decode."""

    def __init__(self, tok):
        self.tok, self.decoded = tok, 0

    def decode(self, ids, **kw):
        self.decoded += len(ids)
        return self.tok.decode(ids, **kw)


def _byte_tokens(tok, values) -> list[int]:
    """Ids of the byte-level tokens of single bytes `values` (GPT-2's byte-to-character map:
    printable Latin-1 bytes stand for themselves, the others for 256 + their rank)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    char = {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(others)}
    vocab = tok.get_vocab()
    return [vocab[char[b]] for b in values]


@pytest.mark.parametrize("run", ["stray bytes", "special tokens"])
def test_a_long_run_without_a_character_costs_linear_decoding(toks, run):
    """Text that completes no character for thousands of tokens (stray UTF-8 bytes, or special
    tokens that decode to nothing) is decoded in windows of bounded length: the ids decoded
    grow linearly with the output (they grew quadratically: 4000 stray bytes took 2 s), and
    the text is still the full decode."""
    tok = toks["byte-level-bpe"]
    rng = random.Random(run)
    filler = _byte_tokens(tok, range(0x80, 0xC0)) if run == "stray bytes" \
        else [tok.eos_token_id]
    word = tok.encode(" word", add_special_tokens=False)
    ids = word + [rng.choice(filler) for _ in range(3000)] + word
    counting = CountingTokenizer(tok)
    detok, deltas, _ = _stream(counting, ids)
    assert "".join(deltas) == detok.text == decode(tok, ids)
    assert counting.decoded < 40 * len(ids)


def test_long_runs_of_bytes_stream_as_their_decode(toks):
    """Long random runs of single-byte tokens (whole characters, stray bytes, cut sequences)
    between words and special tokens: the streamed text is the decode."""
    tok, rng = toks["byte-level-bpe"], random.Random(2)
    byte_ids = _byte_tokens(tok, range(0x80, 0x100))
    words = [i for p, i in tok.get_vocab().items() if p.isalpha()]
    whole = [tok.encode(c, add_special_tokens=False) for c in "é你🙂✓"]
    for _ in range(40):
        ids = []
        for _ in range(rng.randrange(1, 6)):
            for _ in range(rng.randrange(0, 40)):
                ids += rng.choice(whole) if rng.random() < 0.2 else [rng.choice(byte_ids)]
            ids += [rng.choice(words)] + [tok.eos_token_id] * rng.randrange(0, 12)
        detok, deltas, _ = _stream(tok, ids)
        assert "".join(deltas) == detok.text == decode(tok, ids), ids


def test_byte_fallback_streams_valid_utf8_as_its_decode(toks):
    """Byte-fallback pieces mixed with the byte tokens of whole characters (a run that is not
    valid UTF-8 is the documented corner, not tested)."""
    tok, rng = toks["byte-fallback"], random.Random(1)
    vocab = tok.get_vocab()
    pieces = [i for p, i in vocab.items() if not p.startswith("<")]
    chars = "é你好🙂🚀✓—ü"
    for _ in range(150):
        ids = []
        for _ in range(rng.randrange(1, 20)):
            if rng.random() < 0.4:
                ids += [vocab[f"<0x{b:02X}>"] for b in rng.choice(chars).encode()]
            else:
                ids.append(rng.choice(pieces))
        detok, deltas, _ = _stream(tok, ids)
        assert "".join(deltas) == detok.text == decode(tok, ids), ids


def test_decode_skips_special_tokens_unless_asked(toks):
    tok = toks["byte-level-bpe"]
    ids = tok.encode("x = 'string' ,", add_special_tokens=False) + [tok.eos_token_id]
    assert decode(tok, ids) == "x = 'string' ,"
    assert decode(tok, ids, skip_special_tokens=False) == "x = 'string' ,<|endoftext|>"
    detok, deltas, _ = _stream(tok, ids)
    assert "".join(deltas) == "x = 'string' ,"


def test_the_test_stand_in_tokenizer_streams_its_decode():
    char = CharTokenizer()
    ids = char.encode("abc")
    assert decode(char, ids) == char.decode(ids)
    assert "".join(_stream(char, ids)[1]) == char.decode(ids)


# ------------------------------------------------------------------ stop strings

LONG = ("x = 'string' , isn't it ? don't . I'm here , you're there ; it's fine ! we've 'quoted' "
        "words . héllo wörld 你好 🙂 🚀 naïve café — ünïcödé ✓ . print('string' , 'b') ; I'm "
        "sure you're right , aren't you ? ") * 3


def _reference(tok, ids, stop):
    """What searching every stop string after every token finds: the first token whose text
    (the decode of the ids so far, once it ends in a whole character) holds one, and there the
    match that starts first (ties: the smallest string); the text is cut before it."""
    for k in range(1, len(ids) + 1):
        text = decode(tok, ids[:k])
        if text.endswith("\ufffd"):
            continue
        found = [(text.find(s), s) for s in stop if s in text]
        if found:
            index, s = min(found)
            return k - 1, text[:index], s
    return None, decode(tok, ids), None


@pytest.mark.parametrize("seed", range(6))
def test_many_stop_strings_match_the_per_string_search(toks, seed):
    """Up to 64 stop strings, some in the text (across token boundaries), some absent."""
    tok, rng = toks["byte-level-bpe"], random.Random(seed)
    ids = tok.encode(LONG, add_special_tokens=False)
    text = decode(tok, ids)
    bounds = {len(decode(tok, ids[:k])) for k in range(len(ids) + 1)}
    spanning = 0
    for trial in range(25):
        stop = [f"absent-{seed}-{trial}-{j}" for j in range(rng.randrange(0, 40))]
        while len(stop) < 64:
            start = rng.randrange(len(text) // 4, len(text) - 12)
            stop.append(text[start:start + rng.randrange(1, 12)])
        rng.shuffle(stop)
        detok, deltas, stopped_at = _stream(tok, ids, tuple(stop))
        want_at, want_text, want_reason = _reference(tok, ids, stop)
        assert (stopped_at, detok.text, detok.stop_reason) == (want_at, want_text, want_reason)
        assert "".join(deltas) == detok.text
        assert detok.text + detok.stop_reason == text[:len(detok.text) + len(detok.stop_reason)]
        spanning += any(len(detok.text) < b < len(detok.text) + len(detok.stop_reason)
                        for b in bounds)
    assert spanning   # the matches tested include ones that span token boundaries


def test_absent_stop_strings_do_not_stop(toks):
    tok = toks["byte-level-bpe"]
    ids = tok.encode(LONG, add_special_tokens=False)
    stop = tuple(f"stop {j} 🙃" for j in range(60)) + (".*", "a|b", "\\d", "(?:")  # regex syntax
    detok, deltas, stopped_at = _stream(tok, ids, stop)
    assert stopped_at is None and detok.stop_reason is None
    assert "".join(deltas) == detok.text == decode(tok, ids)
    # the same strings, one of them now in the text, do stop it
    ids2 = tok.encode(LONG[:40] + "a|b" + LONG[40:], add_special_tokens=False)
    detok, deltas, stopped_at = _stream(tok, ids2, stop)
    assert detok.stop_reason == "a|b" and "".join(deltas) == detok.text == LONG[:40]


class PieceTokenizer:
    """One fixed string per id, so a test chooses where token boundaries fall."""

    def __init__(self, pieces):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(self.pieces[i] for i in ids)


@pytest.mark.parametrize("pieces, stop, stopped_at, text, reason", [
    # one token completes two matches: the one that starts first wins
    (["xx", "abcdefg"], ("cde", "bcd", "zz"), 1, "xxa", "bcd"),
    # two matches start at the same character: the smaller string wins
    (["x", "abcd"], ("abc", "ab"), 1, "x", "ab"),
    # a match that completes at an earlier token wins over one that starts earlier
    (["ab", "c", "def"], ("abcdef", "c"), 1, "ab", "c"),
    # a match across four tokens, completed by the last
    (["no", " s", "t", "o", "p!", "more"], ("stop",), 4, "no ", "stop"),
    # a match starting inside a token, and at the very first character
    (["xsto", "p"], ("stop",), 1, "x", "stop"),
    (["st", "op"], ("stop", "zzz"), 1, "", "stop"),
    # regular-expression syntax is matched literally
    (["1", "2", ".", "*"], ("\\d", "2.*", "a|b"), 3, "1", "2.*"),
    (["a", "b", "c"], ("a|b", "[abc]", "."), None, "abc", None),
])
def test_stop_string_order(pieces, stop, stopped_at, text, reason):
    tok = PieceTokenizer(pieces)
    ids = list(range(len(pieces)))
    assert _reference(tok, ids, stop) == (stopped_at, text, reason)
    detok, deltas, at = _stream(tok, ids, stop)
    assert (at, detok.text, detok.stop_reason) == (stopped_at, text, reason)
    assert "".join(deltas) == text


def test_held_back_text_and_no_tokens_after_a_stop():
    tok = PieceTokenizer(["one", "\n", "two", "\n", "\n", "three"])
    detok = IncrementalDetokenizer(tok, stop=("\n\n", "zz"))
    deltas = []
    for i in range(4):
        assert not detok.add(i)
        deltas.append(detok.take_delta())
    assert deltas == ["on", "e", "\ntw", "o"]   # the last character may start a match
    assert detok.add(4) and detok.stop_reason == "\n\n" and detok.finished
    assert detok.take_delta() == "" and detok.text == "one\ntwo"
    with pytest.raises(RuntimeError):
        detok.add(5)


@pytest.mark.parametrize("then_eos", [False, True])
def test_a_stop_string_found_when_the_text_is_flushed_ends_the_request_as_a_stop(then_eos):
    """SmolLM2's token 46673 is a space and the first two bytes of 'お': its text waits for the
    third byte, so a stop string " " is found only when the request's end flushes it. The
    request then reports that stop (it kept "length", or the EOS id, as its reason)."""
    from dflash import SamplingParams, assets
    from dflash.engine.request import Request
    from dflash.models import load_tokenizer

    tok = load_tokenizer(assets.smollm2_target())
    (space_and_bytes,) = tok.encode(" お", add_special_tokens=False)[:1]
    assert decode(tok, [space_and_bytes]) == " \ufffd"
    params = SamplingParams(max_tokens=2 if then_eos else 1, stop=[" "])
    request = Request(0, [1, 2], params, 0, frozenset({tok.eos_token_id}),
                      IncrementalDetokenizer(tok, params.stop))
    request.append([space_and_bytes] + ([tok.eos_token_id] if then_eos else []))
    assert (request.detok.text, request.finish_reason, request.stop_reason) == ("", "stop", " ")
