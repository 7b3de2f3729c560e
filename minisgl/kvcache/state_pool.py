"""The recurrent state pool: what a hybrid model's linear-attention layers keep per request.

A Gated DeltaNet layer (Qwen3.5) keeps no keys and values. It carries, per request, a fixed
amount of state from one token to the next, however long the sequence:
- a conv state: the last `conv_kernel - 1` inputs of its causal depthwise conv, over the q, k
  and v channels, in the model's dtype;
- an SSM state: one [key_head_dim, value_head_dim] matrix per value head, in float32 (the
  recurrence adds to it every token; in bf16 it would drift).

Storage is one tensor of each per pool, shaped [linear layers, slots, ...]. A slot belongs
to a page-table row: request row i keeps its state in slot i, and the last slot is the dummy
request's, where padding writes. Nothing is allocated or freed per request: a request owns
its row, so it owns the slot. A request's slot is zeroed when its first forward starts
(`cached_len == 0`); a later chunk of its prompt, or a decode step, reads what the previous
forward left there.

Before each forward the pool puts on the batch, on the device, each request's slot and
where its tokens start in the batch (`state_slots`, `state_offsets`): the layers read
them there, and graphs copy them into their static buffers. The pool also says which
kernels advance its states (`kernels`: MINISGL_GATED_DELTA, read once, here).

Beside the running slots lie the *snapshots*: copies of a slot's state saved for the prefix
cache (scheduler/hybrid_cache.py), which a later request with the same prefix copies back
into its own slot instead of starting from zero. Their number is fixed at start-up from the
same budget as the KV pages (`state_snapshots`; by default a quarter of what the running
slots leave).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from itertools import accumulate
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch

from minisgl.core import Batch, Req
from minisgl.distributed import agree_min, get_tp_info
from minisgl.env import ENV
from minisgl.kernels.gated_delta import conv_roll_back, recurrent_layers
from minisgl.models.families import LinearAttention, attention_layers
from minisgl.utils import cdiv, to_device

if TYPE_CHECKING:
    from minisgl.models.config import ModelConfig

logger = logging.getLogger(__name__)
# A prefill's recurrence runs in two passes (gated_delta_chunks.py) where its requests average
# more tokens than this: on one H200 two passes took 1x4096 tokens 1.50x faster and 2x4096
# 1.16x, one pass 4x1024 1.49x and 16x256 1.69x (docs/benchmarks.md). Prefill graphs (2,048
# tokens at most) stay on one pass, whatever requests they replay.
TWO_PASS_FROM = 2048


class EngineShape(Protocol):
    """What sizing the pool reads of the engine's shape (engine/startup.py), by name only: a
    lower room does not import a higher one."""

    model_config: ModelConfig
    dtype: torch.dtype
    device: torch.device
    max_seq_len: int
    config: Any  # an EngineConfig: its max_running_req, page_size and state_snapshots


class VerifyViews(NamedTuple):
    """A linear layer's share of the roll back's buffers, for one verify."""

    qkv: torch.Tensor  # [T, conv_dim]: the conv's inputs
    mixed: torch.Tensor  # [T, conv_dim]: its outputs, q, k and v
    a: torch.Tensor  # [T, value heads]
    b: torch.Tensor  # [T, value heads]
    conv: torch.Tensor  # [B, conv_dim, K - 1]: the requests' conv states before the verify


class RecurrentStatePool:
    def __init__(
        self,
        num_layers: int,  # the linear-attention layers
        num_slots: int,  # page-table rows: running requests plus the dummy request
        shape: LinearAttention,
        conv_dtype: torch.dtype,
        device: torch.device,
        num_snapshots: int = 0,  # saved states the prefix cache may hold
        verify: tuple[int, int] = (0, 0),  # tokens and requests a verify step holds at most
    ) -> None:
        s = shape
        self.num_slots, self.num_snapshots, self.device = num_slots, num_snapshots, device
        self.kernels = gated_delta_kernels(device)
        # a prefill's recurrence in ours: in two passes (gated_delta_chunks.py) or one
        self.prefill_rule = ENV.GATED_DELTA_PREFILL.value
        self.two_pass = self.prefill_rule == "two-pass"  # for the batch at hand (`prepare`)
        # a decode step's kernels: split or fused, None: by the batch's size (gated_delta.py)
        self.split_decode = {"auto": None, "split": True, "fused": False}[
            ENV.GATED_DELTA_DECODE.value
        ]
        conv = (num_layers, num_slots, s.conv_dim, s.conv_kernel - 1)
        ssm = (num_layers, num_slots, s.num_value_heads, s.key_head_dim, s.value_head_dim)
        self.conv = torch.zeros(conv, dtype=conv_dtype, device=device)
        self.ssm = torch.zeros(ssm, dtype=torch.float32, device=device)
        # The snapshots: the same per-layer shapes, their own slots (never read before saved).
        saved = (num_layers, num_snapshots)
        self.saved_conv = torch.empty(saved + conv[2:], dtype=conv_dtype, device=device)
        self.saved_ssm = torch.empty(saved + ssm[2:], dtype=torch.float32, device=device)
        # A verify step's roll back on the torch path, by linear layer (its forward leaves the
        # slots as they were): each takes the drafts accepted and writes the slots, in
        # `keep_accepted`, holding the forward's own tensors.
        self.kept: dict[int, Callable[[torch.Tensor], None]] = {}
        # Our kernels' instead: the rule run again over the verify's tokens, in every linear
        # layer at once, with each layer's gate parameters (A_log, dt_bias), which the layer
        # gives at its first verify (`gates`, by linear layer). What it reads: the verify's
        # tokens' qkv before and after the conv, their gates a and b, and its requests' conv
        # states before it, in fixed buffers that a verify writes, so a verify graph's replay
        # (which runs no Python) leaves them as an eager verify does.
        self.shape = shape
        self.gates: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._stacked: tuple[torch.Tensor, torch.Tensor] | None = None  # [L, heads] each
        tokens, reqs = verify if self.kernels == "triton" else (0, 0)
        like = {"dtype": conv_dtype, "device": device}
        self.verify_qkv = torch.empty((2, num_layers, tokens, s.conv_dim), **like)
        self.verify_ab = torch.empty((2, num_layers, tokens, s.num_value_heads), **like)
        self.verify_conv = torch.empty((num_layers, reqs) + conv[2:], **like)

    @property
    def bytes(self) -> int:
        tensors = (self.conv, self.ssm, self.saved_conv, self.saved_ssm)
        tensors += (self.verify_qkv, self.verify_ab, self.verify_conv)
        return sum(t.numel() * t.element_size() for t in tensors)

    @staticmethod
    def verify_bytes(
        num_layers: int, shape: LinearAttention, dtype: torch.dtype, verify: tuple[int, int]
    ) -> int:
        """The buffers of our kernels' roll back, for `verify` (tokens, requests) at most."""
        s, (tokens, reqs) = shape, verify
        per_token = 2 * (s.conv_dim + s.num_value_heads)
        per_req = s.conv_dim * (s.conv_kernel - 1)
        return num_layers * (tokens * per_token + reqs * per_req) * dtype.itemsize

    @staticmethod
    def bytes_per_slot(num_layers: int, shape: LinearAttention, conv_dtype: torch.dtype) -> int:
        s = shape
        conv = s.conv_dim * (s.conv_kernel - 1) * conv_dtype.itemsize
        ssm = s.num_value_heads * s.key_head_dim * s.value_head_dim * 4
        return num_layers * (conv + ssm)

    def prepare(self, batch: Batch) -> None:
        """`batch.state_slots` and `batch.state_offsets`: each (padded) request's slot and
        where its tokens start, then the end, on the device in one copy; the slots of
        requests whose first forward this is are zeroed."""
        reqs = batch.padded_reqs
        slots = [r.table_idx for r in reqs]
        offsets = list(accumulate((r.extend_len for r in reqs), initial=0))
        batch.state_slots, batch.state_offsets = to_device(
            slots + offsets, self.device, torch.int64
        ).split([len(slots), len(offsets)])
        if self.prefill_rule == "auto":  # few long requests: two passes (docs/benchmarks.md)
            live = [r.extend_len for r in reqs if r.extend_len]
            self.two_pass = sum(live) > TWO_PASS_FROM * len(live)
        fresh = [r.table_idx for r in reqs if r.cached_len == 0]
        if fresh:
            index = to_device(fresh, self.device, torch.int64)
            self.conv.index_fill_(1, index, 0)
            self.ssm.index_fill_(1, index, 0)

    def save(self, slot: int, snapshot: int) -> None:
        """Copy a running slot's state (every linear layer's) into a snapshot. Queued on the
        device after the forwards launched before it, so it saves what they leave."""
        self.saved_conv[:, snapshot] = self.conv[:, slot]
        self.saved_ssm[:, snapshot] = self.ssm[:, slot]

    def restore(self, snapshot: int, slot: int) -> None:
        """Copy a snapshot into a running slot: the state a request's next forward reads."""
        self.conv[:, slot] = self.saved_conv[:, snapshot]
        self.ssm[:, slot] = self.saved_ssm[:, snapshot]

    def keep_accepted(self, batch: Batch, accepted: torch.Tensor) -> None:
        """After a verify step, each request's state as if only its last token and its
        `accepted` [reqs] drafts had been run: every linear layer replays those tokens from
        the state before the verify (layers/gated_deltanet.py `_roll_back`)."""
        for roll_back in self.kept.values():
            roll_back(accepted)
        self.kept.clear()
        if self.gates:
            self._roll_back_ours(batch, accepted)

    def _roll_back_ours(self, batch: Batch, accepted: torch.Tensor) -> None:
        """The roll back of our kernels' verify, which left the slots as they were: each layer
        runs its rule again over each request's last token and accepted drafts, from the
        state before the verify, and each conv state becomes its last K - 1 inputs up to the
        same token. From the buffers and the live batch (its requests first), every layer at
        once: two kernels, on the device, without a wait."""
        n = batch.size
        slots, offsets = batch.state_slots[:n], batch.state_offsets[: n + 1]
        A_log, dt_bias = self._gate_parameters()
        mixed, (a, b) = self.verify_qkv[1], self.verify_ab
        args = (A_log, dt_bias, self.ssm, slots, offsets, self.shape, accepted)
        recurrent_layers(mixed, a, b, *args)
        conv_roll_back(self.verify_qkv[0], self.verify_conv, self.conv, slots, offsets, accepted)

    def _gate_parameters(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every linear layer's A_log and dt_bias, stacked [L, heads] in float32 (once)."""
        if self._stacked is None:
            layers = [self.gates[i] for i in range(self.ssm.size(0))]
            self._stacked = tuple(torch.stack([p[j].float() for p in layers]) for j in (0, 1))
        return self._stacked

    def verify_views(self, layer: int, tokens: int, reqs: int) -> VerifyViews:
        """Where a linear layer's verify leaves what the roll back reads (our kernels): views
        of the pool's buffers for `tokens` tokens and `reqs` requests."""
        if tokens > self.verify_qkv.size(2) or reqs > self.verify_conv.size(1):
            raise RuntimeError(
                f"a verify step of {tokens} tokens and {reqs} requests; the state pool was "
                f"sized for {self.verify_qkv.size(2)} and {self.verify_conv.size(1)}"
            )
        qkv, ab = self.verify_qkv[:, layer, :tokens], self.verify_ab[:, layer, :tokens]
        return VerifyViews(qkv[0], qkv[1], ab[0], ab[1], self.verify_conv[layer, :reqs])

    def graph_buffers(self, num_reqs: int, dummy_req: Req) -> tuple[torch.Tensor, torch.Tensor]:
        """The graphs' static buffers of state slots and token offsets (engine/graph.py), for
        `num_reqs` requests: a capture batch's `state_slots` and `state_offsets` are views of
        them, and before each replay they take the live batch's. The slots start as the
        dummy request's, which padding rows keep, so a padding row writes only the dummy's
        state, never a live request's. The offsets start at 0: at capture every request is
        empty, and the kernels that read them change no state."""
        slots = torch.full((num_reqs,), dummy_req.table_idx, dtype=torch.int64, device=self.device)
        return slots, torch.zeros(num_reqs + 1, dtype=torch.int64, device=self.device)


def gated_delta_kernels(device: torch.device) -> str:
    """What advances the states: "torch" (the layer's reference) or "triton"
    (kernels/gated_delta.py), as MINISGL_GATED_DELTA says; by default ours on CUDA, where
    they were measured faster at every batch size (tools/bench_gated_delta.py), and torch on
    a CPU."""
    choice = ENV.GATED_DELTA.value
    if choice == "auto":
        choice = "triton" if device.type == "cuda" else "torch"
    if choice == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"MINISGL_GATED_DELTA=triton runs Triton kernels, which need a CUDA device (this "
            f"engine is on {device.type}) or Triton's interpreter (TRITON_INTERPRET=1)"
        )
    return choice


