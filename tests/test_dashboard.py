"""Chapter 30: the live page, from the scheduler's record to what a real browser shows.

In-process, on the offline LLM: nothing is recorded without a watch lease; with one, the
snapshot's page counts are the cache manager's own, and the radix tree shows a shared
prompt as one node. End to end: a live server on SmolLM2, a workload with a shared system
prompt, a prompt longer than the prefill budget and more requests than may run at once,
and the page in headless Chromium (Debian's chromium and chromium-driver, driven by
selenium). Mid-run the scheduler process is stopped (SIGSTOP), so that the page and
/dashboard/state hold the same snapshot while requests run and wait; the page must show
exactly what the state says, and at the end what the clients and /metrics say. The server
wants an API key, as a shared one would: the page opens without it and asks for it.
Screenshots go to $MINISGL_ARTIFACTS (default: artifacts/ at the repo root).
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    ROOT,
    SMOL,
    TINY,
    Server,
    httpx,
    metrics,
    need,
    run_tool,
    serving,
    windowed_models,
    windowed_token_ids,
)

from minisgl.core import SamplingParams
from minisgl.llm import LLM
from minisgl.message.backend import AbortMsg, UserMsg
from minisgl.message.codec import decode, encode
from minisgl.message.dashboard import WatchMsg
from minisgl.scheduler.observe import Observer
from minisgl.server.args import parse_args
from minisgl.tokenizer.tokenizer import Tokenizer

PAGE_SIZE = 4
SYSTEM = (
    "You are a patient geography teacher. You answer every question in one or two short "
    "sentences, and you name the country and the continent of every place you mention."
)
QUESTIONS = ["Where is Lima?", "What is the capital of Kenya?", "Where is Oslo?",
             "Which river runs through Cairo?", "Where is the Gobi desert?"]  # fmt: skip
LONG = "Tell me about the history of the Silk Road. " * 12  # over the prefill budget
FLAGS = [
    "--device", "cpu", "--dtype", "float32", "--max-seq-len-override", "512",
    "--page-size", str(PAGE_SIZE), "--num-pages", "160", "--max-running-requests", "4",
    "--max-prefill-length", "48", "--cuda-graph-max-bs", "4", "--log-level", "WARNING",
    "--api-key", "sk-dashboard-test",
]  # fmt: skip
KEY = {"Authorization": "Bearer sk-dashboard-test"}


# ---- the scheduler's record, in-process ----------------------------------------------------


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    llm = LLM(
        str(need(TINY["llama"])), dtype=torch.float32, device="cpu", max_running_req=4,
        num_page_override=64, max_seq_len_override=128, page_size=PAGE_SIZE,
        max_prefill_length=24, cuda_graph_max_bs=4,
    )  # fmt: skip
    yield llm
    llm.shutdown()


def run(llm: LLM, observer: Observer, prompts: list[list[int]], max_tokens: int) -> list[Any]:
    """Feed the prompts as the worker loop does; returns every snapshot taken."""
    s, uid = llm.scheduler, 1000 + observer.seq * 100
    msgs = [
        UserMsg(uid + i, ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        for i, ids in enumerate(prompts)
    ]
    observer.receive(msgs)
    s.receive(msgs)
    snapshots = []
    while s.has_work:
        observer.next_at = 0.0  # a snapshot after every step
        if (snap := observer.publish(s.step())) is not None:
            snapshots.append(decode(encode(snap)))  # as it crosses the socket
            s.check_integrity()
    return snapshots


def test_nothing_is_recorded_without_a_lease(llm):
    observer = Observer(llm.scheduler)
    assert not run(llm, observer, [[5, 6, 7, 8, 9]], 3)
    assert observer.log not in llm.scheduler.listeners and not observer.log.ring
    observer.receive([WatchMsg(0.05)])
    time.sleep(0.1)  # the lease runs out: the next publish turns the record off
    assert observer.publish([]) is None and not observer.log.on
    assert observer.log not in llm.scheduler.listeners


def test_a_steps_time_is_the_loops_pace(llm):
    """A step's ms runs from its start to the next step's start, read on the host: known for
    every step but the last before the loop waits for work, and the wait is no step's."""
    observer = Observer(llm.scheduler)
    observer.receive([WatchMsg(30.0)])
    began = time.perf_counter()
    run(llm, observer, [[5, 6, 7, 8, 9]], 4)
    first = len(observer.log.ring)
    time.sleep(0.3)
    run(llm, observer, [[15, 16, 17]], 3)
    spent = (time.perf_counter() - began) * 1e3
    ms = observer.log.columns()["ms"]
    assert first >= 4 and len(ms) > first + 2
    assert ms[first - 1] is None and ms[-1] is None  # each run's last: the wait ended it
    timed = ms[: first - 1] + ms[first:-1]
    assert all(t is not None and 0 < t < 300 for t in timed), ms  # none holds the sleep
    assert sum(timed) < spent - 300


