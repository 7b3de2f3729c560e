"""KV-cache events over ZMQ, read the way an external consumer (llm-d, Dynamo) reads them.

Every message here is decoded from its raw frames with plain msgpack, and every block hash
is recomputed by a reference written from the docs (blake2b over the parent's digest and
the page's int32 token ids), not taken from the publisher.

- Two prompts that share a prefix: the first stores its pages, chained by parent hashes;
  the second stores only its new page, whose parent is the first prompt's shared page.
- A small pool evicts: each removal names blocks that were stored, and stores minus
  removals equal what the cache holds. A flush sends one AllBlocksCleared.
- Sequence numbers go up by one; the replay socket sends missed messages, then its end.
- Off by default; a bad or busy endpoint is a clear error; close leaves no thread, and the
  port is free again. The server publishes with --kv-events-endpoint.
"""

from __future__ import annotations

import hashlib
import struct
import threading
import time

import httpx
import msgpack
import pytest
import torch
import zmq
from helpers import TINY, free_port, need, stop, wait_ready
from router_helpers import server

from minisgl.core import SamplingParams
from minisgl.llm import LLM
from minisgl.message.backend import FlushCacheMsg
from minisgl.scheduler.flush import CacheFlusher
from minisgl.scheduler.kv_events import KVEventsConfig
from minisgl.scheduler.kv_publisher import KVEventPublisher
from minisgl.server.args import parse_args
from minisgl.server.replicas import ReplicaSet

PS = 4  # tokens per page: a block
A = list(range(10, 22))  # three pages
B = A[:8] + [50, 51, 52, 53, 54, 55]  # shares two pages with A, then one page of its own
SP = SamplingParams(max_tokens=2, ignore_eos=True)