# ---- its size at start-up: before the KV pages, from the same budget


def rank_linear(mc: ModelConfig) -> LinearAttention:
    """The linear layers' shape on this rank: its share of their heads, as the layers keep."""
    assert mc.linear is not None
    return mc.linear.rank_share(get_tp_info().size)


# By default the snapshots get this share of the memory the running states leave. A snapshot
# costs about what a 1,500-token conversation's K/V does (Qwen3.5-0.8B: 18 MiB against 12 KiB
# a token; the 9B: 48 MiB against 32 KiB), and each conversation the cache keeps wants one:
# for conversations of a few thousand tokens, a quarter of the memory keeps pace with the K/V.
SNAPSHOT_SHARE = 0.25


def snapshot_count(config: Any) -> int:
    """The snapshots to keep (config: the engine's, a SchedulerConfig where a scheduler runs
    it): `state_snapshots`, as set or as the budget resolved it (`budget_after_states`), else
    one per running request (a KV pool of fixed size, with no budget to share); none with the
    naive cache, which never reads one."""
    if getattr(config, "cache_type", "radix") == "naive":
        return 0
    if config.state_snapshots is None:
        return config.max_running_req
    return config.state_snapshots


def verify_capacity(shape: EngineShape) -> tuple[int, int]:
    """The tokens and requests (padding included) of a verify step at most, where our
    kernels run the linear layers of a speculating engine: (0, 0) elsewhere. A verify takes
    at most speculative_max_bs requests of num_draft_tokens drafts each (speculative/step.py);
    a verify graph pads with one filler request (engine/verify_graph.py)."""
    config = shape.config
    if config.speculative == "off" or gated_delta_kernels(shape.device) != "triton":
        return 0, 0
    max_bs = min(config.speculative_max_bs, config.max_running_req)
    return max_bs * (config.num_draft_tokens + 1), max_bs + 1