def test_tokens_wait_to_be_counted_until_a_snapshot(llm):
    """Between snapshots a step's tokens are kept as they are (no work a token on the step
    loop); a snapshot counts them, each request's tokens and first token, and an abort
    counts the aborted request's tokens before it ends."""
    s = llm.scheduler
    observer = Observer(s)
    observer.receive([WatchMsg(30.0)])
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    msgs = [UserMsg(7000 + i, list(range(20 + i, 30 + i)), params) for i in range(2)]
    observer.receive(msgs)
    s.receive(msgs)
    observer.next_at = float("inf")  # no snapshot due while there is work
    seen: Counter[int] = Counter()
    while seen[7001] < 2:
        tokens = s.step()
        seen.update(t.uid for t in tokens)
        assert observer.publish(tokens) is None
    assert observer.pending and observer.reqs[7001]["output_tokens"] == 0  # not counted yet
    abort = [AbortMsg(7001)]
    observer.receive(abort)
    s.receive(abort)
    assert not observer.pending
    (ended,) = observer.finished
    assert ended["id"] == 7001 and ended["reason"] == "abort"
    assert ended["output_tokens"] == seen[7001] and ended["ttft_ms"] is not None
    snapshot = None
    while s.has_work or snapshot is None:  # idle, the state is sent whatever the time
        snapshot = observer.publish(s.step())
    done = {f["id"]: f for f in snapshot.finished}
    assert done[7000]["output_tokens"] == 6 and done[7000]["ttft_ms"] is not None
    assert snapshot.counters["tokens_per_s"] > 0


def test_snapshot_is_the_schedulers_state(llm):
    s = llm.scheduler
    observer = Observer(s)
    observer.receive([WatchMsg(30.0)])
    shared = list(range(10, 42))  # 32 tokens: 8 pages every prompt shares
    prompts = [shared + [100 + i, 101 + i, 102 + i] for i in range(3)] + [list(range(50, 90))]
    snapshots = run(llm, observer, prompts, 4)
    assert snapshots, "no snapshot while watched"
    for snap in snapshots:
        pool, cm = snap.pool, s.cache
        assert pool["free"] + pool["running"] + pool["cached"] + pool["locked"] == cm.num_pages
        assert len(pool["grid"]) == cm.num_pages and pool["cell_pages"] == 1
        letters = Counter(pool["grid"].decode())
        for letter, name in zip("frcl", ("free", "running", "cached", "locked")):
            assert letters[letter] == pool[name]
    last = snapshots[-1]
    assert last.pool["free"] == s.cache.allocator.num_free  # idle: the rest is cached
    assert last.pool["cached"] * PAGE_SIZE == s.cache.cache.evictable_tokens
    kinds = Counter(last.steps["kind"])
    assert kinds["prefill"] >= 2 and kinds["decode"] >= 3, kinds
    assert any(last.steps["chunks"]), "the 40-token prompt is cut by the 24-token budget"
    assert sorted(f["prompt_tokens"] for f in last.finished) == sorted(map(len, prompts))
    assert {f["output_tokens"] for f in last.finished} == {4}
    # A chunk boundary may cut the shared prompt in two nodes; its last one has three children.
    ends = prefix_ends(last.tree["nodes"])
    shared_node = next(n for n in last.tree["nodes"] if ends[n["id"]] == len(shared))
    assert shared_node["children"] == 3 and shared_node["refs"] == 0
    assert last.tree["total_tokens"] == s.cache.cache.evictable_tokens
    assert not {k for k in last.counters if k.startswith("state_")}  # no linear layers


def prefix_ends(nodes: list[dict[str, Any]]) -> list[int]:
    """Where each node's tokens end, counted from the root (nodes come after their parent)."""
    ends = [0] * len(nodes)
    for n in nodes[1:]:
        ends[n["id"]] = ends[n["parent"]] + n["tokens"]
    return ends


