"""Drafts from a smaller model: its greedy guess of each request's next k tokens.

A smaller model trained on the same tokenizer (a sibling of fewer layers, say) agrees
with the big one on many easy tokens and costs a fraction of its step. It runs in an
Engine of its own on the same device, with a KV pool of its own, in which every request
it drafts for keeps a row: the K/V of the tokens the draft model has read so far.

Between two proposals the request moved on: the model accepted some drafts, rejected the
rest and added a token of its own (or a plain step added one). So the drafter keeps the
longest common prefix of what its pool holds and the request's tokens, gives back the
pages past it, and reads the missing tokens in one extend forward for every request at
once (chunked like a prefill when long). That forward's greedy token is the first draft;
k - 1 decode steps, batched over the requests still drafting, give the rest. Between
steps the tokens stay on the device: each step writes its argmax into the draft engine's
token pool, where the next step reads its input, and the host reads every draft once at
the end. Greedy drafts are a function of the text, which is all the acceptance rule asks
of a draft (verify.py): the output stays exactly the model's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from minisgl.core import Batch, Req, SamplingParams
from minisgl.engine.config import EngineConfig
from minisgl.engine.engine import Engine
from minisgl.kvcache.mha_pool import MHAKVCache
from minisgl.models.config import ModelConfig
from minisgl.scheduler.cache import CacheManager
from minisgl.scheduler.table import TableManager
from minisgl.utils import cdiv, common_prefix_len, to_device

logger = logging.getLogger(__name__)

GREEDY = SamplingParams(seed=0)  # drafts are argmax; a fixed seed spares a random draw


@dataclass
class Held:
    """What the draft pool holds for one request."""

    req: Req  # its row and pages (alloc_len) in the draft engine, as the CacheManager counts
    tokens: torch.Tensor  # host int32: the tokens whose K/V is in the pool, in order


class DraftModelDrafter:
    """Every drafter answers `propose(reqs, ks)` and `retain(uids)` (see ngram.py).

    The speculator asks about every decoding request at once, so a request it does not
    ask about has finished or left: its row and pages go back then. At most
    `speculative_max_bs` requests draft at once, which is how many rows the pool has."""

    def __init__(self, config: EngineConfig, target: Engine) -> None:
        self.rows = min(config.speculative_max_bs, config.max_running_req)
        draft = ModelConfig.from_path(str(config.draft_model))
        context = draft.max_position_embeddings
        if context < target.max_seq_len:  # it reads every token the model does
            raise ValueError(
                f"draft model {config.draft_model} has a context of {context} tokens, the "
                f"model {target.max_seq_len}: set max_seq_len_override to {context} or less"
            )
        try:
            self.engine = Engine(draft_config(config, target, draft, self.rows))
        except ValueError as e:
            raise ValueError(f"draft model {config.draft_model}: {e}") from None
        engine = self.engine
        self.table = TableManager(self.rows, engine.token_pool)
        self.cache = CacheManager(engine.num_pages, engine.page_size, engine.page_table, "naive")
        self.max_prefill_length = config.max_prefill_length
        self.held: dict[int, Held] = {}  # by uid

    @torch.inference_mode()
    def propose(self, reqs: list[Req], ks: list[int]) -> list[list[int]]:
        self.retain({r.uid for r in reqs})
        drafts: list[list[int]] = [[] for _ in reqs]
        resumed = [(i, self._resume(r, k)) for i, (r, k) in enumerate(zip(reqs, ks)) if k > 0]
        work = self._fit(resumed)
        if not work:
            return drafts
        live = [d for _, d in work]
        self._extend(live)
        while batch := [d for d in live if d.remain_len > 0]:  # the other k - 1 tokens
            self._forward(Batch(batch, "decode"))
            for d in batch:
                d.complete_one()
        for (i, d), tokens in zip(work, self._read(live)):
            drafts[i] = tokens
            # The pool now holds the request's tokens and every draft but the last.
            held = torch.tensor(tokens[:-1], dtype=torch.int32)
            self.held[d.uid].tokens = torch.cat([d.input_ids, held])
        return drafts

    def retain(self, uids: set[int]) -> None:
        for uid in [uid for uid in self.held if uid not in uids]:
            req = self.held.pop(uid).req
            self.cache.trim(req, 0)
            self.table.free(req.table_idx)

    def check_integrity(self) -> None:
        """Every draft page free or held by a request, once; every row free or held."""
        self.cache.check_integrity([h.req for h in self.held.values()])
        rows = self.table.available + len(self.held)
        assert rows == self.rows, f"draft rows leaked: {rows} of {self.rows} accounted"

    def _resume(self, req: Req, k: int) -> Req:
        """The request in the draft engine: its cached prefix the part of the pool that
        matches its tokens (at least one token left to read), positions up to k drafts."""
        ids, held = req.input_ids, self.held.get(req.uid)
        if held is None:
            row, alloc, start = self.table.alloc(ids[:0]), 0, 0
        else:
            row, alloc = held.req.table_idx, held.req.alloc_len
            start = min(common_prefix_len(held.tokens, ids), len(ids) - 1)
        draft = Req(ids, row, start, k, req.uid, GREEDY)
        draft.alloc_len = alloc
        self.cache.trim(draft, start)  # the pages of rejected drafts go back
        self.held[req.uid] = Held(draft, ids[:start] if held is None else held.tokens[:start])
        return draft

    def _fit(self, resumed: list[tuple[int, Req]]) -> list[tuple[int, Req]]:
        """The requests whose pages fit, in order; the others draft nothing this time."""
        room, fits = self.cache.allocator.num_free, []
        for i, draft in resumed:
            need = self.cache.pages_needed(draft, draft.max_device_len - 1)
            if need <= room:
                room -= need
                fits.append((i, draft))
        return fits

    def _extend(self, live: list[Req]) -> None:
        """Read each request's missing tokens, at most `max_prefill_length` per forward;
        each request's last forward gives its first draft."""
        pool = self.engine.token_pool
        width = pool.size(1)
        places = [torch.arange(d.cached_len, d.seq_len) + d.table_idx * width for d in live]
        tokens = [d.input_ids[d.cached_len :] for d in live]
        where = to_device(torch.cat(places), pool.device, torch.int64)
        pool.put_(where, to_device(torch.cat(tokens), pool.device, torch.int32))
        todo = live
        while todo:
            batch, budget = [], self.max_prefill_length
            for d in todo:
                if budget == 0:
                    break
                d.device_len = min(d.seq_len, d.cached_len + budget)
                budget -= d.extend_len
                batch.append(d)
            self._forward(Batch(batch, "prefill"))
            for d in batch:
                if d.mid_prompt:
                    d.cached_len = d.device_len
                else:
                    d.complete_one()
            todo = [d for d in todo if d.cached_len < d.seq_len]

    def _forward(self, batch: Batch) -> None:
        """One forward; each request's argmax goes into its row after its last token."""
        self.cache.allocate(batch.reqs)
        self.engine.prepare_batch(batch)
        tokens = self.engine.logits(batch).argmax(dim=-1).to(torch.int32)
        self.engine.token_pool.put_(batch.token_dest, tokens)

    def _read(self, live: list[Req]) -> list[list[int]]:
        """Every request's drafts, from the token pool in one copy to the host."""
        pool = self.engine.token_pool
        width = pool.size(1)
        places = [torch.arange(d.seq_len, d.device_len) + d.table_idx * width for d in live]
        flat = pool.take(to_device(torch.cat(places), pool.device, torch.int64)).tolist()
        out, start = [], 0
        for d in live:
            out.append(flat[start : start + d.device_len - d.seq_len])
            start += d.device_len - d.seq_len
        return out


