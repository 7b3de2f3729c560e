"""Gated DeltaNet: the linear-attention layer of Qwen3.5, with a recurrent state per request.

Instead of attending over every earlier key, a head keeps one matrix S [key_dim, value_dim]
and, for each token t, forgets a little of it, writes the token's value under its key by the
delta rule, and reads it with the query:

    S = exp(g_t) * S                          decay, g_t <= 0 (from A_log, dt_bias and a_t)
    S = S + k_t (beta_t * (v_t - k_t^T S))    replace what S held under k_t by v_t, by beta_t
    o_t = q_t^T S

q, k and v first pass a causal depthwise conv of width 4 (with SiLU), so each token also
sees the three before it; q and k are L2-normalised per head; the output is normalised per
head and gated by SiLU(z) before the output projection. What a request carries from one
forward to the next is S (float32) and the conv's last three inputs: the state pool's slots
(kvcache/state_pool.py), read through the forward context.

Tensor parallelism cuts a layer by heads: a rank keeps a share of the key heads and of the
value heads that read them (each rank the same ratio), so its slice of each of q, k and v,
of the conv's channels, of z, b, a, A_log and dt_bias, and a state of its own heads alone;
the gated norm (per head) is whole everywhere and out_proj adds the ranks' partial sums.
Heads never mix until out_proj, so the recurrence runs on each rank as on one.

Two ways to run it, chosen once at start-up (`pool.kernels`, MINISGL_GATED_DELTA):
- torch, the reference (the default on a CPU): a batch's requests are right-padded into one
  [requests, longest, ...] block (padding has beta = 0 and g = 0, so it leaves the state as
  it was), and a prefill runs the delta rule a chunk of 64 tokens at a time
  (`chunk_delta_rule`); `delta_rule` is the same rule one token at a time, in plain words.
  The padding's shape is read from the requests' lengths on the host;
- triton (kernels/gated_delta.py, the default on CUDA): one kernel for a decode step, and
  for a prefill a conv and the chunked rule that read every length and slot from device
  tensors, so a CUDA graph of a prefill replays correctly for any lengths. With
  MINISGL_GATED_DELTA_PREFILL=two-pass the chunked rule is kernels/gated_delta_chunks.py's:
  every chunk's own work at once, then each request's walk, 64 tokens a step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.core import Batch, get_global_ctx
from minisgl.distributed import Split, get_tp_info
from minisgl.kernels import gated_delta, gated_delta_chunks
from minisgl.layers.linear import Linear
from minisgl.layers.parallel import mark_split
from minisgl.models.families import LinearAttention

if TYPE_CHECKING:
    from minisgl.kvcache.state_pool import RecurrentStatePool

CHUNK = 64  # tokens the chunked delta rule solves at once


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm by w (not 1 + w), then times SiLU(gate)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32.to(dtype) * F.silu(gate.float())).to(dtype)


def causal_conv(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, lengths: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU of the causal depthwise conv of x [B, T, C] after the state [B, C, K - 1] (the
    inputs before it); (output [B, T, C], the new state: the last K - 1 inputs). Rows padded
    on the right give `lengths` [B]: the new state is then the last K - 1 real inputs."""
    width = weight.size(-1)
    xs = torch.cat([state.to(x.dtype), x.transpose(1, 2)], dim=-1)  # [B, C, K - 1 + T]
    y = F.silu(F.conv1d(xs, weight.unsqueeze(1), groups=xs.size(1))).transpose(1, 2)
    if lengths is None:
        return y, xs[..., xs.size(-1) - (width - 1) :]
    last = lengths[:, None] + torch.arange(width - 1, device=x.device)  # [B, K - 1] in xs
    return y, xs.gather(2, last[:, None, :].expand(-1, xs.size(1), -1))


def delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule, token by token, in float32. q, k: [B, T, H, dk] (normalised,
    one per value head), v: [B, T, H, dv], g, beta: [B, T, H], state: [B, H, dk, dv].
    Returns (output [B, T, H, dv], the state after the last token)."""
    out = torch.empty_like(v)
    for t in range(q.size(1)):
        state = state * g[:, t].exp()[..., None, None]
        read = torch.einsum("bhk,bhkv->bhv", k[:, t], state)  # what S holds under k_t
        delta = (v[:, t] - read) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        out[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], state)
    return out, state


def chunk_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`delta_rule`'s result (same arguments), `chunk` tokens at a time, mostly in matmuls.

    Within a chunk, let c_t be the sum of g from its first token to t (so exp(c_t) is how
    much of the chunk's starting state S0 is left at t) and d_t = beta_t (v_t - k_t^T
    exp(g_t) S_{t-1}) the change token t writes. Unrolling the rule,

        S_t = exp(c_t) S0 + sum_{j<=t} exp(c_t - c_j) k_j d_j^T,

    and putting that into d_t gives, for the chunk's d at once, a triangular system
    (I + A) d = beta (v - exp(c) k S0) with A[t, j] = beta_t exp(c_t - c_j) k_t.k_j, j < t.
    Solved for v and for k separately, d = U - W S0, where U and W do not depend on S0:
    every chunk's are solved in parallel; then only a few matmuls per chunk carry the state
    from one chunk to the next. Padding (g = 0, beta = 0) changes nothing: its d is 0.
    """
    B, T, H, dk = k.shape
    dv = v.size(-1)
    chunk = min(chunk, T)
    pad = -T % chunk

    def blocks(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, ...] -> [B, H, chunks, chunk, ...]
        x = F.pad(x.transpose(1, 2), [0, 0] * (x.dim() - 3) + [0, pad])
        return x.reshape(B, H, -1, chunk, *x.shape[3:])

    q, k, v, g, beta = (blocks(x) for x in (q, k, v, g, beta))
    c = g.cumsum(-1)  # [B, H, chunks, chunk]
    later = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (c[..., :, None] - c[..., None, :]).masked_fill(later, float("-inf")).exp()
    a = (beta[..., None] * decay * (k @ k.transpose(-1, -2))).tril(-1)
    rhs = beta[..., None] * torch.cat([v, c.exp()[..., None] * k], dim=-1)
    # unitriangular: the solver takes the diagonal as ones, so `a` stands for I + A
    u, w = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True).split(
        [dv, dk], dim=-1
    )
    scores = (q @ k.transpose(-1, -2)) * decay  # within the chunk, each key decayed to t
    q_start = q * c.exp()[..., None]  # queries read what is left of S0
    k_end = k * (c[..., -1:] - c).exp()[..., None]  # keys decayed to the chunk's end
    out = torch.empty_like(v)
    for i in range(q.size(2)):
        d = u[:, :, i] - w[:, :, i] @ state
        out[:, :, i] = q_start[:, :, i] @ state + scores[:, :, i] @ d
        state = state * c[:, :, i, -1, None, None].exp() + k_end[:, :, i].transpose(-1, -2) @ d
    return out.reshape(B, H, -1, dv)[:, :, :T].transpose(1, 2), state


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


def padded_places(offsets: torch.Tensor, width: int, num_tokens: int) -> torch.Tensor:
    """Where each of a batch's packed tokens goes when every request is right-padded to
    `width` tokens: request i's j-th token to row i * width + j (offsets [B + 1]: where each
    request's tokens start). On the device, without waiting for it."""
    t = torch.arange(num_tokens, device=offsets.device)
    req = torch.searchsorted(offsets[1:], t, right=True)
    return req * width + t - offsets[req]


def linear_of(weight: torch.Tensor) -> Linear:
    """A projection holding `weight` [out, in], a rank's own rows: made after loading."""
    with torch.device("meta"):
        layer = Linear(weight.size(1), weight.size(0))
    layer.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    return layer


