"""KV-cache events: what the prefix cache stored and removed, published over ZMQ.

A router that routes by cache contents (llm-d's KV-cache manager, NVIDIA Dynamo's KV router,
SGLang's) keeps an index of which blocks of tokens each replica holds, and learns it from
events that the engines publish. We speak the format vLLM and SGLang publish, so those
consumers read us unchanged:

- A ZMQ PUB socket sends one message per scheduler step that changed the cache: three
  frames, the topic, a sequence number (8 bytes, big-endian, one more per message) and a
  msgpack payload, `[timestamp, [event, ...], data_parallel_rank]`. Each event is a map
  named by its "type", `{"type": "BlockStored", "block_hashes": ..., "parent_block_hash",
  "token_ids", "block_size", "lora_id", "medium", "lora_name"}`, `{"type": "BlockRemoved",
  "block_hashes", "medium"}`, `{"type": "AllBlocksCleared"}`: the layout vLLM publishes now,
  and the only one vllm-router reads. `--kv-events-layout array` sends the layout before it,
  arrays in that order with the name first (`["BlockRemoved", block_hashes, medium]`), which
  older consumers read; llm-d's reads both.
- A ROUTER socket, when asked for, replays: a client that missed messages sends the first
  sequence number it wants and gets each buffered message from there on, as frames
  `[topic, seq, payload]`, then the end marker `[b"", -1, b""]`.

A block is one KV page. Its hash is ours: blake2b with an 8-byte digest over the parent
block's digest (nothing for a prompt's first block) and the page's token ids as
little-endian int32, read as a big-endian unsigned integer. It names the whole prefix up to
its block, on every replica and every run. Consumers that hash tokens by a scheme of their
own (llm-d does) use ours only as an id, to match a removal to its store.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import logging
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import msgpack

if TYPE_CHECKING:  # the flags and the config are read in the API server's process: no torch
    import torch
    import zmq

    from minisgl.kvcache.radix_cache import RadixNode
    from minisgl.scheduler.cache import CacheManager
    from minisgl.scheduler.config import SchedulerConfig

logger = logging.getLogger(__name__)
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
LAYOUTS = ("map", "array")
# The fields of each event after its name, in the order of the array layout.
FIELDS = {
    "BlockStored": (
        "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
        "lora_name",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}  # fmt: skip
REPLAY_POLL_MS = 100  # how soon the replay thread notices close()


@dataclass(frozen=True)
class KVEventsConfig:
    endpoint: str  # a wildcard host (tcp://*:5557) or ipc:// binds; tcp://host:port connects
    replay_endpoint: str | None = None  # a ROUTER socket for replays, always bound
    topic: str = ""  # the first frame of every message; llm-d reads kv@<pod>@<model> from it
    dp_rank: int = 0  # replica i of --dp-size: ports + i, and i in every batch
    buffer_steps: int = 10_000  # messages kept for replay
    layout: str = "map"  # events as maps keyed by field name (vLLM now), or "array" (before)
    hwm: int = 100_000  # messages queued for a slow subscriber before ZMQ drops them

    def __post_init__(self) -> None:
        if self.dp_rank < 0 or self.buffer_steps < 1 or self.hwm < 0:
            raise ValueError("KV events: dp_rank and hwm must be >= 0, buffer_steps >= 1")
        if self.layout not in LAYOUTS:
            raise ValueError(f"KV events: layout must be one of {', '.join(LAYOUTS)}")
        for endpoint in (self.endpoint, self.replay_endpoint):
            if endpoint is not None:
                replica_endpoint(endpoint, self.dp_rank)  # raises on a malformed one


def replica_endpoint(endpoint: str, rank: int) -> str:
    """Replica `rank`'s own endpoint: the port plus the rank (an ipc path gets a suffix)."""
    if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
        return f"{endpoint}-{rank}" if rank else endpoint
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    if not endpoint.startswith("tcp://") or not host or not port.isdigit():
        raise ValueError(
            f"KV events endpoint {endpoint!r}: expected tcp://HOST:PORT (tcp://*:5557 to bind"
            " on every interface) or ipc://PATH"
        )
    if int(port) + rank > 65535:
        raise ValueError(f"KV events endpoint {endpoint!r}: port {port} + rank {rank} > 65535")
    return f"tcp://{host}:{int(port) + rank}"


