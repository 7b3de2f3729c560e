"""The sampler: a forward's logits into one token per request, written to the token pool.

Sampling is split from the forward in time: what sampling needs (temperatures, seeds,
penalties' counts, where each token goes) is gathered when the forward is launched, because
the scheduler moves its requests on right after, and a grammar's mask may only be known once
the step before is in. `StepLogits` holds that; `Sampler.sample` finishes the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.core import Batch, Req

# >>> ch25
from minisgl.engine.bias import (
    LogitBias,
    TokenMask,
    apply_logit_bias,
    apply_token_mask,
    gather_logit_bias,
)
from minisgl.engine.logprobs import Logprobs, top_to_host

# <<< ch25
from minisgl.engine.penalty import Penalties, apply_penalties, gather_penalties
from minisgl.engine.sample import BatchSamplingArgs, prepare_sampling, sample
from minisgl.utils import to_host


@dataclass
class ForwardOutput:
    next_tokens: torch.Tensor  # [bs] int32 on the device
    next_tokens_cpu: torch.Tensor  # [bs] int32 on the host, valid once `copy_done` is reached
    logprobs_cpu: torch.Tensor | None  # [bs] fp32 on the host, when any request asked for them
    copy_done: torch.cuda.Event | None
    # >>> ch25 on the host too, when asked for
    top_ids_cpu: torch.Tensor | None = None  # [bs, k] int32: the likeliest tokens, best first
    top_logprobs_cpu: torch.Tensor | None = None  # [bs, k] fp32
    prompt_logprobs: Logprobs | None = None  # of the prompt tokens this forward covered
    # <<< ch25


@dataclass
class StepLogits:
    """A forward's logits and what sampling them needs, fixed when the forward is launched."""

    logits: torch.Tensor  # [bs, vocab] fp32
    reqs: list[Req]
    sampling: BatchSamplingArgs
    penalties: Penalties | None
    where: torch.Tensor  # [bs] int64: each sampled token's place in the token pool (flat)
    # >>> ch25
    bias: LogitBias | None = None
    prompt_logprobs: Logprobs | None = None
    token_mask: TokenMask | None = None  # a grammar's, set once the previous token is known
    # <<< ch25


class Sampler:
    def __init__(self, vocab_size: int, token_pool: torch.Tensor) -> None:
        self.vocab_size = vocab_size
        self.token_pool = token_pool
        self.device = token_pool.device

    def inputs(self, batch: Batch, logits: torch.Tensor) -> StepLogits:
        """The sampling inputs of `batch` as it stands now, beside its logits."""
        reqs, vocab = batch.reqs, self.vocab_size
        step = StepLogits(
            logits,
            reqs,
            prepare_sampling(reqs, vocab, self.device),
            gather_penalties(reqs, self.token_pool, vocab),
            batch.token_dest,
        )
        step.bias = gather_logit_bias(reqs, self.device)  # [ch25]
        return step

    @torch.inference_mode()
    def sample(self, step: StepLogits) -> ForwardOutput:
        """Penalties, then one token per request; the tokens also go into the token pool."""
        logits = step.logits
        if step.penalties is not None:
            logits = apply_penalties(logits, step.penalties)
        logits = apply_logit_bias(logits, step.bias)  # [ch25]
        logprobs = None
        if any(r.sampling_params.logprobs for r in step.reqs):
            logprobs = torch.log_softmax(logits, dim=-1)
        logits = apply_token_mask(logits, step.token_mask)  # after: the model's view  # [ch25]
        next_tokens = sample(logits, step.sampling)
        self.token_pool.put_(step.where, next_tokens)
        out = ForwardOutput(next_tokens, to_host(next_tokens), None, None)
        if logprobs is not None:
            out.logprobs_cpu = to_host(logprobs.gather(1, next_tokens.long()[:, None])[:, 0])
            out.top_ids_cpu, out.top_logprobs_cpu = top_to_host(logprobs, step.reqs)  # [ch25]
        if step.prompt_logprobs is not None:  # [ch25]
            out.prompt_logprobs = step.prompt_logprobs.to_host()  # [ch25]
        if self.device.type == "cuda":
            out.copy_done = torch.cuda.Event()
            out.copy_done.record()
        return out
