"""A server in the open: API keys on every route, limits on every request, and clients that
stop reading or vanish. One live server (SmolLM2 on CPU) with two keys serves the tests.

- Every route the app has (listed by its own OpenAPI schema, so a route added later is
  covered without a change here) answers 401 in OpenAI's shape without a key and with a
  wrong one, and not 401 with either key; the official `openai` client raises
  AuthenticationError; /health and /ready stay open; no key reaches the log.
- Each request limit gives its OpenAI-shaped error, a body over --max-request-bytes a 413.
- Clients that hang up mid-stream or mid-request, and clients that stop reading a stream,
  are ended within a bound, and the server holds no request and no KV page afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
import zmq
from fastapi import FastAPI
from helpers import CONTEXT, MODEL, SMOL_CPU, Server, httpx, metrics, serving, wait_idle
from starlette.testclient import TestClient

from minisgl.core import SamplingParams
from minisgl.message.frontend import AcceptedMsg, TokenizeMsg
from minisgl.message.transport import Reader, Writer, address
from minisgl.server import limits
from minisgl.server.auth import RequireKey
from minisgl.server.frontend import Frontend
from minisgl.server.protocol import APIError

KEYS = ("key-one-2c1f", "key-two-9b7e")
WRONG = "key-one-2c1e"
BODY_LIMIT = 64 << 10  # --max-request-bytes
CLIENT_TIMEOUT = 2  # --client-timeout


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    log_dir = tmp_path_factory.mktemp("guards")
    keys = ("--api-key", KEYS[0], "--api-key", KEYS[1])
    bounds = ("--max-request-bytes", str(BODY_LIMIT), "--client-timeout", str(CLIENT_TIMEOUT))
    with serving(log_dir, *SMOL_CPU, *keys, *bounds) as srv:
        yield srv


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# ---- keys ---------------------------------------------------------------------------------


def routes(server: Server) -> list[tuple[str, str]]:
    """Every (method, path) the app serves, by its own OpenAPI schema; parameters filled."""
    schema = httpx.get(server.base + "/openapi.json", headers=auth(KEYS[0]), timeout=10).json()
    found = [("GET", "/openapi.json"), ("GET", "/docs")]
    for path, methods in schema["paths"].items():
        path = path.replace("{name}", MODEL)
        found += [(m.upper(), path) for m in methods]
    return found


def test_every_route_needs_a_key(server):
    open_paths = {"/health", "/ready", "/metrics"}
    if importlib.util.find_spec("minisgl.server.dashboard"):  # the live page holds no data
        open_paths.add("/dashboard")
    protected = [(m, p) for m, p in routes(server) if p not in open_paths]
    assert len(protected) >= 6, protected  # chapter 16 has six; later chapters add more
    with httpx.Client(base_url=server.base, timeout=30) as http:
        for method, path in protected:
            for headers in ({}, auth(WRONG), {"Authorization": KEYS[0]}):
                r = http.request(method, path, headers=headers)
                assert r.status_code == 401, (method, path, headers, r.text)
                err = r.json()["error"]
                assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
                assert KEYS[0] not in r.text and WRONG not in r.text
            for key in KEYS:  # an empty body may be a 400 or a 422: anything but a 401
                # the status alone: an event stream (the live page's) never ends by itself
                with http.stream(method, path, headers=auth(key)) as r:
                    assert r.status_code != 401, (method, path)
        assert http.get("/no/such/path").status_code == 401  # no key, no map of the routes
        for path in open_paths:
            assert http.get(path).status_code == 200, path


def test_the_openai_client_with_and_without_the_key(server):
    def client(key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=server.base + "/v1", api_key=key, max_retries=0)

    with pytest.raises(openai.AuthenticationError, match="not valid"):
        client(WRONG).models.list()
    with pytest.raises(openai.AuthenticationError):
        client(WRONG).completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    for key in KEYS:
        api = client(key)
        assert [m.id for m in api.models.list()] == [MODEL]
        out = api.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        assert out.usage.completion_tokens == 2
        chunks = api.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, stream=True
        )
        assert any(c.choices and c.choices[0].delta.content for c in chunks)


def test_no_key_reaches_the_log(server):
    log = server.log.read_text(errors="replace")
    assert "401" in log  # the refusals were logged, without what they carried
    assert not any(k in log for k in (*KEYS, WRONG))


def tiny_app(**kw: Any) -> FastAPI:
    app = FastAPI()
    app.add_middleware(RequireKey, keys=KEYS, **kw)

    @app.get("/metrics")
    async def metrics() -> dict[str, str]:
        return {}

    return app


def test_a_route_added_after_the_key_is_behind_it():
    app = tiny_app()

    @app.get("/later")  # after the middleware, as a later module adds its routes
    async def later() -> dict[str, str]:
        return {"page": "yes"}

    http = TestClient(app)
    assert http.get("/later").status_code == 401
    assert http.get("/later", headers=auth(KEYS[1])).json() == {"page": "yes"}
    assert http.get("/later", headers={"Authorization": f"bearer  {KEYS[0]} "}).status_code == 200
    assert http.get("/metrics").status_code == 200
    assert TestClient(tiny_app(protect_metrics=True)).get("/metrics").status_code == 401


def test_keys_come_from_flags_and_the_environment(monkeypatch, capsys):
    from helpers import SMOL, need

    from minisgl.server.args import parse_args

    base = ["--model", str(need(SMOL))]
    monkeypatch.setenv("MINISGL_API_KEY", "k-a, k-b,,")
    args = parse_args(base + ["--api-key", "k-c", "--api-key", "k-a"])
    assert args.api_keys == ("k-c", "k-a", "k-b") and "k-" not in repr(args)
    monkeypatch.delenv("MINISGL_API_KEY")
    assert parse_args(base).api_keys == ()
    for flags, message in (
        (["--api-key", "two words"], "API key 1 holds spaces"),
        (["--protect-metrics"], "--protect-metrics needs a key"),
    ):
        with pytest.raises(SystemExit):
            parse_args(base + flags)
        assert message in capsys.readouterr().err


# ---- limits -------------------------------------------------------------------------------


def refusal(server: Server, body: dict[str, Any], path: str = "/v1/completions") -> dict:
    r = httpx.post(server.base + path, json=body, headers=auth(KEYS[0]), timeout=60)
    assert r.status_code == 400, r.text
    return r.json()["error"]


COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}


@pytest.mark.parametrize(
    "extra, param, words",
    [
        ({"n": limits.MAX_N + 1}, "n", f"less than or equal to {limits.MAX_N}"),
        ({"stop": ["a"] * (limits.MAX_STOPS + 1)}, "stop", f"at most {limits.MAX_STOPS} items"),
        ({"stop": "x" * (limits.MAX_STOP_CHARS + 1)}, "stop", f"{limits.MAX_STOP_CHARS} char"),
        (
            {"logit_bias": {str(i): 1 for i in range(limits.MAX_LOGIT_BIAS + 1)}},
            "logit_bias",
            f"at most {limits.MAX_LOGIT_BIAS} items",
        ),
        ({"prompt": ["Hi"] * (limits.MAX_PROMPTS + 1)}, "prompt", f"at most {limits.MAX_PROMPTS}"),
    ],
    ids=["n", "stops", "stop-length", "logit-bias", "prompts"],
)
def test_each_limit_is_a_400_naming_it(server, extra, param, words):
    err = refusal(server, COMPLETION | extra)
    assert err["param"] == param and words in err["message"], err


def test_max_tokens_is_held_to_the_context(server):
    prompt = [1000] * (CONTEXT - 3)
    fits = COMPLETION | {"prompt": prompt, "max_tokens": 3}  # to the context's last token
    r = httpx.post(server.base + "/v1/completions", json=fits, headers=auth(KEYS[0]), timeout=120)
    assert r.status_code == 200, r.text
    err = refusal(server, fits | {"max_tokens": 4})
    assert err["code"] == "context_length_exceeded", err
    assert f"{CONTEXT + 1} in all, more than this model's context of {CONTEXT}" in err["message"]
    unlimited = {k: v for k, v in fits.items() if k != "max_tokens"}  # none: until the end
    r = httpx.post(
        server.base + "/v1/completions",
        json=unlimited | {"max_tokens": None},
        headers=auth(KEYS[0]),
        timeout=120,
    )
    assert r.status_code == 200, r.text


def test_a_body_over_the_limit_is_a_413(server):
    big = json.dumps(COMPLETION | {"prompt": "word " * BODY_LIMIT}).encode()

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it comes
        for i in range(0, len(big), 4096):
            yield big[i : i + 4096]

    headers = auth(KEYS[0]) | {"Content-Type": "application/json"}
    for content in (big, chunks()):
        r = httpx.post(
            server.base + "/v1/completions", content=content, headers=headers, timeout=60
        )
        assert r.status_code == 413, r.text
        err = r.json()["error"]
        assert err["code"] == "request_too_large" and "--max-request-bytes" in err["message"]
    small = json.dumps(COMPLETION).encode()
    r = httpx.post(
        server.base + "/v1/completions", content=iter([small]), headers=headers, timeout=60
    )
    assert r.status_code == 200, r.text


def test_the_queue_is_bounded_by_the_prompt_tokens_it_holds(tmp_path):
    """The front end with a stand-in for the tokenizer worker: it refuses a request once the
    accepted ones hold the limit's worth of prompt tokens, and admits again when one ends."""

    async def scenario() -> None:
        frontend = Frontend(str(tmp_path), max_requests=10, max_tokens_held=1000)
        ctx = zmq.Context()
        tokenizer = Reader(ctx, address(tmp_path, "tokenizer"))
        to_api = Writer(ctx, address(tmp_path, "api"))
        receiver = asyncio.create_task(frontend.receive_forever())

        def request() -> list[TokenizeMsg]:
            return [TokenizeMsg(next(frontend.uids), SamplingParams(max_tokens=1), input_ids=[1])]

        async def accepted(tokens: int) -> int:
            msgs = request()
            opened = asyncio.create_task(frontend.open(msgs))
            msg = await asyncio.to_thread(tokenizer.recv, 5000)
            to_api.send(AcceptedMsg(msg.uid, tokens))
            _, prompt_tokens = await opened
            assert prompt_tokens == tokens
            return msgs[0].uid

        try:
            first = await accepted(600)
            await accepted(600)  # 600 held: under the limit, so this one is let in
            with pytest.raises(APIError) as refused:  # before it reaches the tokenizer
                await frontend.open(request())
            assert refused.value.status == 503 and refused.value.code == "queue_full"
            assert "holds 1200 prompt tokens, its limit is 1000" in refused.value.message
            await frontend.close([first], abort=False)
            await accepted(300)
            assert frontend.tokens_held == 900
        finally:  # every socket closed: a context collected with one open hangs in term()
            receiver.cancel()
            await asyncio.gather(receiver, return_exceptions=True)
            for sock in (tokenizer, to_api, frontend.inbox, frontend.to_tokenizer):
                sock.socket.close(linger=0)
            ctx.term()

    asyncio.run(scenario())


