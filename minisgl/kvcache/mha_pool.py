"""The paged KV pool: every layer's keys and values for every cached token, in fixed pages.

Storage is one tensor per K and V shaped [layers, pages + 1, page_size, kv_heads, head_dim].
A token's place in it is its *slot*: page * page_size + offset. The extra last page is the
dummy page: padding requests (CUDA-graph batches) write their K/V there, so they never
touch a real request's cache.
"""

from __future__ import annotations

import torch


class MHAKVCache:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(
                f"need num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}"
            )
        self.num_pages, self.page_size = num_pages, page_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        shape = (num_layers, num_pages + 1, page_size, num_kv_heads, head_dim)
        # zeros, not empty: attention may read (and mask) stale slots, which must not be NaN
        self._k = torch.zeros(shape, dtype=dtype, device=device)
        self._v = torch.zeros(shape, dtype=dtype, device=device)
        self.k_scale, self.v_scale = [1.0] * num_layers, [1.0] * num_layers  # see scales  # [ch28]

    @property
    def dummy_page(self) -> int:
        return self.num_pages

    @property
    def num_slots(self) -> int:
        return (self.num_pages + 1) * self.page_size

    def paged(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's (keys, values), each [pages + 1, page_size, kv_heads, head_dim].

        The layout paged attention kernels read directly: page ids index the first dimension.
        """
        return self._k[layer_id], self._v[layer_id]

    def k_cache(self, layer_id: int) -> torch.Tensor:
        """[slots, kv_heads, head_dim] view of one layer's keys."""
        return self._k[layer_id].flatten(0, 1)

    def v_cache(self, layer_id: int) -> torch.Tensor:
        return self._v[layer_id].flatten(0, 1)

    def store_kv(
        self, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor, layer_id: int
    ) -> None:
        if self.dtype == torch.float8_e4m3fn:  # x / scale, as x * (1 / scale) in fp32  # [ch28]
            ks, vs = self.scales(layer_id)  # [ch28]
            k = (k.float() * (1 / ks)).clamp(-448.0, 448.0)  # CUDA's cast: NaN past 448  # [ch28]
            v = (v.float() * (1 / vs)).clamp(-448.0, 448.0)  # [ch28]
        self.k_cache(layer_id)[out_loc] = k.to(self.dtype)
        self.v_cache(layer_id)[out_loc] = v.to(self.dtype)

    # >>> ch28
    def scales(self, layer_id: int) -> tuple[float, float]:
        """An FP8 cache's (k_scale, v_scale) of a layer: it holds x / scale, and a stored key
        times k_scale is the key. 1.0 unless calibrated (set before the first forward)."""
        return self.k_scale[layer_id], self.v_scale[layer_id]

    # <<< ch28

    @staticmethod
    def bytes_per_page(
        num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * page_size * num_kv_heads * head_dim * dtype.itemsize
