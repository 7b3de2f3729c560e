"""The ZMQ side of KV-cache events: one message per step, sequence numbers, replays.

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
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

import msgpack
import zmq

from minisgl.scheduler.kv_events import KVEventsConfig, replica_endpoint

logger = logging.getLogger(__name__)
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
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


def _binds(endpoint: str) -> bool:
    # vLLM's rule, which deployments are written for: a publisher binds a wildcard address
    # (subscribers connect to it), and connects to a named one (a subscriber bound there).
    return endpoint.startswith("ipc://") or "*" in endpoint or "::" in endpoint


class KVEventPublisher:
    """Sends a step's events as one message, and keeps the last messages for replays."""

    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self.topic = config.topic.encode()
        self.seq = 0
        self.sent: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.lock = threading.Lock()  # `sent` is read by the replay thread
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

    def send(self, events: list[list[Any]]) -> None:
        """Send events, each `[name, field, ...]` in the array layout, as one message."""
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
        """Stop the replay thread, close the sockets."""
        self.closing.set()
        if self.replay_thread is not None:
            self.replay_thread.join()
        self.ctx.destroy(linger=0)
