"""Gated DeltaNet in Triton: a decode step in one kernel, a prefill as a conv and a recurrence.

The torch reference (layers/gated_deltanet.py) spends a decode step of one linear layer in
about twenty small ops: the conv state is gathered, shifted and scattered back, q and k are
normalised, the gates computed, the state of every request gathered from its slot, decayed,
updated, read and scattered back, and the output normalised and gated. Each op reads and
writes its whole input, and the state (value heads x 128 x 128 floats a request: 1 MB for
Qwen3.5-0.8B's 16 heads, 2 MB for 9B's 32) makes the trip several times. Here a decode step
is one kernel that reads each state once and writes it once, in place, in its slot.

Decode: one program per (request, key head). It owns the conv channels of its q and k head
and of the value heads that share them, so it alone shifts their conv state: no other
program reads a channel it writes. Then, for each of those value heads, the state [dk, dv]
sits in registers for one update, and the gated RMSNorm of the head's output follows. At
small batches those programs are too few for the machine, and the step runs in two kernels
instead (`_decode_columns_kernel`, then `_decode_finish_kernel`: see there).

Prefill (and verify): lengths differ per request, and a CUDA graph must not bake them in,
so every kernel reads where each request's tokens start (`offsets` [requests + 1]) and its
slot from device tensors:
- the conv, one program per block of tokens and channels: each token finds its request
  among the offsets, and reads the inputs before the request's first token from its slot's
  conv state;
- the conv state's update, one program per (request, block of channels), after the conv
  has read the old one: the last K - 1 inputs of each request;
- the recurrence, one program per (request, value head, block of value channels), its
  block of the state in registers in float32, from the slot's state to the slot's state.
  `recurrent_varlen` walks the request's tokens one by one: simple, but a long prompt is
  one long walk of small steps. `chunked_varlen`, which the layer runs, walks it 16
  tokens at a step in the chunk form of the torch path (`chunk_delta_rule`): the chunk's
  triangular system is solved by forward substitution on a 16 x 16 tile, the rest is
  matmuls. A wider chunk (64, solved by blocks) would use the tensor cores better and
  walk fewer steps; not written yet.

A request with no tokens (a prefill graph's empty slots) changes nothing; padding requests
write only the dummy request's slot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.env import ENV
from minisgl.kernels.attention import _dot
from minisgl.models.families import LinearAttention

CHUNK = 16  # tokens the chunked kernel solves at once
SEARCH = 16  # the conv finds a token's request among at most 2^16 - 1
# A decode step of this many (request, key head) programs or fewer asks for each state
# first: the machine is mostly idle, and a program's loads are its time. With more, a state
# held from the start only crowds the registers of programs that wait their turn anyway.
EARLY_PROGRAMS = 128
# Built for sm_90 (Triton 3.6), the fused decode kernel takes 148 registers a thread at 8
# warps, so one program of 8 warps fits on an SM at a time: it asks for its 64 KB state,
# waits, computes, stores, and the memory idles between. Capped at 128 (maxnreg,
# MINISGL_GATED_DELTA_REGISTERS, the default) it spills nothing and two programs share an
# SM: on an H100 1.10-1.20x faster at batch 16-256 on the 0.8B's and 9B's heads, the 0.8B's
# steps at batch 64 and 256 1.06x and 1.13x (docs/benchmarks.md).


@triton.jit
def _silu(x):
    return x / (1.0 + tl.exp(-x))


@triton.jit
def _gates(A, Bp, ALog, DtBias, row, head, stride_a, stride_b):
    """The decay's log g <= 0 and the write strength beta of one token and value head."""
    x = tl.load(A + row * stride_a + head).to(tl.float32) + tl.load(DtBias + head).to(tl.float32)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))
    g = -tl.exp(tl.load(ALog + head).to(tl.float32)) * softplus
    beta = 1.0 / (1.0 + tl.exp(-tl.load(Bp + row * stride_b + head).to(tl.float32)))
    return g, beta


@triton.jit
def _l2normed(x):
    return x / tl.sqrt(tl.sum(x * x, axis=0) + 1e-6)  # the reference's epsilon


@triton.jit
def _delta_step(S, q, k, v, g, beta):
    """One token of the gated delta rule on a block of the state S [dk, block of dv]."""
    S = S * tl.exp(g)
    d = (v - tl.sum(S * k[:, None], axis=0)) * beta  # v minus what S holds under k
    S = S + k[:, None] * d[None, :]
    return S, tl.sum(S * q[:, None], axis=0)


@triton.jit
def _window(X, State, stride_c, chans, mask, taps, WIDTH: tl.constexpr):
    """One token's conv inputs over `chans` [chans, taps]: the state's K - 1, then its own."""
    earlier = taps[None, :] < WIDTH - 1
    st = tl.load(
        State + chans[:, None] * stride_c + taps[None, :], mask=mask[:, None] & earlier, other=0.0
    )
    x = tl.load(X + chans, mask=mask, other=0.0)
    return tl.where(taps[None, :] == WIDTH - 1, x[:, None], st)


@triton.jit
def _conv_window(X, W, State, stride_c, chans, mask, taps, WIDTH: tl.constexpr):
    """The conv of one token over `chans`: (its SiLU output, the window of inputs [chans,
    taps]: the state's K - 1, then the token's)."""
    window = _window(X, State, stride_c, chans, mask, taps, WIDTH)
    in_w = mask[:, None] & (taps[None, :] < WIDTH)
    w = tl.load(W + chans[:, None] * WIDTH + taps[None, :], mask=in_w, other=0.0)
    return _silu(tl.sum(window.to(tl.float32) * w.to(tl.float32), axis=1)), window


