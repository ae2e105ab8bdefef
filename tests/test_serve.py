"""`dflash serve` against live servers on 127.0.0.1 (free ports), driven by the real `openai`
client and httpx: outputs equal `LLM.generate`, streaming, usage, stop strings, load, faults,
bad input, shutdown. Tiny random checkpoints (float32) with a byte-level BPE tokenizer, except
the one slow test on the bundled pair."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from dflash import LLM, SamplingParams  # noqa: E402
from dflash.engine.cost_model import CostModel  # noqa: E402
from dflash.engine.speculation import Planner  # noqa: E402
from dflash.serve import Server  # noqa: E402

from helpers import (  # noqa: E402
    make_tiny_draft,
    make_tiny_target,
    save_byte_tokenizer,
    serving_engine,
)

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
NAME = "tiny"
B = 8
MAGIC = [201, 202, 203, 204, 205]   # prompt ids the fault test makes the engine raise on


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    tok = save_byte_tokenizer(root / "target")
    make_tiny_target(root / "target", "qwen3", vocab_size=len(tok))
    make_tiny_draft(root / "draft", root / "target", block_size=B)
    return root / "target", root / "draft"


@pytest.fixture(scope="module")
def offline(pair):
    """Target-only greedy decoding in float32: DFlash greedy output equals it token for token."""
    return LLM(pair[0], dtype="float32", max_num_seqs=16)


@pytest.fixture(scope="module")
def server(pair):
    llm = serving_engine(*pair, dtype="float32", max_num_seqs=8)   # adaptive verify lengths
    with Server(llm, NAME, port=0, api_key=KEY) as s:
        yield s


def _client(server, **kw):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, **kw)


def _scrape(server) -> dict:
    """{(name, ((label, value), ...)): value} of /metrics, model_name label dropped."""
    text = httpx.get(server.url + "/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def _metric(samples, name, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def _wait_idle(server, timeout=10.0):
    llm = server.state.llm
    deadline = time.time() + timeout
    while time.time() < deadline:
        if llm.allocator.num_free == llm.allocator.num_blocks and \
                not server.state.engine.engine.has_unfinished():
            return
        time.sleep(0.02)
    raise AssertionError("the engine did not go idle")


def _pick_stop(text: str) -> str:
    """Two characters of `text` (no replacement character) that first occur after its start."""
    for i in range(3, len(text) - 2):
        s = text[i:i + 2]
        if "\ufffd" not in s and text.index(s) >= 2:
            return s
    raise AssertionError(f"no stop string to pick in {text!r}")


# ---------------------------------------------------------------------------- correctness

PROMPTS = ["the quick brown fox", "café 世界 🙂", "hello there, how are", "a"]


def test_completions_equal_generate_streamed_and_not(server, offline):
    client = _client(server)
    for prompt in PROMPTS:
        want = offline.generate(prompt, SamplingParams(max_tokens=24))[0]
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0)
        assert r.choices[0].text == want.text
        assert r.choices[0].finish_reason == want.finish_reason
        assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == \
            (len(want.prompt_token_ids), len(want.token_ids),
             len(want.prompt_token_ids) + len(want.token_ids))
        spec = r.model_extra["speculative_decoding"]
        assert spec["num_draft_tokens"] >= spec["num_accepted_tokens"] >= 0
        chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=24,
                                                temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices and
                c.choices[0].finish_reason] == [want.finish_reason]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
            len(want.token_ids)
    # token-id prompts too
    ids = offline.encode(PROMPTS[0])
    r = client.completions.create(model=NAME, prompt=ids, max_tokens=5, temperature=0)
    assert r.choices[0].text == offline.generate(ids, SamplingParams(max_tokens=5))[0].text


def test_chat_equals_generate_with_template_kwargs(server, offline):
    client = _client(server)
    tok = offline.tokenizer
    for message, kwargs in [("What is 2 + 2?", None), ("Name a colour.", {"enable_thinking":
                                                                          False})]:
        prompt = tok.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                         add_generation_prompt=True, **(kwargs or {}))
        want = offline.generate(prompt, SamplingParams(max_tokens=20))[0]
        extra = {"chat_template_kwargs": kwargs} if kwargs else None
        r = client.chat.completions.create(model=NAME, messages=[{"role": "user",
                                                                  "content": message}],
                                           max_tokens=20, temperature=0, extra_body=extra)
        assert r.choices[0].message.content == want.text
        assert r.choices[0].message.role == "assistant"
        assert r.usage.prompt_tokens == len(want.prompt_token_ids)
        assert r.usage.completion_tokens == len(want.token_ids)
        stream = client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": message}], max_tokens=20,
            temperature=0, stream=True, extra_body=extra)
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
        assert chunks[-1].choices[0].finish_reason == want.finish_reason


def test_sse_wire_format_ends_with_done(server):
    with httpx.stream("POST", server.url + "/v1/completions", headers=AUTH, timeout=60,
                      json={"model": NAME, "prompt": "hi", "max_tokens": 6, "temperature": 0,
                            "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][len("data: "):])
    assert last["choices"] == [] and last["usage"]["completion_tokens"] >= 1
    assert all(json.loads(line[6:])["usage"] is None for line in lines[:-2])


def test_stop_strings(server, offline):
    client = _client(server)
    prompt = PROMPTS[0]
    full = offline.generate(prompt, SamplingParams(max_tokens=40, ignore_eos=True))[0].text
    stop = _pick_stop(full)
    want = full[:full.index(stop)]
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=40, temperature=0,
                                  stop=[stop, "\x00never"], extra_body={"ignore_eos": True})
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop
    chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=40,
                                            temperature=0, stop=stop, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == want


def test_models_health_version_metrics(server):
    models = _client(server).models.list()
    assert [m.id for m in models.data] == [NAME]
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]
    samples = _scrape(server)
    for name in ["vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total", "vllm:num_requests_running",
                 "vllm:num_requests_waiting", "vllm:generation_tokens_total",
                 "vllm:prompt_tokens_total", "vllm:time_to_first_token_seconds_count",
                 "vllm:time_per_output_token_seconds_count", "vllm:kv_cache_usage_perc"]:
        assert any(key[0] == name for key in samples), name
    assert any(key[0] == "vllm:spec_decode_num_accepted_tokens_per_pos_total" and
               key[1] == (("position", "0"),) for key in samples)


def test_speculative_figures_in_the_response_and_metrics(server, offline):
    """A draft that proposes the target's own continuation: the accepted tokens show in the
    response's speculative_decoding field and, by position, in /metrics."""
    import torch

    llm = server.state.llm
    prompt = "drafts that are right"
    ids = offline.encode(prompt)
    ref = offline.generate(prompt, SamplingParams(max_tokens=40 + B, ignore_eos=True))[0]

    def proposer(inputs):
        rows = []
        for r in inputs.requests:
            n = len(r.output_ids)
            known = ref.token_ids + [0] * B if r.prompt_ids == ids else [0] * (n + B)
            rows.append(known[n:n + inputs.block_size - 1])
        return torch.tensor(rows), None

    _wait_idle(server)
    before = _scrape(server)
    planner, llm.planner, llm.worker.proposer = llm.planner, None, proposer   # full blocks
    try:
        r = _client(server).completions.create(model=NAME, prompt=prompt, max_tokens=40,
                                               temperature=0, extra_body={"ignore_eos": True})
    finally:
        llm.planner, llm.worker.proposer = planner, None
    assert r.choices[0].text == offline.tokenizer.decode(ref.token_ids[:40])
    spec = r.model_extra["speculative_decoding"]
    assert spec["num_accepted_tokens"] > 20 and spec["mean_acceptance_length"] > 3
    after = _scrape(server)

    def delta(name, **labels):
        return _metric(after, name, **labels) - _metric(before, name, **labels)

    assert delta("vllm:spec_decode_num_drafts_total") == spec["num_drafts"]
    assert delta("vllm:spec_decode_num_draft_tokens_total") == spec["num_draft_tokens"]
    assert delta("vllm:spec_decode_num_accepted_tokens_total") == spec["num_accepted_tokens"]
    assert [delta("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
            for i in range(B - 1)] == spec["accepted_per_position"]
    assert delta("vllm:generation_tokens_total") == 40
    assert delta("vllm:prompt_tokens_total") == len(ids)


# ----------------------------------------------------------------------------------- load

def _load_cases(offline):
    cases = []
    for i in range(64):
        text = f"request {i}: " + "the cat sat " * (i % 9)
        kw = {"max_tokens": 4 + (i * 7) % 45}
        if i % 3 == 0:
            kw.update(temperature=0.8, top_p=0.9, top_k=20, seed=i)
        elif i % 3 == 1:
            kw.update(temperature=0.0, top_p=0.5)   # greedy whatever top_p says
        else:
            kw.update(temperature=0.0)
        chat = i % 4 == 1
        prompt = offline.chat_prompt(text) if chat else text
        cases.append((i, chat, text, prompt, kw))
    return cases


def test_load_64_requests_from_16_streaming_clients(server, offline):
    cases = _load_cases(offline)
    greedy = [c for c in cases if c[4]["temperature"] == 0]
    expected = offline.generate([c[3] for c in greedy],
                                [SamplingParams(max_tokens=c[4]["max_tokens"]) for c in greedy])
    expected = {c[0]: e for c, e in zip(greedy, expected)}

    async def main():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0,
                                    timeout=120)
        todo = list(cases)
        results = {}

        async def one_client():
            while todo:
                i, chat, text, _, kw = todo.pop(0)
                common = dict(model=NAME, stream=True, stream_options={"include_usage": True},
                              **{k: v for k, v in kw.items() if k != "top_k"},
                              extra_body={"top_k": kw["top_k"]} if "top_k" in kw else None)
                if chat:
                    stream = await client.chat.completions.create(
                        messages=[{"role": "user", "content": text}], **common)
                else:
                    stream = await client.completions.create(prompt=text, **common)
                out, usage = "", None
                async for chunk in stream:
                    if chunk.choices:
                        out += (chunk.choices[0].delta.content or "") if chat else \
                            chunk.choices[0].text
                    if chunk.usage:
                        usage = chunk.usage
                results[i] = (out, usage)

        await asyncio.gather(*[one_client() for _ in range(16)])
        await client.close()
        return results

    start = time.time()
    results = asyncio.run(main())
    elapsed = time.time() - start
    assert sorted(results) == list(range(64))
    for i, *_, kw in cases:
        out, usage = results[i]
        assert 1 <= usage.completion_tokens <= kw["max_tokens"]
        if i in expected:
            assert out == expected[i].text, i
            assert usage.completion_tokens == len(expected[i].token_ids)
            assert usage.prompt_tokens == len(expected[i].prompt_token_ids)
    _wait_idle(server)
    samples = _scrape(server)
    assert _metric(samples, "vllm:num_requests_running") == 0
    assert _metric(samples, "vllm:num_requests_waiting") == 0
    assert _metric(samples, "vllm:kv_cache_usage_perc") == 0
    assert _metric(samples, "dflash:kv_cache_free_blocks") == \
        _metric(samples, "dflash:kv_cache_total_blocks")
    assert server.state.in_flight == 0
    print(f"64 requests from 16 streaming clients in {elapsed:.1f} s")


