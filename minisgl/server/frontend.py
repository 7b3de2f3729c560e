"""The front end's end of the pipes to the workers, shared by the HTTP server and the shell.

Each request is sent to the tokenizer worker; its tokens come back as text deltas on one
socket that a background task reads and routes to the waiting request by its uid. Every
answer, whole or streamed, of every route and of the shell, reads them through one loop
(`results`), so that a refusal, a worker's error or the server stopping ends each of them
the same way. The front end also counts what /metrics reports. It knows nothing of HTTP,
so an interactive shell can drive the same workers without a web framework.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import zmq.asyncio

from minisgl.message.backend import AbortMsg, SchedulerStats
from minisgl.message.codec import encode
from minisgl.message.dashboard import DashboardSnapshot  # [ch30]
from minisgl.message.frontend import AcceptedMsg, DeltaMsg, RejectedMsg, TokenizeMsg
from minisgl.message.transport import AsyncReader, AsyncWriter, address
from minisgl.server.logprobs import FullChoice  # [ch25]
from minisgl.server.metrics import Metrics
from minisgl.server.protocol import APIError


@dataclass
class Choice:
    """One of a request's n completions, as it streams in."""

    uid: int
    index: int
    text: list[str] = field(default_factory=list)
    tokens: int = 0
    logprobs: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)  # for logprobs
    finish_reason: str | None = None
    started: float | None = None  # its arrival, then its first token's time
    arrived: float | None = None
    full: FullChoice = field(default_factory=FullChoice)  # [ch25]


