"""Starting and stopping the process tree: scheduler, tokenizer worker, API server.

The workers talk over ipc sockets in a private temporary folder (mode 0700). Startup waits
for each worker's ready message; afterwards a watchdog turns the server unhealthy and
shuts it down if a worker dies, rather than leaving clients to hang.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import shutil
import signal
import sys
import tempfile
import time
from multiprocessing.process import BaseProcess
from typing import Any

import uvicorn
import zmq

from minisgl.message.frontend import ReadyMsg
from minisgl.message.transport import Reader, address
from minisgl.scheduler.io import run_scheduler_worker
from minisgl.server.api_server import Frontend, create_app
from minisgl.server.args import ServerArgs, parse_args
from minisgl.tokenizer.worker import Limits, run_tokenizer_worker

logger = logging.getLogger("minisgl")
UNHEALTHY_GRACE_S = 2.0  # how long a server with a dead worker reports 503 before exiting


def _ignore_sigint(target: Any, *args: Any) -> None:
    # Ctrl-C reaches the whole process group; only the launcher decides how to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    target(*args)


class ProcessTree:
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.ipc_dir = tempfile.mkdtemp(prefix="minisgl-")  # mode 0700: ours alone
        self.procs: list[BaseProcess] = []
        self._ready = Reader(zmq.Context.instance(), address(self.ipc_dir, "ready"))

    def start(self) -> None:
        level = self.args.log_level
        info = self._start(
            "scheduler", run_scheduler_worker, self.args.scheduler, self.ipc_dir, level
        )
        limits = Limits(info["max_seq_len"], info["max_kv_tokens"], info["vocab_size"])
        self._start(
            "tokenizer",
            run_tokenizer_worker,
            self.args.scheduler.model_path,
            self.ipc_dir,
            limits,
            level,
        )

    def _start(self, name: str, target: Any, *args: Any) -> dict[str, Any]:
        proc = mp.get_context("spawn").Process(
            target=_ignore_sigint, args=(target, *args), name=f"minisgl-{name}", daemon=True
        )
        proc.start()
        self.procs.append(proc)
        while True:  # loading a model can take a while; a crash must not
            msg = self._ready.recv(timeout_ms=200)
            if isinstance(msg, ReadyMsg) and msg.worker == name:
                if "error" in msg.info:
                    raise RuntimeError(f"the {name} worker failed to start: {msg.info['error']}")
                logger.info("%s worker ready", name)
                return msg.info
            if not proc.is_alive():
                raise RuntimeError(f"the {name} worker exited with code {proc.exitcode} at start")

    def dead(self) -> BaseProcess | None:
        return next((p for p in self.procs if not p.is_alive()), None)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + 5
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._ready.socket.close(linger=0)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


async def _serve(args: ServerArgs, tree: ProcessTree) -> int:
    frontend = Frontend(tree.ipc_dir)
    app = create_app(
        frontend,
        args.served_model_name,
        lambda: tree.dead() is None,
        aliases=(args.scheduler.model_path,),
    )
    server = uvicorn.Server(
        uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower())
    )
    receiver = asyncio.create_task(frontend.receive_forever())
    exit_code = 0

    async def watchdog() -> None:
        nonlocal exit_code
        while not server.should_exit:
            if (proc := tree.dead()) is not None:
                logger.error("%s exited with code %s: shutting down", proc.name, proc.exitcode)
                # Answer /health with 503 for a moment, so that monitors see why we go.
                await asyncio.sleep(UNHEALTHY_GRACE_S)
                exit_code, server.should_exit = 1, True
            await asyncio.sleep(0.5)

    watcher = asyncio.create_task(watchdog())
    try:
        await server.serve()
    finally:
        receiver.cancel()
        watcher.cancel()
    return exit_code


async def _run(args: ServerArgs, tree: ProcessTree) -> int:
    # >>> ch17 the shell instead of the HTTP server
    if args.shell:
        from minisgl.shell import run_shell

        return await run_shell(Frontend(tree.ipc_dir), tree)
    # <<< ch17
    return await _serve(args, tree)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
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
