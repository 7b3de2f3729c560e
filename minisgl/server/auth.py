"""API keys: with `--api-key`, the server answers only requests that carry one.

The check wraps the whole app (an ASGI middleware), not each route: a route added later,
by a later chapter or by the router's worker routes, is behind the key without a word.
Only a short list of paths stays open: /health and /ready, which load balancers and
Kubernetes probe without credentials, /metrics unless `--protect-metrics` (Prometheus
scrapers are often set up without one), and pages whose HTML holds no data (the live page
of docs/ch30_dashboard.md: its script asks for the key and sends it with each request). An
unknown path asks for a key too, so a client without one learns nothing about which routes
exist.

A client sends `Authorization: Bearer KEY`, as the official OpenAI clients do with their
`api_key`. The key is compared with every accepted key in constant time (the SHA-256 of
each side, by `hmac.compare_digest`), so the time a refusal takes does not tell how much
of a guess was right. Keys come from `--api-key` (given once per key) and MINISGL_API_KEY
(comma-separated); neither is ever logged, and a refusal does not quote what was sent.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the command line reads this module before the web framework loads
    from starlette.types import ASGIApp, Receive, Scope, Send

ENV_VAR = "MINISGL_API_KEY"
OPEN_PATHS = ("/health", "/ready")
OPEN_PATHS += ("/dashboard",)  # the live page's HTML holds no data; it asks for the key  # [ch30]
METRICS_PATH = "/metrics"


def add_auth_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help=f"require `Authorization: Bearer KEY` on every route but /health, /ready and"
        f" /metrics; give it once per key (also {ENV_VAR}, comma-separated)",
    )
    p.add_argument("--protect-metrics", action="store_true", help="/metrics needs the key too")


def api_keys(p: argparse.ArgumentParser, a: argparse.Namespace) -> tuple[str, ...]:
    """The accepted keys, from the flags and the environment; usage errors for bad ones."""
    keys = list(a.api_key) + [k.strip() for k in os.environ.get(ENV_VAR, "").split(",")]
    keys = [k for k in keys if k]
    for i, key in enumerate(keys):  # name the key by its place: never print one
        if not all(33 <= ord(c) < 127 for c in key):
            p.error(f"API key {i + 1} holds spaces or characters an HTTP header cannot carry")
    if a.protect_metrics and not keys:
        p.error(f"--protect-metrics needs a key: --api-key KEY or {ENV_VAR}")
    return tuple(dict.fromkeys(keys))


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


class RequireKey:
    """ASGI middleware: a request to any path but the open ones needs one of `keys`."""

    def __init__(
        self,
        app: ASGIApp,
        keys: tuple[str, ...],
        protect_metrics: bool = False,
        on_refusal: Callable[[], None] = lambda: None,
    ) -> None:
        self.app = app
        self.digests = [_digest(k.encode()) for k in keys]
        self.open = set(OPEN_PATHS) | (set() if protect_metrics else {METRICS_PATH})
        self.on_refusal = on_refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in self.open:
            return await self.app(scope, receive, send)
        why = self.refusal(dict(scope["headers"]).get(b"authorization"))
        if why is None:
            return await self.app(scope, receive, send)
        self.on_refusal()
        if scope["type"] == "websocket":  # before it is accepted: a refused handshake
            return await send({"type": "websocket.close", "code": 1008, "reason": why})
        from starlette.responses import JSONResponse

        from minisgl.server.protocol import APIError

        error = APIError(401, why, kind="invalid_request_error", code="invalid_api_key")
        headers = {"WWW-Authenticate": 'Bearer realm="minisgl"'}
        await JSONResponse(error.body(), 401, headers)(scope, receive, send)

    def refusal(self, header: bytes | None) -> str | None:
        """Why a request with this Authorization header is refused; None if it is not."""
        scheme, _, given = (header or b"").partition(b" ")
        if header is None or scheme.lower() != b"bearer" or not given.strip():
            return "this server needs an API key: send the header `Authorization: Bearer KEY`"
        digest = _digest(given.strip())
        matched = False
        for accepted in self.digests:  # every one, so that the time is the same for each
            matched |= hmac.compare_digest(digest, accepted)
        return None if matched else "the API key is not valid for this server"