def test_tree_steps_are_in_the_metrics(pair, offline):
    """Where verify rows cost nothing the engine verifies trees; /metrics shows how many nodes
    its request-steps verified and how deep they accepted, how many draft nodes it verified and
    accepted by the draft's confidence in them, how many nodes only the prompt lookup proposed,
    and the text is the target's own."""
    llm = serving_engine(*pair, dtype="float32", max_num_seqs=2, speculation="adaptive")
    flat = CostModel({1: 1e-3, 64: 1e-3}, {1: 1e-4, 8: 1e-4}, B, {1: 1e-3, 8: 1e-3})
    llm.planner = Planner(B - 1, flat)
    with Server(llm, NAME, port=0) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        r = client.completions.create(model=NAME, prompt="trees of drafts", max_tokens=24,
                                      temperature=0, extra_body={"ignore_eos": True})
        ref = offline.generate("trees of drafts", SamplingParams(max_tokens=24, ignore_eos=True))
        assert r.choices[0].text == ref[0].text
        _wait_idle(s)
        samples = _scrape(s)
    stats = llm.stats
    assert stats.tree_steps > 0
    assert _metric(samples, "dflash:spec_decode_tree_steps") == stats.tree_steps
    for k, n in stats.tree_nodes.items():
        assert _metric(samples, "dflash:spec_decode_tree_request_steps", nodes=str(k)) == n
    for k, n in stats.tree_depths.items():
        assert _metric(samples, "dflash:spec_decode_tree_accepted_depth", depth=str(k)) == n
    confidence = stats.summary()["tree_confidence"]
    for kind in ("verified", "accepted"):
        scraped = [_metric(samples, f"dflash:spec_decode_tree_{kind}_nodes", confidence=str(u))
                   for u in confidence["bin_upper"]]
        assert scraped == confidence[kind]
    lookup = stats.summary()["tree_lookup_nodes"]
    for kind in ("verified", "accepted"):
        assert _metric(samples, "dflash:spec_decode_tree_lookup_nodes", kind=kind) == lookup[kind]
    assert sum(confidence["verified"]) + lookup["verified"] == \
        sum(k * n for k, n in stats.tree_nodes.items()) > 0