def draft_config(
    config: EngineConfig, target: Engine, draft: ModelConfig, rows: int
) -> EngineConfig:
    """The draft engine: the model's device, dtype, pages and context, `rows` requests, no
    speculation of its own; graphs as the model's settings ask (None: the engine decides)."""
    return EngineConfig(
        str(config.draft_model),
        dtype=target.dtype,
        device=str(target.device),
        max_running_req=rows,
        num_page_override=draft_pages(target, draft, rows),
        max_seq_len_override=target.max_seq_len,
        page_size=target.page_size,
        attention_backend=config.attention_backend,
        max_prefill_length=config.max_prefill_length,
        cuda_graph_max_bs=config.cuda_graph_max_bs,
        debug_cuda_graph=config.debug_cuda_graph,
        prefill_graph=config.prefill_graph,
    )


def draft_pages(target: Engine, draft: ModelConfig, rows: int) -> int:
    """As many tokens as the model's own pool holds: the draft pool holds the same text
    (and k - 1 drafts a request), only not shared between requests; no more than `rows`
    requests of the longest length could fill. On a GPU, at most half the memory the
    model left free, the rest for the draft's weights, graphs and activations. Where it
    runs short (many requests sharing a long prefix), the last requests draft nothing."""
    ps = target.page_size
    pages = min(target.num_pages, rows * cdiv(target.max_seq_len, ps))
    if target.device.type == "cuda":
        per_page = MHAKVCache.bytes_per_page(
            draft.num_layers, ps, draft.num_kv_heads, draft.head_dim, target.dtype
        )
        room = torch.cuda.mem_get_info(target.device)[0] // 2 // per_page
        if room < pages:
            logger.info(
                "draft KV pool: %d pages of %d wanted fit in half the free memory", room, pages
            )
            pages = room
    if pages < 1:
        raise MemoryError("no room left on the device for the draft model's KV pages")
    return pages