class GatedDeltaNet(nn.Module):
    def __init__(self, hidden_size: int, shape: LinearAttention, eps: float, index: int) -> None:
        """`shape`: the whole layer's; the layer keeps this rank's share of its heads."""
        super().__init__()
        s = shape
        self.shape = s.rank_share(get_tp_info().size)  # what forward sees: this rank's heads
        self.index = index  # its place among the linear layers: its layer of the state pool
        key_dim, value_dim = s.num_key_heads * s.key_head_dim, s.num_value_heads * s.value_head_dim
        qkv = Split.even(0, key_dim, key_dim, value_dim)  # each rank its slice of q, k and v
        self.in_proj_qkv = Linear(hidden_size, s.conv_dim, split=qkv)
        self.in_proj_z = Linear(hidden_size, value_dim, split=Split.even(0, value_dim))
        heads = Split.even(0, s.num_value_heads)  # one number per value head
        self.in_proj_b = Linear(hidden_size, s.num_value_heads, split=heads)
        self.in_proj_a = Linear(hidden_size, s.num_value_heads, split=heads)
        channels = qkv.local_size  # the conv is depthwise: its channels split as q, k, v do
        self.conv1d = nn.Conv1d(channels, channels, s.conv_kernel, groups=channels, bias=False)
        self.A_log = nn.Parameter(torch.empty(heads.local_size))
        self.dt_bias = nn.Parameter(torch.empty(heads.local_size))
        mark_split(qkv, self.conv1d.weight)
        mark_split(heads, self.A_log)
        mark_split(heads, self.dt_bias)
        self.norm = GatedRMSNorm(s.value_head_dim, eps)  # per head: whole on every rank
        self.out_proj = Linear(value_dim, hidden_size, split=Split.even(1, value_dim))
        self.in_proj_sizes: list[int] = []  # after_load merges the four in_proj_* into one

    def after_load(self) -> None:
        """One projection where the checkpoint has four: this rank's rows of in_proj_qkv, z,
        b and a, stacked. A decode step then reads them in one matrix-vector product, where
        four launches (two of 16-32 rows: all launch, no bandwidth) cost more than the
        reading. Weights stored in FP8 stay apart, each with its scales."""
        parts = [self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a]
        if any(p.weight.dtype == torch.float8_e4m3fn or len(p.state_dict()) > 1 for p in parts):
            return
        self.in_proj_sizes = [p.weight.size(0) for p in parts]
        self.in_proj = linear_of(torch.cat([p.weight.data for p in parts]))
        del self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = get_global_ctx()
        batch, pool = ctx.batch, ctx.state_pool
        if self.in_proj_sizes:  # merged at load
            qkv, z, b, a = self.in_proj(x).split(self.in_proj_sizes, dim=-1)
        else:
            qkv, z = self.in_proj_qkv(x), self.in_proj_z(x)
            b, a = self.in_proj_b(x), self.in_proj_a(x)
        if pool.kernels == "triton":
            out = self._kernels(qkv, z, b, a, batch, pool)
        else:
            out = self._reference(qkv, z, b, a, batch, pool)
        return self.out_proj(out.flatten(1))

    def _reference(
        self, qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
        batch: Batch, pool: RecurrentStatePool,
    ) -> torch.Tensor:  # fmt: skip
        """The torch path: every request at once, right-padded to the longest."""
        beta = b.sigmoid().float()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        conv, ssm = pool.conv[self.index], pool.ssm[self.index]  # [slots, ...] each
        slots, reqs = batch.state_slots, batch.padded_size
        longest = max(r.extend_len for r in batch.padded_reqs)
        if longest == 1:  # a decode step: one token each, nothing to pad
            lengths, places = None, None
        else:
            lengths = batch.state_offsets.diff()
            places = padded_places(batch.state_offsets, longest, qkv.size(0))

        def padded(t: torch.Tensor) -> torch.Tensor:  # [T, ...] -> [reqs, longest, ...]
            if places is None:
                return t[:, None]
            out = t.new_zeros(reqs * longest, *t.shape[1:])
            return out.index_copy_(0, places, t).view(reqs, longest, *t.shape[1:])

        weight = self.conv1d.weight.squeeze(1)
        x, conv_before, g, beta = padded(qkv), conv[slots], padded(g), padded(beta)
        mixed, conv_after = causal_conv(x, conv_before, weight, lengths)
        q, k, v = self._heads(mixed)
        rule = delta_rule if x.size(1) == 1 else chunk_delta_rule
        o, ssm_after = rule(q, k, v, g, beta, ssm[slots])
        if batch.phase == "verify":  # the slots keep the state before it, for the roll back
            inputs = torch.cat([conv_before.to(x.dtype), x.transpose(1, 2)], dim=-1)
            pool.kept[self.index] = lambda accepted: self._roll_back(
                pool, slots[: batch.size], inputs, k, v, g, beta, accepted
            )
        else:
            conv[slots], ssm[slots] = conv_after.to(conv.dtype), ssm_after
        o = o.flatten(0, 1)
        o = o if places is None else o.index_select(0, places)
        o = o.to(qkv.dtype)
        return self.norm(o, z.view_as(o))

    def _heads(
        self,
        mixed: torch.Tensor,  # [B, T, conv_dim]: q, k, v after the conv
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (scaled), k: [B, T, value heads, dk], L2-normed in fp32, each q/k head repeated
        for the value heads that read it; v: [B, T, value heads, dv]."""
        s = self.shape
        reqs, n = mixed.shape[:2]
        key_dim = s.num_key_heads * s.key_head_dim
        q, k, v = mixed.float().split([key_dim, key_dim, mixed.size(-1) - 2 * key_dim], dim=-1)
        per_key = s.num_value_heads // s.num_key_heads  # value heads that share a q/k head
        q, k = (
            _l2norm(t.reshape(reqs, n, s.num_key_heads, s.key_head_dim)).repeat_interleave(
                per_key, dim=2
            )
            for t in (q, k)
        )
        return q * s.key_head_dim**-0.5, k, v.reshape(reqs, n, s.num_value_heads, -1)

    def _roll_back(
        self, pool: RecurrentStatePool, slots: torch.Tensor, inputs: torch.Tensor,
        k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
        accepted: torch.Tensor,
    ) -> None:  # fmt: skip
        """After a verify step (whose forward left the slots as they were): each request's
        state after its last token and its `accepted` [reqs] drafts, from the verify's own
        k, v, g and beta, the tokens after them masked out (g = 0, beta = 0 leave the state
        as it is); the conv's state is its last K - 1 inputs up to the same token. On the
        device, without a wait: the verify's extra cost is one more pass of the rule."""
        n = slots.size(0)
        steps = torch.arange(k.size(1), device=k.device)
        keep = (steps[None, :] <= accepted[:n, None]).float()[..., None]  # [reqs, T, 1]
        ssm, conv = pool.ssm[self.index], pool.conv[self.index]
        _, state = delta_rule(k[:n], k[:n], v[:n], g[:n] * keep, beta[:n] * keep, ssm[slots])
        ssm[slots] = state
        last = accepted[:n, None] + 1 + torch.arange(conv.size(-1), device=k.device)
        window = inputs[:n].gather(2, last[:, None, :].expand(-1, inputs.size(1), -1))
        conv[slots] = window.to(conv.dtype)

    def _kernels(
        self, qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
        batch: Batch, pool: RecurrentStatePool,
    ) -> torch.Tensor:  # fmt: skip
        """Our Triton kernels: a decode step in one; a prefill step as a conv and the chunked
        recurrence over each request's tokens, lengths read on the device (a verify's
        recurrence token by token)."""
        conv, ssm = pool.conv[self.index], pool.ssm[self.index]
        weight = self.conv1d.weight.squeeze(1)
        if batch.is_decode:
            return gated_delta.decode_step(
                qkv, z, a, b, self.A_log, self.dt_bias, weight, self.norm.weight,
                self.norm.eps, conv, ssm, batch.state_slots, self.shape, pool.split_decode,
            )  # fmt: skip
        slots, offsets = batch.state_slots, batch.state_offsets
        if batch.phase == "verify":  # the slots keep the states before it
            keep = pool.verify_views(self.index, qkv.size(0), slots.size(0))
            torch.index_select(conv, 0, slots, out=keep.conv)
            mixed = gated_delta.conv_varlen(qkv, weight, conv, slots, offsets, keep.mixed, False)
            keep.qkv.copy_(qkv)
            keep.a.copy_(a)
            keep.b.copy_(b)
            # a request's last token and its few drafts: token by token, as a decode step
            # runs them (a chunk of 64 would solve its system for a handful of rows)
            o = gated_delta.recurrent_varlen(
                mixed, a, b, self.A_log, self.dt_bias, ssm, slots, offsets, self.shape, keep=False
            )
            pool.gates[self.index] = self.A_log, self.dt_bias  # for the roll back
        else:
            rule = gated_delta_chunks.chunks_varlen if pool.two_pass else gated_delta.chunked_varlen
            mixed = gated_delta.conv_varlen(qkv, weight, conv, slots, offsets)
            o = rule(mixed, a, b, self.A_log, self.dt_bias, ssm, slots, offsets, self.shape)
        return gated_delta.gated_norm(o, z, self.norm.weight, self.norm.eps, qkv.dtype)
