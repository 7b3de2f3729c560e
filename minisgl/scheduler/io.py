"""The scheduler as its own process: messages in, one step, messages out, forever.

When there is work, the loop never blocks on input: it takes whatever arrived and steps.
When there is none, it waits for a message (waking now and then to notice a dead parent).
"""

from __future__ import annotations

import logging
import multiprocessing as mp  # [ch21]
import os
import random  # [ch21]
import signal  # [ch21]
import socket  # [ch21]
from dataclasses import replace  # [ch21]
from multiprocessing.process import BaseProcess  # [ch21]
from typing import Any

import zmq

from minisgl.distributed import broadcast_bytes, get_tp_info  # [ch21]
from minisgl.message.backend import (
    AbortMsg,
    SchedulerOutput,
    SchedulerStats,
    StopMsg,  # [ch21]
    TokenMsg,
    UserMsg,
)
from minisgl.message.codec import decode, encode  # [ch21]
from minisgl.message.frontend import ReadyMsg
from minisgl.message.transport import Reader, Writer, address
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.scheduler import Scheduler
from minisgl.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def scheduler_stats(s: Scheduler) -> SchedulerStats:
    cache = s.cache
    evictable = cache.cache.evictable_tokens // cache.page_size
    return SchedulerStats(
        running=len(s.reqs),
        queued=len(s.prefill.pending),
        kv_pages_total=cache.num_pages,
        kv_pages_in_use=cache.num_pages - cache.allocator.num_free - evictable,
        cached_tokens_total=s.prefill.cached_tokens_total,
        preemptions_total=s.num_preemptions,
    )


def receive(scheduler: Scheduler, messages: list[Any]) -> list[TokenMsg]:
    """Apply new messages; the refusals of requests that can never run come back."""
    refused = []
    for msg in messages:
        if isinstance(msg, AbortMsg):
            scheduler.abort(msg)
        elif isinstance(msg, UserMsg):
            try:
                scheduler.add_request(msg)
            except ValueError as e:  # the tokenizer checks first; this is the last line
                refused.append(TokenMsg(msg.uid, -1, True, None, 0, error=str(e)))
    return refused


def serve(scheduler: Scheduler, inbox: Reader, outbox: Writer) -> None:
    parent = os.getppid()
    while os.getppid() == parent:
        if scheduler.has_work:
            messages = inbox.recv_all()
        else:
            first = inbox.recv(timeout_ms=500)
            messages = [first, *inbox.recv_all()] if first is not None else []
        messages = share_messages(messages)  # every rank applies the same ones  # [ch21]
        refused = receive(scheduler, messages)
        tokens = scheduler.step() if scheduler.has_work else []
        if tokens or refused or messages:
            outbox.send(SchedulerOutput(refused + tokens, scheduler_stats(scheduler)))


def run_scheduler_worker(config: SchedulerConfig, ipc_dir: str, log_level: str) -> None:
    logging.basicConfig(level=log_level, format="%(asctime)s scheduler %(levelname)s %(message)s")
    ctx = zmq.Context()
    ready = Writer(ctx, address(ipc_dir, "ready"))
    try:
        scheduler = Scheduler(config, Tokenizer(config.model_path).eos_token_ids)
    except Exception as e:
        ready.send(ReadyMsg("scheduler", {"error": f"{type(e).__name__}: {e}"}))
        raise
    inbox = Reader(ctx, address(ipc_dir, "scheduler"))
    outbox = Writer(ctx, address(ipc_dir, "detokenizer"))
    info = {"limits": scheduler.limits.to_dict(), "device": str(scheduler.engine.device)}
    ready.send(ReadyMsg("scheduler", info))
    try:
        serve(scheduler, inbox, outbox)
    finally:
        scheduler.shutdown()


# >>> ch21 tensor parallelism: many ranks, one schedule
# Every rank runs a whole Scheduler over its slice of the model. The schedulers never talk
# about batches: they start equal, apply the same messages in the same order and sample the
# same tokens from the same (all-gathered) logits, so they pick the same batch at every
# step without being told. Rank 0 alone hears the outside world and alone replies. Every
# loop turn on every rank is: share, apply, step when there is work; a rank that steps out
# of that order would wait in a collective that the others never join.
def share_messages(messages: list[Any]) -> list[Any]:
    """Rank 0's `messages` on every rank (the others pass an empty list)."""
    tp = get_tp_info()
    if tp.size == 1:
        return messages
    if not tp.is_primary:
        return decode(broadcast_bytes(None))
    for msg in messages:
        # An unseeded request would draw its seed from each rank's own random state.
        if isinstance(msg, UserMsg) and msg.sampling_params.seed is None:
            msg.sampling_params.seed = random.getrandbits(63)
    broadcast_bytes(encode(messages))
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
        receive(scheduler, messages)
        if scheduler.has_work:
            scheduler.step()


def run_follower(config: SchedulerConfig, log_level: str) -> None:
    """A process of its own for rank `config.tp_rank` (> 0), until rank 0 stops it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for whoever started us
    logging.basicConfig(
        level=log_level, format=f"%(asctime)s rank {config.tp_rank} %(levelname)s %(message)s"
    )
    scheduler = Scheduler(config, Tokenizer(config.model_path).eos_token_ids)
    try:
        follow(scheduler)
    finally:
        scheduler.shutdown()


def with_rendezvous(config: SchedulerConfig) -> SchedulerConfig:
    """Give a one-machine run a free local port to meet at, unless it has an address."""
    if config.tp_size == 1 or config.dist_init_addr is not None:
        return config
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return replace(config, dist_init_addr=f"127.0.0.1:{s.getsockname()[1]}")


def start_followers(config: SchedulerConfig, log_level: str = "WARNING") -> list[BaseProcess]:
    """Start ranks 1..tp_size-1 (all on this machine) for an in-process rank 0."""
    procs = []
    for rank in range(1, config.tp_size):
        proc = mp.get_context("spawn").Process(
            target=run_follower,
            args=(replace(config, tp_rank=rank), log_level),
            name=f"minisgl-rank-{rank}",
            daemon=True,
        )
        proc.start()
        procs.append(proc)
    return procs


def stop_followers(procs: list[BaseProcess], timeout: float = 10.0) -> None:
    """Wait for ranks told to stop; end those that do not (or were never told)."""
    for proc in procs:
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()


# <<< ch21