def _per_slot(shape: EngineShape) -> tuple[int, int]:
    """(linear layers, the bytes of one slot's state on this rank: every linear layer's conv
    and SSM)."""
    mc = shape.model_config
    assert mc.linear is not None
    linear_layers = mc.num_layers - len(attention_layers(mc))
    per_slot = RecurrentStatePool.bytes_per_slot(linear_layers, rank_linear(mc), shape.dtype)
    return linear_layers, per_slot


def state_pool_bytes(shape: EngineShape) -> int:
    """What a hybrid model's recurrent state pool takes on this rank: a slot for every
    page-table row and every snapshot (0 for a model without linear layers)."""
    if shape.model_config.linear is None:
        return 0
    config, per_slot = shape.config, _per_slot(shape)[1]
    return per_slot * (config.max_running_req + 1 + snapshot_count(config)) + _verify_bytes(shape)


def _verify_bytes(shape: EngineShape) -> int:
    layers, linear = _per_slot(shape)[0], rank_linear(shape.model_config)
    return RecurrentStatePool.verify_bytes(layers, linear, shape.dtype, verify_capacity(shape))


def budget_after_states(shape: EngineShape, budget: int, per_page: int) -> int:
    """The KV pages' budget once the recurrent states have theirs; an error, saying what the
    states take, if no page fits. Where `state_snapshots` is left to the default, it is set
    here to SNAPSHOT_SHARE of what the running states leave: the config then says what runs."""
    states = state_pool_bytes(shape)
    if not states:
        return budget
    config, per_slot = shape.config, _per_slot(shape)[1]
    if config.state_snapshots is None and snapshot_count(config):  # the default, not naive
        left = budget - per_slot * (config.max_running_req + 1) - _verify_bytes(shape)
        # A snapshot sits on a radix node of one page or more: no more than a full pool holds.
        pages = config.max_running_req * cdiv(shape.max_seq_len, config.page_size)
        count = min(max(0, int(left * SNAPSHOT_SHARE) // per_slot), pages)
        config.state_snapshots = agree_min(count)  # ranks schedule alike: as many on each
        states = state_pool_bytes(shape)
    if budget - states < per_page:
        raise MemoryError(
            f"the recurrent states of {config.max_running_req} requests and "
            f"{snapshot_count(config)} prefix-cache snapshots take {_mb(states)} "
            f"({_mb(per_slot)} each, and one for the dummy request), leaving no room for a KV "
            f"page in a budget of {_mb(budget)}; one request needs at least "
            f"{_mb(2 * per_slot + per_page)}: lower max_running_req or state_snapshots, or "
            "raise the budget"
        )
    return budget - states


def make_state_pool(shape: EngineShape, rows: int) -> RecurrentStatePool | None:
    """Slot i for page-table row i, the last for the dummy request, then the snapshots, each
    with this rank's heads; its size logged."""
    mc = shape.model_config
    if mc.linear is None:
        return None
    linear_layers, per_slot = _per_slot(shape)
    snapshots = snapshot_count(shape.config)
    pool = RecurrentStatePool(
        linear_layers, rows, rank_linear(mc), shape.dtype, shape.device, snapshots,
        verify_capacity(shape),
    )  # fmt: skip
    logger.info(
        "recurrent state pool: %d linear layers x %d slots (%d requests + the dummy) and "
        "%d prefix-cache snapshots, %s each, %s in all",
        linear_layers, rows, rows - 1, snapshots, _mb(per_slot), _mb(pool.bytes),
    )  # fmt: skip
    return pool


def _mb(n: int) -> str:
    return f"{n / 2**20:.3g} MB"