# --------------------------------------------------------------------------------- faults

def test_clients_that_disconnect_mid_stream_are_aborted(server, offline):
    engine = server.state.engine
    aborted_before = len(engine.aborts)
    stay = [f"stay {i}" for i in range(4)]
    expected = [o.text for o in offline.generate(stay, SamplingParams(max_tokens=30))]

    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as client:
            async def quitter(i):
                body = {"model": NAME, "prompt": f"quit {i}", "max_tokens": 400,
                        "temperature": 0, "ignore_eos": True, "stream": True}
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    seen = 0
                    async for line in r.aiter_lines():
                        seen += line.startswith("data: ")
                        if seen >= 3:
                            return seen   # leaving the block closes the connection

            async def stayer(prompt):
                r = await client.post("/v1/completions", json={
                    "model": NAME, "prompt": prompt, "max_tokens": 30, "temperature": 0})
                return r.json()["choices"][0]["text"]

            return await asyncio.gather(*[quitter(i) for i in range(8)],
                                        *[stayer(p) for p in stay])

    results = asyncio.run(main())
    assert results[8:] == expected
    deadline = time.time() + 10
    while len(engine.aborts) < aborted_before + 8 and time.time() < deadline:
        time.sleep(0.02)
    aborts = list(engine.aborts)[aborted_before:]
    assert len(aborts) == 8
    assert all(freed - requested <= 1 for requested, freed in aborts)   # within one step
    _wait_idle(server)
    assert _metric(_scrape(server), "vllm:request_success_total", finished_reason="abort") >= 8
    assert server.state.in_flight == 0