class Frontend:
    """The pipes to the tokenizer worker, and the routing of its answers by uid."""

    def __init__(
        self,
        ipc_dir: str,
        kv_pages_total: int = 0,
        max_requests: int | None = None,
        max_tokens_held: int | None = None,
    ) -> None:
        ctx = zmq.asyncio.Context()
        self.to_tokenizer = AsyncWriter(ctx, address(ipc_dir, "tokenizer"))
        self.inbox = AsyncReader(ctx, address(ipc_dir, "api"))
        self.queues: dict[int, asyncio.Queue] = {}
        self.uids = itertools.count()
        self.metrics = Metrics(kv_pages_total)
        self.metrics.open_requests.set_function(lambda: len(self.queues))
        self.max_requests = max_requests  # running and queued together; beyond it, a 503
        # Their prompts' tokens, as the tokenizer counted them: what they hold of the memory
        # (here a prompt of token ids takes some 70 bytes a token) and of the time to come.
        self.max_tokens_held = max_tokens_held
        self.tokens_held, self._tokens = 0, {}  # in all, and by uid
        self.refusal: APIError | None = None  # once set, every new request gets it
        self.failed = False  # every request was ended (`fail`): the workers may be gone
        self.heard = time.monotonic()  # the workers' last word, or the first request since
        self.dashboard: DashboardSnapshot | None = None  # the live page's latest  # [ch30]
        # by uid: AcceptedMsg.thinking and think_style, where it is set  # [ch25]
        self.thinking: dict[int, tuple[str, str]] = {}  # [ch25]

    async def receive_forever(self) -> None:
        while True:
            msg = await self.inbox.recv()
            self.heard = time.monotonic()
            if isinstance(msg, SchedulerStats):
                self.metrics.stats = msg
            elif isinstance(msg, DashboardSnapshot):  # [ch30]
                self.dashboard = msg  # [ch30]
            elif (queue := self.queues.get(msg.uid)) is not None:
                queue.put_nowait(msg)

    async def open(self, msgs: list[TokenizeMsg], per_prompt: int = 1) -> tuple[asyncio.Queue, int]:
        """Submit the requests; returns their shared queue and their prompts' tokens, where
        each run of `per_prompt` requests (the n choices of one prompt) counts its prompt once."""
        if self.refusal is not None:
            raise self.refusal
        if self.max_requests is not None and len(self.queues) + len(msgs) > self.max_requests:
            message = (
                f"the server holds {len(self.queues)} requests, its limit is {self.max_requests}"
                " (--max-running-requests plus --max-queued-requests); retry later"
            )
            raise APIError(503, message, code="queue_full", retry_after=1)
        if self.max_tokens_held is not None and self.tokens_held >= self.max_tokens_held:
            message = (
                f"the server holds {self.tokens_held} prompt tokens, its limit is"
                f" {self.max_tokens_held} (the KV cache's, plus --max-queued-tokens); retry later"
            )
            raise APIError(503, message, code="queue_full", retry_after=1)
        for msg in msgs:
            try:  # the request models let through only what msgpack carries; a last check
                encode(msg)
            except (OverflowError, UnicodeEncodeError) as e:
                raise APIError(400, f"the request cannot be passed on: {e}") from None
        queue: asyncio.Queue = asyncio.Queue()
        uids = [m.uid for m in msgs]
        if not self.queues:  # the workers had nothing to say until now
            self.heard = time.monotonic()
        for msg in msgs:
            self.queues[msg.uid] = queue
            await self.to_tokenizer.send(msg)
        prompt_tokens, refusal, early = 0, None, []
        waiting = set(uids)
        try:
            while waiting:
                reply = await queue.get()
                if isinstance(reply, APIError):
                    raise reply
                if isinstance(reply, AcceptedMsg):
                    prompt_tokens += reply.prompt_tokens
                    self._tokens[reply.uid] = reply.prompt_tokens
                    self.tokens_held += reply.prompt_tokens
                    if reply.thinking is not None:  # [ch25]
                        self.thinking[reply.uid] = reply.thinking, reply.think_style  # [ch25]
                elif isinstance(reply, RejectedMsg):
                    refusal = reply
                else:  # a choice already accepted may produce tokens before the others are
                    early.append(reply)
                    continue
                waiting.discard(reply.uid)
        except (asyncio.CancelledError, APIError):
            await self.close(uids, abort=True)
            raise
        if refusal is not None:
            await self.close(uids, abort=True)
            param = "messages" if msgs[0].messages else "prompt"
            raise APIError(refusal.status, refusal.message, param, code=refusal.code)
        for reply in early + [queue.get_nowait() for _ in range(queue.qsize())]:
            queue.put_nowait(reply)  # back in their order, ahead of what came after
        prompt_tokens //= per_prompt  # n choices share one prompt
        self.metrics.requests.inc(len(msgs))
        self.metrics.prompt_tokens.inc(prompt_tokens)
        return queue, prompt_tokens

    # >>> ch25 a stream's status waits for the scheduler's checks
    async def started(self, queue: asyncio.Queue, uids: list[int]) -> None:
        """Wait for every request's first token, or for the refusal of the scheduler's own
        checks (a grammar it cannot compile), raised: a stream that waits for this before
        its status answers a refused request with a 400, not with an event after a 200."""
        seen: set[int] = set()
        early = []
        try:
            while len(seen) < len(uids):
                reply = await queue.get()
                if isinstance(reply, APIError):
                    raise reply
                if isinstance(reply, RejectedMsg):
                    raise APIError(reply.status, reply.message, code=reply.code)
                early.append(reply)
                seen.add(reply.uid)
        except (asyncio.CancelledError, APIError):
            await self.close(uids, abort=True)
            raise
        for reply in early + [queue.get_nowait() for _ in range(queue.qsize())]:
            queue.put_nowait(reply)  # back in their order, ahead of what came after

    # <<< ch25
    async def results(
        self, queue: asyncio.Queue, choices: list[Choice]
    ) -> AsyncIterator[tuple[Choice, DeltaMsg]]:
        """The choices' deltas as they come, each recorded in its choice, until all have
        finished. A failure (the scheduler's refusal, a worker's error, the server stopping)
        is counted and raised as an APIError. However the loop ends, early included (an
        error, a client that hangs up), the choices still running are aborted."""
        by_uid = {c.uid: c for c in choices}
        try:
            while any(c.finish_reason is None for c in choices):
                reply: DeltaMsg | RejectedMsg | APIError = await queue.get()
                if isinstance(reply, APIError | RejectedMsg):
                    self.metrics.failed_requests.inc()
                    if isinstance(reply, RejectedMsg):
                        reply = APIError(reply.status, reply.message, code=reply.code)
                    raise reply
                choice = by_uid[reply.uid]
                self.record(choice, reply)
                yield choice, reply
        finally:
            await self.end(choices)

    async def end(self, choices: list[Choice]) -> None:
        """Stop routing the choices' results, and abort those still running. A stream calls
        it too, for the events it sends before its first delta; a second call does nothing."""
        await self.close([c.uid for c in choices if c.finish_reason is None], abort=True)
        await self.close([c.uid for c in choices], abort=False)

    async def close(self, uids: list[int], abort: bool) -> None:
        """Stop routing results for these requests; with `abort`, stop computing them too.
        A request already closed is left alone."""
        uids = [uid for uid in uids if uid in self.queues]
        if abort:
            self.metrics.aborted_requests.inc(len(uids))
        for uid in uids:
            self.queues.pop(uid, None)
            self.tokens_held -= self._tokens.pop(uid, 0)
            self.thinking.pop(uid, None)  # [ch25]
            if abort and not self.failed:
                self.to_tokenizer.send_nowait(AbortMsg(uid))

    def fail(self, error: APIError) -> None:
        """End every request now with `error`, and refuse every new one with it."""
        self.refusal, self.failed = error, True
        for queue in set(self.queues.values()):
            queue.put_nowait(error)

    def record(self, choice: Choice, delta: DeltaMsg) -> None:
        now = time.perf_counter()
        choice.full.record(delta)  # [ch25]
        choice.text.append(delta.text)
        if delta.token is not None:
            self.metrics.generation_tokens.inc()
            choice.tokens += 1
            choice.token_ids.append(delta.token)
            if delta.logprob is not None:
                choice.logprobs.append(delta.logprob)
                choice.token_texts.append(delta.token_text or "")
            if choice.tokens == 1:
                self.metrics.ttft.observe(now - choice.started)
                choice.started = now
        if delta.finished:
            choice.finish_reason = delta.finish_reason or "stop"
            if choice.tokens > 1:
                self.metrics.tpot.observe((now - choice.started) / (choice.tokens - 1))
            if choice.arrived is not None:
                self.metrics.e2e.observe(now - choice.arrived)
