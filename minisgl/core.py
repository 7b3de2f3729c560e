"""The nouns every other module speaks: SamplingParams, Req, Batch, and the forward Context.

SamplingParams lives in sampling_params.py, apart from torch, and is imported from here as
well. A `Req` is one sequence living in the engine; a `Batch` is the requests that run in one
forward; the `Context` is a process-wide slot holding the batch being computed, so that a
layer deep inside the model can find its positions and attention metadata without every
`forward` in between passing them along.
"""

from __future__ import annotations

import functools  # [ch23]
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import torch

from minisgl.sampling_params import SamplingParams  # torch-free, for the server's processes

if TYPE_CHECKING:
    from minisgl.attention.base import BaseAttnBackend, BaseAttnMetadata


F = TypeVar("F", bound=Callable[..., torch.Tensor])  # [ch23]


class Req:
    """One sequence. Its KV lives in pages recorded in row `table_idx` of the page table.

    Lengths, all counted in tokens from the start of the prompt:
    - `cached_len`: tokens whose K/V is already in the KV pool;
    - `device_len`: tokens whose K/V will be in the pool once the scheduled forward is done,
      so the next forward computes positions [cached_len, device_len);
    - `max_device_len`: prompt plus the most tokens the request may generate.
    """

    def __init__(
        self,
        input_ids: torch.Tensor,
        table_idx: int,
        cached_len: int,
        output_len: int,
        uid: int,
        sampling_params: SamplingParams,
    ) -> None:
        assert input_ids.dim() == 1 and input_ids.device.type == "cpu"
        # Host copy of the prompt + tokens generated so far, in a buffer that doubles when
        # full, so that appending a token does not copy the whole sequence every step.
        self._ids = input_ids.to(torch.int32)
        self._ids_np = self._ids.numpy()  # the same memory: one element set costs ~0.1 us
        self._len = len(input_ids)
        self.prompt_len = len(input_ids)  # where the output starts (kept across preemption)
        self.table_idx = table_idx
        self.cached_len = cached_len
        self.device_len = len(input_ids)
        self.max_device_len = len(input_ids) + output_len
        self.uid = uid
        self.sampling_params = sampling_params
        # Unseeded requests get a random seed of their own: sampling is always seed-driven.
        seed = sampling_params.seed
        self.seed = random.getrandbits(63) if seed is None else seed
        # >>> ch09 what the scheduler's cache manager tracks
        self.cache_handle: Any = None  # the locked prefix-cache node this row starts with
        self.shared_len = 0  # leading tokens whose pages belong to the prefix cache
        self.alloc_len = 0  # tokens the row has pages for
        self.cached_tokens = 0  # prompt tokens that came from the prefix cache
        # <<< ch09
        # >>> ch25 its prefill computes the log-probability of each prompt token after the first
        self.wants_prompt_logprobs = False
        # <<< ch25

    @property
    def input_ids(self) -> torch.Tensor:
        return self._ids[: self._len]

    # >>> ch26 a drafter reads a request's last tokens every step
    def tokens_from(self, start: int) -> list[int]:
        """Its tokens from `start` (negative: from the end) as a list, through numpy: a
        tensor's slice and `tolist` cost some ten times more."""
        return self._ids_np[: self._len][start:].tolist()

    # <<< ch26
    @property
    def seq_len(self) -> int:
        """Tokens in the sequence so far: the prompt and every token appended since."""
        return self._len

    @property
    def extend_len(self) -> int:
        return self.device_len - self.cached_len

    @property
    def mid_prompt(self) -> bool:
        """The scheduled forward stops inside the prompt (a chunk): its sampled token is moot."""
        return self.device_len < self._len

    @property
    def remain_len(self) -> int:
        return self.max_device_len - self.device_len

    def complete_one(self) -> None:
        """The forward finished: its tokens are cached, and one new token joins the sequence."""
        self.cached_len = self.device_len
        self.device_len += 1

    def append_host(self, token: int) -> None:
        if self._len == len(self._ids_np):  # numpy's len is ~5x cheaper than a tensor's
            self._ids = torch.cat([self._ids, torch.empty_like(self._ids)])
            self._ids_np = self._ids.numpy()
        self._ids_np[self._len] = token  # a torch element write costs ~50x more per token
        self._len += 1

    def __repr__(self) -> str:
        return (
            f"Req(uid={self.uid}, row={self.table_idx}, cached={self.cached_len}, "
            f"device={self.device_len}, max={self.max_device_len})"
        )


