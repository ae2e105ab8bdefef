"""`dflash serve` against hostile requests, on live servers on 127.0.0.1 (free ports) with the
real `openai` client, httpx and raw sockets: request-supplied chat templates, oversized bodies
and prompts, stop-string floods, clients that stop reading, the API key and Host header, values
at the edges, fields dflash cannot honour, and a dead engine thread. Each test fails against a
server without the corresponding defence."""

import asyncio
import hmac
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from dflash import LLM, SamplingParams, sampling  # noqa: E402
from dflash.cli import build_parser  # noqa: E402
from dflash.serve import (  # noqa: E402
    Server,  # noqa: E402
    protocol,
    security,
    serving,
)

from helpers import (  # noqa: E402
    make_tiny_draft,
    make_tiny_target,
    save_byte_tokenizer,
    serving_engine,
)

KEY = "hardening-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
NAME = "tiny"
SLOW_TEMPLATE = ("{% for i in range(3000) %}{% for j in range(3000) %}x{% endfor %}{% endfor %}"
                 "{{ messages[0]['content'] }}")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("hardening")
    tok = save_byte_tokenizer(root / "target")
    make_tiny_target(root / "target", "qwen3", vocab_size=len(tok), max_position_embeddings=4096)
    make_tiny_draft(root / "draft", root / "target", block_size=8)
    return root / "target", root / "draft"


@pytest.fixture(scope="module")
def offline(pair):
    return LLM(pair[0], dtype="float32", max_num_seqs=4, max_model_len=512)


@pytest.fixture(scope="module")
def server(pair):
    llm = serving_engine(*pair, dtype="float32", max_num_seqs=4, max_model_len=512)
    with Server(llm, NAME, port=0, api_key=KEY) as s:
        yield s