def _binds(endpoint: str) -> bool:
    # vLLM's rule, which deployments are written for: a publisher binds a wildcard address
    # (subscribers connect to it), and connects to a named one (a subscriber bound there).
    return endpoint.startswith("ipc://") or "*" in endpoint or "::" in endpoint


class KVEventPublisher:
    """Collects the cache's events during a step and sends them as one message at its end."""

    def __init__(self, config: KVEventsConfig, page_size: int, medium: str) -> None:
        self.config, self.page_size, self.medium = config, page_size, medium
        self.topic = config.topic.encode()
        self.pending: list[list[Any]] = []  # this step's events
        self.seq = 0
        self.sent: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.lock = threading.Lock()  # `sent` is read by the replay thread
        import zmq  # here, not at the top: an offline engine runs without pyzmq

        self.ctx = zmq.Context()  # our own, so that close() can end it
        self.replay: zmq.Socket | None = None
        self.closing = threading.Event()
        self.replay_thread: threading.Thread | None = None
        try:
            self.pub = self._open(zmq.PUB, config.endpoint, "--kv-events-endpoint")
            if config.replay_endpoint is not None:
                flag = "--kv-events-replay-endpoint"
                self.replay = self._open(zmq.ROUTER, config.replay_endpoint, flag, bind=True)
        except ValueError:
            self.ctx.destroy(linger=0)
            raise
        if self.replay is not None:
            self.replay_thread = threading.Thread(
                target=self._serve_replays, name="kv-events-replay", daemon=True
            )
            self.replay_thread.start()
        logger.info("KV-cache events on %s", replica_endpoint(config.endpoint, config.dp_rank))

    def _open(self, kind: int, endpoint: str, flag: str, bind: bool = False) -> zmq.Socket:
        import zmq

        endpoint = replica_endpoint(endpoint, self.config.dp_rank)
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.config.hwm)
        verb = "bind" if bind or _binds(endpoint) else "connect to"
        try:
            sock.bind(endpoint) if verb == "bind" else sock.connect(endpoint)
        except zmq.ZMQError as e:
            sock.close()
            why = zmq.strerror(e.errno)  # without pyzmq's repetition of the address
            if e.errno == zmq.EADDRINUSE:
                why += "; pick a free port, or stop what holds it"
            raise ValueError(f"{flag}: cannot {verb} {endpoint}: {why}") from None
        return sock

    # ---- events, as the radix cache changes -----------------------------------------------

    def stored(self, node: RadixNode) -> None:
        """A node was added to the tree: its pages are new blocks."""
        tokens, hashes = self._path(node)
        n = len(node.key) // self.page_size
        parent = hashes[-n - 1] if len(hashes) > n else None
        event = ["BlockStored", hashes[-n:], parent, tokens[-len(node.key) :], self.page_size]
        self.pending.append(event + [None, self.medium, None])  # no LoRA, no LoRA name

    def removed(self, node: RadixNode) -> None:
        """A leaf was evicted (it still knows its parent, so its path is whole)."""
        _, hashes = self._path(node)
        n = len(node.key) // self.page_size
        self.pending.append(["BlockRemoved", hashes[-n:], self.medium])

    def cleared(self) -> None:
        """The cache was emptied: one event says so, instead of this step's removals."""
        self.pending = [["AllBlocksCleared"]]
        self.publish()

    def _path(self, node: RadixNode) -> tuple[list[int], list[int]]:
        """The token ids from the root down to `node`'s end, and the hash of each page."""
        keys = []
        while node.parent is not None:
            keys.append(node.key)
            node = node.parent
        tokens = [t for key in reversed(keys) for t in key.tolist()]
        hashes, parent, ps = [], b"", self.page_size
        for i in range(0, len(tokens), ps):
            page = struct.pack(f"<{ps}i", *tokens[i : i + ps])
            parent = hashlib.blake2b(parent + page, digest_size=8).digest()
            hashes.append(int.from_bytes(parent, "big"))
        return tokens, hashes

    # ---- out --------------------------------------------------------------------------------

    def publish(self) -> None:
        """Send this step's events, if any, as one message (and keep it for replays)."""
        if not self.pending:
            return
        events, self.pending = self.pending, []
        if self.config.layout == "map":  # {"type": name, field: value, ...}
            events = [{"type": e[0], **dict(zip(FIELDS[e[0]], e[1:]))} for e in events]
        payload = msgpack.packb([time.time(), events, self.config.dp_rank])
        with self.lock:
            seq, self.seq = self.seq, self.seq + 1
            self.sent.append((seq, payload))
        self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])

    def _serve_replays(self) -> None:
        assert self.replay is not None
        while not self.closing.is_set():
            if not self.replay.poll(REPLAY_POLL_MS):
                continue
            frames = self.replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning("KV events: a replay request is [b'', 8-byte seq]; got %s", frames)
                continue
            client, _, first = frames
            start = int.from_bytes(first, "big")
            with self.lock:
                wanted = [(seq, payload) for seq, payload in self.sent if seq >= start]
            for seq, payload in wanted:
                frames = [client, b"", self.topic, seq.to_bytes(8, "big"), payload]
                self.replay.send_multipart(frames)
            self.replay.send_multipart([client, b"", b"", END_OF_REPLAY, b""])

    def close(self) -> None:
        """Send what is pending, stop the replay thread, close the sockets."""
        self.publish()
        self.closing.set()
        if self.replay_thread is not None:
            self.replay_thread.join()
        self.ctx.destroy(linger=0)