# What a forward computes: new prompt tokens (a prefill, or a chunk of one), or one token per
# request (a decode step).
Phase = Literal[
    "prefill",
    "decode",
    "verify",  # each request's last token and its drafts  # [ch26]
]


class Batch:
    """The requests of one forward, all in one phase, and the tensors that feed it.

    `padded_reqs` is `reqs` plus dummy requests that round the batch up to a captured
    CUDA-graph size; the device tensors (input_ids, positions, out_loc, metadata) cover
    the padded batch, and only the first `size` rows of the output are real.
    """

    def __init__(self, reqs: list[Req], phase: Phase) -> None:
        self.reqs = reqs
        self.phase = phase
        self.padded_reqs = reqs
        self.graphed = False  # a CUDA graph runs it (engine/graph.py pad_batch)  # [ch18]
        self.logits_out: torch.Tensor | None = None  # a graph's buffer for the head  # [ch18]
        self.input_ids: torch.Tensor  # [num_tokens] int32, device
        self.positions: torch.Tensor  # [num_tokens] int32, device
        self.out_loc: torch.Tensor  # [num_tokens] int32, device: KV slot of each new token
        self.token_dest: torch.Tensor  # [size] int64, device: where each sampled token goes
        # in the token pool, as a flat index (row * width + position)
        self.attn_metadata: BaseAttnMetadata
        self.state_slots: torch.Tensor  # [padded size] int64: recurrent-state slots  # [ch31]
        self.state_offsets: torch.Tensor  # [padded size + 1] int64: where tokens start  # [ch31]
        # >>> ch25 prefill: the tokens the LM head projects, when not just each request's last
        self.logit_rows: torch.Tensor | None = None
        # <<< ch25

    @property
    def size(self) -> int:
        return len(self.reqs)

    @property
    def padded_size(self) -> int:
        return len(self.padded_reqs)

    @property
    def is_prefill(self) -> bool:
        return self.phase == "prefill"

    @property
    def is_decode(self) -> bool:
        return self.phase == "decode"

    @property
    def num_logit_rows(self) -> int:
        """Rows of the forward's logits that belong to live requests: one per request."""
        if self.phase == "verify":  # one per new token: each draft is checked  # [ch26]
            return sum(r.extend_len for r in self.reqs)  # [ch26]
        return self.size


class Context:
    """Process-wide state of the running forward: the attention backend and the batch."""

    def __init__(self, attn_backend: BaseAttnBackend) -> None:
        self.attn_backend = attn_backend
        self._batch: Batch | None = None
        self.breakable: Any = None  # the breakable graph being captured or replayed  # [ch23]
        self.state_pool: Any = None  # a hybrid's recurrent states (kvcache/state_pool.py)  # [ch31]

    @property
    def batch(self) -> Batch:
        assert self._batch is not None, "no batch: call the model inside ctx.forward_batch(batch)"
        return self._batch

    @contextmanager
    def forward_batch(self, batch: Batch) -> Iterator[None]:
        assert self._batch is None, "forward_batch does not nest"
        self._batch = batch
        try:
            yield
        finally:
            self._batch = None


_GLOBAL_CTX: Context | None = None


def set_global_ctx(ctx: Context | None) -> None:
    global _GLOBAL_CTX
    _GLOBAL_CTX = ctx


def get_global_ctx() -> Context:
    assert _GLOBAL_CTX is not None, "no global Context: create an Engine first"
    return _GLOBAL_CTX


def logits_out() -> torch.Tensor | None:  # where a graph's LM head writes, if anywhere  # [ch18]
    batch = _GLOBAL_CTX._batch if _GLOBAL_CTX is not None else None  # [ch18]
    return batch.logits_out if batch is not None else None  # [ch18]


# >>> ch23
def eager_on_graph(fn: F) -> F:
    """Run `fn` eagerly between two graph segments while a breakable graph is captured or
    replayed (engine/breakable.py); anywhere else it is a plain call."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> torch.Tensor:
        graph = _GLOBAL_CTX.breakable if _GLOBAL_CTX is not None else None
        return fn(*args, **kwargs) if graph is None else graph.break_at(fn, args, kwargs)

    return wrapper  # type: ignore[return-value]


# <<< ch23
