"""The entry point of `python -m minisgl`: parse the command line, start the workers, serve.

The workers are a ProcessTree (processes.py), stopped whatever happens. While serving, the
Supervisor (supervisor.py) ends every request and the server if a worker dies, rather than
leaving clients to hang, and drains on SIGTERM.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import TYPE_CHECKING

from minisgl.server.args import ServerArgs, parse_args
from minisgl.server.frontend import Frontend
from minisgl.server.processes import ProcessTree
from minisgl.server.replicas import serve_replicas  # [ch27]
from minisgl.shell import run_shell  # [ch17]

if TYPE_CHECKING:
    from fastapi import FastAPI

    from minisgl.server.metrics import Metrics

logger = logging.getLogger("minisgl")


async def _serve(args: ServerArgs, tree: ProcessTree) -> int:
    # Imported once the workers are started, so that FastAPI's, pydantic's and uvicorn's
    # imports (a quarter of a second, more from a cold disk) overlap the engine's load.
    import uvicorn

    from minisgl.server.api_server import create_app
    from minisgl.server.clients import KEEP_ALIVE_S, ClientTimeouts
    from minisgl.server.dashboard import add_dashboard_routes  # [ch30]
    from minisgl.server.supervisor import Supervisor
    from minisgl.server.worker_api import add_worker_routes  # [ch27]

    tree.wait_ready()
    limits = tree.limits
    assert limits is not None, "the scheduler reports its limits when it is ready"
    max_requests = limits.max_running_req + args.max_queued_requests
    queued_tokens = args.max_queued_tokens
    if queued_tokens is None:  # what the pool can take in twice more, while it runs a full one
        queued_tokens = 2 * limits.max_kv_tokens
    max_tokens = limits.max_kv_tokens + queued_tokens
    frontend = Frontend(tree.ipc_dir, limits.num_pages, max_requests, max_tokens)
    app = create_app(
        frontend,
        args.served_model_name,
        lambda: server.live(),
        limits.vocab_size,
        aliases=(args.scheduler.model_path,),
        ready=lambda: server.ready(),
    )
    add_worker_routes(app, frontend, args, limits, tree.ipc_dir)  # what routers ask  # [ch27]
    if args.dashboard:  # [ch30]
        add_dashboard_routes(app, frontend, tree.ipc_dir, args.dashboard_text)  # [ch30]
    _guard(app, args, frontend.metrics)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level.lower(),
        http=ClientTimeouts.with_timeout(args.client_timeout),
        timeout_keep_alive=KEEP_ALIVE_S,
    )
    timeouts = args.shutdown_timeout, args.worker_timeout
    server = Supervisor(config, frontend, tree.dead, *timeouts)
    receiver = asyncio.create_task(frontend.receive_forever())
    watcher = asyncio.create_task(server.watch())
    try:
        await server.serve()
    finally:
        receiver.cancel()
        watcher.cancel()
    return server.exit_code


def _guard(app: FastAPI, args: ServerArgs, metrics: Metrics) -> None:
    """Around every route, those above and any added later: the key first, then the body's
    size, then a watch for a client that hangs up."""
    from minisgl.server.auth import RequireKey
    from minisgl.server.clients import WatchClients
    from minisgl.server.limits import BodyLimit

    refused = metrics.error_responses.labels
    app.add_middleware(WatchClients)
    app.add_middleware(BodyLimit, limit=args.max_request_bytes, on_refusal=refused("413").inc)
    if args.api_keys:  # the last added is the outermost: no body is read without a key
        app.add_middleware(
            RequireKey,
            keys=args.api_keys,
            protect_metrics=args.protect_metrics,
            on_refusal=refused("401").inc,
        )


async def _run(args: ServerArgs, tree: ProcessTree) -> int:
    # >>> ch21 a machine that hosts ranks only serves nothing
    if args.node_rank > 0:
        from minisgl.scheduler.ranks import wait_for_ranks  # torch: not for the API server

        return await wait_for_ranks(tree.procs)
    # <<< ch21
    # >>> ch17 the shell instead of the HTTP server
    if args.shell:
        tree.wait_ready()
        return await run_shell(Frontend(tree.ipc_dir), tree)
    # <<< ch17
    return await _serve(args, tree)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    if args.replicas is not None:  # [ch27]
        sys.exit(serve_replicas(args, sys.argv[1:] if argv is None else argv))  # [ch27]
    tree = ProcessTree(args)
    # SIGTERM during start-up (before uvicorn takes the signals) must still clean up.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    code = 1
    try:
        tree.start()
        code = asyncio.run(_run(args, tree))
    except KeyboardInterrupt:
        code = 130
    except RuntimeError as e:
        logger.error("%s", e)
    finally:
        tree.stop()
    sys.exit(code)