# ---- clients that vanish or stall ---------------------------------------------------------


def connect(server: Server, small_buffers: bool = False) -> socket.socket:
    sock = socket.socket()
    if small_buffers:  # before connecting: what the server's kernel sees of this client
        # Segments of a real network's size: over loopback's 64 KiB ones, the server's kernel
        # would take megabytes of a stream before its writes had to wait.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 1400)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    host, port = server.base.removeprefix("http://").split(":")
    sock.connect((host, int(port)))
    sock.settimeout(60)
    return sock


def send_request(sock: socket.socket, path: str, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {KEYS[0]}\r\n"
    head += f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    sock.sendall(head.encode() + data)


LONG_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}]}
LONG_CHAT |= {"max_tokens": 200, "ignore_eos": True}
STALLED, STALL_N = 6, 4  # clients that stop reading, and their streams' choices


def vanish_mid_stream(server: Server) -> None:
    with connect(server) as sock:
        send_request(sock, "/v1/chat/completions", LONG_CHAT | {"stream": True})
        seen = b""
        while seen.count(b"data:") < 3:  # the role, then tokens: it runs
            seen += sock.recv(4096)


def vanish_mid_request(server: Server) -> None:
    with connect(server) as sock:
        send_request(sock, "/v1/chat/completions", LONG_CHAT)
        time.sleep(1.0)


