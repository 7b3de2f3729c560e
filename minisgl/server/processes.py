"""The worker processes behind a server or a shell: start them, watch them, stop them.

Its own module so that both front ends (the HTTP server in launch.py, the shell in
shell.py) can hold a ProcessTree without importing each other. Workers talk over ipc
sockets in a private temporary folder (mode 0700); startup waits for each worker's
ready message, so a worker that cannot start fails the launch instead of hanging it.
Each worker names itself `minisgl::<name>`, so that `ps` and `top` tell them apart from
each other and from the launcher.

The workers start together: the tokenizer worker loads its tokenizer while the scheduler
loads the model, then waits for the engine's limits, which the launcher forwards from the
scheduler's ready message. A worker is named by the module and function it runs, imported
in its own process only: this module (which the API server's process imports) and the
tokenizer worker stay free of torch, and each worker logs how long its imports took.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing as mp
import shutil
import signal
import tempfile
import time
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

import zmq
from setproctitle import setproctitle

from minisgl.engine.limits import EngineLimits
from minisgl.message.frontend import ReadyMsg
from minisgl.message.transport import Reader, Writer, address

if TYPE_CHECKING:
    from minisgl.server.args import ServerArgs

logger = logging.getLogger("minisgl")
SCHEDULER = "minisgl.scheduler.io:run_scheduler_worker"
TOKENIZER = "minisgl.tokenizer.worker:run_tokenizer_worker"


def _worker(name: str, target: str, log_level: str, *args: Any) -> None:
    setproctitle(f"minisgl::{name}")
    # Ctrl-C reaches the whole process group, and systemd sends SIGTERM to every process of
    # the service: only the launcher decides how to stop, after draining (supervisor.py).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=f"%(asctime)s {name} %(levelname)s %(message)s")
    began = time.perf_counter()
    module, function = target.split(":")
    run = getattr(importlib.import_module(module), function)
    logger.info("start-up: %s imports took %.2fs", name, time.perf_counter() - began)
    run(*args, log_level)


class ProcessTree:
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.ipc_dir = tempfile.mkdtemp(prefix="minisgl-")  # mode 0700: ours alone
        self.procs: list[BaseProcess] = []
        ctx = zmq.Context.instance()
        self._ready = Reader(ctx, address(self.ipc_dir, "ready"))
        self._to_tokenizer = Writer(ctx, address(self.ipc_dir, "tokenizer"))
        self.limits: EngineLimits | None = None  # the scheduler's, from its ready message

    def start(self) -> None:
        """Start the workers, without waiting for them (`wait_ready`)."""
        config = self.args.scheduler
        # >>> ch21 this machine's other ranks first: rank 0 cannot start until all have joined
        if config.tp_size > 1:
            from minisgl.scheduler.ranks import start_followers  # torch: only for more ranks

            config, ranks = start_followers(
                config, self.args.log_level, self.args.node_rank, serving=True
            )
            self.procs += ranks
        if self.args.node_rank > 0:
            return  # a machine without rank 0 hosts ranks only: no tokenizer, no API
        # <<< ch21
        logger.info("start-up: starting the scheduler and tokenizer workers")
        self._spawn("scheduler", SCHEDULER, config, self.ipc_dir)
        self._spawn("tokenizer", TOKENIZER, config.model_path, self.ipc_dir)

    def wait_ready(self) -> None:
        """Until both workers are ready; raise RuntimeError if one fails or dies first."""
        if self.args.node_rank > 0:  # [ch21]
            return  # [ch21]
        info = self._wait_ready("scheduler")
        self.limits = EngineLimits.from_dict(info["limits"])
        self._to_tokenizer.send(ReadyMsg("scheduler", info))  # what it checks prompts against
        self._wait_ready("tokenizer")

    def _spawn(self, name: str, target: str, *args: Any) -> None:
        proc = mp.get_context("spawn").Process(
            target=_worker,
            args=(name, target, self.args.log_level, *args),
            name=f"minisgl-{name}",
            daemon=True,
        )
        proc.start()
        self.procs.append(proc)

    def _wait_ready(self, name: str) -> dict[str, Any]:
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
        self._to_tokenizer.socket.close(linger=0)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