def test_an_engine_error_fails_that_request_with_500_and_serving_goes_on(server, offline):
    llm = server.state.llm

    def failing(original):   # a worker stage that fails any batch holding a MAGIC request
        def stage(requests, *args, **kw):
            if any(r.prompt_ids[:len(MAGIC)] == MAGIC for r in requests):
                raise RuntimeError("injected fault")
            return original(requests, *args, **kw)
        return stage

    client = _client(server)
    want = offline.generate("still fine", SamplingParams(max_tokens=30))[0].text
    results = {}

    def good():
        results["good"] = "".join(c.choices[0].text for c in client.completions.create(
            model=NAME, prompt="still fine", max_tokens=30, temperature=0, stream=True))

    llm.worker.step, llm.worker.tree_step = failing(llm.worker.step), \
        failing(llm.worker.tree_step)
    try:
        thread = threading.Thread(target=good)
        thread.start()
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError) as e:
                # ignore_eos: a sampled first token that ends the request would skip the steps
                r = client.completions.create(model=NAME, prompt=MAGIC + [7, 8], max_tokens=30,
                                              stream=stream, extra_body={"ignore_eos": True})
                list(r) if stream else r
            assert e.value.status_code == 500 and "injected fault" in str(e.value)
        thread.join(60)
    finally:
        del llm.worker.step, llm.worker.tree_step
    assert results["good"] == want
    r = client.completions.create(model=NAME, prompt="still fine", max_tokens=30, temperature=0)
    assert r.choices[0].text == want
    _wait_idle(server)


# ------------------------------------------------------------------------------ bad input

