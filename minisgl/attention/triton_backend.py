"""Our own attention kernels (minisgl/kernels/*_attention.py) as a backend.

The metadata is the page-table form the kernels read directly: each request's row of the
page table, its length, and where its new tokens sit in the batch. Triton ships with
every CUDA build of torch, so `auto` takes this backend on a GPU without FlashInfer; on a
CPU the same kernels run in Triton's interpreter (TRITON_INTERPRET=1), slowly, so that
they can be tested anywhere.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from minisgl.attention.base import BaseAttnBackend, BaseAttnMetadata
from minisgl.env import ENV  # [ch26]
from minisgl.utils import to_device

if TYPE_CHECKING:
    from minisgl.core import Batch
    from minisgl.kvcache.mha_pool import MHAKVCache
    from minisgl.layers.attention import AttentionLayer


@dataclass
class TritonMetadata(BaseAttnMetadata):
    qo_indptr: torch.Tensor  # [bs + 1] int32: request i's new tokens are q[qo[i]:qo[i+1]]
    rows: torch.Tensor  # [bs] int32: each request's page-table row
    seq_lens: torch.Tensor  # [bs] int32: K/V length, new tokens included
    max_extend_len: int  # host-side: sizes the extend kernel's grid (1 means decode)

    def get_last_indices(self) -> torch.Tensor:
        return self.qo_indptr[1:] - 1

    # >>> ch29
    def last_rows(self) -> TritonMetadata:
        n = self.rows.size(0)
        one_each = torch.arange(n + 1, dtype=torch.int32, device=self.rows.device)
        return TritonMetadata(one_each, self.rows, self.seq_lens, 1)

    # <<< ch29


@dataclass
class TritonCaptureData:
    qo_indptr: torch.Tensor  # [max_bs + 1]: 0, 1, ..., max_bs in decode
    rows: torch.Tensor  # [max_bs]
    seq_lens: torch.Tensor  # [max_bs]


class TritonAttnBackend(BaseAttnBackend):
    name = "triton"
    devices = ("cuda", "cpu")
    auto_devices = ("cuda",)  # on a CPU the interpreter is for checking, never the default
    cuda_graphs = ("decode", "prefill")
    reads_fp8_kv = True  # the kernels widen e4m3 to q's dtype, the scales outside  # [ch28]

    @classmethod
    def unavailable_reason(cls, device: torch.device, dtype: torch.dtype, page_size: int) -> str:
        if importlib.util.find_spec("triton") is None:
            return "the triton package is not installed (it comes with torch's CUDA builds)"
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            return "on a CPU its kernels run only in Triton's interpreter: set TRITON_INTERPRET=1"
        if (
            device.type == "cuda"
            and dtype == torch.bfloat16
            and torch.cuda.get_device_capability(device) < (8, 0)
        ):
            return "bfloat16 matrix products in Triton need an Ampere or newer GPU"
        return super().unavailable_reason(device, dtype, page_size)  # any page size

    def __init__(
        self, kv_cache: MHAKVCache, page_table: torch.Tensor, scale: float, num_qo_heads: int
    ) -> None:
        from minisgl.kernels import verify_attention as verify  # [ch26]
        from minisgl.kernels.decode_attention import decode_attention
        from minisgl.kernels.extend_attention import extend_attention

        super().__init__(kv_cache, page_table, scale, num_qo_heads)
        self.decode_attention, self.extend_attention = decode_attention, extend_attention
        self.verify_attention = verify.verify_attention  # [ch26]
        self.verify_from_qkv = verify.from_qkv  # [ch26]
        self.capture: TritonCaptureData | None = None

    def prepare_metadata(self, batch: Batch) -> None:
        reqs = batch.padded_reqs
        extend_lens = [r.extend_len for r in reqs]
        qo = [0, *itertools.accumulate(extend_lens)]
        # One copy for the three, each part starting on 16 bytes: Triton compiles a kernel
        # again for a pointer that is not (its alignment is part of the specialisation), so
        # unaligned parts would build new kernels for some batch sizes mid-run.
        bs = len(reqs)
        gap = [0] * (-bs % 4)
        at = bs + len(gap)
        host = to_device(
            [r.table_idx for r in reqs] + gap + [r.device_len for r in reqs] + gap + qo,
            self.device,
            torch.int32,
        )
        batch.attn_metadata = TritonMetadata(
            qo_indptr=host[2 * at :],
            rows=host[:bs],
            seq_lens=host[at : at + bs],
            max_extend_len=max(extend_lens),
        )

    def attend(self, q: torch.Tensor, layer_id: int, batch: Batch) -> torch.Tensor:
        md = batch.attn_metadata
        assert isinstance(md, TritonMetadata)
        k_cache, v_cache = self.kv_cache.k_cache(layer_id), self.kv_cache.v_cache(layer_id)
        if md.max_extend_len == 1:
            return self.decode_attention(
                q,
                k_cache,
                v_cache,
                self.page_table,
                md.rows,
                md.seq_lens,
                self.scale,
                self.window(layer_id),  # [ch29]
                *self.kv_cache.scales(layer_id),  # [ch28]
            )
        extend = self.extend_attention
        if batch.phase == "verify" and ENV.VERIFY_ATTN.value != "extend":  # [ch26]
            extend = self.verify_attention  # a few tokens a request, split over the keys  # [ch26]
        return extend(
            q,
            k_cache,
            v_cache,
            self.page_table,
            md.rows,
            md.seq_lens,
            md.qo_indptr,
            md.max_extend_len,
            self.scale,
            self.window(layer_id),  # [ch29]
            *self.kv_cache.scales(layer_id),  # [ch28]
        )

    def decode_from_qkv(
        self, layer: AttentionLayer, qkv: torch.Tensor, batch: Batch
    ) -> torch.Tensor | None:
        """A decode step's attention from the layer's qkv in one kernel (rotary, KV store,
        split-KV attention and merge: kernels/fused_decode.py); None: not a layer it takes."""
        # >>> ch29 its kernel turns every channel of a head and attends to every key
        if self.window(layer.layer_id) is not None or layer.rotary.rotary_dim < layer.head_dim:
            return None
        # <<< ch29
        from minisgl.kernels import fused_decode

        md = batch.attn_metadata
        assert isinstance(md, TritonMetadata)
        norms = hasattr(layer, "q_norm")
        inputs = (  # qkv, its rotary and norms, the KV pool and where each request's keys are
            qkv,
            batch.positions,
            layer.rotary.cos_sin,
            layer.q_norm.weight if norms else None,
            layer.k_norm.weight if norms else None,
            layer.q_norm.eps if norms else 0.0,
            self.kv_cache.k_cache(layer.layer_id),
            self.kv_cache.v_cache(layer.layer_id),
            batch.out_loc,
            self.page_table,
            md.rows,
            md.seq_lens,
        )
        heads = (layer.num_heads, layer.num_kv_heads, layer.head_dim)
        if batch.phase == "verify":  # [ch26]
            return self.verify_from_qkv(self, layer, batch, inputs, heads)  # [ch26]
        assert md.max_extend_len == 1
        return fused_decode.decode_attention_qkv(
            *inputs, self.scale, *heads,
            *self.kv_cache.scales(layer.layer_id),  # [ch28]
        )  # fmt: skip

    def init_capture_graph(self, max_seq_len: int, bs_list: list[int]) -> None:
        max_bs, device = max(bs_list), self.device
        dummy_row = self.page_table.size(0) - 1
        self.capture = TritonCaptureData(
            qo_indptr=torch.arange(max_bs + 1, dtype=torch.int32, device=device),
            rows=torch.full((max_bs,), dummy_row, dtype=torch.int32, device=device),
            seq_lens=torch.ones(max_bs, dtype=torch.int32, device=device),
        )

    def prepare_for_capture(self, batch: Batch) -> None:
        # The shape's own metadata, copied in. The kernel grid is the capture's: one token a
        # request in decode; in a prefill shape all its tokens (held by one filler request)
        # in every slot, most of whose programs exit at once.
        self.prepare_metadata(batch)
        self.prepare_for_replay(batch)
        bs, cap, md = batch.padded_size, self.capture, batch.attn_metadata
        assert cap is not None and isinstance(md, TritonMetadata)
        batch.attn_metadata = TritonMetadata(
            qo_indptr=cap.qo_indptr[: bs + 1],
            rows=cap.rows[:bs],
            seq_lens=cap.seq_lens[:bs],
            max_extend_len=md.max_extend_len,
        )

    def prepare_for_replay(self, batch: Batch) -> None:
        md, bs, cap = batch.attn_metadata, batch.padded_size, self.capture
        assert isinstance(md, TritonMetadata) and cap is not None
        cap.qo_indptr[: bs + 1].copy_(md.qo_indptr)  # 0, 1, ..., bs in decode
        cap.rows[:bs].copy_(md.rows)
        cap.seq_lens[:bs].copy_(md.seq_lens)