def _client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def _wait_idle(server, timeout=20.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if server.state.in_flight == 0 and not server.state.engine.engine.has_unfinished():
            return
        time.sleep(0.02)
    raise AssertionError(f"the server did not go idle (in_flight {server.state.in_flight})")


def _raw(server, data: bytes, rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket()
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect((server.host, server.port))
    s.settimeout(30)
    s.sendall(data)
    return s


def _status(sock: socket.socket) -> tuple[int, bytes]:
    """(status, the response as read) of a response with a Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < int(
            data.lower().split(b"content-length: ")[1].split(b"\r\n")[0]):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return int(data.split(b" ", 2)[1]), data


# ------------------------------------------------------------------------- chat templates

def test_a_request_supplied_chat_template_is_refused_and_reserved_kwargs_are_dropped(
        server, offline):
    evil = ("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}"
            "{% endfor %}")
    chat = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "temperature": 0}
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as http:
        for body in ({**chat, "chat_template_kwargs": {"chat_template": evil}},
                     {**chat, "chat_template": evil}):
            r = http.post("/v1/chat/completions", json=body)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "chat_template"
            assert "--trust-request-chat-template" in error["message"]
        assert http.get("/health", timeout=5).status_code == 200
        # keys that change what the template call returns are dropped, not passed on
        plain = http.post("/v1/chat/completions", json=chat).json()
        for extra in ({"tokenize": True}, {"return_dict": True}, {"add_generation_prompt": False},
                      {"tokenize": True, "return_tensors": "pt", "padding": True}):
            r = http.post("/v1/chat/completions", json={**chat, "chat_template_kwargs": extra})
            assert r.status_code == 200, (extra, r.text)
            assert r.json()["choices"][0]["message"]["content"] == \
                plain["choices"][0]["message"]["content"]


def test_a_trusted_template_renders_off_the_event_loop(pair):
    """With --trust-request-chat-template a slow template still leaves the server responsive:
    /health answers while it renders (the rendered text is then too long and refused unencoded)."""
    llm = serving_engine(pair[0], dtype="float32", max_num_seqs=2, max_model_len=256)
    with Server(llm, NAME, port=0, trust_request_chat_template=True) as s:
        done = {}

        def slow():
            r = httpx.post(s.url + "/v1/chat/completions", timeout=120, json={
                "model": NAME, "messages": [{"role": "user", "content": "hi"}],
                "chat_template": SLOW_TEMPLATE, "max_tokens": 4})
            done["slow"] = (time.time(), r.status_code, r.json()["error"]["message"])

        thread = threading.Thread(target=slow)
        thread.start()
        deadline = time.time() + 30
        while s.state.in_flight == 0 and time.time() < deadline:   # admitted: rendering
            time.sleep(0.005)
        r = httpx.get(s.url + "/health", timeout=60)
        health_at = time.time()
        thread.join(120)
        assert r.status_code == 200
        slow_at, status, message = done["slow"]
        assert health_at < slow_at, "/health waited for the template to render"
        assert status == 400 and "characters" in message


# ---------------------------------------------------------------------- bodies and prompts

def test_oversized_bodies_get_413_and_a_stream_keeps_going(pair, offline):
    llm = serving_engine(*pair, dtype="float32", max_num_seqs=4, max_model_len=512)
    want = offline.generate("keep going", SamplingParams(max_tokens=100, ignore_eos=True))[0]
    with Server(llm, NAME, port=0, api_key=KEY, max_request_bytes=1 << 20) as s:
        streamed = {}

        def stream():
            with httpx.stream("POST", s.url + "/v1/completions", headers=AUTH, timeout=120,
                              json={"model": NAME, "prompt": "keep going", "max_tokens": 100,
                                    "temperature": 0, "ignore_eos": True, "stream": True}) as r:
                streamed["lines"] = [line for line in r.iter_lines() if line]

        thread = threading.Thread(target=stream)
        thread.start()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
                f"{KEY}\r\nContent-Type: application/json\r\n").encode()
        # a declared 64 MB body: refused before it is read
        sock = _raw(s, head + b"Content-Length: 67108864\r\n\r\n" + b'{"prompt": "' +
                    b"x" * 65536)
        status, data = _status(sock)
        sock.close()
        assert status == 413 and b"1048576" in data
        # a chunked body: refused once it passes the limit
        chunk = b"x" * 65536
        sock = _raw(s, head + b"Transfer-Encoding: chunked\r\n\r\n" +
                    (b"%x\r\n" % len(chunk) + chunk + b"\r\n") * 20)
        status, data = _status(sock)
        sock.close()
        assert status == 413 and b"--max-request-bytes" in data
        thread.join(120)
        lines = streamed["lines"]
        assert lines[-1] == "data: [DONE]"
        text = "".join(httpx.Response(200, content=line[6:]).json()["choices"][0]["text"]
                       for line in lines[:-1])
        assert text == want.text


def test_a_prompt_too_long_for_max_model_len_is_refused_before_encoding(server):
    tokenizer = server.state.llm.tokenizer
    calls = []
    encode = tokenizer.encode

    def counting(text, *args, **kw):
        calls.append(len(text))
        return encode(text, *args, **kw)

    tokenizer.encode = counting
    try:
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
            for path, body in (
                    ("/v1/completions", {"model": NAME, "prompt": "word " * 600_000}),
                    ("/v1/chat/completions", {"model": NAME, "messages": [
                        {"role": "user", "content": "word " * 600_000}]})):
                r = http.post(path, json=body)
                assert r.status_code == 400, r.text
                assert "max_model_len" in r.json()["error"]["message"]
            assert calls == []
            r = http.post("/v1/completions", json={"model": NAME, "prompt": "short",
                                                   "max_tokens": 2})
            assert r.status_code == 200 and len(calls) == 1
    finally:
        del tokenizer.encode


# --------------------------------------------------------------------------- stop strings

def test_stop_strings_are_bounded_and_50_of_them_work(server, offline):
    client = _client(server)
    for stop, word in (([f"s{i}" for i in range(5000)], "at most 64"),
                       (["x" * 10_000], "at most 256")):
        with pytest.raises(openai.BadRequestError, match=word) as e:
            client.completions.create(model=NAME, prompt="hi", stop=stop, max_tokens=4)
        assert e.value.body["param"] == "stop"
    full = offline.generate("stop here", SamplingParams(max_tokens=40, ignore_eos=True))[0].text
    target = next(full[i:i + 3] for i in range(4, len(full) - 3)
                  if "\ufffd" not in full[i:i + 3] and full.index(full[i:i + 3]) >= 4)
    stops = [f"never{i}\u2603" for i in range(49)] + [target]
    want = full[:full.index(target)]
    r = client.completions.create(model=NAME, prompt="stop here", stop=stops, max_tokens=40,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=NAME, prompt="stop here", stop=stops, max_tokens=40, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if c.choices)
    assert streamed == want


# ------------------------------------------------------------------ clients that stop reading

def test_clients_that_stop_reading_release_their_slots(pair):
    llm = serving_engine(pair[0], dtype="float32", max_num_seqs=2, max_model_len=4096)
    with Server(llm, NAME, port=0, max_queue=0, stream_timeout=2.0) as s:
        s.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)   # small kernel buffers
        body = (b'{"model": "tiny", "prompt": "never read", "max_tokens": 4000, '
                b'"ignore_eos": true, "temperature": 0, "stream": true}')
        request = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                   b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body)) + body
        stalled = [_raw(s, request, rcvbuf=4096) for _ in range(2)]
        deadline = time.time() + 60
        status = None
        while time.time() < deadline:   # 503 while both slots are held, then served
            r = httpx.post(s.url + "/v1/completions", timeout=60,
                           json={"model": NAME, "prompt": "next", "max_tokens": 4})
            status = r.status_code
            if status == 200:
                break
            assert status == 503
            time.sleep(0.2)
        assert status == 200
        for sock in stalled:   # the server closed them mid-stream: no [DONE]
            data = b""
            while chunk := sock.recv(1 << 16):
                data += chunk
            sock.close()
            assert b"data: " in data and b"[DONE]" not in data
        _wait_idle(s)


def test_a_body_that_stops_arriving_gets_408_and_its_connection_closed(pair):
    """A client that sends part of its body and stalls (one of many such would hold the
    server's connections) is answered 408 once --body-timeout has passed."""
    llm = serving_engine(pair[0], dtype="float32", max_num_seqs=1, max_model_len=256)
    with Server(llm, NAME, port=0, body_timeout=1.0) as s:
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                b"application/json\r\nContent-Length: 100\r\n\r\n")
        stalled = [_raw(s, head + part) for part in (b"", b'{"prompt": "hi", ')]
        for sock in stalled:
            status, data = _status(sock)
            assert status == 408 and b"--body-timeout" in data, data
            assert sock.recv(1) == b""   # closed
            sock.close()
        r = httpx.post(s.url + "/v1/completions", timeout=60,
                       json={"model": NAME, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text


# -------------------------------------------------------------------- key, Host, /docs

def test_the_api_key_is_compared_in_constant_time(monkeypatch):
    compared = []
    original = hmac.compare_digest

    def compare(a, b):
        compared.append((a, b))
        return original(a, b)

    monkeypatch.setattr(security.hmac, "compare_digest", compare)
    seen = []

    async def app(scope, receive, send):
        seen.append(scope["path"])

    async def send(message):
        if message["type"] == "http.response.start":
            seen.append(message["status"])

    middleware = security.ApiKeyMiddleware(app, "k")
    for auth, expected in ((b"Bearer k", "/v1/models"), (b"Bearer x", 401)):
        scope = {"type": "http", "path": "/v1/models", "method": "GET",
                 "headers": [(b"authorization", auth)]}
        asyncio.run(middleware(scope, None, send))
        assert seen[-1] == expected
    assert compared == [(b"Bearer k", b"Bearer k"), (b"Bearer x", b"Bearer k")]


def test_the_key_comes_from_the_environment_and_docs_are_closed(server, monkeypatch):
    monkeypatch.setenv("DFLASH_API_KEY", "from-env")
    args = build_parser().parse_args(["serve", "--target", "t"])
    assert args.api_key == "from-env"
    for path in ("/docs", "/redoc", "/openapi.json"):
        for headers in ({}, AUTH):
            assert httpx.get(server.url + path, headers=headers).status_code == 404


def test_a_keyless_server_answers_only_its_own_host_names(pair):
    llm = serving_engine(pair[0], dtype="float32", max_num_seqs=1, max_model_len=256)
    with Server(llm, NAME, port=0, allowed_hosts=("dflash.internal",)) as s:
        def get(host):
            return httpx.get(s.url + "/v1/models", headers={"Host": host})

        for host in (f"127.0.0.1:{s.port}", "localhost", f"[::1]:{s.port}", "10.1.2.3",
                     "dflash.internal:8000"):
            assert get(host).status_code == 200, host
        for host in ("evil.example", f"attacker.example:{s.port}", "127.0.0.1.nip.io"):
            r = get(host)
            assert r.status_code == 403 and "--allowed-hosts" in r.json()["error"]["message"]
    assert security.host_allowed("anything", frozenset({"*"}))


# ---------------------------------------------------------------------- values at the edges

def test_edge_values_are_greedy_or_400_never_500(server, offline):
    want = offline.generate("edge", SamplingParams(max_tokens=12))[0].text
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
        base = {"model": NAME, "prompt": "edge", "max_tokens": 12}
        for extra in ({"temperature": 1e-45}, {"temperature": 5e-324}, {"temperature": 1e-7}):
            r = http.post("/v1/completions", json={**base, **extra})
            assert r.status_code == 200, (extra, r.text)
            assert r.json()["choices"][0]["text"] == want, extra
        for extra in ({"temperature": 0.8, "top_k": 2**63, "seed": 3},
                      {"temperature": 0.8, "top_k": 2**80, "seed": 3},
                      {"temperature": 0.8, "top_k": 10**6, "seed": 3},
                      {"max_tokens": 2**70}):   # capped by max_model_len
            r = http.post("/v1/completions", json={**base, **extra})
            assert r.status_code == 200, (extra, r.text)
        # a k past the vocabulary keeps every token: the distribution without top-k (two such
        # requests' tokens may still differ: the verify schedule follows the engine's history)
        logits = torch.randn(1, 3, 50, generator=torch.Generator().manual_seed(0))
        assert torch.equal(
            sampling.target_probs(logits, [SamplingParams(temperature=0.8, top_k=2**63)]),
            sampling.target_probs(logits, [SamplingParams(temperature=0.8)]))
        for extra, param in (({"seed": 2**64}, "seed"), ({"seed": -1}, "seed"),
                             ({"stop_token_ids": list(range(2000))}, "stop_token_ids")):
            r = http.post("/v1/completions", json={**base, **extra})
            assert r.status_code == 400, (extra, r.text)
            assert r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("field,value", [
    ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("tool_choice", "auto"), ("response_format", {"type": "json_object"}),
    ("logit_bias", {"5": 100}), ("min_tokens", 4), ("min_p", 0.1),
    ("guided_json", {"type": "object"}), ("include_stop_str_in_output", True),
    ("use_beam_search", True), ("presence_penalty", 0.5)])
def test_fields_dflash_cannot_honour_are_400_naming_them(server, field, value):
    for path, body in (("/v1/completions", {"model": NAME, "prompt": "hi"}),
                       ("/v1/chat/completions",
                        {"model": NAME, "messages": [{"role": "user", "content": "hi"}]})):
        r = httpx.post(server.url + path, headers=AUTH, json={**body, field: value,
                                                               "max_tokens": 2})
        assert r.status_code == 400, (field, r.text)
        error = r.json()["error"]
        assert error["param"] == field and field in error["message"]
    # the values that mean "not used" pass
    r = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, json={
        "model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "tools": [], "tool_choice": "none", "response_format": {"type": "text"},
        "logit_bias": {}, "min_tokens": 0})
    assert r.status_code == 200, r.text


# ------------------------------------------------- text that is not Unicode, shapes, names

# "\\ud800" in JSON is a lone UTF-16 surrogate: valid JSON, but not text any tokenizer encodes
@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", r'{"prompt": "a\ud800b"}', "prompt"),
    ("/v1/completions", r'{"prompt": ["\udfff"]}', "prompt"),
    ("/v1/completions", r'{"prompt": "\ud800", "stream": true}', "prompt"),
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "\ud800"}]}',
     "messages"),
    ("/v1/chat/completions",
     r'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}',
     "messages"),
    ("/v1/chat/completions", r'{"messages": [{"role": "\ud800", "content": "hi"}]}',
     "messages")])
