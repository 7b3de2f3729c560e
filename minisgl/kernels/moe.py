"""Fused mixture of experts in Triton: all experts in two grouped GEMMs, grouped on the device.

The reference in minisgl/layers/moe.py asks the host how many tokens each expert got
(`.tolist()`) and launches two matmuls per chosen expert. The host read forbids CUDA
graphs, and a decode step of a 128-expert model becomes hundreds of tiny launches per
layer, each reading one expert's weights. Here the routing is turned into a layout on
the device instead, one whose size depends only on the shapes, never on the routing:

  * the (token, slot) pairs are sorted by expert, and each expert's run of pairs is padded
    to a multiple of BLOCK_M rows (`group_by_expert`), so every block of rows belongs to
    one expert;
  * one kernel computes, for one block of rows and one block of output columns, rows of
    A times the transpose of that expert's weight. It serves gate_up (A = the tokens'
    hidden states) and down (A = the activated pairs, scaled by the routing weights);
  * the k partial outputs of a token are summed with a reshape, with no atomics, so the
    result does not depend on the order programs run in.

On the CPU the kernel runs in Triton's interpreter, slowly, for tests: TRITON_INTERPRET=1
must be set before triton is first imported.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from minisgl.layers.activation import silu_and_mul


@dataclass(frozen=True)
class ExpertGroups:
    """Pairs laid out by expert: rows [b*block_m, (b+1)*block_m) all belong to block_expert[b]."""

    pair_of_row: torch.Tensor  # [max_blocks * block_m]; a pair index, or num_pairs for padding
    block_expert: torch.Tensor  # [max_blocks]; the block's expert, or num_experts past the end
    block_m: int


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks needed in the worst routing: each used expert wastes at most one partial block."""
    return triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)


def group_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertGroups:
    """Sort (token, slot) pairs by expert and pad each expert's group to whole blocks.

    Pair p is slot p % top_k of token p // top_k. Only device ops with fixed output shapes,
    so this never waits for the GPU and can be captured in a CUDA graph.
    """
    experts = topk_ids.flatten()
    num_pairs, device = experts.numel(), experts.device
    order = experts.argsort(stable=True)  # pairs, grouped by expert
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, experts, torch.ones_like(experts))  # bincount would sync on CUDA
    blocks = (counts + block_m - 1) // block_m
    first_sorted = counts.cumsum(0) - counts  # where each expert's pairs start in `order`
    first_row = (blocks.cumsum(0) - blocks) * block_m  # and in the padded layout
    sorted_experts = experts[order]
    rank = torch.arange(num_pairs, device=device) - first_sorted[sorted_experts]
    rows = first_row[sorted_experts] + rank
    n_blocks = max_blocks(num_pairs, num_experts, block_m)
    pair_of_row = torch.full((n_blocks * block_m,), num_pairs, dtype=torch.long, device=device)
    pair_of_row.scatter_(0, rows, order)
    # Block b belongs to the first expert whose blocks end after b; past the last, to none.
    block_ids = torch.arange(n_blocks, device=device)
    block_expert = torch.searchsorted(blocks.cumsum(0), block_ids, right=True)
    return ExpertGroups(pair_of_row, block_expert, block_m)


@triton.jit
def _grouped_gemm_kernel(
    A, W, C, PairOfRow, BlockExpert, PairWeight,
    num_pairs, num_experts, n, k, rows_per_a,
    stride_am, stride_we, stride_wn, stride_cm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SCALE: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """C[p, cols] = A[p // rows_per_a] @ W[e, cols].T (times PairWeight[p] if SCALE) for the
    pairs p of one block of rows, all routed to expert e. W's rows are contiguous in k."""
    block, col_block = tl.program_id(0), tl.program_id(1)
    expert = tl.load(BlockExpert + block)
    if expert < num_experts:  # blocks past the last expert's are left idle
        pairs = tl.load(PairOfRow + block * BLOCK_M + tl.arange(0, BLOCK_M))
        row_ok = pairs < num_pairs
        a_rows = (pairs // rows_per_a).to(tl.int64)
        cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n
        w = W + expert.to(tl.int64) * stride_we
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, k, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < k
            a = tl.load(
                A + a_rows[:, None] * stride_am + ks[None, :],
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            b = tl.load(  # [BLOCK_K, BLOCK_N]: the expert's weight, transposed
                w + cols[None, :] * stride_wn + ks[:, None],
                mask=k_ok[:, None] & col_ok[None, :],
                other=0.0,
            )
            # fp32 stays fp32 (as in torch) rather than Triton's default, tf32.
            acc = tl.dot(a, b, acc, input_precision="ieee") if IEEE else tl.dot(a, b, acc)
        if SCALE:
            weight = tl.load(PairWeight + pairs, mask=row_ok, other=0.0).to(tl.float32)
            acc = acc * weight[:, None]
        out = C + pairs[:, None].to(tl.int64) * stride_cm + cols[None, :]
        tl.store(out, acc.to(C.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _block(size: int, cap: int) -> int:
    # tl.dot needs 16 or more; a tiny model's dimensions need no wider block than themselves.
    return min(cap, max(16, triton.next_power_of_2(size)))


def grouped_gemm(
    a: torch.Tensor,
    weight: torch.Tensor,
    groups: ExpertGroups,
    num_pairs: int,
    pair_weight: torch.Tensor | None = None,
    block_n: int = 64,
    block_k: int = 64,
) -> torch.Tensor:
    """out[p] = a[row of p] @ weight[expert of p].T for every pair p, times pair_weight[p] if given.

    `a` has one row per token, shared by the token's top_k pairs (row p // top_k), or one
    row per pair (row p).
    """
    num_experts, n, k = weight.shape
    assert a.size(1) == k and weight.stride(2) == 1 and a.stride(1) == 1
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    block_n, block_k = _block(n, block_n), _block(k, block_k)
    grid = (groups.block_expert.numel(), triton.cdiv(n, block_n))
    scale = pair_weight is not None
    _grouped_gemm_kernel[grid](
        a, weight, out, groups.pair_of_row, groups.block_expert,
        pair_weight if scale else out,  # never read when not scaling
        num_pairs, num_experts, n, k, num_pairs // a.size(0),
        a.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
        BLOCK_M=groups.block_m, BLOCK_N=block_n, BLOCK_K=block_k, SCALE=scale,
        IEEE=a.dtype == torch.float32,
    )  # fmt: skip
    return out


def fused_moe(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    block_m: int | None = None,
    block_n: int = 64,
    block_k: int = 64,
) -> torch.Tensor:
    """sum over slots j of topk_weights[:, j] * expert_{topk_ids[:, j]}(x), like the reference.

    x [tokens, hidden]; gate_up_proj [experts, 2 * inter, hidden]; down_proj [experts, hidden,
    inter]; topk_ids and topk_weights [tokens, top_k].
    """
    tokens, top_k = topk_ids.shape
    num_experts, num_pairs = gate_up_proj.size(0), topk_ids.numel()
    if block_m is None:  # decode: a few pairs per expert; prefill: many, so taller blocks
        block_m = 16 if num_pairs <= 16 * num_experts else 64
    groups = group_by_expert(topk_ids, num_experts, block_m)
    x = x.contiguous()
    h = grouped_gemm(x, gate_up_proj, groups, num_pairs, None, block_n, block_k)
    h = silu_and_mul(h)  # [pairs, inter]
    weights = topk_weights.flatten().contiguous()
    y = grouped_gemm(h, down_proj, groups, num_pairs, weights, block_n, block_k)
    return y.view(tokens, top_k, -1).sum(dim=1)
