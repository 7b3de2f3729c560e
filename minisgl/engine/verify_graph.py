"""Verify graphs: the third kind of captured shape, front-packed by total tokens.

A verify batch checks each request's draft tokens in one forward: request i brings its last
sampled token and k_i drafts, and the batch packs them front to back into one flat run of
tokens. Its shape is that run's length, whatever the split between requests, so the plan
captures a ladder of token tiers (a dozen at most) and pads a batch only up to the next
tier: [6, 2, 4] tokens make 12, replayed in the 16-token graph, with one filler request
taking the 4 missing tokens and zero-length sentinels in the empty request slots. That is
the padding of a prefill graph (prefill_graph.py), so a verify graph is one with two
differences: its batches are of phase "verify", and it returns the logits of every token,
since every draft is checked.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from minisgl.engine.graph import GraphPlan, GraphShape
from minisgl.engine.hybrid import verify_graph_blocker  # [ch31]
from minisgl.engine.prefill_graph import PrefillGraphs

if TYPE_CHECKING:
    from minisgl.attention.base import BaseAttnBackend
    from minisgl.engine.startup import EngineShape

logger = logging.getLogger(__name__)


def verify_token_tiers(max_tokens: int) -> list[int]:
    """2, 4, 8, 16, then steps of 1.5x and 4/3x (24, 32, 48, 64, ...) up to max_tokens, and
    max_tokens itself: twelve tiers reach 256 tokens."""
    tiers, t = set(), 2
    while t < max_tokens:
        tiers.add(t)
        t = t * 2 if t < 16 else (t * 3 // 2 if t & (t - 1) == 0 else t * 4 // 3)
    return sorted(tiers | {max_tokens})


class VerifyGraphs(PrefillGraphs):
    phase = "verify"

    def logit_rows(self, shape: GraphShape) -> int:
        return shape.tokens


def plan_verify_graphs(
    shape: EngineShape, plan: GraphPlan, backend: BaseAttnBackend
) -> list[VerifyGraphs]:
    """With speculative decoding on, the verify tiers up to the largest batch it runs at,
    each request with all its drafts. Attention is captured where the backend keeps static
    prefill metadata (or the graphs are emulated), else it runs between graph segments."""
    config = shape.config
    if config.speculative == "off" or not any(k.shapes for k in plan.kinds):
        return []  # no graphs at all (off, or the model or backend cannot be captured)
    if (why := verify_graph_blocker(shape.model_config, shape.device.type)) is not None:  # [ch31]
        logger.info("verify graphs off: %s", why)  # [ch31]
        return []  # [ch31]
    max_bs = min(config.speculative_max_bs, config.max_running_req)
    max_tokens = min(max_bs * (config.num_draft_tokens + 1), plan.max_seq_len)
    full = plan.emulated or "prefill" in backend.cuda_graphs
    shapes = [GraphShape(min(t, max_bs) + 1, t) for t in verify_token_tiers(max_tokens)]
    return [VerifyGraphs(shapes, plan.dummy_req, "full" if full else "breakable")]
