"""The command line of chapter 27: `--dp-size N` replicas behind SGLang's router.

The router is an optional dependency (`pip install "minisgl[router]"`, the `sglang-router`
package); a missing one is a usage error found before any model loads. What a replica set
on one machine cannot do (a shell, ranks on several machines) is refused here as well.

With an API key, the replicas get it as the launcher did (the same flags, the same
environment), and so does the router (`--api-key`): it asks the replicas with it, and
refuses a client without it.

Each replica is told its `--dp-rank` by the launcher: its KV-cache events, if asked for,
go out on the endpoint's port plus that rank and carry it (scheduler/kv_events.py).
"""

from __future__ import annotations

import argparse
import importlib.util
from dataclasses import dataclass

INSTALL = 'pip install "minisgl[router]"'
POLICIES = ["cache_aware", "round_robin", "power_of_two", "random"]


@dataclass(frozen=True)
class Replicas:
    size: int
    policy: str  # the router's: how it picks a replica for each request


def add_dp_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dp-size",
        type=int,
        default=1,
        help=f"replicas of the whole server, behind SGLang's router on --port ({INSTALL})",
    )
    p.add_argument(
        "--router-policy",
        choices=POLICIES,
        default="cache_aware",
        help="how the router picks a replica (default: cache_aware, the longest cached prefix)",
    )
    p.add_argument("--dp-rank", type=int, default=0, help=argparse.SUPPRESS)  # set by --dp-size


def check_dp_options(
    p: argparse.ArgumentParser, a: argparse.Namespace, api_keys: int = 0
) -> Replicas | None:
    if a.dp_size < 1:
        p.error(f"--dp-size takes a number >= 1, got {a.dp_size}")
    if a.dp_size == 1:
        return None
    if a.shell:
        p.error("--dp-size serves over HTTP; --shell chats with one server")
    if a.nnodes > 1 or a.dist_init_addr is not None:
        p.error(
            "--dp-size starts its replicas on this machine; for replicas on several, start a"
            " server on each and the router in front of them (see docs/deployment.md)"
        )
    if api_keys > 1:  # it checks every client's key against the one it holds
        p.error("--dp-size puts SGLang's router in front, which accepts one API key; give one")
    if importlib.util.find_spec("sglang_router") is None:
        p.error(f"--dp-size puts the replicas behind SGLang's router, not installed: {INSTALL}")
    return Replicas(a.dp_size, a.router_policy)
