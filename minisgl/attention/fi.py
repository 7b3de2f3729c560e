"""FlashInfer attention: paged prefill and decode kernels on CUDA, and decode CUDA graphs.

FlashInfer describes where a batch's K/V lives with three arrays over *pages*: `indptr`
(request i's pages are `indices[indptr[i]:indptr[i + 1]]`), `indices` (page ids) and
`last_page_len` (tokens in each request's last page). A wrapper's `plan()` reads the
lengths on the host, picks how to split the work and copies the arrays to the device;
its `run()` is then pure device work, so a decode step can be captured in a CUDA graph
as long as `plan()` runs outside the graph before every replay.

`paged_kv_layout` below needs no FlashInfer, so its arithmetic is tested on CPU.
"""

from __future__ import annotations

import importlib.util
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from minisgl.attention.base import BaseAttnBackend, BaseAttnMetadata
from minisgl.utils import cdiv, to_device

if TYPE_CHECKING:
    from minisgl.core import Batch
    from minisgl.kvcache.mha_pool import MHAKVCache

WORKSPACE_BYTES = 256 * 2**20  # split-KV partial results; FlashInfer recommends >= 128 MiB


def paged_kv_layout(
    seq_lens: list[int],
    rows: list[int],
    page_table: torch.Tensor,
    page_size: int,
    kernel: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(indptr [bs + 1] host, indices [pages] device, last_page_len [bs] host), int32.

    Request i holds `seq_lens[i]` tokens in row `rows[i]` of the page table, which maps
    each position to its KV slot (page * page_size + offset). The page ids are gathered on
    the device: a batch of long sequences has hundreds of thousands of them. `kernel`: by
    our Triton kernel in one launch (the default on CUDA), else by torch operations.
    """
    bs, device = len(rows), page_table.device
    pages = [cdiv(n, page_size) for n in seq_lens]
    indptr = [0, *itertools.accumulate(pages)]
    last_page_len = [n - (p - 1) * page_size for n, p in zip(seq_lens, pages)]
    host = torch.tensor(indptr + last_page_len + rows + pages, dtype=torch.int32)
    if device.type == "cuda":  # plan() copies indptr and last_page_len in: asynchronously
        host = host.pin_memory()
    starts, _, row_of, pages_of = host.to(device, non_blocking=True).split([bs + 1, bs, bs, bs])
    total = indptr[-1]
    # >>> ch20 one kernel instead of the dozen operations below
    if kernel if kernel is not None else device.type == "cuda":
        from minisgl.kernels.page_ids import gather_page_ids

        indices = gather_page_ids(page_table, row_of, starts, total, max(pages), page_size)
        return host[: bs + 1], indices, host[bs + 1 : 2 * bs + 1]
    # <<< ch20
    # For each output entry: the row of the request it belongs to, and its page number
    # within that request.
    row = torch.repeat_interleave(row_of, pages_of, output_size=total)
    first = torch.repeat_interleave(starts[:-1], pages_of, output_size=total)
    page_no = torch.arange(total, device=device, dtype=torch.int32) - first
    indices = page_table[row, page_no * page_size] // page_size
    return host[: bs + 1], indices, host[bs + 1 : 2 * bs + 1]


@dataclass
class FlashInferMetadata(BaseAttnMetadata):
    qo_indptr: torch.Tensor  # [bs + 1] int32, device: request i's new tokens are q[qo[i]:qo[i+1]]
    qo_indptr_host: torch.Tensor | None  # the same on the host, for a prefill's plan()
    kv_indptr: torch.Tensor  # [bs + 1] int32, host
    kv_indices: torch.Tensor  # [pages] int32, device
    kv_last_page_len: torch.Tensor  # [bs] int32, host
    # the FlashInfer wrappers planned for this batch: one per attention window (None: all)
    wrappers: dict[int | None, Any] | None = None

    def get_last_indices(self) -> torch.Tensor:
        return self.qo_indptr[1:] - 1


class FlashInferBackend(BaseAttnBackend):
    name = "fi"
    devices = ("cuda",)
    auto_devices = ("cuda",)
    # Decode only. No full prefill graphs: FlashInfer's CUDA-graph prefill plan bounds a
    # request's query length by (tokens - requests + 1), as if every request had a token,
    # which the zero-length sentinels of a padded prefill break (measured: wrong tokens).
    # Breakable prefill graphs run its attention eagerly and need nothing from it.
    cuda_graphs = ("decode",)

    @classmethod
    def unavailable_reason(cls, device: torch.device, dtype: torch.dtype, page_size: int) -> str:
        if device.type != "cuda":
            return f"FlashInfer needs a CUDA device, and this engine runs on {device.type}"
        if importlib.util.find_spec("flashinfer") is None:
            return "the flashinfer package is not installed (pip install 'minisgl[gpu]')"
        if dtype not in (torch.bfloat16, torch.float16):
            return f"FlashInfer's kernels take bfloat16 or float16, not {dtype}"
        return ""  # any page size

    def __init__(
        self, kv_cache: MHAKVCache, page_table: torch.Tensor, scale: float, num_qo_heads: int
    ) -> None:
        super().__init__(kv_cache, page_table, scale, num_qo_heads)
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        # Grouped-query decode runs faster on the tensor-core (prefill) kernels once several
        # query heads share a KV head.
        self.use_tensor_cores = num_qo_heads // kv_cache.num_kv_heads >= 4
        self.shape = dict(
            num_qo_heads=num_qo_heads,
            num_kv_heads=kv_cache.num_kv_heads,
            page_size=kv_cache.page_size,
            sm_scale=scale,
            q_data_type=kv_cache.dtype,
            kv_data_type=kv_cache.dtype,
        )
        # A wrapper is planned for one attention window; the layers share the float workspace,
        # as they run one after the other. Without sliding layers, one window: None (all).
        self.prefill_wrappers: dict[int | None, Any] = {}
        self.decode_wrappers: dict[int | None, Any] = {}
        self._make_wrappers((None,))
        # captured batch size -> its own decode wrappers
        self.graph_wrappers: dict[int, dict[int | None, Any]] = {}
        self._last_plan: torch.cuda.Event | None = None

    def _make_wrappers(self, windows: tuple[int | None, ...]) -> None:
        import flashinfer

        # FA2 kernels: the Hopper (FA3) ones take minutes longer to JIT-compile.
        self.prefill_wrappers = {
            w: flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2")
            for w in windows
        }
        self.decode_wrappers = {w: self._decode_wrapper() for w in windows}

    # >>> ch29
    def set_windows(self, windows: list[int | None]) -> None:
        super().set_windows(windows)
        self._make_wrappers(self._distinct_windows())

    def _distinct_windows(self) -> tuple[int | None, ...]:
        return tuple(dict.fromkeys(self.windows)) or (None,)

    # <<< ch29

    def _decode_wrapper(self, **graph_buffers: torch.Tensor) -> Any:
        import flashinfer

        return flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace,
            "NHD",
            use_cuda_graph=bool(graph_buffers),
            use_tensor_cores=self.use_tensor_cores,
            **graph_buffers,
        )

    def prepare_metadata(self, batch: Batch) -> None:
        md = self._metadata(batch)
        batch.attn_metadata = md
        if batch.is_decode and batch.padded_size in self.graph_wrappers:
            return  # a graph replay: the runner plans that graph's own wrapper
        self._plan(md, self.decode_wrappers if batch.is_decode else self.prefill_wrappers)

    def _metadata(self, batch: Batch) -> FlashInferMetadata:
        reqs = batch.padded_reqs
        if batch.is_decode:  # one new token each: 0, 1, ..., bs, made on the device
            qo_host = None  # only a prefill's plan() reads it
            qo = torch.arange(len(reqs) + 1, dtype=torch.int32, device=self.device)
        else:
            qo_host = torch.tensor(
                [0, *itertools.accumulate(r.extend_len for r in reqs)], dtype=torch.int32
            )
            qo = to_device(qo_host, self.device)
        kv_indptr, kv_indices, last_page_len = paged_kv_layout(
            [r.device_len for r in reqs],
            [r.table_idx for r in reqs],
            self.page_table,
            self.kv_cache.page_size,
        )
        return FlashInferMetadata(
            qo_indptr=qo,
            qo_indptr_host=qo_host,
            kv_indptr=kv_indptr,
            kv_indices=kv_indices,
            kv_last_page_len=last_page_len,
        )

    def _plan(self, md: FlashInferMetadata, wrappers: dict[int | None, Any]) -> None:
        # plan() stages its work split in a pinned host buffer of the wrapper and copies it
        # to the device asynchronously. Under overlap scheduling the next plan() can come
        # before that copy has run (it waits behind the batch on the GPU), and would
        # overwrite the buffer under it. Waiting for the previous plan's copy is cheap: by
        # then the host has already waited for the batch queued before it.
        if self._last_plan is not None:
            self._last_plan.synchronize()
        head_dim = self.kv_cache.head_dim
        for window, wrapper in wrappers.items():
            left = -1 if window is None else window - 1  # a query at p sees p - left .. p  # [ch29]
            if wrappers is self.prefill_wrappers:
                wrapper.plan(
                    md.qo_indptr_host,
                    md.kv_indptr,
                    md.kv_indices,
                    md.kv_last_page_len,
                    head_dim_qk=head_dim,
                    causal=True,
                    window_left=left,  # [ch29]
                    **self.shape,
                )
            else:
                wrapper.plan(
                    md.kv_indptr,
                    md.kv_indices,
                    md.kv_last_page_len,
                    head_dim=head_dim,
                    window_left=left,  # [ch29]
                    **self.shape,
                )
        self._last_plan = torch.cuda.Event()
        self._last_plan.record()
        md.wrappers = wrappers

    def attend(self, q: torch.Tensor, layer_id: int, batch: Batch) -> torch.Tensor:
        md = batch.attn_metadata
        assert isinstance(md, FlashInferMetadata) and md.wrappers is not None
        window = None
        window = self.window(layer_id)  # [ch29]
        return md.wrappers[window].run(q, self.kv_cache.paged(layer_id))

    def init_capture_graph(self, max_seq_len: int, bs_list: list[int]) -> None:
        # One set of index buffers sized for the largest batch; each captured size gets a
        # wrapper over slices of them (only one graph runs at a time).
        max_bs, device = max(bs_list), self.device
        pages_per_row = cdiv(self.page_table.size(1), self.kv_cache.page_size)
        indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=device)
        indices = torch.zeros(max_bs * pages_per_row, dtype=torch.int32, device=device)
        last_page_len = torch.zeros(max_bs, dtype=torch.int32, device=device)
        for bs in bs_list:
            self.graph_wrappers[bs] = {
                window: self._decode_wrapper(
                    paged_kv_indptr_buffer=indptr[: bs + 1],
                    paged_kv_indices_buffer=indices,
                    paged_kv_last_page_len_buffer=last_page_len[:bs],
                )
                for window in self.decode_wrappers
            }

    def prepare_for_capture(self, batch: Batch) -> None:
        md = self._metadata(batch)
        self._plan(md, self.graph_wrappers[batch.padded_size])
        batch.attn_metadata = md

    def prepare_for_replay(self, batch: Batch) -> None:
        md = batch.attn_metadata
        assert isinstance(md, FlashInferMetadata)
        self._plan(md, self.graph_wrappers[batch.padded_size])