def _bad_cases():
    hi = {"model": NAME, "prompt": "hi"}
    chat = {"model": NAME, "messages": [{"role": "user", "content": "hi"}]}
    long = "x " * 600
    c, cc = "/v1/completions", "/v1/chat/completions"
    return [
        (c, b'{"prompt": "hi", ', 400, "JSON"),
        (c, {**hi, "max_tokens": "many"}, 400, "max_tokens"),
        (c, {**hi, "temperature": "hot"}, 400, "temperature"),
        (c, {**hi, "stop": 5}, 400, "stop"),
        (c, {"model": NAME, "max_tokens": 4}, 400, "prompt"),
        (c, {**hi, "model": "gpt-9"}, 404, "gpt-9"),
        (cc, {**chat, "model": "gpt-9"}, 404, "gpt-9"),
        (c, {**hi, "prompt": long}, 400, "max_model_len"),
        (cc, {**chat, "messages": [{"role": "user", "content": long}]}, 400, "max_model_len"),
        (c, {**hi, "max_tokens": 0}, 400, "max_tokens"),
        (cc, {**chat, "max_tokens": -3}, 400, "max_tokens"),
        (c, {**hi, "temperature": -1}, 400, "temperature"),
        (c, {**hi, "top_p": 0}, 400, "top_p"),
        (cc, {**chat, "top_p": 1.5}, 400, "top_p"),
        (c, {**hi, "prompt": ""}, 400, "empty"),
        (c, {**hi, "prompt": []}, 400, "empty"),
        (cc, {**chat, "messages": []}, 400, "messages"),
        (c, {**hi, "prompt": [1, 99999]}, 400, "token ids"),
        (c, {**hi, "n": 2}, 400, "n=2"),
        (c, {**hi, "logprobs": 1}, 400, "logprobs"),
        (c, {**hi, "top_k": -5}, 400, "top_k"),
    ]


def test_bad_requests_get_4xx_naming_the_problem_and_disturb_nothing(server, offline):
    want = offline.generate("a long one", SamplingParams(max_tokens=120, ignore_eos=True))[0]
    running = {}

    def long_request():
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as http:
            r = http.post("/v1/completions", json={
                "model": NAME, "prompt": "a long one", "max_tokens": 120, "temperature": 0,
                "ignore_eos": True})
            running["text"] = r.json()["choices"][0]["text"]

    thread = threading.Thread(target=long_request)
    thread.start()
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as http:
        for path, body, status, word in _bad_cases():
            r = http.post(path, content=body, headers={"Content-Type": "application/json"}) \
                if isinstance(body, bytes) else http.post(path, json=body)
            assert r.status_code == status, (body, r.text)
            error = r.json()["error"]
            assert word.lower() in error["message"].lower(), (body, error)
            assert set(error) == {"message", "type", "param", "code"}
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.post(server.url + "/v1/completions", headers=headers,
                           json={"model": NAME, "prompt": "hi"})
            assert r.status_code == 401 and "api key" in r.json()["error"]["message"].lower()
        r = http.get("/v1/nope")
        assert r.status_code == 404 and "/v1/nope" in r.json()["error"]["message"]
        # the openai client surfaces the error object
        with pytest.raises(openai.BadRequestError, match="top_p"):
            _client(server).completions.create(model=NAME, prompt="hi", top_p=7)
        r = http.post("/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    thread.join(120)
    assert running["text"] == want.text
    _wait_idle(server)


def test_a_full_queue_is_503_with_retry_after(pair):
    llm = serving_engine(*pair, dtype="float32", max_num_seqs=1, speculation="fixed")
    with Server(llm, NAME, port=0, max_queue=1) as s:
        texts = []

        def long_request(i):
            r = httpx.post(s.url + "/v1/completions", timeout=120, json={
                "prompt": f"busy {i}", "max_tokens": 150, "temperature": 0, "ignore_eos": True})
            texts.append(r.status_code)

        threads = [threading.Thread(target=long_request, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        deadline = time.time() + 30
        while s.state.in_flight < 2 and time.time() < deadline:
            time.sleep(0.005)
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "one more", "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert "busy" in r.json()["error"]["message"]
        for t in threads:
            t.join(120)
        assert texts == [200, 200]
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "one more", "max_tokens": 2})
        assert r.status_code == 200


# ------------------------------------------------------------------------------- shutdown

def _serve_process(pair, tmp_path, *options, setup: str = ""):
    """`dflash serve` of the tiny pair in a subprocess, after the Python code `setup`:
    (process, its URL, its stderr lines, which a thread keeps reading)."""
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, DFLASH_CACHE=str(tmp_path),
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    main = f"{setup}\nimport sys\nfrom dflash import cli\nsys.exit(cli.main(sys.argv[1:]))"
    proc = subprocess.Popen(
        [sys.executable, "-c", main, "serve", "--target", str(pair[0]), "--draft",
         str(pair[1]), "--dtype", "float32", "--speculation", "fixed", "--port", "0", *options],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env, cwd=tmp_path)
    url, log = None, []
    deadline = time.time() + 120
    while url is None and time.time() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        log.append(line)
        if line.startswith("dflash serve:") and " on http://" in line:
            url = line.split(" on ")[1].split()[0]
    if url is None:
        proc.kill()
        proc.wait()
        pytest.fail("the server did not start: " + "".join(log))
    threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()
    return proc, url, log


def _stream_lines(url, body, started=None) -> list[str]:
    """The status and non-empty lines of a streamed completion (or the transport error),
    releasing `started` at the first."""
    lines = []
    try:
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json=dict(body, stream=True)) as r:
            lines.append(r.status_code)
            for line in r.iter_lines():
                if line:
                    if len(lines) == 1 and started is not None:
                        started.release()
                    lines.append(line)
    except httpx.HTTPError as e:
        lines.append(f"error: {e!r}")
    return lines