@triton.jit
def _shift_in(State, stride_c, chans, mask, taps, window, WIDTH: tl.constexpr):
    """The new conv state: the window's last K - 1 inputs (tap j goes to j - 1)."""
    keep = mask[:, None] & (taps[None, :] >= 1) & (taps[None, :] < WIDTH)
    tl.store(State + chans[:, None] * stride_c + taps[None, :] - 1, window, mask=keep)


@triton.jit
def _decode_kernel(
    QKV, Z, A, Bp, ALog, DtBias, ConvW, NormW, ConvState, SSM, Slots, Out,
    eps, scale,
    stride_qkv, stride_z, stride_a, stride_b, stride_out,
    stride_cs, stride_cc, stride_ss, stride_sh,
    KEY_DIM: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, PER_KEY: tl.constexpr,
    WIDTH: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_W: tl.constexpr,
    EARLY: tl.constexpr,
):  # fmt: skip
    row, h = tl.program_id(0), tl.program_id(1)
    slot = tl.load(Slots + row).to(tl.int64)
    x = QKV + row * stride_qkv
    conv = ConvState + slot * stride_cs
    taps = tl.arange(0, BLOCK_W)
    offs_k = tl.arange(0, BLOCK_DK)
    mk = offs_k < DK
    offs_v = tl.arange(0, BLOCK_DV)
    mv = offs_v < DV
    smask = mk[:, None] & mv[None, :]
    states = SSM + slot * stride_ss + offs_k[:, None] * DV + offs_v[None, :]
    if EARLY:  # few programs, each waiting on its loads: the state (64 KB a head, the largest
        # read by far) is asked for first, on its way while the conv, norms and gates run
        S = tl.load(states + h * PER_KEY * stride_sh, mask=smask, other=0.0)
    q_chans, k_chans = h * DK + offs_k, KEY_DIM + h * DK + offs_k
    q, q_window = _conv_window(x, ConvW, conv, stride_cc, q_chans, mk, taps, WIDTH)
    k, k_window = _conv_window(x, ConvW, conv, stride_cc, k_chans, mk, taps, WIDTH)
    q = _l2normed(q) * scale
    k = _l2normed(k)
    norm_w = tl.load(NormW + offs_v, mask=mv, other=0.0).to(tl.float32)
    for i in tl.static_range(PER_KEY):  # the value heads that share this q/k head
        hv = h * PER_KEY + i
        if i > 0 or not EARLY:
            S = tl.load(states + hv * stride_sh, mask=smask, other=0.0)
        v_chans = 2 * KEY_DIM + hv * DV + offs_v
        v, v_window = _conv_window(x, ConvW, conv, stride_cc, v_chans, mv, taps, WIDTH)
        g, beta = _gates(A, Bp, ALog, DtBias, row, hv, stride_a, stride_b)
        S, o = _delta_step(S, q, k, v, g, beta)
        tl.store(states + hv * stride_sh, S, mask=smask)
        # the gated RMSNorm: o normalised over the head, times its weight and SiLU(z)
        z = tl.load(Z + row * stride_z + hv * DV + offs_v, mask=mv, other=0.0).to(tl.float32)
        o = o / tl.sqrt(tl.sum(o * o, axis=0) / DV + eps) * norm_w * _silu(z)
        tl.store(Out + row * stride_out + hv * DV + offs_v, o, mask=mv)
        tl.debug_barrier()  # every thread has read this head's conv state before it shifts
        _shift_in(conv, stride_cc, v_chans, mv, taps, v_window, WIDTH)
    _shift_in(conv, stride_cc, q_chans, mk, taps, q_window, WIDTH)
    _shift_in(conv, stride_cc, k_chans, mk, taps, k_window, WIDTH)


# ---- decode in two kernels: the recurrence over blocks of value columns, then the rest
#
# The fused kernel's program holds a whole state (dk x dv floats, 64 KB at 128 x 128): at
# batch 1 a layer is 16 such programs on a machine of 132 SMs, each waiting out its loads;
# at batch 64 few fit on an SM at once. Here the recurrence's program holds dk x SPLIT_DV
# of one value head, so a layer has dv / SPLIT_DV times as many, smaller ones. A value
# column's update needs all of q and k but nothing of the other columns; what needs the
# whole head (the norm), or must wait until every program has read the conv state (its
# shift), is the second kernel's.

SPLIT_DV = 16  # value columns a program of the recurrence holds
SPLIT_WARPS = 2  # and its warps
# Measured on one H200 (docs/benchmarks.md), a layer's decode step in µs, fused / split (32
# columns, 4 warps): the 0.8B's 16 heads 12.3 / 7.5 at batch 1, 16.0 / 14.7 at 8, 63.4 / 68.4
# at 64, 234 / 251 at 256; the 9B's (32 value heads) 18.1 / 8.4, 23.1 / 23.2, 112 / 127, 420
# / 482. So a step splits where the fused kernel has EARLY_PROGRAMS programs or fewer (batch 8
# and below). A sweep of columns and warps on an H100 then gave 16 columns with 2 warps at
# batch 1 and 8: 0.8B 6.4 and 13.6 µs against 7.4 and 15.7 with 32 and 4; 9B 7.5 and 23.4
# against 9.0 and 25.2 (at 64 and 256 the fused kernel stays fastest of all).