def test_text_only_when_asked(llm):
    tok = Tokenizer(str(TINY["llama"]))
    observer = Observer(llm.scheduler)
    observer.receive([WatchMsg(30.0, text=False)])
    plain = run(llm, observer, [[7, 8, 9, 10, 11, 12]], 3)[-1]
    assert "_ids" not in str(plain) and "_text" not in str(plain)
    observer.receive([WatchMsg(30.0, text=True)])
    prompt = list(range(20, 60))
    snap = run(llm, observer, [prompt], 3)[-1].with_text(tok.decode)
    done = snap.finished[0]
    assert done["prompt_text"] == tok.decode(prompt[-32:]) and "prompt_ids" not in done
    assert done["output_text"] and "_ids" not in str(snap.tree)
    assert any("text" in node for node in snap.tree["nodes"][1:])


def test_flags():
    base = ["--model", str(need(SMOL))]
    assert parse_args(base).dashboard and not parse_args(base).dashboard_text
    assert not parse_args([*base, "--no-dashboard"]).dashboard
    assert parse_args([*base, "--dashboard-text"]).dashboard_text


def test_cost_benchmark_runs_on_the_cpu():
    args = ["--model", str(need(TINY["llama"])), "--device", "cpu", "--batch-sizes", "1,2"]
    done = run_tool("bench_dashboard.py", *args, "--input-len", "8", "--output-len", "12",
                    "--rounds", "1", timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "| 2 |" in done.stdout and "ns a step" in done.stdout, done.stdout


# ---- the page, in a browser ---------------------------------------------------------------


def browser_paths() -> tuple[str, str]:
    """Debian's chromium and its driver, or skip saying what is missing."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if chromium is None or driver is None:
        pytest.skip("no chromium / chromedriver (Debian: apt-get install chromium chromium-driver)")
    pytest.importorskip("selenium", reason="selenium is in the dev extra: pip install -e .[dev]")
    return chromium, driver


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    chromium, driver = browser_paths()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1366,1400"):  # fmt: skip
        options.add_argument(arg)
    page = webdriver.Chrome(service=Service(driver), options=options)
    page.set_script_timeout(10)
    yield page
    page.quit()


@pytest.fixture(scope="module")
def server(tmp_path_factory, browser) -> Iterator[Server]:
    """`python -m minisgl` on SmolLM2 with FLAGS; its log is in the test's temporary folder."""
    with serving(tmp_path_factory.mktemp("dashboard"), *FLAGS) as srv:
        yield srv


@pytest.fixture(scope="module")
def artifacts() -> Path:
    where = Path(os.environ.get("MINISGL_ARTIFACTS", ROOT / "artifacts")) / "dashboard"
    where.mkdir(parents=True, exist_ok=True)
    return where


def state(server: Server) -> dict[str, Any]:
    r = httpx.get(server.base + "/dashboard/state", headers=KEY, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def until(check, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}")


def shown(page: Any, server: Server) -> dict[str, Any]:
    """The state, once the page shows the same snapshot (the scheduler must be still)."""
    snap = state(server)
    until(lambda: page.execute_script("return window.dashboardSeq") == snap["seq"], 10,
          f"the page to draw snapshot {snap['seq']}")  # fmt: skip
    return snap


# What the page shows, read from its DOM.
REQUEST_ROWS = """return [...document.querySelectorAll('#requests tbody tr')].map(tr => [
    +tr.dataset.id, tr.dataset.state,
    ...['prompt', 'cached', 'output', 'pages'].map(c => tr.querySelector('.' + c).textContent)])"""
TREE_NODES = """return [...document.querySelectorAll('#tree g.node')].map(g => [
    +g.dataset.id, +g.dataset.tokens, +g.dataset.refs, +g.dataset.children])"""
GRAPH_ROWS = """return [...document.querySelectorAll('#graphs tbody tr')].map(tr => [
    tr.dataset.kind, +tr.dataset.size,
    +tr.querySelector('.hits').textContent, +tr.querySelector('.steps').textContent])"""
COUNTERS = {
    "running": "#c-running",
    "waiting": "#c-waiting",
    "preemptions_total": "#c-preemptions",
    "cached_tokens_total": "#c-cached-tokens",
}


def count(page: Any, css: str) -> int:
    return page.execute_script(f"return document.querySelectorAll('{css}').length")


def page_requests(page: Any) -> list[tuple]:
    rows = page.execute_script(REQUEST_ROWS)
    return [(i, st, int(p), c, o.split(" ")[0], pg.split(" ")[0]) for i, st, p, c, o, pg in rows]


def state_requests(snap: dict[str, Any]) -> list[tuple]:
    return [
        (r["id"], r["state"], r["prompt_tokens"], _blank(r.get("cached_tokens")),
         str(r["output_tokens"]), str(r.get("pages", "")))
        for r in snap["running"] + snap["waiting"] + snap["finished"]
    ]  # fmt: skip


def _blank(value: Any) -> str:
    return "" if value is None else str(value)


def check_page_equals_state(page: Any, snap: dict[str, Any]) -> None:
    text = lambda css: page.find_element("css selector", css).text  # noqa: E731
    assert page_requests(page) == state_requests(snap)
    pool = snap["pool"]
    for name, letter in (("free", "f"), ("running", "r"), ("cached", "c"), ("locked", "l")):
        assert int(text(f"#pool-{name}")) == pool[name]
        assert count(page, f".pg-{letter}") == pool[name]  # a cell a page in a pool this small
    kinds = Counter(snap["steps"]["kind"][-200:])
    for kind in ("prefill", "decode", "verify"):
        assert int(text(f"#kind-{kind}")) == kinds[kind]
        assert count(page, f"g.step[data-kind={kind}]") == kinds[kind]
    for key, css in COUNTERS.items():
        assert int(text(css)) == snap["counters"][key], key
    drawn = page.execute_script(TREE_NODES)
    nodes = snap["tree"]["nodes"][1:]
    assert drawn == [[n["id"], n["tokens"], n["refs"], n["children"]] for n in nodes]
    graphs = page.execute_script(GRAPH_ROWS)
    shown_rows = [[k, bs, hits, steps] for k, bs, _, hits, steps in snap["graphs"]]
    assert graphs == [g for g in shown_rows if g[0] != "prefill" or g[2] > 0]


def idle_page_equals_state(page: Any, server: Server) -> dict[str, Any]:
    """check_page_equals_state on an idle server, which still sends snapshots while the page
    watches: one that lands mid-check redraws the page under the check, which then looks again."""
    from selenium.common.exceptions import StaleElementReferenceException

    for _ in range(4):
        snap = shown(page, server)
        try:
            check_page_equals_state(page, snap)
            return snap
        except StaleElementReferenceException:
            continue
    pytest.fail("the page was redrawn under every check")


def scheduler_pid(server: Server) -> int:
    """The server's child that names itself minisgl::scheduler (see server/processes.py)."""
    for children in Path(f"/proc/{server.proc.pid}/task").glob("*/children"):
        for pid in children.read_text().split():
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"minisgl::scheduler"):
                return int(pid)
    pytest.fail("no minisgl::scheduler process under the server")


def chat(server: Server, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    body = {"model": SMOL.name, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    r = httpx.post(server.base + "/v1/chat/completions", json=body, headers=KEY, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def test_page_shows_what_the_scheduler_reports(server, browser, artifacts):
    page = browser
    page.get(server.base + "/dashboard")  # open: the page holds no data
    form = until(lambda: page.find_element("id", "key-form").is_displayed(), 30, "the key form")
    assert form and page.execute_script("return window.dashboardSeq") is None
    page.find_element("id", "key").send_keys("sk-wrong")
    page.find_element("css selector", "#key-form button").click()
    until(lambda: "refused" in page.find_element("id", "key-note").text, 10, "the refusal")
    page.find_element("id", "key").clear()
    page.find_element("id", "key").send_keys("sk-dashboard-test")
    page.find_element("css selector", "#key-form button").click()
    until(lambda: page.execute_script("return window.dashboardSeq"), 30, "the first snapshot")
    asks = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
            for q in QUESTIONS] + [[{"role": "user", "content": LONG}]]  # fmt: skip
    with ThreadPoolExecutor(len(asks)) as pool:
        futures = [pool.submit(chat, server, m, 20) for m in asks]
        until(lambda: (s := state(server))["running"] and s["waiting"]
              and s["steps"]["kind"].count("decode") >= 2, 120,
              "requests decoding and waiting at once")  # fmt: skip
        sched = scheduler_pid(server)
        os.kill(sched, signal.SIGSTOP)  # the page and the state now hold still
        try:
            time.sleep(0.5)  # a snapshot on its way arrives
            snap = shown(page, server)
            check_page_equals_state(page, snap)
            assert {r["state"] for r in snap["running"]} <= {"decoding", "prefilling"}
            assert {r["state"] for r in snap["waiting"]} <= {"queued", "preempted"}
            page.save_screenshot(str(artifacts / "mid-run.png"))
        finally:
            os.kill(sched, signal.SIGCONT)
        usages = [f.result() for f in futures]
    until(lambda: (s := state(server))["counters"]["running"] == 0 and not s["waiting"], 60,
          "the server to be idle")  # fmt: skip
    snap = idle_page_equals_state(page, server)
    page.save_screenshot(str(artifacts / "idle.png"))
    done = Counter((f["prompt_tokens"], f["output_tokens"]) for f in snap["finished"][: len(asks)])
    assert done == Counter((u["prompt_tokens"], u["completion_tokens"]) for u in usages)
    m = metrics(server)
    assert snap["counters"]["cached_tokens_total"] == m["minisgl:cached_tokens_total"]
    assert snap["counters"]["preemptions_total"] == m["minisgl:preemptions_total"]
    assert any(c > 0 for c in snap["steps"]["chunks"]), "the long prompt came in chunks"
    # The system prompt is one node under the root, shared by the five chats.
    tok = Tokenizer(str(SMOL))
    ids = [tok.encode(tok.apply_chat_template(m), add_special_tokens=False) for m in asks[:-1]]
    common = min(_common(ids[0], other) for other in ids[1:]) // PAGE_SIZE * PAGE_SIZE
    ends = prefix_ends(snap["tree"]["nodes"])
    node = next(n for n in snap["tree"]["nodes"] if ends[n["id"]] == common)
    assert node["children"] >= 2
    # One script reads both: the page redraws its tree on every snapshot, idle or not.
    drawn = page.execute_script(
        "const g = document.querySelector(arguments[0]);"
        "return g && [g.dataset.start, g.dataset.tokens];",
        f'#tree g.node[data-id="{node["id"]}"]',
    )
    assert drawn, f"node {node['id']} is not drawn"
    start, tokens = (int(v) for v in drawn)
    assert start + tokens == common and tokens == node["tokens"]


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_state_documents_its_fields(server):
    snap = state(server)
    assert set(snap) == {"seq", "time", "engine", "counters", "steps", "running", "waiting",
                         "finished", "pool", "tree", "graphs"}  # fmt: skip
    assert snap["engine"]["page_size"] == PAGE_SIZE and snap["engine"]["decode_graphs"] == [1, 2, 4]
    assert "prompt_text" not in str(snap) and not snap["engine"]["text"]  # no --dashboard-text
    for path in ("/dashboard/state", "/dashboard/events"):  # the data wants the key
        assert httpx.get(server.base + path, timeout=30).status_code == 401
    with httpx.stream("GET", server.base + "/dashboard/events", headers=KEY, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        assert '"seq"' in next(lines)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Chapter 29's tiny models with sliding windows (test_sliding_window_pages.py's)."""
    return windowed_models(tmp_path_factory.mktemp("swa"))


def test_the_live_page_counts_windowed_pages(folders) -> None:
    """Chapter 29's windowed pool on the page (the snapshot, as it crosses the socket): the
    windowed pages running requests hold (a window's few each, whatever their length), those
    idle on cached pages, of the windowed pool; none held once every request has left."""
    llm = LLM(str(folders["gemma4"]), device="cpu", dtype="float32", max_running_req=3,
              page_size=4, num_page_override=128, max_prefill_length=7, cuda_graph_max_bs=0,
              cache_type="radix", window_pages=16)  # fmt: skip
    try:
        observer = Observer(llm.scheduler)
        observer.receive([WatchMsg(30.0)])
        prompts = [windowed_token_ids(40 + i, 3 * 8 + 5 * i) for i in range(2)]
        seen = [snap.counters for snap in run(llm, observer, prompts, max_tokens=14)]
    finally:
        llm.shutdown()
    assert seen and all(c["window_pages"] == 16 for c in seen)
    # a request holds its window and a chunk of 7 at most, in pages of 4: 5 pages, where its
    # 38 to 43 tokens would hold 10 or 11
    assert all(c["window_pages_in_use"] <= 2 * (-(-(8 + 7) // 4) + 1) for c in seen)
    assert max(c["window_pages_in_use"] for c in seen) > 0
    assert seen[-1]["window_pages_in_use"] == 0 and seen[-1]["window_pages_idle"] > 0  # cached
