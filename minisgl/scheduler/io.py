"""The scheduler as its own process: messages in, one step, messages out, forever.

When there is work, the loop never blocks on input: it takes whatever arrived and steps.
When there is none, it waits for a message (waking now and then to notice a dead parent).
Every step reports, even a prefill chunk that yields no token: the server takes a long
silence while it waits for answers as a stuck scheduler.

What watches the scheduler is set up here, not in it: the cache flusher, the KV-cache
events (a listener of the radix cache, published once a pass) and the live page's observer
(whose step log listens to the forwards while a page watches).
"""

from __future__ import annotations

import logging
import os

import zmq

from minisgl.message.backend import SchedulerOutput, SchedulerStats
from minisgl.message.frontend import ReadyMsg
from minisgl.message.transport import Reader, Writer, address
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.flush import CacheFlusher  # [ch27]
from minisgl.scheduler.kv_blocks import BlockEvents, start_kv_events  # [ch27]
from minisgl.scheduler.observe import Observer  # [ch30]
from minisgl.scheduler.ranks import share_messages  # [ch21]
from minisgl.scheduler.scheduler import Scheduler
from minisgl.tokenizer.tokenizer import Tokenizer


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
        spec_drafted_total=s.spec.num_drafted,  # [ch26]
        spec_accepted_total=s.spec.num_accepted,  # [ch26]
        spec_accepted_lengths=s.spec.accepted_lengths if s.spec.enabled else None,  # [ch26]
        queued_tokens=sum(len(p.input_ids) for p in s.prefill.pending),  # [ch27]
    )


def serve(
    scheduler: Scheduler,
    inbox: Reader,
    outbox: Writer,
    kv_events: BlockEvents | None = None,  # [ch27]
) -> None:
    parent = os.getppid()
    flusher = CacheFlusher(scheduler, kv_events)  # [ch27]
    observer = Observer(scheduler)  # snapshots for the live page, while one watches  # [ch30]
    while os.getppid() == parent:
        if scheduler.has_work:
            messages = inbox.recv_all()
        else:
            first = inbox.recv(timeout_ms=500)
            messages = [first, *inbox.recv_all()] if first is not None else []
        messages = share_messages(messages)  # every rank applies the same ones  # [ch21]
        flusher.apply(messages)  # [ch27]
        observer.receive(messages)  # [ch30]
        refused = scheduler.receive(messages)
        stepped = scheduler.has_work
        tokens = scheduler.step() if stepped else []
        if kv_events is not None:  # what this pass stored and evicted, as one message  # [ch27]
            kv_events.publish()  # [ch27]
        if stepped or refused or messages:
            stats = scheduler_stats(scheduler)
            flusher.report(stats)  # [ch27]
            output = SchedulerOutput(refused + tokens, stats)
            output.dashboard = observer.publish(tokens)  # [ch30]
            outbox.send(output)


def run_scheduler_worker(config: SchedulerConfig, ipc_dir: str, log_level: str) -> None:
    logging.basicConfig(level=log_level, format="%(asctime)s scheduler %(levelname)s %(message)s")
    ctx = zmq.Context()
    ready = Writer(ctx, address(ipc_dir, "ready"))
    try:
        scheduler = Scheduler(config, Tokenizer(config.model_path).eos_token_ids)
        kv_events = start_kv_events(config, scheduler)  # [ch27]
    except Exception as e:
        ready.send(ReadyMsg("scheduler", {"error": f"{type(e).__name__}: {e}"}))
        raise
    inbox = Reader(ctx, address(ipc_dir, "scheduler"))
    outbox = Writer(ctx, address(ipc_dir, "detokenizer"))
    info = {"limits": scheduler.limits.to_dict(), "device": str(scheduler.engine.device)}
    ready.send(ReadyMsg("scheduler", info))
    try:
        serve(
            scheduler,
            inbox,
            outbox,
            kv_events,  # [ch27]
        )
    finally:
        scheduler.shutdown()
        if kv_events is not None:  # [ch27]
            kv_events.close()  # [ch27]
