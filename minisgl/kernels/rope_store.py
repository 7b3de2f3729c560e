"""Everything between the qkv projection and attention, in one kernel.

After the qkv matmul a decoder layer normalises each query and key head (Qwen3), rotates
them by position (RoPE), and writes the keys and values of the new tokens into the KV pool.
Done one step at a time that is seven small kernels per layer (two head norms, a rotary,
two copies to make q/k contiguous, two scattered stores), each a few microseconds at
batch 1 for a few kilobytes of data. Here one program takes one head of a block of tokens
(a tile, a row per token): it loads each row once, normalises and rotates it in
registers with the row of the angle table at the token's position, and writes it where it
goes: a query head to the output, a key head (and the value head beside it) to each
token's KV slot. The block is one token for a few tokens and grows with their count
(`tile_tokens`), so that a prefill chunk is not hundreds of thousands of tiny programs.

The rotation is the "neox" one: channel i pairs with channel i + rotary_dim / 2, and the
angle table holds, for each position, the cosines of the pairs and then their sines. Its
width is the number of channels that turn: all of a head's, or (partial rotary) the first
ones, the rest passing through unrotated.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernels.fp8_quantize import _round_to_e4m3  # [ch28]


@triton.jit(do_not_specialize=["tokens"])
def _qk_rope_store_kernel(
    QKV, Q_OUT, K_CACHE, V_CACHE, positions, out_loc, cos_sin, q_weight, k_weight, eps, tokens,
    k_inv, v_inv,  # an FP8 cache holds k * k_inv and v * v_inv (1 / its scales)  # [ch28]
    stride_t, stride_qo_t, stride_qo_h, stride_kc_s, stride_kc_h, stride_vc_s, stride_vc_h,
    stride_cs,
    Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    ROTARY_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_HEAD: tl.constexpr,
    BLOCK_PASS: tl.constexpr,  # [ch29]
    QK_NORM: tl.constexpr,
):  # fmt: skip
    # one head (the same for every row of the tile) of BLOCK_T tokens: a row per token
    h = tl.program_id(1)  # 0..Q_HEADS-1: a query head; then the key heads
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < tokens
    t = t.to(tl.int64)
    half: tl.constexpr = ROTARY_DIM // 2  # the angle table's width: the channels that turn
    offs = tl.arange(0, BLOCK_HALF)
    turns = offs < half
    mask = t_mask[:, None] & turns[None, :]
    rows = QKV + t[:, None] * stride_t + h * HEAD_DIM  # q and k heads lie side by side in qkv
    x1 = tl.load(rows + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(rows + half + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    squares = tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)
    # >>> ch29 partial rotary: the channels past the table's pass unrotated
    offs_p = ROTARY_DIM + tl.arange(0, BLOCK_PASS)
    passes = offs_p < HEAD_DIM
    mask_p = t_mask[:, None] & passes[None, :]
    xp = tl.load(rows + offs_p[None, :], mask=mask_p, other=0.0).to(tl.float32)
    squares += tl.sum(xp * xp, 1)
    # <<< ch29
    dtype = QKV.dtype.element_ty
    if QK_NORM:
        if h < Q_HEADS:  # noqa: SIM108 (a runtime branch of the kernel)
            w = q_weight
        else:
            w = k_weight
        rstd = tl.rsqrt(squares / HEAD_DIM + eps)[:, None]
        # rounded to the model dtype between the steps, as the unfused layers do
        w1 = tl.load(w + offs, mask=turns, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w + half + offs, mask=turns, other=0.0).to(tl.float32)[None, :]
        x1 = ((x1 * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
        wp = tl.load(w + offs_p, mask=passes, other=0.0).to(tl.float32)[None, :]  # [ch29]
        xp = ((xp * rstd).to(dtype).to(tl.float32) * wp).to(dtype).to(tl.float32)  # [ch29]
    pos = tl.load(positions + t, mask=t_mask, other=0).to(tl.int64)
    angles = cos_sin + pos[:, None] * stride_cs + offs[None, :]  # each token's row of the table
    cos = tl.load(angles, mask=mask, other=0.0)
    sin = tl.load(angles + half, mask=mask, other=0.0)
    y1 = (x1 * cos - x2 * sin).to(dtype)
    y2 = (x2 * cos + x1 * sin).to(dtype)
    if h < Q_HEADS:
        out = Q_OUT + t[:, None] * stride_qo_t + h * stride_qo_h
        tl.store(out + offs[None, :], y1, mask=mask)
        tl.store(out + half + offs[None, :], y2, mask=mask)
        tl.store(out + offs_p[None, :], xp.to(dtype), mask=mask_p)  # [ch29]
    else:
        kv_head = h - Q_HEADS
        slot = tl.load(out_loc + t, mask=t_mask, other=0).to(tl.int64)  # any page layout
        k_out = K_CACHE + slot[:, None] * stride_kc_s + kv_head * stride_kc_h
        k1, k2 = y1, y2
        k1, k2 = y1 * k_inv, y2 * k_inv  # (new names: a branch may not change y1's type)  # [ch28]
        tl.store(k_out + offs[None, :], _cached(k1, K_CACHE), mask=mask)
        tl.store(k_out + half + offs[None, :], _cached(k2, K_CACHE), mask=mask)
        tl.store(k_out + offs_p[None, :], _cached(xp * k_inv, K_CACHE), mask=mask_p)  # [ch29]
        v_rows = rows + KV_HEADS * HEAD_DIM  # the value head sits KV_HEADS heads further on
        v_out = V_CACHE + slot[:, None] * stride_vc_s + kv_head * stride_vc_h
        offs_d = tl.arange(0, BLOCK_HEAD)
        v_mask = t_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
        v = tl.load(v_rows + offs_d[None, :], mask=v_mask)
        v = v * v_inv  # [ch28]
        tl.store(v_out + offs_d[None, :], _cached(v, V_CACHE), mask=v_mask)


@triton.jit
def _cached(x, CACHE):
    """x in the cache's dtype."""
    # >>> ch28 an FP8 cache: x saturated to e4m3's range and rounded to the nearest value,
    # ties to even, as torch's cast does (and on every GPU and the interpreter alike)
    if CACHE.dtype.element_ty == tl.float8e4nv:
        x = _round_to_e4m3(tl.clamp(x.to(tl.float32), -448.0, 448.0))
    # <<< ch28
    return x.to(CACHE.dtype.element_ty)