def test_sigterm_lets_running_requests_finish_and_exits_0(pair, tmp_path):
    grace = 4.0
    proc, url, log = _serve_process(pair, tmp_path, "--grace-period", str(grace),
                                    "--max-num-seqs", "4")
    try:
        streams = {}
        started = threading.Semaphore(0)

        def stream(i, max_tokens):
            streams[i] = _stream_lines(url, {"prompt": f"in flight {i}", "temperature": 0,
                                             "max_tokens": max_tokens, "ignore_eos": True},
                                       started)

        threads = [threading.Thread(target=stream, args=(i, 60)) for i in range(3)]
        for t in threads:
            t.start()
        for _ in threads:
            assert started.acquire(timeout=60)
        start = time.time()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=grace + 15)
        took = time.time() - start
        for t in threads:
            t.join(10)
        assert code == 0, "".join(log)
        assert took < grace + 5
        for i in range(3):   # they finished within the grace period
            assert streams[i][0] == 200 and streams[i][-1] == "data: [DONE]", streams[i][-3:]
            assert "error" not in streams[i][-2]
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_requests_left_at_the_end_of_the_grace_period_get_503s_and_whole_streams(pair,
                                                                                tmp_path):
    # uvicorn cancelled them at its deadline: a plain-text 500 (no JSON, no Retry-After), a
    # stream cut mid-body without an error or [DONE], and a CancelledError traceback apiece
    proc, url, log = _serve_process(pair, tmp_path, "--grace-period", "0.5",
                                    "--max-num-seqs", "1")
    try:
        body = {"temperature": 0, "max_tokens": 400, "ignore_eos": True}
        results, started = {}, threading.Semaphore(0)

        def plain(i):
            try:
                r = httpx.post(url + "/v1/completions", timeout=60,
                               json=dict(body, prompt=f"plain {i}"))
                results[i] = (r.status_code, r.headers.get("content-type"), r.text)
            except httpx.HTTPError as e:
                results[i] = (None, None, repr(e))

        def stream(i):
            results[i] = _stream_lines(url, dict(body, prompt=f"stream {i}"), started)

        threads = [threading.Thread(target=stream, args=(0,))]
        threads[0].start()
        assert started.acquire(timeout=60)   # the one running request
        threads += [threading.Thread(target=f, args=(i,))
                    for i, f in enumerate([plain, stream, plain], start=1)]
        for t in threads[1:]:
            t.start()
        deadline = time.time() + 30   # the others wait in the queue
        while time.time() < deadline and \
                _metric_text(url, "vllm:num_requests_waiting") < 3:
            time.sleep(0.02)
        assert _metric_text(url, "vllm:num_requests_waiting") == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0, "".join(log)
        for t in threads:
            t.join(30)
        # the running stream ends with an error event; the queued one never started: a 503
        status, *lines = results[0]
        assert status == 200 and lines[-1] == "data: [DONE]", lines[-3:]
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert (error["code"], error["message"]) == (503, "the server is shutting down")
        assert results[2][0] == 503, results[2]
        assert json.loads(results[2][1])["error"]["message"] == "the server is shutting down"
        for i in (1, 3):
            status, kind, text = results[i]
            assert (status, kind) == (503, "application/json"), results[i]
            assert json.loads(text)["error"]["message"] == "the server is shutting down"
        assert "Traceback" not in "".join(log) and "cancelled" not in "".join(log).lower()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_fresh_server_reports_its_whole_cache_free(pair):
    # the gauge was set after the engine thread's first command: 0 free blocks until then
    llm = serving_engine(*pair, dtype="float32", max_num_seqs=2, speculation="fixed")
    with Server(llm, NAME, port=0) as server:
        deadline = time.time() + 10
        while _metric_text(server.url, "dflash:kv_cache_free_blocks") == 0 and \
                time.time() < deadline:
            time.sleep(0.05)
        assert _metric_text(server.url, "dflash:kv_cache_free_blocks") == \
            llm.allocator.num_blocks > 0
        assert _metric_text(server.url, "vllm:kv_cache_usage_perc") == 0


