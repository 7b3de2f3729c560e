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

This is the torch reference: one step per token, in float32. It is exact, not fast.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.core import get_global_ctx
from minisgl.distributed import Split, get_tp_info
from minisgl.layers.linear import Linear
from minisgl.layers.parallel import mark_split
from minisgl.models.families import LinearAttention


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
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU of the causal depthwise conv of x [B, T, C] after the state [B, C, K - 1] (the
    inputs before it); (output [B, T, C], the new state: the last K - 1 inputs)."""
    width = weight.size(-1)
    xs = torch.cat([state.to(x.dtype), x.transpose(1, 2)], dim=-1)  # [B, C, K - 1 + T]
    y = F.conv1d(xs, weight.unsqueeze(1), groups=xs.size(1))  # [B, C, T]
    return F.silu(y).transpose(1, 2), xs[..., xs.size(-1) - (width - 1) :]


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


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = get_global_ctx()
        batch, pool = ctx.batch, ctx.state_pool
        s = self.shape
        qkv = self.in_proj_qkv(x)
        z = self.in_proj_z(x)
        beta = self.in_proj_b(x).sigmoid().float()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        conv, ssm = pool.conv[self.index], pool.ssm[self.index]  # [slots, ...] each
        lengths = [r.extend_len for r in batch.padded_reqs]
        if max(lengths) == 1:  # a decode step: every request at once
            groups = [(batch.state_slots, 0, len(lengths), 1)]
        else:  # a prefill: request by request
            starts = [sum(lengths[:i]) for i in range(len(lengths))]
            groups = [
                (batch.state_slots[i : i + 1], starts[i], 1, n) for i, n in enumerate(lengths)
            ]
        out = x.new_empty(x.size(0), s.num_value_heads, s.value_head_dim)
        weight = self.conv1d.weight.squeeze(1)
        for slots, start, reqs, n in groups:
            rows = slice(start, start + reqs * n)
            mixed, conv_after = causal_conv(qkv[rows].view(reqs, n, -1), conv[slots], weight)
            o, ssm_after = self._recur(mixed, g[rows], beta[rows], ssm[slots], reqs, n)
            conv[slots], ssm[slots] = conv_after.to(conv.dtype), ssm_after
            out[rows] = o.reshape(reqs * n, s.num_value_heads, s.value_head_dim).to(x.dtype)
        out = self.norm(out, z.view_as(out))
        return self.out_proj(out.flatten(1))

    def _recur(
        self,
        mixed: torch.Tensor,  # [B, T, conv_dim]: q, k, v after the conv
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
        reqs: int,
        n: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.shape
        key_dim = s.num_key_heads * s.key_head_dim
        q, k, v = mixed.float().split([key_dim, key_dim, mixed.size(-1) - 2 * key_dim], dim=-1)
        per_key = s.num_value_heads // s.num_key_heads  # value heads that share a q/k head
        q, k = (
            _l2norm(t.reshape(reqs, n, s.num_key_heads, s.key_head_dim)).repeat_interleave(
                per_key, dim=2
            )
            for t in (q, k)
        )
        v = v.reshape(reqs, n, s.num_value_heads, s.value_head_dim)
        g, beta = g.view(reqs, n, -1), beta.view(reqs, n, -1)
        return delta_rule(q * s.key_head_dim**-0.5, k, v, g, beta, state)