def stall(server: Server) -> socket.socket:
    """A stream whose client reads nothing: the server's buffers fill, then it must cut."""
    sock = connect(server, small_buffers=True)
    big = {"stream": True, "n": STALL_N, "logprobs": True}  # over 1 KB of events per step
    send_request(sock, "/v1/chat/completions", LONG_CHAT | big)
    return sock


def test_clients_that_vanish_or_stall_leave_nothing_held(server):
    before = metrics(server)
    started = time.monotonic()
    with ThreadPoolExecutor(100) as pool:
        stalled = [pool.submit(stall, server) for _ in range(STALLED)]
        vanished = [pool.submit(vanish_mid_stream, server) for _ in range(47)]
        vanished += [pool.submit(vanish_mid_request, server) for _ in range(47)]
        for f in vanished:
            f.result()
        sockets = [f.result() for f in stalled]
    try:
        after = wait_idle(server, timeout=60)
        took = time.monotonic() - started
        for name in ("num_requests_running", "num_requests_waiting", "kv_pages_used"):
            assert after[f"minisgl:{name}"] == 0, (name, after)
        assert after["minisgl:num_requests_open"] == 0, after
        aborted = after["minisgl:aborted_requests_total"] - before["minisgl:aborted_requests_total"]
        assert aborted == 94 + STALLED * STALL_N, after
        log = server.log.read_text(errors="replace")
        assert log.count(f"took over {CLIENT_TIMEOUT:g} s reading its answer") == STALLED
        print(f"100 clients vanished or stalled: all ended, nothing held, {took:.1f} s")
    finally:
        for sock in sockets:
            sock.close()
    r = httpx.post(server.base + "/v1/completions", json=COMPLETION, headers=auth(KEYS[0]))
    assert r.status_code == 200, r.text


def test_a_client_too_slow_to_send_its_request_is_cut_off(server):
    with connect(server) as silent, connect(server) as trickle:
        trickle.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n")  # and no more
        started = time.monotonic()
        for sock in (silent, trickle):
            with contextlib.suppress(ConnectionResetError):  # closed, or reset: cut off
                assert sock.recv(1024) == b""
        took = time.monotonic() - started
    assert CLIENT_TIMEOUT - 0.5 < took < CLIENT_TIMEOUT + 3, took