def test_shutdown_does_not_wait_for_a_long_step_past_the_grace_period(pair):
    # the engine thread read its stop only once the step (a long prefill) ended: the server
    # stopped after the step, however long, and that step's request got uvicorn's bare 500
    llm = serving_engine(*pair, dtype="float32", max_num_seqs=2, speculation="fixed")
    server = Server(llm, NAME, port=0, grace_period=0.5).start()
    in_step, release = threading.Event(), threading.Event()
    prefill = llm.worker.prefill

    def slow_prefill(requests, ends=None):   # a prefill that takes until the test releases it
        if any(r.prompt_ids[:len(MAGIC)] == MAGIC for r in requests):
            in_step.set()
            release.wait(60)
        return prefill(requests, ends)

    llm.worker.prefill = slow_prefill
    result = {}

    def request():
        r = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"prompt": MAGIC, "max_tokens": 4})
        result["response"] = (r.status_code, r.json()["error"]["message"])

    thread = threading.Thread(target=request)
    try:
        thread.start()
        assert in_step.wait(30)
        start = time.time()
        server.stop()
        took = time.time() - start
        thread.join(30)
        assert took < 0.5 + 2 * 2.0 + 1.5, took   # grace, then FLUSH for the answers and step
        assert result["response"] == (503, "the server is shutting down")
    finally:
        release.set()
        server.stop()


def test_a_server_stopped_during_a_long_step_exits_0_at_once(pair, tmp_path):
    # it waited for the step to end, then the interpreter's exit under the still running
    # engine thread ended the process with SIGABRT (std::terminate)
    slow = f"""
import time, torch
from dflash.engine.worker import Worker
prefill = Worker.prefill
def slow(self, requests, ends=None):   # a minute of torch ops, as a long prefill would run
    if any(r.prompt_ids[:{len(MAGIC)}] == {MAGIC} for r in requests):
        x, end = torch.ones(256, 256), time.time() + 60
        while time.time() < end:
            x = torch.tanh(x @ x)
    return prefill(self, requests, ends)
Worker.prefill = slow
"""
    proc, url, log = _serve_process(pair, tmp_path, "--grace-period", "0.5", setup=slow)
    try:
        result = {}

        def request():
            r = httpx.post(url + "/v1/completions", timeout=60,
                           json={"prompt": MAGIC, "max_tokens": 4})
            result["response"] = (r.status_code, r.json()["error"]["message"])

        thread = threading.Thread(target=request)
        thread.start()
        deadline = time.time() + 30   # queued (the gauge stays so until the step ends)
        while _metric_text(url, "vllm:num_requests_waiting") == 0 and time.time() < deadline:
            time.sleep(0.02)
        time.sleep(1.0)   # inside the step
        start = time.time()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, "".join(log)
        assert time.time() - start < 0.5 + 2 * 2.0 + 2.0
        thread.join(30)
        assert result["response"] == (503, "the server is shutting down")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _metric_text(url, name) -> float:
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise KeyError(name)


# --------------------------------------------------------------------- the real bundled pair

@pytest.mark.slow
@pytest.mark.network
def test_bundled_pair_chat_through_openai_with_acceptance_in_metrics():
    from dflash import assets, demo

    try:
        target = assets.smollm2_target()
    except RuntimeError as e:
        pytest.skip(f"offline: {e}")
    llm = serving_engine(target, assets.bundled_draft(), dtype="float32", max_num_seqs=2,
              speculation="fixed")
    with Server(llm, "SmolLM2-135M-Instruct", port=0) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        for question in demo.QUESTIONS[:2]:
            r = client.chat.completions.create(
                model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": question}],
                max_tokens=64, temperature=0)
            assert r.choices[0].message.content.strip()
            assert r.model_extra["speculative_decoding"]["mean_acceptance_length"] > 1.0
        samples = _scrape(s)
    drafts = _metric(samples, "vllm:spec_decode_num_drafts_total")
    accepted = _metric(samples, "vllm:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and 1 + accepted / drafts > 1.5