def tile_tokens(tokens: int) -> int:
    """Tokens per program (BLOCK_T) for a call on this many tokens.

    A prefill chunk of thousands of tokens at one program per (token, head) is hundreds of
    thousands of programs of a few hundred bytes each: their start, not their bytes, sets
    the time. Tiles of 8 tokens make them 8 times fewer, and still several per SM. Measured
    on the H200 (Qwen3-0.6B's heads, `tools/bench_elementwise.py --ops rope_store`, bf16
    and e4m3 caches): at 8,192 tokens one token a program took 157 us, tiles of 8, 16 and
    32 took 35-38, 37-38 and 40-45 us (3.4-3.6 TB/s at 8); at 2,048, 41 against 10-11,
    10-11 and 15; at 64, 3.7 against 2.9, 3.2-3.4 and 3.7-3.9. A few tokens (a decode
    batch, a small verify batch) keep one token a program: their programs all run at once,
    so the kernel takes one launch and one program's time (1.8-2.1 us at one token for
    every tile).
    """
    return 1 if tokens < 64 else 8


def qk_rope_store(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_loc: torch.Tensor,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    k_scale: float = 1.0,  # an FP8 cache's keys and values are stored * these  # [ch28]
    v_scale: float = 1.0,  # [ch28]
) -> torch.Tensor:
    """qkv [tokens, (q_heads + 2 kv_heads) * head_dim] -> rotated q [tokens, q_heads, head_dim];
    the rotated keys and the values land in k/v_cache [slots, kv_heads, head_dim] at out_loc.
    With q_weight and k_weight, each q and k head is RMS-normalised first (Qwen3). cos_sin
    [positions, rotary_dim]: the first rotary_dim channels of a head turn."""
    rotary_dim = cos_sin.size(1)
    assert qkv.stride(-1) == 1 and rotary_dim % 2 == 0 and rotary_dim <= head_dim
    tokens = qkv.size(0)
    q = torch.empty(tokens, q_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if tokens == 0:
        return q
    qk_norm = q_weight is not None
    block_t = tile_tokens(tokens)
    _qk_rope_store_kernel[(triton.cdiv(tokens, block_t), q_heads + kv_heads)](
        qkv, q, k_cache, v_cache, positions, out_loc, cos_sin,
        q_weight if qk_norm else cos_sin, k_weight if qk_norm else cos_sin, eps, tokens,
        1 / k_scale, 1 / v_scale,  # [ch28]
        qkv.stride(0), q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        cos_sin.stride(0),
        Q_HEADS=q_heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim, ROTARY_DIM=rotary_dim,
        BLOCK_T=block_t, BLOCK_HALF=triton.next_power_of_2(rotary_dim // 2),
        BLOCK_HEAD=triton.next_power_of_2(head_dim),
        BLOCK_PASS=triton.next_power_of_2(max(head_dim - rotary_dim, 1)),  # [ch29]
        QK_NORM=qk_norm,
    )  # fmt: skip
    return q
