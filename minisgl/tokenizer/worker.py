"""The tokenizer worker: text in from the API server, token ids out to the scheduler, and
generated tokens back as text.

It runs in its own process so that tokenizing a long prompt or detokenizing a big batch
never stalls the HTTP server's event loop or the scheduler's step. A bug that one request
hits here (its state is its own detokenizer) fails that request with a 500, not the worker.
"""

from __future__ import annotations

import logging
import os
import time

import zmq

from minisgl.engine.limits import EngineLimits, PromptTooLong
from minisgl.message.backend import AbortMsg, SchedulerOutput, TokenMsg, UserMsg
from minisgl.message.frontend import (
    AcceptedMsg,
    DeltaMsg,
    ReadyMsg,
    RejectedMsg,
    TokenizeMsg,
)
from minisgl.message.transport import Reader, Writer, address
from minisgl.server.reasoning import STYLES  # [ch25]
from minisgl.tokenizer.detokenizer import IncrementalDetokenizer
from minisgl.tokenizer.logprobs import LogprobTexts  # [ch25]
from minisgl.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class TokenizerWorker:
    """Ready once built. The server starts it with the scheduler: it loads the tokenizer while
    the engine loads, then waits for the engine's limits (None given), which prompts must fit."""

    def __init__(self, model_path: str, ipc_dir: str, limits: EngineLimits | None = None) -> None:
        began = time.perf_counter()
        self.tokenizer = Tokenizer(model_path)
        logger.info("start-up: tokenizer loaded in %.2fs", time.perf_counter() - began)
        ctx = zmq.Context()
        self.from_api = Reader(ctx, address(ipc_dir, "tokenizer"))
        self.from_scheduler = Reader(ctx, address(ipc_dir, "detokenizer"))
        self.to_scheduler = Writer(ctx, address(ipc_dir, "scheduler"))
        self.to_api = Writer(ctx, address(ipc_dir, "api"))
        self.poller = zmq.Poller()
        self.poller.register(self.from_api.socket, zmq.POLLIN)
        self.poller.register(self.from_scheduler.socket, zmq.POLLIN)
        self.detoks: dict[int, IncrementalDetokenizer] = {}
        self.logprob_texts = LogprobTexts(self.tokenizer)  # [ch25]
        self.limits = limits or self._wait_for_limits()

    def _wait_for_limits(self) -> EngineLimits:
        """The scheduler's ready message, forwarded by the launcher: the first on our pipe."""
        parent = os.getppid()
        while os.getppid() == parent:
            msg = self.from_api.recv(timeout_ms=500)
            if isinstance(msg, ReadyMsg):
                return EngineLimits.from_dict(msg.info["limits"])
        raise SystemExit("the launcher died before the engine was ready")

    def run(self) -> None:
        parent = os.getppid()
        while os.getppid() == parent:  # the launcher died: nobody will stop us but us
            if not self.poller.poll(500):
                continue
            for msg in self.from_api.recv_all():
                self.handle_api(msg)
            for msg in self.from_scheduler.recv_all():
                self.handle_scheduler(msg)

    def handle_api(self, msg: TokenizeMsg | AbortMsg) -> None:
        if isinstance(msg, AbortMsg):
            self.logprob_texts.forget(msg.uid)  # [ch25]
            if self.detoks.pop(msg.uid, None) is not None:
                self.to_scheduler.send(msg)
            return
        try:
            ids = self.tokenize(msg)
            # The scheduler's own check, done before it, and max_tokens held to the context.
            self.limits.check_prompt(ids, msg.sampling_params.max_tokens)
        except ValueError as e:
            code = e.code if isinstance(e, PromptTooLong) else None
            self.to_api.send(RejectedMsg(msg.uid, str(e), code))
            return
        except Exception as e:
            self.fail(msg.uid, "tokenizing", e)
            return
        self.detoks[msg.uid] = IncrementalDetokenizer(
            self.tokenizer, ids, msg.stop, msg.skip_special_tokens
        )
        self.logprob_texts.accept(msg, ids)  # [ch25]
        accepted = AcceptedMsg(msg.uid, len(ids))
        accepted.thinking, accepted.think_style = thinking_of(self.tokenizer, msg, ids)  # [ch25]
        self.to_api.send(accepted)
        self.to_scheduler.send(UserMsg(msg.uid, ids, msg.sampling_params))

    def tokenize(self, msg: TokenizeMsg) -> list[int]:
        if msg.input_ids is not None:
            return msg.input_ids
        if msg.messages is not None:
            try:
                text = self.tokenizer.apply_chat_template(msg.messages, **msg.template_vars)
            except Exception as e:  # a template may reject a conversation (e.g. roles order)
                raise ValueError(f"the chat template rejected the messages: {e}") from None
            # The template already wrote the special tokens it wants.
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(msg.prompt or "")

    def handle_scheduler(self, out: SchedulerOutput) -> None:
        for msg in out.tokens:
            try:
                self.handle_token(msg)
            except Exception as e:
                if self.detoks.pop(msg.uid, None) is not None and not msg.finished:
                    self.to_scheduler.send(AbortMsg(msg.uid))
                self.fail(msg.uid, "detokenizing", e)
        self.to_api.send(out.stats)
        if out.dashboard is not None:  # the live page's snapshot, its token ids as text  # [ch30]
            self.to_api.send(out.dashboard.with_text(self.tokenizer.decode))  # [ch30]

    def fail(self, uid: int, doing: str, e: Exception) -> None:
        """One request hit a bug: it ends with a 500; the log has the traceback."""
        logger.exception("request %d failed while %s", uid, doing)
        self.logprob_texts.forget(uid)  # [ch25]
        message = f"internal error while {doing} the request ({type(e).__name__}: {e})"
        self.to_api.send(RejectedMsg(uid, message, status=500))

    def handle_token(self, msg: TokenMsg) -> None:
        detok = self.detoks.get(msg.uid)
        if detok is None:
            return  # aborted, or already cut at a stop string
        if msg.error is not None:
            del self.detoks[msg.uid]
            self.logprob_texts.forget(msg.uid)  # [ch25]
            self.to_api.send(RejectedMsg(msg.uid, msg.error))
            return
        text = detok.add(msg.token)
        finished, reason = msg.finished, msg.finish_reason
        if detok.stopped:  # a stop string: the request ends here, whatever else happened
            if not finished:
                self.to_scheduler.send(AbortMsg(msg.uid))
            finished, reason = True, "stop"
        if finished:
            text += detok.finish()
            del self.detoks[msg.uid]
        token_text = None
        if msg.logprob is not None:
            token_text = self.tokenizer.decode([msg.token], skip_special_tokens=False)
        delta = DeltaMsg(
            msg.uid, text, msg.token, token_text, msg.logprob, finished, reason, msg.cached_tokens
        )
        self.logprob_texts.add(delta, msg)  # [ch25]
        self.to_api.send(delta)


def run_tokenizer_worker(model_path: str, ipc_dir: str, log_level: str) -> None:
    logging.basicConfig(level=log_level, format="%(asctime)s tokenizer %(levelname)s %(message)s")
    worker = TokenizerWorker(model_path, ipc_dir)
    ready = Writer(zmq.Context.instance(), address(ipc_dir, "ready"))
    ready.send(ReadyMsg("tokenizer"))
    worker.run()


# >>> ch25 a thinking model's reasoning, apart from its answer (server/reasoning.py)
def thinking_of(tokenizer: Tokenizer, msg: TokenizeMsg, ids: list[int]) -> tuple[str | None, str]:
    """For a chat whose template writes think blocks (`STYLES`): "open" where the prompt
    ends inside one (the answer starts with reasoning), else "may"; None otherwise. And
    the blocks' style."""
    template = tokenizer.chat_template or ""
    style = next((s for s, (_, close) in STYLES.items() if close in template), None)
    if msg.messages is None or style is None:
        return None, "think"
    tail = tokenizer.decode(ids[-8:], skip_special_tokens=False).rstrip()
    return ("open" if tail.endswith(STYLES[style][0]) else "may"), style


# <<< ch25
