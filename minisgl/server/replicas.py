"""`--dp-size N`: N replicas of the server on one machine, behind SGLang's router, as one service.

Each replica is a plain `python -m minisgl` with the same flags, on a free local port,
pinned to its own GPUs by CUDA_VISIBLE_DEVICES (on CPU, N processes share the cores), and
told its rank (KV-cache events go out on a port of its own and carry it). In
front of them, on the user's --host and --port, runs SGLang's router (the Rust binary of
the `sglang-router` package), which picks a replica for each request by --router-policy.
There is no router of our own: the field's is what production runs, and it is better.

One command, one port, one exit. SIGTERM or SIGINT is passed on once to every child: the
replicas drain (supervisor.py) and the router finishes what it forwards; a second signal is
passed on again and ends the drain. A child that exits ends the others, and the launcher
exits 1, so that whoever runs it starts the whole set again. The kernel sends each child
SIGTERM if the launcher itself dies (PR_SET_PDEATHSIG), so nothing outlives it.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from types import FrameType

from minisgl.server.args import ServerArgs

logger = logging.getLogger("minisgl")
POLL_S = 0.2
KILL_GRACE_S = 5.0  # beyond the drain, for a child to exit before it is killed
ROUTER_LOG_LEVELS = {"DEBUG": "debug", "INFO": "info", "WARNING": "warn"}


def serve_replicas(args: ServerArgs, argv: list[str]) -> int:
    """Run the replicas and the router until a signal or a death; the exit code."""
    group = ReplicaSet(args, argv)
    before = {s: signal.signal(s, group.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return group.run()
    except RuntimeError as e:
        logger.error("%s", e)
        return 1
    finally:
        group.stop()
        for sig, handler in before.items():
            signal.signal(sig, handler)


class ReplicaSet:
    def __init__(self, args: ServerArgs, argv: list[str]) -> None:
        assert args.replicas is not None
        self.args, self.argv = args, argv
        self.size, self.policy = args.replicas.size, args.replicas.policy
        self.children: list[tuple[str, subprocess.Popen]] = []
        self.signals = 0  # received, and passed on to the children
        self.passed_on = 0

    def on_signal(self, sig: int, frame: FrameType | None) -> None:
        self.signals += 1

    def run(self) -> int:
        urls = []
        for i, (port, gpus) in enumerate(zip(free_ports(self.size), gpu_sets(self.args))):
            self.spawn(f"replica {i}", self.replica_command(port, i), gpus)
            urls.append(f"http://127.0.0.1:{port}")
            where = f" on GPU {gpus}" if gpus is not None else ""
            logger.info("replica %d: %s%s", i, urls[-1], where)
        for url in urls:
            if not self.wait_ready(url + "/health"):
                return self.failure()
        metrics_port = free_ports(1)[0]
        self.spawn("router", self.router_command(urls, metrics_port), None)
        ready = self.wait_ready(f"http://{_local(self.args.host)}:{self.args.port}/readiness")
        if not ready and self.dead() is not None:
            return self.failure()
        if ready:  # else a signal came first; the replicas serve already, so it drains them
            logger.info(
                "%d replicas behind SGLang's router (%s) on http://%s:%d; its own metrics on"
                " http://127.0.0.1:%d/metrics",
                self.size,
                self.policy,
                self.args.host,
                self.args.port,
                metrics_port,
            )
        while self.signals == 0:
            if self.dead() is not None:
                return self.failure()
            time.sleep(POLL_S)
        return self.drain()

    def replica_command(self, port: int, rank: int) -> list[str]:
        # argparse keeps a flag's last value: the same command, on a port of its own, alone.
        local = ["--host", "127.0.0.1", "--port", str(port), "--dp-size", "1"]
        local += ["--dp-rank", str(rank)]
        return [sys.executable, "-m", "minisgl", *self.argv, *local]

    def router_command(self, urls: list[str], metrics_port: int) -> list[str]:
        a = self.args
        return [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--worker-urls",
            *urls,
            "--host",
            a.host,
            "--port",
            str(a.port),
            "--policy",
            self.policy,
            "--prometheus-host",  # its default port, 29000, would be taken by a second set
            "127.0.0.1",
            "--prometheus-port",
            str(metrics_port),
            "--shutdown-grace-period-secs",
            str(math.ceil(a.shutdown_timeout)),
            "--log-level",
            ROUTER_LOG_LEVELS.get(a.log_level, "error"),
            *(["--api-key", a.api_keys[0]] if a.api_keys else []),
        ]

    def spawn(self, name: str, cmd: list[str], gpus: str | None) -> None:
        env = dict(os.environ)
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_die_with_us)
        self.children.append((name, proc))

    def wait_ready(self, url: str) -> bool:
        """Poll `url` until it answers 200; False if a signal or a death comes first."""
        while self.signals == 0 and self.dead() is None:
            try:
                with urllib.request.urlopen(url, timeout=1) as r:
                    if r.status == 200:
                        return True
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        return False

    def dead(self) -> tuple[str, subprocess.Popen] | None:
        return next(((n, p) for n, p in self.children if p.poll() is not None), None)

    def failure(self) -> int:
        if (child := self.dead()) is not None:
            name, proc = child
            logger.error("%s exited with code %s: stopping the others", name, proc.returncode)
            return 1
        return 128 + signal.SIGTERM  # a signal during start-up

    def drain(self) -> int:
        """Pass each signal on; wait for every child to exit, up to the drain and a grace."""
        deadline = time.monotonic() + self.args.shutdown_timeout + KILL_GRACE_S
        while time.monotonic() < deadline:
            if self.passed_on < self.signals:
                self.passed_on += 1
                self.terminate()
            if all(p.poll() is not None for _, p in self.children):
                return 0 if all(p.returncode == 0 for _, p in self.children) else 1
            time.sleep(POLL_S)
        logger.error("children still running after the drain: killing them")
        return 1

    def terminate(self) -> None:
        for _, proc in self.children:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        """Whatever happened, no child outlives the launcher."""
        if any(p.poll() is None for _, p in self.children):
            self.terminate()
            deadline = time.monotonic() + self.args.shutdown_timeout + KILL_GRACE_S
            while time.monotonic() < deadline and any(p.poll() is None for _, p in self.children):
                time.sleep(POLL_S)
        for _, proc in self.children:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def free_ports(n: int) -> list[int]:
    """n distinct ports free now (held open together, so that none repeats)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def gpu_sets(args: ServerArgs) -> list[str | None]:
    """Each replica's CUDA_VISIBLE_DEVICES: --tp-size GPUs apiece; None on CPU."""
    assert args.replicas is not None
    n, tp, device = args.replicas.size, args.scheduler.tp_size, args.scheduler.device
    import torch  # to count the GPUs: here, for the launcher that imports us has no torch

    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return [None] * n
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    if len(gpus) < n * tp:
        raise RuntimeError(
            f"--dp-size {n} times --tp-size {tp} needs {n * tp} GPUs; {len(gpus)} are visible"
        )
    return [",".join(gpus[i * tp : (i + 1) * tp]) for i in range(n)]


def _local(host: str) -> str:
    """Where this machine reaches a server that listens on `host`."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host  # an IPv6 address, in a URL


def _die_with_us() -> None:
    """In the child, before it runs: SIGTERM when the launcher dies, however it dies."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
