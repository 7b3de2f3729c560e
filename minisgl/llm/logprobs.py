"""Log-probabilities in the offline API's results: plain dicts keyed by token id.

A token message carries the chosen token's log-probability, its likeliest rivals, and, with
the request's first token, the whole prompt's; `generate` returns them per result as
"logprobs" (one entry per generated token) and "prompt_logprobs" (None for the first token).
"""

from __future__ import annotations

from typing import Any

from minisgl.message.backend import TokenMsg


def add_logprobs(result: dict[str, Any], out: TokenMsg) -> None:
    if out.logprob is not None:
        top = dict(zip(out.top_ids or [], out.top_logprobs or []))
        result.setdefault("logprobs", []).append({"logprob": out.logprob, "top": top})
    if (prompt := out.prompt_logprobs) is not None:
        tops = [dict(zip(i, v)) for i, v in zip(prompt.top_ids, prompt.top_logprobs)]
        rest = [{"logprob": v, "top": t} for v, t in zip(prompt.logprobs, tops)]
        result["prompt_logprobs"] = [None, *rest]