@triton.jit
def _decode_columns_kernel(
    QKV, A, Bp, ALog, DtBias, ConvW, ConvState, SSM, Slots, Cols,
    scale,
    stride_qkv, stride_a, stride_b, stride_o,
    stride_cs, stride_cc, stride_ss, stride_sh,
    KEY_DIM: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, PER_KEY: tl.constexpr,
    WIDTH: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    """One program per (request, value head, block of value columns): the conv of its q, k
    and value columns read from the conv state (not shifted here), its block of the state
    updated in place, the head's output columns (before the norm) into Cols, in float32."""
    row, hv, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    h = hv // PER_KEY
    slot = tl.load(Slots + row).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_DK)
    mk = offs_k < DK
    cols = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    mv = cols < DV
    at = SSM + slot * stride_ss + hv * stride_sh + offs_k[:, None] * DV + cols[None, :]
    smask = mk[:, None] & mv[None, :]
    S = tl.load(at, mask=smask, other=0.0)  # the largest read, on its way first
    x = QKV + row * stride_qkv
    conv = ConvState + slot * stride_cs
    taps = tl.arange(0, BLOCK_W)
    q, _ = _conv_window(x, ConvW, conv, stride_cc, h * DK + offs_k, mk, taps, WIDTH)
    k, _ = _conv_window(x, ConvW, conv, stride_cc, KEY_DIM + h * DK + offs_k, mk, taps, WIDTH)
    v, _ = _conv_window(x, ConvW, conv, stride_cc, 2 * KEY_DIM + hv * DV + cols, mv, taps, WIDTH)
    g, beta = _gates(A, Bp, ALog, DtBias, row, hv, stride_a, stride_b)
    S, o = _delta_step(S, _l2normed(q) * scale, _l2normed(k), v, g, beta)
    tl.store(at, S, mask=smask)
    tl.store(Cols + row * stride_o + hv * DV + cols, o, mask=mv)


