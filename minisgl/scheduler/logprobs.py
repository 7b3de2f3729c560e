"""Log-probabilities on their way out of the scheduler, for the requests that ask for them.

The engine computes them (engine/logprobs.py); the scheduler puts a token's likeliest
rivals into its message, and keeps a prompt's log-probabilities, which a chunked prompt
produces over several steps, until the request's first token carries them all.

Prompt log-probabilities need the logits of every prompt position, so a request that wants
them takes nothing from the prefix cache. Once they are sent, a recompute (after a
preemption) need not redo them and may use the cache like any other request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from minisgl.core import Req
from minisgl.message.backend import TokenMsg
from minisgl.message.logprobs import PromptLogprobs

if TYPE_CHECKING:
    from minisgl.engine.sampler import ForwardOutput
    from minisgl.scheduler.prefill import PendingReq


def prompt_logprobs_due(pending: PendingReq) -> bool:
    """Whether a request admitted now must compute (and send) its prompt's log-probabilities:
    asked for, and not sent before (a preempted request's return knows its `cached_tokens`)."""
    return pending.sampling_params.prompt_logprobs and pending.cached_tokens is None


class LogprobCollector:
    def __init__(self) -> None:
        self._prompts: dict[int, PromptLogprobs] = {}  # by uid, gathered over a prompt's chunks

    def gather(self, reqs: list[Req], output: ForwardOutput, running: dict[int, Req]) -> None:
        """Keep the prompt log-probabilities of this forward's chunks, until the first token."""
        lp = output.prompt_logprobs
        if lp is None:
            return
        parts = lp.split([r.sampling_params.top_logprobs for r in reqs])
        for req, (values, top_ids, top_values) in zip(reqs, parts):
            if req.wants_prompt_logprobs and running.get(req.uid) is req:
                ids = req.input_ids[: req.prompt_len].tolist()
                kept = self._prompts.setdefault(req.uid, PromptLogprobs(ids, [], [], []))
                kept.logprobs += values
                kept.top_ids += top_ids
                kept.top_logprobs += top_values

    def attach(self, msg: TokenMsg, req: Req, output: ForwardOutput, i: int) -> None:
        """Put what `req` asked for into `msg`, the message of the batch's `i`-th token."""
        params = req.sampling_params
        if params.logprobs and params.top_logprobs and output.top_ids_cpu is not None:
            msg.top_ids = output.top_ids_cpu[i, : params.top_logprobs].tolist()
            msg.top_logprobs = output.top_logprobs_cpu[i, : params.top_logprobs].tolist()
        if req.wants_prompt_logprobs:
            msg.prompt_logprobs = self._prompts.pop(req.uid, None)
            req.wants_prompt_logprobs = False  # sent; a later recompute need not redo them

    def remove(self, uid: int) -> None:
        self._prompts.pop(uid, None)
