"""A stand-in for the flashinfer module, so the FlashInfer backend's plumbing runs on CPU.

Its wrappers have FlashInfer's constructor and `plan()` signatures, and their `run()`
computes attention in plain torch from exactly the arrays that were planned (read back
from the fixed buffers in CUDA-graph mode, as the real kernels do).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from minisgl.attention.fi import FlashInferBackend
from minisgl.engine.graph import GraphKind, GraphPlan, GraphRunner, GraphShape

CPU = torch.device("cpu")


class _Wrapper:
    """FlashInfer's paged wrappers as far as the backend uses them; attention in torch."""

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        use_tensor_cores: bool = False,
        paged_kv_indptr_buffer: torch.Tensor | None = None,
        paged_kv_indices_buffer: torch.Tensor | None = None,
        paged_kv_last_page_len_buffer: torch.Tensor | None = None,
        backend: str = "auto",
    ) -> None:
        assert kv_layout == "NHD" and backend in ("auto", "fa2")
        self.graph = use_cuda_graph
        if use_cuda_graph:  # FlashInfer's rule: the batch size is fixed by the buffers
            assert len(paged_kv_indptr_buffer) == len(paged_kv_last_page_len_buffer) + 1
            self.indptr, self.indices = paged_kv_indptr_buffer, paged_kv_indices_buffer
            self.last = paged_kv_last_page_len_buffer
        self.plans = 0
        self.window_left = -1  # FlashInfer's: a query at p sees keys p - window_left .. p

    def _take(self, indptr, indices, last, num_qo_heads, num_kv_heads, page_size, sm_scale):
        for t in (indptr, indices, last):
            assert t.dtype == torch.int32
        if self.graph:
            assert len(last) == len(self.last), "batch size differs from the captured one"
            self.indptr.copy_(indptr)
            self.indices[: len(indices)].copy_(indices)
            self.last.copy_(last)
        else:
            self.indptr, self.indices, self.last = indptr.clone(), indices.clone(), last.clone()
        self.heads, self.kv_heads, self.page_size, self.scale = (
            num_qo_heads,
            num_kv_heads,
            page_size,
            sm_scale,
        )
        self.plans += 1

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor]):
        k_pages, v_pages = paged_kv_cache
        assert k_pages.dim() == 4 and k_pages.size(1) == self.page_size
        out = torch.empty_like(q)
        indptr, indices, last = self.indptr.tolist(), self.indices.tolist(), self.last.tolist()
        qo = self.qo_indptr()
        for i in range(len(last)):
            pages = indices[indptr[i] : indptr[i + 1]]
            n_kv = (len(pages) - 1) * self.page_size + last[i]
            keys = k_pages[pages].flatten(0, 1)[:n_kv].transpose(0, 1)
            values = v_pages[pages].flatten(0, 1)[:n_kv].transpose(0, 1)
            n_q = qo[i + 1] - qo[i]
            q_pos = torch.arange(n_kv - n_q, n_kv)
            mask = torch.arange(n_kv)[None, :] <= q_pos[:, None]
            if self.window_left >= 0:  # [ch29]
                mask &= torch.arange(n_kv)[None, :] >= q_pos[:, None] - self.window_left  # [ch29]
            out[qo[i] : qo[i + 1]] = F.scaled_dot_product_attention(
                q[qo[i] : qo[i + 1]].transpose(0, 1),
                keys,
                values,
                attn_mask=mask,
                scale=self.scale,
                enable_gqa=True,
            ).transpose(0, 1)
        return out


class _Decode(_Wrapper):
    def plan(
        self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
        *, sm_scale, q_data_type, kv_data_type,
        window_left=-1,  # [ch29]
    ) -> None:  # fmt: skip
        self.window_left = window_left  # [ch29]
        self._take(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, page_size, sm_scale)

    def qo_indptr(self) -> list[int]:
        return list(range(len(self.last) + 1))


class _Prefill(_Wrapper):
    def plan(
        self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
        num_qo_heads, num_kv_heads, head_dim_qk, page_size,
        *, causal, sm_scale, q_data_type, kv_data_type,
        window_left=-1,  # [ch29]
    ) -> None:  # fmt: skip
        assert causal and qo_indptr.dtype == torch.int32
        self.window_left = window_left  # [ch29]
        self.qo = qo_indptr.tolist()
        self._take(
            paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
            num_qo_heads, num_kv_heads, page_size, sm_scale,
        )  # fmt: skip

    def qo_indptr(self) -> list[int]:
        return self.qo


def fake_flashinfer() -> types.ModuleType:
    module = types.ModuleType("flashinfer")
    module.BatchDecodeWithPagedKVCacheWrapper = _Decode
    module.BatchPrefillWithPagedKVCacheWrapper = _Prefill
    return module


class _Event:  # torch.cuda.Event stand-in: the backend records one after every plan
    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


@pytest.fixture
def fake_fi(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer())
    monkeypatch.setattr(torch.cuda, "Event", _Event)


def use_fi(engine, graph_bs: list[int]) -> FlashInferBackend:
    mc = engine.model_config
    fi = FlashInferBackend(engine.kv_cache, engine.page_table, mc.head_dim**-0.5, mc.num_heads)
    engine.attn_backend = engine.ctx.attn_backend = fi
    decode = GraphKind([GraphShape(bs, bs) for bs in graph_bs], engine.dummy_req)
    plan = GraphPlan([decode], engine.max_seq_len, emulated=True)
    engine.graph_runner = GraphRunner(engine.model, fi, plan, mc.vocab_size, CPU)
    engine.graph_runner.capture()
    return fi