def start_kv_events(
    config: SchedulerConfig, cache: CacheManager, device: torch.device
) -> KVEventPublisher | None:
    """The publisher, hooked into the radix cache; None when events are off (or rank > 0)."""
    if config.kv_events is None or config.tp_rank != 0:  # the ranks hold one cache between them
        return None
    if config.cache_type != "radix":
        raise ValueError("KV-cache events describe the radix prefix cache; --cache naive has none")
    medium = "GPU" if device.type == "cuda" else "CPU"
    publisher = KVEventPublisher(config.kv_events, cache.page_size, medium)
    cache.cache.events = publisher
    return publisher


def add_kv_events_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kv-events-endpoint",
        default=None,
        help="publish KV-cache events (vLLM's format) on this ZMQ endpoint, e.g. tcp://*:5557;"
        " a replica of --dp-size uses the port plus its rank (default: off)",
    )
    p.add_argument(
        "--kv-events-replay-endpoint",
        default=None,
        help="a ZMQ ROUTER endpoint that replays missed event messages, e.g. tcp://*:5558",
    )
    p.add_argument("--kv-events-topic", default="", help="the topic frame of every message")
    p.add_argument(
        "--kv-events-layout",
        choices=LAYOUTS,
        default="map",
        help="map: each event a map of its fields, as vLLM publishes now and vllm-router reads;"
        " array: the positional layout before it (default: map)",
    )


def kv_events_config(p: argparse.ArgumentParser, a: argparse.Namespace) -> KVEventsConfig | None:
    if a.kv_events_endpoint is None:
        if a.kv_events_replay_endpoint is not None or a.kv_events_topic:
            p.error("--kv-events-replay-endpoint and --kv-events-topic need --kv-events-endpoint")
        if a.kv_events_layout != "map":
            p.error("--kv-events-layout needs --kv-events-endpoint")
        return None
    if a.cache == "naive":
        p.error("--kv-events-endpoint publishes what the radix cache holds; --cache naive has none")
    try:
        return KVEventsConfig(
            a.kv_events_endpoint,
            a.kv_events_replay_endpoint,
            a.kv_events_topic,
            a.dp_rank,
            layout=a.kv_events_layout,
        )
    except ValueError as e:
        p.error(str(e))


F = TypeVar("F", bound=Callable[..., Any])


def publishes_kv_events(method: F) -> F:
    """A Scheduler method whose cache changes go out as one message when it returns."""

    @functools.wraps(method)
    def publishing(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        finally:
            if self.kv_events is not None:
                self.kv_events.publish()

    return publishing  # type: ignore[return-value]
