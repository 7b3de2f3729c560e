"""Two minisgl workers behind SGLang's real router (the sglang-router package), on CPU.

- The router registers the workers under the served model's name, and no path it asks of
  them, at registration or while routing, gets a 404 (their access logs say so).
- cache_aware sends each conversation's next turn to the worker that holds its prefix:
  on the same shared-prefix conversations, the share of prompt tokens served from the
  prefix cache (the workers' /metrics) is higher than with round_robin, and every answer
  equals a single server's greedy answer.
- The load report tells the truth: with one worker loaded by requests the router did not
  send, power_of_two sends every new request to the other. A /get_load that lied (or said
  nothing) would leave the router to split them.
- Killing one worker's scheduler mid-run ends that worker's streams with an error event,
  not a hang, and new requests through the router go to the worker that is left.

Skipped, with the reason printed, where the router's wheel is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from helpers import SMOL, Server, free_port, need, stop, wait_ready
from router_helpers import child_titled, counters, router, server, skip_without_router

skip_without_router(__name__)

MODEL = SMOL.name
TOPICS = [  # one per conversation: a long first message, the prefix its turns share
    "You are a ship's navigator in 1850. Describe the stars you steer by, the brass"
    " instruments on the deck, and the sailors who keep the night watch with you.",
    "You are a baker in a small mountain village. Describe your wood-fired oven, the flour"
    " from the valley mill, and the neighbours who knock on your door before dawn.",
    "You are the keeper of a lighthouse on a rocky island. Describe the great lamp, the"
    " storms of winter, and the supply boat that comes once a month if the sea allows.",
]
TURNS, ANSWER = 3, 8  # turns per conversation, tokens per answer
ACCESS = re.compile(r'"(GET|POST) (\S+) HTTP/1.1" (\d+)')


@pytest.fixture(scope="module")
def workers(tmp_path_factory) -> Iterator[list[Server]]:
    log_dir = tmp_path_factory.mktemp("router")
    procs = []
    for _ in range(2):  # each publishes its KV-cache events, for vllm-router's kv_aware
        port = free_port()
        args = ("--max-seq-len-override", "512", "--kv-events-endpoint", f"tcp://*:{port}")
        procs.append(server(need(SMOL), log_dir, *args))
        procs[-1].events = f"tcp://127.0.0.1:{port}"
    try:
        for p in procs:
            wait_ready(p)
        yield procs
    finally:
        for p in procs:
            stop(p)


def test_what_a_router_asks_of_a_worker(workers):
    w = workers[0].base
    info, card = (
        httpx.get(w + path, timeout=10).json() for path in ("/server_info", "/model_info")
    )
    assert info["served_model_name"] == MODEL and info["model_path"] == str(SMOL.resolve())
    assert httpx.get(w + "/get_server_info", timeout=10).json() == info
    assert card["architectures"] == ["LlamaForCausalLM"] and card["model_type"] == "llama"
    assert httpx.get(w + "/health_generate", timeout=60).json() == {"status": "ok"}
    [legacy] = httpx.get(w + "/get_load", timeout=10).json()
    [entry] = httpx.get(w + "/v1/loads", timeout=10).json()["loads"]
    assert legacy["num_tokens"] == entry["num_total_tokens"] == 0  # idle, nothing held
    assert entry["max_total_num_tokens"] == info["max_total_num_tokens"]

    def generate(**body) -> httpx.Response:
        return httpx.post(w + "/generate", json=body, timeout=120)

    greedy = {"max_new_tokens": 6, "temperature": 0}
    done = generate(text="The capital of France is", sampling_params=greedy).json()
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6}
    completion = httpx.post(w + "/v1/completions", json=body | {"temperature": 0}, timeout=120)
    assert done["text"] == completion.json()["choices"][0]["text"]
    assert len(done["output_ids"]) == done["meta_info"]["completion_tokens"] == 6
    assert done["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    ids = [[504, 3575, 282], [504, 3575, 282, 4649, 314]]
    batch = generate(input_ids=ids, sampling_params=greedy).json()
    assert [b["meta_info"]["prompt_tokens"] for b in batch] == [3, 5]
    [alone] = generate(input_ids=ids[1:], sampling_params=greedy).json()
    assert alone["output_ids"] == batch[1]["output_ids"]
    with httpx.stream(
        "POST",
        w + "/generate",
        json={"input_ids": ids[1], "stream": True, "sampling_params": greedy},
    ) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["output_ids"] == alone["output_ids"]
    for wrong, name in (({"image_data": "x"}, "image_data"), ({"return_logprob": True}, "")):
        r = generate(text="Hi", **wrong)
        assert r.status_code == 400 and name in r.json()["error"]["message"], r.text


def routed(
    workers: list[Server], policy: str, *extra: str, module: str = "sglang_router"
) -> Server:
    r = router([w.base for w in workers], policy, workers[0].log.parent, *extra, module=module)
    wait_ready(r, "/readiness")
    return r


def converse(base: str) -> list[str]:
    """Every turn of every conversation, one request at a time, turn by turn; the answers."""
    chats = [[{"role": "user", "content": topic}] for topic in TOPICS]
    answers = []
    for turn in range(TURNS):
        for chat in chats:
            body = {"model": MODEL, "messages": chat, "max_tokens": ANSWER, "temperature": 0}
            r = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            answers.append(r.json()["choices"][0]["message"]["content"])
            chat += [{"role": "assistant", "content": answers[-1]}]
            chat += [{"role": "user", "content": f"Go on, part {turn + 2}."}]
    return answers


def totals(workers: list[Server], *names: str) -> list[float]:
    snaps = [counters(w) for w in workers]
    return [sum(s[f"minisgl:{n}_total"] for s in snaps) for n in names]


def test_cache_aware_routing_reuses_more_prefix_than_round_robin(workers):
    reference = converse(workers[0].base)  # a single server
    # vLLM's name for the flush, which vllm-router calls: the reference leaves nothing cached
    assert httpx.post(workers[0].base + "/reset_prefix_cache", timeout=30).status_code == 200
    shares = {}
    for policy in ("round_robin", "cache_aware"):
        r = routed(workers, policy)
        try:
            models = httpx.get(r.base + "/v1/models", timeout=10).json()["data"]
            assert [m["id"] for m in models] == [MODEL]  # the name, not "unknown"
            # to every worker: ready with one, the router may not have checked the other yet
            deadline = time.monotonic() + 30
            while True:
                flushed = httpx.post(r.base + "/flush_cache", timeout=30)
                if flushed.json().get("workers_flushed") == 2 or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            assert flushed.status_code == 200 and flushed.json()["workers_flushed"] == 2
            names = ("cached_tokens", "prompt_tokens")
            before = totals(workers, *names)
            assert converse(r.base) == reference
            cached, prompt = (b - a for a, b in zip(before, totals(workers, *names)))
            shares[policy] = cached / prompt
        finally:
            stop(r)
    print(f"cached-token share: {shares}")
    assert shares["cache_aware"] > shares["round_robin"] + 0.1, shares
    for w in workers:  # every path the routers asked for exists
        asked = ACCESS.findall(w.log.read_text())
        missing = {path for _, path, status in asked if status == "404"}
        assert not missing, f"the router asked {w.base} for {missing}"
        assert {"/server_info", "/model_info", "/flush_cache"} <= {p for _, p, _ in asked}


def test_vllm_router_in_front_of_the_same_workers(workers):
    """vLLM's fork of the router (vllm-router) registers the workers, splits chat, completions
    and streams between them with round_robin, and asks nothing that gets a 404. (Its
    power_of_two reads /get_load as {"load": N}, an older shape than the list SGLang's router
    needs now; served the list, it sees every worker at 0 and picks at random.)"""
    if importlib.util.find_spec("vllm_router") is None:
        pytest.skip("vllm-router is not installed: pip install vllm-router==0.1.17")
    before = [counters(w)["minisgl:requests_total"] for w in workers]
    r = routed(workers, "round_robin", module="vllm_router")
    try:
        chat = {"model": MODEL, "messages": [{"role": "user", "content": TOPICS[0]}]}
        chat |= {"max_tokens": ANSWER, "temperature": 0}
        answers = []
        for _ in range(2):
            reply = httpx.post(r.base + "/v1/chat/completions", json=chat, timeout=120)
            assert reply.status_code == 200, reply.text
            answers.append(reply.json()["choices"][0]["message"]["content"])
        direct = httpx.post(workers[0].base + "/v1/chat/completions", json=chat, timeout=120)
        assert answers == [direct.json()["choices"][0]["message"]["content"]] * 2
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "stream": True}
        with httpx.stream("POST", r.base + "/v1/completions", json=body, timeout=60) as s:
            lines = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and len(lines) >= 2, lines
        models = httpx.get(r.base + "/v1/models", timeout=10).json()["data"]
        assert [m["id"] for m in models] == [MODEL]
    finally:
        stop(r)
    after = [counters(w)["minisgl:requests_total"] for w in workers]
    assert [b - a for a, b in zip(before, after)] in ([2, 2], [3, 1]), (before, after)
    for w in workers:  # every path it asked for exists
        missing = {p for _, p, status in ACCESS.findall(w.log.read_text()) if status == "404"}
        assert not missing, f"vllm-router asked {w.base} for {missing}"


def test_vllm_router_kv_aware_places_by_our_kv_events(workers):
    """vllm-router's kv_aware policy indexes the blocks each worker publishes (our KV-cache
    events), asks a worker for each request's token ids (/render), and sends a request to
    the worker holding its longest prefix: after the first, every turn of the conversations
    is a hit in its index. Events it could not decode, or no /tokenize, would leave none."""
    if importlib.util.find_spec("vllm_router") is None:
        pytest.skip("vllm-router is not installed: pip install vllm-router==0.1.17")
    for w in workers:  # nothing cached, nothing indexed: every hit below is this test's
        assert httpx.post(w.base + "/flush_cache", timeout=30).status_code == 200
    sources = [a for w in workers for a in ("--kv-event-source", f"{w.base}={w.events}")]
    block = ("--kv-event-block-size", "1", "--kv-event-model", MODEL)  # a block is our page
    r = routed(workers, "kv_aware", *sources, *block, module="vllm_router")
    try:
        converse(r.base)
        metrics = httpx.get(r.metrics, timeout=10).text
    finally:
        stop(r)
    lookups = dict(re.findall(r'kv_placement_lookups_total\{result="(\w+)"\} (\d+)', metrics))
    print(f"vllm-router's index lookups: {lookups}")
    assert int(lookups.get("hit", 0)) >= len(TOPICS) * (TURNS - 1), metrics
    asked = {(p, s) for w in workers for _, p, s in ACCESS.findall(w.log.read_text())}
    assert ("/v1/chat/completions/render", "200") in asked  # the ids, before it picks
    missing = {p for p, s in asked if s == "404"}
    assert not missing, f"vllm-router asked for {missing}"


def test_tokenize_gives_the_ids_a_request_is_served_with(workers):
    w = workers[0].base
    messages = [{"role": "user", "content": TOPICS[1]}]

    def post(path: str, **body) -> httpx.Response:
        return httpx.post(w + path, json=body, timeout=120)

    chat = post("/tokenize", model=MODEL, messages=messages).json()
    served = post("/v1/chat/completions", model=MODEL, messages=messages, max_tokens=1).json()
    assert chat["count"] == len(chat["tokens"]) == served["usage"]["prompt_tokens"]
    assert chat["max_model_len"] == 512 and chat["token_strs"] is None
    text = "The capital of France is"
    plain = post("/tokenize", prompt=text, return_token_strs=True).json()
    done = post("/v1/completions", model=MODEL, prompt=text, max_tokens=1).json()
    assert plain["count"] == done["usage"]["prompt_tokens"] and len(plain["token_strs"]) > 1
    assert post("/detokenize", tokens=plain["tokens"]).json()["prompt"].endswith(text)
    assert chat["tokens"][: plain["count"]] != plain["tokens"]  # the template came first
    rendered = post("/v1/chat/completions/render", model=MODEL, messages=messages, max_tokens=3)
    assert rendered.json()["token_ids"] == chat["tokens"], rendered.text
    assert rendered.json()["sampling_params"]["max_tokens"] == 3
    both = post("/v1/completions/render", model=MODEL, prompt=[text, "Hi"]).json()
    assert [r["token_ids"] for r in both] == [
        plain["tokens"],
        post("/tokenize", prompt="Hi").json()["tokens"],
    ]
    cases = [
        ("/tokenize", {"prompt": "a", "messages": messages}, 400, "either"),
        ("/tokenize", {"messages": []}, 400, "empty"),
        ("/v1/chat/completions/render", {"model": MODEL, "messages": []}, 400, "messages"),
        ("/tokenize", {"model": "other", "prompt": "a"}, 404, "does not exist"),
        ("/detokenize", {"tokens": [1, 10**9]}, 400, "vocabulary"),
    ]
    for path, body, status, says in cases:
        r = post(path, **body)
        assert r.status_code == status and says in r.json()["error"]["message"], r.text


def stream(base: str, body: dict, out: dict, key: str, stop_when: threading.Event) -> None:
    """A streamed completion; `out[key]`: its last event (or the error that ended it), and when."""
    last = ""
    try:
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                last = line if line.startswith("data: ") else last
                if stop_when.is_set():
                    break
    except httpx.HTTPError as e:
        last = f"transport error: {e!r}"
    out[key] = (last, time.monotonic())


def load(w: Server) -> dict:
    [entry] = httpx.get(w.base + "/get_load", timeout=10).json()
    return entry


def wait_for(check, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_power_of_two_follows_the_reported_load(workers):
    busy, idle = workers
    prompts = [[100 + i, 504, 3575, 282, 4649, 314] * 16 for i in range(2)]  # no common prefix
    out: dict[str, tuple[str, float]] = {}
    done = threading.Event()
    threads = []
    for i, prompt in enumerate(prompts):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 400, "ignore_eos": True}
        body |= {"stream": True, "temperature": 0}
        args = (busy.base, body, out, str(i), done)
        threads.append(threading.Thread(target=stream, args=args))
    r = routed(workers, "power_of_two", "--worker-startup-check-interval", "1")
    try:
        for t in threads:
            t.start()
        wait_for(lambda: load(busy)["num_reqs"] == 2)
        assert load(busy)["num_tokens"] >= sum(map(len, prompts))  # the prompts, at least
        assert load(idle) == {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
        time.sleep(2.5)  # the router asks for the loads every second
        before = [counters(w)["minisgl:requests_total"] for w in workers]
        short = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
        for _ in range(6):
            assert httpx.post(r.base + "/v1/completions", json=short, timeout=60).status_code == 200
        after = [counters(w)["minisgl:requests_total"] for w in workers]
        assert [b - a for a, b in zip(before, after)] == [0, 6]  # all to the idle worker
    finally:
        done.set()
        for t in threads:
            t.join()
        stop(r)
    wait_for(lambda: load(busy)["num_tokens"] == 0)  # the aborted streams' pages came back


def test_a_dead_worker_fails_its_streams_and_the_router_goes_around_it(workers):
    keep, victim = workers
    r = routed(workers, "round_robin")
    out: dict[str, tuple[str, float]] = {}
    done = threading.Event()
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 60, "ignore_eos": True}
    body |= {"stream": True, "temperature": 0}
    threads = [
        threading.Thread(target=stream, args=(r.base, body, out, str(i), done)) for i in range(2)
    ]
    try:
        for t in threads:
            t.start()
        wait_for(lambda: load(keep)["num_reqs"] == load(victim)["num_reqs"] == 1)
        child = child_titled(victim.proc.pid, "minisgl::scheduler")
        os.kill(child, signal.SIGKILL)
        killed = time.monotonic()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a client hangs"
        (done_line, _), (error_line, failed_at) = sorted(out.values())
        assert done_line == "data: [DONE]" and "error" in error_line, out
        assert failed_at - killed < 10, f"the dead worker's client waited {failed_at - killed} s"
        assert victim.proc.wait(30) == 1
        before = counters(keep)["minisgl:requests_total"]
        short = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
        for _ in range(3):
            assert httpx.post(r.base + "/v1/completions", json=short, timeout=60).status_code == 200
        assert counters(keep)["minisgl:requests_total"] - before == 3
        print(f"the dead worker's stream ended {failed_at - killed:.1f} s after the kill")
    finally:
        done.set()
        stop(r)