def test_text_that_is_not_unicode_is_a_400_naming_its_field(server, path, body, param):
    with httpx.Client(base_url=server.url, headers={**AUTH, "Content-Type": "application/json"},
                      timeout=60) as http:
        r = http.post(path, content=body.encode())
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and "surrogate" in error["message"], error
        # an unknown model's name is echoed in its 404, whatever it holds
        r = http.post("/v1/completions", content=rb'{"model": "m\ud800", "prompt": "hi"}')
        assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text
        r = http.post("/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text


def test_a_template_kwarg_that_is_not_unicode_is_a_400_naming_it(pair):
    llm = serving_engine(pair[0], dtype="float32", max_num_seqs=1, max_model_len=256)
    with Server(llm, NAME, port=0, trust_request_chat_template=True) as s:
        r = httpx.post(s.url + "/v1/chat/completions", timeout=60, headers={
            "Content-Type": "application/json"}, content=(
                rb'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
                rb'"chat_template": "{{ x }}{{ messages[0].content }}", '
                rb'"chat_template_kwargs": {"x": "\ud800"}}'))
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "chat_template_kwargs", r.text


def test_message_floods_are_refused_before_their_items_are_validated(server):
    """Item validation costs time on the event loop: a body with more messages or content
    parts than the limits is refused on its counts, before any item is looked at (these items
    are all invalid, and the error is about the count)."""
    over = protocol.MAX_MESSAGES + 1
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
        for messages in ([{"role": 5}] * over,
                         [{"role": "user", "content": [{"type": "text", "text": 5}] * over}],
                         [{"role": "user", "content": [{"type": "text", "text": 5}] * 2}] *
                         (over // 2 + 1)):
            r = http.post("/v1/chat/completions", json={"model": NAME, "messages": messages})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "messages" and str(protocol.MAX_MESSAGES) in \
                error["message"], error
        # at the limit the counts pass (this many messages are then too long to encode)
        r = http.post("/v1/chat/completions", json={"model": NAME, "messages": [
            {"role": "user", "content": "hi"}] * protocol.MAX_MESSAGES})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_400s_name_the_field_the_client_sent(server):
    chat = {"model": NAME, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
        for value in (0, -5):
            r = http.post("/v1/chat/completions", json={**chat, "max_completion_tokens": value})
            error = r.json()["error"]
            assert r.status_code == 400 and error["param"] == "max_completion_tokens", error
            assert error["message"].startswith("max_completion_tokens"), error
        for messages, where in (([{"content": "hi"}], "messages[0].role"),
                                ([{"role": "user", "content": "hi"}, {"role": "user",
                                                                       "content": 5}],
                                 "messages[1].content")):
            r = http.post("/v1/chat/completions", json={**chat, "messages": messages})
            error = r.json()["error"]
            assert r.status_code == 400 and error["param"] == "messages", error
            assert error["message"].startswith(where), error


# ------------------------------------------------------------------------ a dead engine

def test_a_dead_engine_thread_fails_health_and_exits_non_zero(pair, tmp_path):
    script = tmp_path / "serve_and_die.py"
    script.write_text(f"""
import sys
from dflash.engine import EngineArgs, LLMEngine
from dflash.serve import Server, runner

def boom(self):
    raise RuntimeError("the engine loop broke")

runner.EngineThread._step = boom
llm = LLMEngine(EngineArgs({str(pair[0])!r}, dtype="float32", max_num_seqs=1,
                           max_model_len=256), isolate_errors=True)
sys.exit(Server(llm, "tiny", port=0).run())
""")
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, DFLASH_CACHE=str(tmp_path),
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, str(script)], stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True, env=env, cwd=tmp_path)
    try:
        url = None
        deadline = time.time() + 120
        while url is None and time.time() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            if " on http://" in line:
                url = line.split(" on ")[1].split()[0]
        assert url is not None
        threading.Thread(target=lambda: proc.stderr.read(), daemon=True).start()
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        r = httpx.post(url + "/v1/completions", timeout=60,
                       json={"prompt": "hi", "max_tokens": 4})
        assert r.status_code in (500, 503) and "engine" in r.json()["error"]["message"]
        code = proc.wait(timeout=30)
        assert code == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serving_limits_are_documented_defaults():
    """The CLI's defaults are the Options' defaults (one source for the README's table)."""
    args = build_parser().parse_args(["serve", "--target", "t"])
    options = serving.Options()
    assert (args.max_request_bytes, args.stream_timeout, args.body_timeout, args.max_queue,
            args.trust_request_chat_template) == (
        options.max_request_bytes, options.stream_timeout, options.body_timeout,
        options.max_queue, options.trust_request_chat_template)