@triton.jit
def _decode_finish_kernel(
    QKV, Z, Cols, NormW, ConvState, Slots, Out,
    eps,
    stride_qkv, stride_z, stride_o, stride_out, stride_cs, stride_cc,
    KEY_DIM: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, PER_KEY: tl.constexpr,
    WIDTH: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    """One program per (request, value head), after the recurrence: the head's gated RMSNorm,
    and the conv state's shift for its value channels (and, for the first value head of a
    key head, its q and k channels): every program of the recurrence has read them."""
    row, hv = tl.program_id(0), tl.program_id(1)
    offs_v = tl.arange(0, BLOCK_DV)
    mv = offs_v < DV
    o = tl.load(Cols + row * stride_o + hv * DV + offs_v, mask=mv, other=0.0)
    z = tl.load(Z + row * stride_z + hv * DV + offs_v, mask=mv, other=0.0).to(tl.float32)
    norm_w = tl.load(NormW + offs_v, mask=mv, other=0.0).to(tl.float32)
    o = o / tl.sqrt(tl.sum(o * o, axis=0) / DV + eps) * norm_w * _silu(z)
    tl.store(Out + row * stride_out + hv * DV + offs_v, o, mask=mv)
    slot = tl.load(Slots + row).to(tl.int64)
    x = QKV + row * stride_qkv
    conv = ConvState + slot * stride_cs
    taps = tl.arange(0, BLOCK_W)
    v_chans = 2 * KEY_DIM + hv * DV + offs_v
    window = _window(x, conv, stride_cc, v_chans, mv, taps, WIDTH)
    tl.debug_barrier()  # every thread has read the channels' state before any is shifted
    _shift_in(conv, stride_cc, v_chans, mv, taps, window, WIDTH)
    if hv % PER_KEY == 0:  # the first value head of its key head: q's and k's channels too
        offs_k = tl.arange(0, BLOCK_DK)
        mk = offs_k < DK
        q_chans, k_chans = hv // PER_KEY * DK + offs_k, KEY_DIM + hv // PER_KEY * DK + offs_k
        q_window = _window(x, conv, stride_cc, q_chans, mk, taps, WIDTH)
        k_window = _window(x, conv, stride_cc, k_chans, mk, taps, WIDTH)
        tl.debug_barrier()
        _shift_in(conv, stride_cc, q_chans, mk, taps, q_window, WIDTH)
        _shift_in(conv, stride_cc, k_chans, mk, taps, k_window, WIDTH)


def decode_step(
    qkv: torch.Tensor,  # [B, conv_dim]: the token's q, k and v before the conv
    z: torch.Tensor,  # [B, value heads * dv]: the output gate
    a: torch.Tensor,  # [B, value heads]: the decay's input
    b: torch.Tensor,  # [B, value heads]: beta's input
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    conv_weight: torch.Tensor,  # [conv_dim, K]
    norm_weight: torch.Tensor,  # [dv]
    eps: float,
    conv_state: torch.Tensor,  # [slots, conv_dim, K - 1]: one layer's, updated in place
    ssm_state: torch.Tensor,  # [slots, value heads, dk, dv] float32, updated in place
    slots: torch.Tensor,  # [B]: each request's slot
    shape: LinearAttention,
    split: bool | None = None,  # two kernels (the recurrence over blocks of value columns);
    # None: where the fused kernel would have few programs (EARLY_PROGRAMS or fewer)
) -> torch.Tensor:
    """One decode token per request through a linear layer, up to its output projection:
    the gated, normalised output [B, value heads, dv] in qkv's dtype."""
    s = shape
    _check(qkv, conv_weight, conv_state, ssm_state, s)
    reqs = qkv.size(0)
    out = torch.empty(reqs, s.num_value_heads, s.value_head_dim, dtype=qkv.dtype, device=qkv.device)
    if split or (split is None and reqs * s.num_key_heads <= EARLY_PROGRAMS):
        return _decode_split(
            qkv, z, a, b, A_log, dt_bias, conv_weight, norm_weight, eps, conv_state, ssm_state,
            slots, s, out,
        )  # fmt: skip
    dk, dv = s.key_head_dim, s.value_head_dim
    block_dk, block_dv = triton.next_power_of_2(dk), triton.next_power_of_2(dv)
    early = reqs * s.num_key_heads <= EARLY_PROGRAMS  # a state held from the start: uncapped
    _decode_kernel[(reqs, s.num_key_heads)](
        qkv, z, a, b, A_log, dt_bias, conv_weight, norm_weight, conv_state, ssm_state, slots,
        out, eps, dk**-0.5,
        qkv.stride(0), z.stride(0), a.stride(0), b.stride(0), out.stride(0),
        conv_state.stride(0), conv_state.stride(1), ssm_state.stride(0), ssm_state.stride(1),
        KEY_DIM=s.num_key_heads * dk, DK=dk, DV=dv,
        PER_KEY=s.num_value_heads // s.num_key_heads, WIDTH=s.conv_kernel,
        BLOCK_DK=block_dk, BLOCK_DV=block_dv, BLOCK_W=triton.next_power_of_2(s.conv_kernel),
        EARLY=early, num_warps=8 if block_dk * block_dv >= 128 * 64 else 4,
        **({} if early else _registers(qkv.device)),
    )  # fmt: skip
    return out


def _registers(device: torch.device) -> dict:
    """The fused decode's launch option that caps its registers, where one is set (CUDA)."""
    cap = ENV.GATED_DELTA_REGISTERS.value
    return {"maxnreg": cap} if cap and device.type == "cuda" else {}


def _decode_split(
    qkv: torch.Tensor, z: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
    dt_bias: torch.Tensor, conv_weight: torch.Tensor, norm_weight: torch.Tensor, eps: float,
    conv_state: torch.Tensor, ssm_state: torch.Tensor, slots: torch.Tensor,
    s: LinearAttention, out: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """`decode_step` in two kernels (see _decode_columns_kernel)."""
    reqs, dk, dv = qkv.size(0), s.key_head_dim, s.value_head_dim
    block_dk, block_dv = triton.next_power_of_2(dk), triton.next_power_of_2(dv)
    block_v = min(SPLIT_DV, block_dv)
    o = torch.empty(reqs, s.num_value_heads * dv, dtype=torch.float32, device=qkv.device)
    common = dict(
        KEY_DIM=s.num_key_heads * dk,
        DK=dk,
        DV=dv,
        PER_KEY=s.num_value_heads // s.num_key_heads,
        WIDTH=s.conv_kernel,
        BLOCK_DK=block_dk,
        BLOCK_W=triton.next_power_of_2(s.conv_kernel),
    )
    _decode_columns_kernel[(reqs, s.num_value_heads, triton.cdiv(dv, block_v))](
        qkv, a, b, A_log, dt_bias, conv_weight, conv_state, ssm_state, slots, o, dk**-0.5,
        qkv.stride(0), a.stride(0), b.stride(0), o.stride(0),
        conv_state.stride(0), conv_state.stride(1), ssm_state.stride(0), ssm_state.stride(1),
        BLOCK_V=block_v, num_warps=SPLIT_WARPS, **common,
    )  # fmt: skip
    _decode_finish_kernel[(reqs, s.num_value_heads)](
        qkv, z, o, norm_weight, conv_state, slots, out, eps,
        qkv.stride(0), z.stride(0), o.stride(0), out.stride(0),
        conv_state.stride(0), conv_state.stride(1), BLOCK_DV=block_dv, num_warps=4, **common,
    )  # fmt: skip
    return out


# ---- prefill: lengths and slots from device tensors


@triton.jit(do_not_specialize=["num_reqs", "num_tokens"])
def _conv_varlen_kernel(
    X, W, ConvState, Slots, Offsets, Y,
    num_reqs, num_tokens, channels,
    stride_x, stride_y, stride_cs, stride_cc,
    WIDTH: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, SEARCH: tl.constexpr,
):  # fmt: skip
    # One build serves every batch: neither the number of requests nor of tokens is baked in
    # (a build for each, in a serving run, cost more than the conv itself).
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mc = c < channels
    # Each token's request: how many requests end at or before it, by a binary search of
    # the offsets (`SEARCH` halvings cover 2^SEARCH - 1 requests).
    lo = tl.zeros([BLOCK_T], dtype=tl.int32)
    hi = lo + num_reqs
    for _ in tl.static_range(SEARCH):
        mid = (lo + hi) // 2
        searching = lo < hi
        end = tl.load(Offsets + 1 + mid, mask=searching, other=0)
        lo = tl.where(searching & (end <= t), mid + 1, lo)
        hi = tl.where(searching & (end > t), mid, hi)
    req = lo
    live = (t < num_tokens) & (req < num_reqs)  # past the last request: no one's token
    start = tl.load(Offsets + req, mask=live, other=0)
    slot = tl.load(Slots + req, mask=live, other=0).to(tl.int64)
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(WIDTH):
        src = t - (WIDTH - 1) + j  # the input this tap reads
        inside = (src >= start)[:, None]  # else it is before the request: in its conv state
        m = live[:, None] & mc[None, :]
        xv = tl.load(X + src[:, None] * stride_x + c[None, :], mask=m & inside, other=0.0)
        at = slot[:, None] * stride_cs + c[None, :] * stride_cc + (WIDTH - 1 + src - start)[:, None]
        sv = tl.load(ConvState + at, mask=m & ~inside, other=0.0)
        w = tl.load(W + c * WIDTH + j, mask=mc, other=0.0).to(tl.float32)
        acc += (xv.to(tl.float32) + sv.to(tl.float32)) * w[None, :]
    tl.store(Y + t[:, None] * stride_y + c[None, :], _silu(acc), mask=live[:, None] & mc[None, :])


@triton.jit
def _conv_state_kernel(
    X, ConvState, Slots, Offsets,
    channels, stride_x, stride_cs, stride_cc,
    WIDTH: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    start = tl.load(Offsets + r)
    n = tl.load(Offsets + r + 1) - start
    conv = ConvState + tl.load(Slots + r).to(tl.int64) * stride_cs
    j = tl.arange(0, BLOCK_W)
    keep = (c < channels)[:, None] & ((j < WIDTH - 1) & (n + 0 * j > 0))[None, :]  # a vector:
    # the interpreter takes no scalar in a mask
    idx = n + j  # new state j is element n + j of (old state, the request's inputs)
    from_x = (idx >= WIDTH - 1)[None, :]
    token = start + idx - (WIDTH - 1)
    xv = tl.load(X + token[None, :] * stride_x + c[:, None], mask=keep & from_x, other=0.0)
    sv = tl.load(conv + c[:, None] * stride_cc + idx[None, :], mask=keep & ~from_x, other=0.0)
    tl.debug_barrier()  # every thread has read the old state before any writes it
    tl.store(conv + c[:, None] * stride_cc + j[None, :], tl.where(from_x, xv, sv), mask=keep)


def conv_varlen(
    qkv: torch.Tensor,  # [T, conv_dim]: the packed tokens of every request
    conv_weight: torch.Tensor,  # [conv_dim, K]
    conv_state: torch.Tensor,  # [slots, conv_dim, K - 1]: one layer's, updated in place
    slots: torch.Tensor,  # [B]
    offsets: torch.Tensor,  # [B + 1]: where each request's tokens start, then the end
    out: torch.Tensor | None = None,  # [T, conv_dim]: where the output goes
    keep: bool = True,  # False: the states are read, not written (a verify's forward)
) -> torch.Tensor:
    """SiLU of the causal conv of each request's tokens after its slot's conv state, [T,
    conv_dim] in qkv's dtype; each slot then holds its request's last K - 1 inputs."""
    tokens, channels = qkv.shape
    width, reqs = conv_weight.size(-1), slots.size(0)
    if reqs >= 2**SEARCH:
        raise ValueError(f"{reqs} requests in one conv; it takes at most {2**SEARCH - 1}")
    assert qkv.stride(1) == 1 and conv_weight.is_contiguous() and conv_state.stride(2) == 1
    out = torch.empty_like(qkv) if out is None else out
    assert out.shape == qkv.shape and out.stride(1) == 1
    block_t, block_c = 16, 128
    if tokens:
        _conv_varlen_kernel[(triton.cdiv(tokens, block_t), triton.cdiv(channels, block_c))](
            qkv, conv_weight, conv_state, slots, offsets, out, reqs, tokens, channels,
            qkv.stride(0), out.stride(0), conv_state.stride(0), conv_state.stride(1),
            WIDTH=width, BLOCK_T=block_t, BLOCK_C=block_c, SEARCH=SEARCH,
        )  # fmt: skip
    if not keep:
        return out
    _conv_state_kernel[(reqs, triton.cdiv(channels, block_c))](
        qkv, conv_state, slots, offsets, channels,
        qkv.stride(0), conv_state.stride(0), conv_state.stride(1),
        WIDTH=width, BLOCK_C=block_c, BLOCK_W=triton.next_power_of_2(width),
    )  # fmt: skip
    return out


@triton.jit
def _recurrent_varlen_kernel(
    Mixed, A, Bp, ALog, DtBias, SSM, Slots, Offsets, Out, Accepted,
    scale, reqs,
    stride_m, stride_a, stride_b, stride_ss, stride_sh, stride_ot, stride_oh,
    layer_m, layer_a, layer_b, layer_g, layer_s,
    KEY_DIM: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, PER_KEY: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_V: tl.constexpr, OUT: tl.constexpr, STATE: tl.constexpr,
    LIMIT: tl.constexpr,
):  # fmt: skip
    # program 0's axis is (layer, request): several layers at once, each with its own
    # tokens, gates, gate parameters and states, `layer_*` apart (the roll back's way)
    layer, r = (tl.program_id(0) // reqs).to(tl.int64), tl.program_id(0) % reqs
    Mixed += layer * layer_m
    A += layer * layer_a
    Bp += layer * layer_b
    ALog += layer * layer_g
    DtBias += layer * layer_g
    SSM += layer * layer_s
    hv = tl.program_id(1)
    h = hv // PER_KEY
    start, end = tl.load(Offsets + r), tl.load(Offsets + r + 1)
    if LIMIT:  # a verify's roll back: its last token and the drafts accepted, no further
        end = tl.minimum(end, start + 1 + tl.load(Accepted + r))
    slot = tl.load(Slots + r).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_DK)
    mk = offs_k < DK
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mv = offs_v < DV
    s_ptrs = SSM + slot * stride_ss + hv * stride_sh + offs_k[:, None] * DV + offs_v[None, :]
    smask = mk[:, None] & mv[None, :]
    S = tl.load(s_ptrs, mask=smask, other=0.0)
    for t in range(start, end):
        x = Mixed + t * stride_m
        q = tl.load(x + h * DK + offs_k, mask=mk, other=0.0).to(tl.float32)
        k = tl.load(x + KEY_DIM + h * DK + offs_k, mask=mk, other=0.0).to(tl.float32)
        v = tl.load(x + 2 * KEY_DIM + hv * DV + offs_v, mask=mv, other=0.0).to(tl.float32)
        g, beta = _gates(A, Bp, ALog, DtBias, t, hv, stride_a, stride_b)
        S, o = _delta_step(S, _l2normed(q) * scale, _l2normed(k), v, g, beta)
        if OUT:
            tl.store(Out + t * stride_ot + hv * stride_oh + offs_v, o, mask=mv)
    if STATE:  # an empty request's slot is left as it is
        tl.store(s_ptrs, S, mask=smask & (end + 0 * offs_v > start)[None, :])


def recurrent_varlen(
    mixed: torch.Tensor,  # [T, conv_dim]: q, k and v after the conv
    a: torch.Tensor,  # [T, value heads]
    b: torch.Tensor,  # [T, value heads]
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_state: torch.Tensor,  # [slots, value heads, dk, dv] float32, updated in place
    slots: torch.Tensor,  # [B]
    offsets: torch.Tensor,  # [B + 1]
    shape: LinearAttention,
    block_v: int = 32,
    keep: bool = True,  # False: the slots are read, not written (a verify's forward)
) -> torch.Tensor:
    """The gated delta rule over each request's tokens from its slot's state, which then
    holds the state after its last token: the output [T, value heads, dv] in float32."""
    out = varlen_out(mixed, ssm_state, shape)
    one = (mixed, a, b, A_log, dt_bias, ssm_state)
    _recurrent(*(t[None] for t in one), slots, offsets, shape, block_v, out, keep, None)
    return out


def recurrent_layers(
    mixed: torch.Tensor,  # [L, T, conv_dim]: each layer's q, k and v after the conv
    a: torch.Tensor,  # [L, T, value heads]
    b: torch.Tensor,  # [L, T, value heads]
    A_log: torch.Tensor,  # [L, value heads]
    dt_bias: torch.Tensor,  # [L, value heads]
    ssm_state: torch.Tensor,  # [L, slots, value heads, dk, dv] float32, updated in place
    slots: torch.Tensor,  # [B]
    offsets: torch.Tensor,  # [B + 1]
    shape: LinearAttention,
    accepted: torch.Tensor | None = None,  # [>= B]: each request's first 1 + accepted tokens
    block_v: int = 32,
) -> None:
    """`recurrent_varlen` in L layers at once, their states only (no output): one launch where
    a loop over the layers would launch one each (a verify's roll back, where the host's time
    a launch is most of the cost). With `accepted`, each request's walk stops after its
    first 1 + accepted[r] tokens (its last token and the drafts accepted)."""
    assert a.shape[:2] == b.shape[:2] == mixed.shape[:2]
    assert A_log.size(0) == dt_bias.size(0) == ssm_state.size(0) == mixed.size(0)
    args = (mixed, a, b, A_log, dt_bias, ssm_state, slots, offsets, shape, block_v)
    _recurrent(*args, None, True, accepted)


def _recurrent(
    mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
    dt_bias: torch.Tensor, ssm_state: torch.Tensor, slots: torch.Tensor, offsets: torch.Tensor,
    s: LinearAttention, block_v: int, out: torch.Tensor | None, keep: bool,
    accepted: torch.Tensor | None,
) -> None:  # fmt: skip
    # a program per (layer, request), value head and block of v
    assert mixed.stride(2) == 1 and ssm_state.dtype == torch.float32
    assert ssm_state.stride(4) == 1 and ssm_state.stride(3) == s.value_head_dim
    assert A_log.stride() == dt_bias.stride()
    layers, reqs, dk, dv = mixed.size(0), slots.size(0), s.key_head_dim, s.value_head_dim
    if not layers or not reqs:
        return
    block_v = min(block_v, triton.next_power_of_2(dv))
    written = out if out is not None else mixed.new_empty(0, 0)
    _recurrent_varlen_kernel[(layers * reqs, s.num_value_heads, triton.cdiv(dv, block_v))](
        mixed, a, b, A_log, dt_bias, ssm_state, slots, offsets, written,
        accepted if accepted is not None else offsets, dk**-0.5, reqs,
        mixed.stride(1), a.stride(1), b.stride(1), ssm_state.stride(1), ssm_state.stride(2),
        written.stride(0), written.stride(1),
        mixed.stride(0), a.stride(0), b.stride(0), A_log.stride(0), ssm_state.stride(0),
        KEY_DIM=s.num_key_heads * dk, DK=dk, DV=dv, PER_KEY=s.num_value_heads // s.num_key_heads,
        BLOCK_DK=triton.next_power_of_2(dk), BLOCK_V=block_v, OUT=out is not None, STATE=keep,
        LIMIT=accepted is not None,
    )  # fmt: skip


@triton.jit
def _conv_roll_back_kernel(
    Inputs, Before, Conv, Slots, Offsets, Accepted, reqs, channels,
    stride_it, stride_br, stride_bc, stride_cs, stride_cc, layer_i, layer_b, layer_c,
    WIDTH: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    layer, r = (tl.program_id(0) // reqs).to(tl.int64), tl.program_id(0) % reqs
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    start, slot = tl.load(Offsets + r), tl.load(Slots + r).to(tl.int64)
    mc = (c < channels) & (tl.load(Offsets + r + 1) + 0 * c > start)  # an empty one: no
    at = tl.load(Accepted + r) + 1  # entries at .. at + WIDTH - 1 of (state before, inputs)
    Inputs += layer * layer_i
    Before += layer * layer_b + r * stride_br
    Conv += layer * layer_c + slot * stride_cs
    for j in tl.static_range(WIDTH - 1):
        p = at + j + 0 * c  # a block, as the masks are
        from_x = p >= WIDTH - 1
        x = tl.load(Inputs + (start + p - (WIDTH - 1)) * stride_it + c, mask=mc & from_x)
        kept = Before + c * stride_bc + tl.minimum(p, WIDTH - 2)
        before = tl.load(kept, mask=mc & (p < WIDTH - 1))
        tl.store(Conv + c * stride_cc + j, tl.where(from_x, x, before), mask=mc)


def conv_roll_back(
    inputs: torch.Tensor,  # [L, T, conv_dim]: a verify's conv inputs (qkv), every layer's
    before: torch.Tensor,  # [L, >= B, conv_dim, K - 1]: its requests' conv states before it
    conv_state: torch.Tensor,  # [L, slots, conv_dim, K - 1], written at the requests' slots
    slots: torch.Tensor,  # [B]
    offsets: torch.Tensor,  # [B + 1]
    accepted: torch.Tensor,  # [>= B]
) -> None:
    """Each request's conv state as its last token and accepted drafts leave it: the last K - 1
    of (its state before the verify, then the verify's inputs) up to its last accepted token,
    every layer in one launch."""
    layers, reqs, channels = inputs.size(0), slots.size(0), inputs.size(2)
    assert inputs.stride(2) == 1 and before.stride(3) == 1 and conv_state.stride(3) == 1
    assert before.dtype == conv_state.dtype == inputs.dtype
    if not layers or not reqs:
        return
    block_c = 128
    _conv_roll_back_kernel[(layers * reqs, triton.cdiv(channels, block_c))](
        inputs, before, conv_state, slots, offsets, accepted, reqs, channels,
        inputs.stride(1), before.stride(1), before.stride(2),
        conv_state.stride(1), conv_state.stride(2),
        inputs.stride(0), before.stride(0), conv_state.stride(0),
        WIDTH=conv_state.size(3) + 1, BLOCK_C=block_c,
    )  # fmt: skip


@triton.jit(do_not_specialize=["rows"])
def _gated_norm_kernel(
    X, Z, W, Out, eps, rows,
    stride_x, stride_z, stride_out,
    HEADS: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # (token, head) rows
    t, h = r // HEADS, r % HEADS
    d = tl.arange(0, BLOCK_D)
    m = (r < rows)[:, None] & (d < D)[None, :]
    x = tl.load(X + t[:, None] * stride_x + h[:, None] * D + d[None, :], mask=m, other=0.0)
    z = tl.load(Z + t[:, None] * stride_z + h[:, None] * D + d[None, :], mask=m, other=0.0)
    w = tl.load(W + d, mask=d < D, other=0.0).to(tl.float32)
    x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    y = x * rstd[:, None] * w[None, :] * _silu(z.to(tl.float32))
    tl.store(Out + t[:, None] * stride_out + h[:, None] * D + d[None, :], y, mask=m)


def gated_norm(
    o: torch.Tensor,  # [T, value heads, dv]: a rule's output (float32)
    z: torch.Tensor,  # [T, value heads * dv]: the output gate, rows may be strided
    weight: torch.Tensor,  # [dv]
    eps: float,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The gated RMSNorm of a prefill's or a verify's output in one kernel (the decode kernel
    has it inside): per head, o normalised, times the weight and SiLU(z), in float32 from
    the rule's own output; [T, value heads, dv] in `dtype`. Torch ran it as eight kernels
    a linear layer, and a verify step of Qwen3.5-0.8B has 18 such layers."""
    T, heads, dv = o.shape
    assert o.stride(2) == 1 and o.stride(1) == dv and z.stride(1) == 1
    out = torch.empty(T, heads, dv, dtype=dtype, device=o.device)
    block_r = 16
    _gated_norm_kernel[(triton.cdiv(T * heads, block_r),)](
        o, z, weight, out, eps, T * heads, o.stride(0), z.stride(0), out.stride(0),
        HEADS=heads, D=dv, BLOCK_R=block_r, BLOCK_D=triton.next_power_of_2(dv), num_warps=4,
    )  # fmt: skip
    return out


def varlen_out(mixed: torch.Tensor, ssm_state: torch.Tensor, s: LinearAttention) -> torch.Tensor:
    """A varlen rule's output, [T, value heads, dv] in float32, once its inputs are checked."""
    assert mixed.stride(1) == 1 and ssm_state.dtype == torch.float32
    assert ssm_state.stride(3) == 1 and ssm_state.stride(2) == s.value_head_dim
    shape = (mixed.size(0), s.num_value_heads, s.value_head_dim)
    return mixed.new_empty(shape, dtype=torch.float32)


@triton.jit
def _chunked_varlen_kernel(
    Mixed, A, Bp, ALog, DtBias, SSM, Slots, Offsets, Out,
    scale,
    stride_m, stride_a, stride_b, stride_ss, stride_sh, stride_ot, stride_oh,
    KEY_DIM: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, PER_KEY: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_V: tl.constexpr, CHUNK: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    r, hv = tl.program_id(0), tl.program_id(1)
    h = hv // PER_KEY
    start, end = tl.load(Offsets + r), tl.load(Offsets + r + 1)
    slot = tl.load(Slots + r).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_DK)
    mk = offs_k < DK
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mv = offs_v < DV
    s_ptrs = SSM + slot * stride_ss + hv * stride_sh + offs_k[:, None] * DV + offs_v[None, :]
    smask = mk[:, None] & mv[None, :]
    S = tl.load(s_ptrs, mask=smask, other=0.0)
    rows = tl.arange(0, CHUNK)
    lower = rows[:, None] >= rows[None, :]
    eye = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    decay_rate = -tl.exp(tl.load(ALog + hv).to(tl.float32))
    dt_bias = tl.load(DtBias + hv).to(tl.float32)
    for c0 in range(start, end, CHUNK):
        t = c0 + rows
        mt = t < end  # the last chunk's rows past the request: g = beta = 0, no change
        x = Mixed + t[:, None] * stride_m
        qk_mask, v_mask = mt[:, None] & mk[None, :], mt[:, None] & mv[None, :]
        q = tl.load(x + h * DK + offs_k[None, :], mask=qk_mask, other=0.0).to(tl.float32)
        k = tl.load(x + KEY_DIM + h * DK + offs_k[None, :], mask=qk_mask, other=0.0).to(tl.float32)
        v = tl.load(x + 2 * KEY_DIM + hv * DV + offs_v[None, :], mask=v_mask, other=0.0)
        v = v.to(tl.float32)
        q = q / tl.sqrt(tl.sum(q * q, axis=1) + 1e-6)[:, None] * scale
        k = k / tl.sqrt(tl.sum(k * k, axis=1) + 1e-6)[:, None]
        a = tl.load(A + t * stride_a + hv, mask=mt, other=0.0).to(tl.float32) + dt_bias
        g = tl.where(mt, decay_rate * tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a))), 0.0)
        b = tl.load(Bp + t * stride_b + hv, mask=mt, other=0.0).to(tl.float32)
        beta = tl.where(mt, 1.0 / (1.0 + tl.exp(-b)), 0.0)
        # the chunk form of torch's `chunk_delta_rule`, for one head and a block of v
        c = tl.cumsum(g, axis=0)
        decay = tl.where(lower, tl.exp(tl.where(lower, c[:, None] - c[None, :], 0.0)), 0.0)
        kk = _dot(k, tl.trans(k), IEEE)
        a_mat = tl.where(rows[:, None] > rows[None, :], beta[:, None] * decay * kk, 0.0)
        # (I + A)^-1 by forward substitution: row i is e_i minus A's row i times the rows above
        inv = eye
        for i in tl.static_range(1, CHUNK):
            a_row = tl.sum(tl.where(rows[:, None] == i, a_mat, 0.0), axis=0)
            above = tl.sum(a_row[:, None] * inv, axis=0)  # A's row i times the rows above
            inv = tl.where(rows[:, None] == i, inv - above[None, :], inv)
        u = _dot(inv, beta[:, None] * v, IEEE)
        w = _dot(inv, (beta * tl.exp(c))[:, None] * k, IEEE)
        d = u - _dot(w, S, IEEE)  # what each token writes
        scores = _dot(q, tl.trans(k), IEEE) * decay
        o = _dot(q * tl.exp(c)[:, None], S, IEEE) + _dot(scores, d, IEEE)
        out = Out + t[:, None] * stride_ot + hv * stride_oh + offs_v[None, :]
        tl.store(out, o, mask=v_mask)
        c_last = tl.sum(tl.where(rows == CHUNK - 1, c, 0.0), axis=0)
        S = S * tl.exp(c_last) + _dot(tl.trans(k * tl.exp(c_last - c)[:, None]), d, IEEE)
    tl.store(s_ptrs, S, mask=smask & (end + 0 * offs_v > start)[None, :])


def chunked_varlen(
    mixed: torch.Tensor,  # [T, conv_dim]: q, k and v after the conv
    a: torch.Tensor,  # [T, value heads]
    b: torch.Tensor,  # [T, value heads]
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_state: torch.Tensor,  # [slots, value heads, dk, dv] float32, updated in place
    slots: torch.Tensor,  # [B]
    offsets: torch.Tensor,  # [B + 1]
    shape: LinearAttention,
    block_v: int = 64,
) -> torch.Tensor:
    """`recurrent_varlen`'s result, CHUNK tokens at a step: within a chunk the tokens' writes
    solve one small triangular system, and the rest is matmuls (the torch path's chunk form)."""
    s = shape
    out = varlen_out(mixed, ssm_state, s)
    dk, dv = s.key_head_dim, s.value_head_dim
    block_v = max(16, min(block_v, triton.next_power_of_2(dv)))
    _chunked_varlen_kernel[(slots.size(0), s.num_value_heads, triton.cdiv(dv, block_v))](
        mixed, a, b, A_log, dt_bias, ssm_state, slots, offsets, out, dk**-0.5,
        mixed.stride(0), a.stride(0), b.stride(0), ssm_state.stride(0), ssm_state.stride(1),
        out.stride(0), out.stride(1),
        KEY_DIM=s.num_key_heads * dk, DK=dk, DV=dv, PER_KEY=s.num_value_heads // s.num_key_heads,
        BLOCK_DK=max(16, triton.next_power_of_2(dk)), BLOCK_V=block_v, CHUNK=CHUNK,
        IEEE=mixed.dtype == torch.float32,
    )  # fmt: skip
    return out


def _check(
    qkv: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    s: LinearAttention,
) -> None:
    """The layouts the kernels index by hand: rows of channels, the state's matrices whole."""
    assert qkv.size(1) == s.conv_dim and qkv.stride(1) == 1, "qkv: [tokens, conv_dim] rows"
    assert conv_weight.shape == (s.conv_dim, s.conv_kernel) and conv_weight.is_contiguous()
    assert conv_state.stride(2) == 1 and ssm_state.dtype == torch.float32
    assert ssm_state.stride(3) == 1 and ssm_state.stride(2) == s.value_head_dim