def ref_hashes(tokens: list[int]) -> list[int]:
    """Each full page's hash, as docs/ch27 defines it."""
    out, parent = [], b""
    for i in range(0, len(tokens) // PS * PS, PS):
        data = parent + struct.pack(f"<{PS}i", *tokens[i : i + PS])
        parent = hashlib.blake2b(data, digest_size=8).digest()
        out.append(int.from_bytes(parent, "big"))
    return out


def make_llm(**kwargs) -> LLM:
    return LLM(
        str(need(TINY["llama"])),
        dtype=torch.float32,
        device="cpu",
        page_size=PS,
        max_seq_len_override=64,
        **kwargs,
    )


def subscribe(ctx: zmq.Context, endpoint: str, topic: bytes = b"") -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    sub.subscribe(topic)
    time.sleep(0.3)  # a PUB socket drops what it sends before the subscription arrives
    return sub


def receive(sub: zmq.Socket, quiet_ms: int = 300) -> list[tuple[bytes, int, list]]:
    """Every message until none comes for `quiet_ms`: (topic, seq, decoded payload)."""
    out = []
    while sub.poll(quiet_ms):
        frames = sub.recv_multipart()
        assert len(frames) == 3 and len(frames[1]) == 8, frames
        out.append((frames[0], int.from_bytes(frames[1], "big"), msgpack.unpackb(frames[2])))
    return out


# vLLM's events, field by field: a map names them, the array layout lists them in this order
FIELDS = {
    "BlockStored": (
        "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
        "lora_name",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}  # fmt: skip


def events(messages: list[tuple[bytes, int, list]]) -> list[list]:
    """Every event, written as the array layout lists it (a map is read by its names)."""
    out = []
    for _, _, (_, batch, _) in messages:
        for event in batch:
            if isinstance(event, dict):
                assert set(event) == {"type", *FIELDS[event["type"]]}, event
                event = [event["type"], *(event[k] for k in FIELDS[event["type"]])]
            out.append(event)
    return out


def layouts(messages: list[tuple[bytes, int, list]]) -> set[type]:
    return {type(event) for _, _, (_, batch, _) in messages for event in batch}


def cached_hashes(llm: LLM) -> set[int]:
    """What the radix cache holds now, hashed by the reference."""
    tree, held = llm.scheduler.cache.cache, set()
    for node in tree._nodes():
        path, up = [], node
        while up.parent is not None:
            path.append(up.key)
            up = up.parent
        if path:
            held |= set(ref_hashes(torch.cat(path[::-1]).tolist()))
    return held


def test_off_by_default_and_checked():
    assert parse_args(["--model", str(need(TINY["llama"]))]).scheduler.kv_events is None
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        KVEventsConfig("http://localhost:5557")
    with pytest.raises(ValueError, match="65535"):
        KVEventsConfig("tcp://*:65535", dp_rank=1)


def test_a_shared_prefix_stores_only_new_blocks_chained_by_parent(tmp_path):
    ctx = zmq.Context()
    endpoint = f"ipc://{tmp_path}/events"
    llm = make_llm(kv_events=KVEventsConfig(endpoint, topic="kv@pod@tiny", layout="array"))
    try:
        sub = subscribe(ctx, endpoint)
        started = time.time()
        llm.generate([A], SP, use_tqdm=False)
        first = receive(sub)
        llm.generate([B], SP, use_tqdm=False)
        second = receive(sub)
    finally:
        llm.shutdown()
        ctx.destroy(linger=0)
    messages = first + second
    assert layouts(messages) == {list}  # the positional layout, as asked
    assert [seq for _, seq, _ in messages] == list(range(len(messages)))
    for topic, _, payload in messages:
        assert topic == b"kv@pod@tiny" and len(payload) == 3
        ts, _, rank = payload
        assert started - 1 < ts < time.time() + 1 and rank == 0
    # A's three pages, in one event: no parent, the prompt's tokens, the reference's hashes
    assert events(first) == [["BlockStored", ref_hashes(A), None, A, PS, None, "CPU", None]]
    # B: only its own page, hung under A's second page
    new = [["BlockStored", ref_hashes(B)[2:], ref_hashes(A)[1], B[8:12], PS, None, "CPU", None]]
    assert events(second) == new


def test_eviction_removes_stored_blocks_and_a_flush_clears(tmp_path):
    ctx = zmq.Context()
    endpoint = f"ipc://{tmp_path}/events"
    llm = make_llm(num_page_override=8, kv_events=KVEventsConfig(endpoint))
    long_prompt = list(range(100, 124))  # 6 pages, +1 for its output: A's and B's must go
    try:
        sub = subscribe(ctx, endpoint)
        for prompt in (A, B, long_prompt):
            llm.generate([prompt], SP, use_tqdm=False)
        messages = receive(sub)
        held = cached_hashes(llm)
        CacheFlusher(llm.scheduler, llm.kv_events).apply([FlushCacheMsg()])
        flushed = receive(sub)
        assert len(llm.scheduler.cache.cache.all_slots()) == 0
    finally:
        llm.shutdown()
        ctx.destroy(linger=0)
    stored, removed = [], []
    for event in events(messages):
        if event[0] == "BlockStored":
            stored += event[1]
        else:
            assert event[0] == "BlockRemoved" and event[2] == "CPU", event
            assert set(event[1]) <= set(stored), "a removal of a block never stored"
            removed += event[1]
    assert removed and len(set(removed)) == len(removed)
    assert set(stored) - set(removed) == held  # a consumer's index is the cache's content
    assert ref_hashes(long_prompt)[0] in held
    seqs = [seq for _, seq, _ in messages + flushed]
    assert seqs == list(range(len(seqs)))
    assert events(flushed) == [["AllBlocksCleared"]]


def test_replay_sends_missed_messages_then_the_end(tmp_path):
    ctx = zmq.Context()
    endpoint, replay = f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"
    llm = make_llm(kv_events=KVEventsConfig(endpoint, replay, topic="t"))
    try:
        sub = subscribe(ctx, endpoint)
        for prompt in (A, B, list(range(200, 212))):
            llm.generate([prompt], SP, use_tqdm=False)
        live = receive(sub)
        client = ctx.socket(zmq.DEALER)
        client.setsockopt(zmq.LINGER, 0)
        client.connect(replay)
        client.send_multipart([b"", b"not a sequence number"])  # ignored, and it serves on
        client.send_multipart([b"", (1).to_bytes(8, "big")])
        replayed = []
        while True:
            assert client.poll(5000), "no replay answer"
            frames = client.recv_multipart()
            assert len(frames) == 4 and frames[0] == b"", frames
            if frames[2] == (-1).to_bytes(8, "big", signed=True):
                assert frames[1] == frames[3] == b""
                break
            replayed.append(
                (frames[1], int.from_bytes(frames[2], "big"), msgpack.unpackb(frames[3]))
            )
    finally:
        llm.shutdown()
        ctx.destroy(linger=0)
    assert len(live) == 3 and replayed == live[1:]
    assert not [t for t in threading.enumerate() if t.name == "kv-events-replay"]


def test_a_replica_publishes_on_its_port_and_close_frees_it():
    port = free_port()
    ctx = zmq.Context()
    llm = make_llm(kv_events=KVEventsConfig(f"tcp://*:{port - 1}", dp_rank=1))
    try:
        sub = subscribe(ctx, f"tcp://127.0.0.1:{port}")
        llm.generate([A], SP, use_tqdm=False)
        ((_, _, (_, _, rank)),) = receive(sub)
        assert rank == 1
    finally:
        llm.shutdown()
        ctx.destroy(linger=0)
    again = KVEventPublisher(KVEventsConfig(f"tcp://*:{port}"))  # bindable again
    with pytest.raises(ValueError, match=f"--kv-events-endpoint: cannot bind tcp://\\*:{port}"):
        KVEventPublisher(KVEventsConfig(f"tcp://*:{port}"))
    again.close()
    with pytest.raises(ValueError, match="--cache naive has none"):
        make_llm(cache_type="naive", kv_events=KVEventsConfig(f"tcp://*:{port}"))


def test_the_command_line_and_each_replica_rank(capsys):
    model = str(need(TINY["llama"]))
    base = ["--model", model, "--kv-events-endpoint", "tcp://*:6000"]
    config = parse_args([*base, "--kv-events-topic", "kv@a@b"]).scheduler.kv_events
    assert config == KVEventsConfig("tcp://*:6000", None, "kv@a@b", 0)
    for bad, says in [
        (["--model", model, "--kv-events-topic", "x"], "need --kv-events-endpoint"),
        ([*base, "--cache", "naive"], "--cache naive has none"),
        (["--model", model, "--kv-events-endpoint", "localhost:6000"], "tcp://HOST:PORT"),
    ]:
        with pytest.raises(SystemExit):
            parse_args(bad)
        assert says in capsys.readouterr().err
    replicas = object.__new__(ReplicaSet)  # only its command line, no processes
    replicas.argv = base
    command = replicas.replica_command(7000, 1)
    replica = parse_args(command[command.index("minisgl") + 1 :])
    assert replica.scheduler.kv_events.dp_rank == 1


def test_the_server_publishes_with_the_flag(tmp_path):
    events_port = free_port()
    p = server(
        need(TINY["llama"]),
        tmp_path,
        "--page-size",
        str(PS),
        "--kv-events-endpoint",
        f"tcp://*:{events_port}",
        "--kv-events-topic",
        "kv@pod@tiny",
    )
    ctx = zmq.Context()
    try:
        wait_ready(p)
        sub = subscribe(ctx, f"tcp://127.0.0.1:{events_port}", b"kv@pod@tiny")
        body = {"model": "tiny-llama", "prompt": A, "max_tokens": 2, "ignore_eos": True}
        assert httpx.post(p.base + "/v1/completions", json=body, timeout=60).status_code == 200
        stored = receive(sub, quiet_ms=2000)
        assert httpx.post(p.base + "/flush_cache", timeout=30).status_code == 200
        cleared = receive(sub, quiet_ms=2000)
    finally:
        ctx.destroy(linger=0)
        stop(p)
    assert layouts(stored + cleared) == {dict}  # maps, the default
    assert events(stored) == [["BlockStored", ref_hashes(A), None, A, PS, None, "CPU", None]]
    assert [seq for _, seq, _ in stored + cleared] == [0, 1]
    assert events(cleared) == [["AllBlocksCleared"]]
