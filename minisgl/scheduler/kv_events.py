"""KV-cache events: the settings and flags of publishing what the prefix cache holds.

A router that routes by cache contents (llm-d's KV-cache manager, NVIDIA Dynamo's KV router,
SGLang's) keeps an index of which blocks of tokens each replica holds, and learns it from
events that the engines publish. We speak the format vLLM and SGLang publish, so those
consumers read us unchanged: kv_blocks.py turns what the radix cache stores and evicts into
block events, kv_publisher.py sends them over ZMQ. This module is read in the API server's
process too (the flags, the config), so it imports neither torch nor zmq.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

LAYOUTS = ("map", "array")


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
