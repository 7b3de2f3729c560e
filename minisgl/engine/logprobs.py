"""Log-probabilities for the API: of each chosen token, of its likeliest rivals, of the prompt.

They come from the logits the sampler sees, after penalties and logit_bias and before the
temperature and any grammar mask: what the model (as the request adjusted it) thought of
each token, not an artefact of how the next one was drawn.

Prompt log-probabilities (`echo` with `logprobs`, which evaluation harnesses use to score a
text) need logits at every prompt position, while a prefill normally projects only each
request's last token onto the vocabulary. So a prefill with such a request tells the LM head
which rows to project (`Batch.logit_rows`), and the engine splits the result: each request's
last row goes to the sampler, the rows before a known prompt token give its log-probability.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.core import Batch, Req
from minisgl.utils import to_device, to_host


@dataclass
class Logprobs:
    """Log-probabilities at n positions, on the device or (after `to_host`) on the host."""

    chosen: torch.Tensor  # [n] fp32: of the token that came next (sampled, or the prompt's)
    top_ids: torch.Tensor | None  # [n, k] int32: the k likeliest tokens, best first
    top_values: torch.Tensor | None  # [n, k] fp32
    counts: list[int] | None = None  # prompt only: how many of the n are each request's

    def split(
        self, top_ks: list[int]
    ) -> list[tuple[list[float], list[list[int]], list[list[float]]]]:
        """Host side, prompt only: per request, its values and its own top k of each."""
        chosen = self.chosen.tolist()
        ids = self.top_ids.tolist() if self.top_ids is not None else None
        values = self.top_values.tolist() if self.top_values is not None else None
        out, start = [], 0
        for n, k in zip(self.counts or [], top_ks):
            rows = range(start, start + n)
            top_ids = [ids[i][:k] for i in rows] if ids is not None and k else [[]] * n
            top_values = [values[i][:k] for i in rows] if values is not None and k else [[]] * n
            out.append((chosen[start : start + n], top_ids, top_values))
            start += n
        return out

    def to_host(self) -> Logprobs:
        ids, values = self.top_ids, self.top_values
        return Logprobs(
            to_host(self.chosen),
            None if ids is None else to_host(ids),
            None if values is None else to_host(values),
            self.counts,
        )


def pick(logprobs: torch.Tensor, next_ids: torch.Tensor, k: int) -> Logprobs:
    """logprobs: [n, vocab]; next_ids: [n] -> their log-probabilities and the top k."""
    chosen = logprobs.gather(1, next_ids.long()[:, None])[:, 0]
    if k == 0:
        return Logprobs(chosen, None, None)
    top = logprobs.topk(k, dim=-1)
    return Logprobs(chosen, top.indices.to(torch.int32), top.values)


@dataclass
class PromptPlan:
    """Where each request's logits land when some requests want every prompt position's."""

    last_rows: torch.Tensor  # [bs] int64: the row each request samples its next token from
    rows: torch.Tensor  # [m] int64: rows whose next token is a known prompt token
    targets: torch.Tensor  # [m] int64: that token
    counts: list[int]  # per request: how many of the m rows are its
    top_k: int


def plan_prompt_logprobs(batch: Batch, device: torch.device) -> PromptPlan | None:
    """For a prefill with prompt-logprob requests: set `batch.logit_rows`, return the plan."""
    if not any(r.wants_prompt_logprobs for r in batch.reqs):
        return None
    logit_rows: list[int] = []  # token indices in the batch, in the LM head's output order
    last_rows, rows, targets, counts = [], [], [], []
    start = 0  # the request's first token in the flattened batch
    for req in batch.reqs:
        n = req.extend_len
        m = 0
        if req.wants_prompt_logprobs:
            # Position p predicts token p + 1; those up to the prompt's end are known.
            m = max(0, min(req.device_len, req.prompt_len - 1) - req.cached_len)
            rows += range(len(logit_rows), len(logit_rows) + m)
            targets += req.input_ids[req.cached_len + 1 : req.cached_len + 1 + m].tolist()
            logit_rows += range(start, start + n)
        else:
            logit_rows.append(start + n - 1)
        last_rows.append(len(logit_rows) - 1)
        counts.append(m)
        start += n
    packed = to_device(logit_rows + last_rows + rows + targets, device, torch.int64)  # one copy
    batch.logit_rows, last, rows_d, targets_d = packed.split(
        [len(logit_rows), len(last_rows), len(rows), len(targets)]
    )
    top_k = max(r.sampling_params.top_logprobs for r in batch.reqs if r.wants_prompt_logprobs)
    return PromptPlan(last, rows_d, targets_d, counts, top_k)


def split_prompt_logits(
    logits: torch.Tensor, plan: PromptPlan | None
) -> tuple[torch.Tensor, Logprobs | None]:
    """The LM head's output -> (next-token logits [bs, vocab], the prompt's log-probabilities)."""
    if plan is None:
        return logits, None
    prompt = pick(torch.log_softmax(logits[plan.rows], dim=-1), plan.targets, plan.top_k)
    prompt.counts = plan.counts
    return logits[plan.last_rows], prompt


def top_to_host(
    logprobs: torch.Tensor, reqs: list[Req]
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The likeliest tokens at each row and their log-probabilities, on the host, as many as
    the request that wants most asked for; (None, None) when none asked."""
    k = max(r.sampling_params.top_logprobs for r in reqs)
    if k == 0:
        return None, None
    top = logprobs.topk(k, dim=-1)
    return to_host(top.indices.to(torch.int32)), to_host(top.values)
