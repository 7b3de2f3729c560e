"""Tensor parallelism on the scheduler's side: many ranks, one schedule.

Every rank runs a whole Scheduler over its slice of the model. The schedulers never talk
about batches: they start equal, apply the same messages in the same order and sample the
same tokens from the same (all-gathered) logits, so they pick the same batch at every
step without being told. Rank 0 alone hears the outside world and alone replies. Every
loop turn on every rank is: share, apply, step when there is work; a rank that steps out
of that order would wait in a collective that the others never join.

Ranks 1.. are processes of their own, started here for the server and the offline LLM
alike; whoever starts them runs rank 0 itself, with the config they share.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import random
import signal
import socket
from dataclasses import replace
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event
from typing import Any

from setproctitle import setproctitle

from minisgl.distributed import broadcast_bytes, get_tp_info
from minisgl.layers.parallel import check_tp
from minisgl.message.backend import StopMsg, UserMsg
from minisgl.message.codec import decode, encode
from minisgl.models.config import ModelConfig
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.scheduler import Scheduler
from minisgl.speculative.cost import read_clock, stamp_clock  # [ch26]
from minisgl.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def share_messages(messages: list[Any]) -> list[Any]:
    """Rank 0's `messages` on every rank (the others pass an empty list)."""
    tp = get_tp_info()
    if tp.size == 1:
        return messages
    if not tp.is_primary:
        data = broadcast_bytes(None)
        data = read_clock(data)  # rank 0's, which speculation's step costs read  # [ch26]
        return decode(data)
    for msg in messages:
        # An unseeded request would draw its seed from each rank's own random state.
        if isinstance(msg, UserMsg) and msg.sampling_params.seed is None:
            msg.sampling_params.seed = random.getrandbits(63)
    data = encode(messages)
    data = stamp_clock(data)  # [ch26]
    broadcast_bytes(data)
    return messages


def follow(scheduler: Scheduler) -> None:
    """The loop of every rank but 0: rank 0's messages in, one step, the replies dropped."""
    while True:
        try:
            messages = share_messages([])
        except RuntimeError as e:  # gloo: the connection to rank 0 is gone
            logger.warning("rank 0 has gone (%s): stopping", e)
            return
        if any(isinstance(m, StopMsg) for m in messages):
            return
        scheduler.receive(messages)
        if scheduler.has_work:
            scheduler.step()


def run_follower(
    config: SchedulerConfig, log_level: str, started: Event, serving: bool = False
) -> None:
    """A process of its own for rank `config.tp_rank` (> 0), until rank 0 stops it."""
    started.set()  # it got past importing the parent's main module: see wait_started
    setproctitle(f"minisgl::scheduler-{config.tp_rank}")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for whoever started us
    if serving:  # so is SIGTERM, which systemd sends to every process: the server drains,
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # and this rank steps with rank 0
    logging.basicConfig(
        level=log_level, format=f"%(asctime)s rank {config.tp_rank} %(levelname)s %(message)s"
    )
    scheduler = Scheduler(config, Tokenizer(config.model_path).eos_token_ids)
    scheduler.spec.together = not serving  # as rank 0's: LLM.generate's  # [ch26]
    try:
        follow(scheduler)
    finally:
        scheduler.shutdown()


def start_followers(
    config: SchedulerConfig, log_level: str = "WARNING", node_rank: int = 0, serving: bool = False
) -> tuple[SchedulerConfig, list[BaseProcess]]:
    """Start this machine's ranks other than 0; the config every rank shares comes back.

    A server's ranks (`serving`) ignore SIGTERM, as its other workers do, and are killed by
    the launcher once it has drained; the offline LLM's die of it, as its own process does
    (and multiprocessing sends it to them when that process exits).

    The model is checked to split over `tp_size` ranks before any starts. Ranks are
    numbered across machines, `tp_size // nnodes` on each, rank 0 on node 0; a run on
    one machine without a rendezvous address is given a free local port to meet at.
    """
    if config.tp_size == 1:
        return config, []
    check_tp(ModelConfig.from_path(config.model_path), config.tp_size)
    if config.dist_init_addr is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            config = replace(config, dist_init_addr=f"127.0.0.1:{s.getsockname()[1]}")
    per_node = config.tp_size // config.nnodes
    first = node_rank * per_node
    spawn = mp.get_context("spawn")
    procs, started = [], []
    for rank in range(max(first, 1), first + per_node):
        started.append(spawn.Event())
        proc = spawn.Process(
            target=run_follower,
            args=(replace(config, tp_rank=rank), log_level, started[-1], serving),
            name=f"minisgl-scheduler-{rank}",
            daemon=True,
        )
        proc.start()
        procs.append(proc)
    wait_started(procs, started)
    return config, procs


def wait_started(procs: list[BaseProcess], started: list[Event]) -> None:
    """Raise if a rank dies before it runs our code, rather than wait for it to join forever.

    A spawned process first imports the main module of its parent; a script that builds an
    LLM at its top level, without the main guard, starts ranks again from inside a rank, and
    multiprocessing ends that rank before it reaches run_follower.
    """
    for proc, event in zip(procs, started):
        while not event.wait(0.05):
            if not proc.is_alive():
                stop_followers(procs, timeout=0.0)
                raise RuntimeError(
                    f"tensor-parallel rank {proc.name} exited with code {proc.exitcode} while"
                    " starting. Each rank is a new process that imports your main module: if"
                    " a script creates LLM(tp_size=...) at its top level, put that code under"
                    ' `if __name__ == "__main__":` (see the rank\'s error above)'
                )


def stop_followers(procs: list[BaseProcess], timeout: float = 10.0) -> None:
    """Wait for ranks told to stop; end those that do not (or were never told)."""
    for proc in procs:
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()


async def wait_for_ranks(procs: list[BaseProcess]) -> int:
    """On a machine that hosts ranks only: wait until one ends; 0 if it ended cleanly."""
    while (proc := next((p for p in procs if not p.is_alive()), None)) is None:
        await asyncio.sleep(0.5)
    logger.info("%s exited with code %s", proc.name, proc.exitcode)
    return 0 if proc.exitcode == 0 else 1
