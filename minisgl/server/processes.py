"""The worker processes behind a server or a shell: start them, watch them, stop them.

Its own module so that both front ends (the HTTP server in launch.py, the shell in
shell.py) can hold a ProcessTree without importing each other. Workers talk over ipc
sockets in a private temporary folder (mode 0700); startup waits for each worker's
ready message, so a worker that cannot start fails the launch instead of hanging it.
Each worker names itself `minisgl::<name>`, so that `ps` and `top` tell them apart from
each other and from the launcher.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import shutil
import signal
import tempfile
from multiprocessing.process import BaseProcess
from typing import Any

import zmq
from setproctitle import setproctitle

from minisgl.engine.limits import EngineLimits
from minisgl.message.frontend import ReadyMsg
from minisgl.message.transport import Reader, address
from minisgl.scheduler.io import run_scheduler_worker
from minisgl.scheduler.ranks import start_followers  # [ch21]
from minisgl.server.args import ServerArgs
from minisgl.tokenizer.worker import run_tokenizer_worker

logger = logging.getLogger("minisgl")


def _worker(name: str, target: Any, *args: Any) -> None:
    setproctitle(f"minisgl::{name}")
    # Ctrl-C reaches the whole process group, and systemd sends SIGTERM to every process of
    # the service: only the launcher decides how to stop, after draining (supervisor.py).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    target(*args)


class ProcessTree:
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.ipc_dir = tempfile.mkdtemp(prefix="minisgl-")  # mode 0700: ours alone
        self.procs: list[BaseProcess] = []
        self._ready = Reader(zmq.Context.instance(), address(self.ipc_dir, "ready"))
        self.limits: EngineLimits | None = None  # the scheduler's, from its ready message

    def start(self) -> None:
        level = self.args.log_level
        config = self.args.scheduler
        # >>> ch21 this machine's other ranks first: rank 0 cannot start until all have joined
        config, ranks = start_followers(config, level, self.args.node_rank, serving=True)
        self.procs += ranks
        if self.args.node_rank > 0:
            return  # a machine without rank 0 hosts ranks only: no tokenizer, no API
        # <<< ch21
        info = self._start("scheduler", run_scheduler_worker, config, self.ipc_dir, level)
        self.limits = EngineLimits.from_dict(info["limits"])
        self._start(
            "tokenizer",
            run_tokenizer_worker,
            self.args.scheduler.model_path,
            self.ipc_dir,
            self.limits,
            level,
        )

    def _spawn(self, name: str, target: Any, *args: Any) -> BaseProcess:
        proc = mp.get_context("spawn").Process(
            target=_worker, args=(name, target, *args), name=f"minisgl-{name}", daemon=True
        )
        proc.start()
        self.procs.append(proc)
        return proc

    def _start(self, name: str, target: Any, *args: Any) -> dict[str, Any]:
        self._spawn(name, target, *args)
        while True:  # loading a model can take a while; a crash must not
            msg = self._ready.recv(timeout_ms=200)
            if isinstance(msg, ReadyMsg) and msg.worker == name:
                if "error" in msg.info:
                    raise RuntimeError(f"the {name} worker failed to start: {msg.info['error']}")
                logger.info("%s worker ready", name)
                return msg.info
            if (proc := self.dead()) is not None:  # it, or a rank it waits for
                raise RuntimeError(f"the {proc.name} worker exited with code {proc.exitcode}")

    def dead(self) -> BaseProcess | None:
        return next((p for p in self.procs if not p.is_alive()), None)

    def stop(self) -> None:
        # A worker keeps nothing that must outlive it, and ignores SIGTERM: SIGKILL, which
        # also ends a stopped or stuck one, is the whole of stopping it.
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join()
        self._ready.socket.close(linger=0)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
