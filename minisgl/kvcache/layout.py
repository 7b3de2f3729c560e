"""Which state each layer keeps, and the KV pool that holds it by layer group.

Until chapter 29 every layer kept keys and values of one shape, so the KV pool was one tensor
[layers, pages + 1, page_size, kv_heads, head_dim]. Now a layer keeps one of:
- paged keys and values in a *group*: the layers of one geometry (KV heads x head_dim) and
  one window. Gemma 4's 256-dim sliding layers are one group, its 512-dim full layers
  another; Gemma 3's sliding and global layers, of one geometry, are two;
- nothing: it attends over an earlier layer's keys (Gemma 4's KV-shared layers);
- a recurrent state per request, in the state pool (Qwen3.5's linear layers, state_pool.py).

`KVLayout` says which, for every layer, computed once from the model's config and this
rank's share of the heads. The pool keeps one storage per group. The groups that keep every
position are indexed by the same page ids: one page table, and a page holds page_size tokens
of each. A sliding group has page ids of its own, fewer, given back once the window has
passed them (window_pages.py); with `window_pages=0` it shares the full ones, and a page
costs the sum of the groups' bytes. A model of one group without a window (Llama, Qwen3,
Qwen3.5's attention layers) gets chapter 3's `MHAKVCache`; a model of several gets
`GroupedKVCache`, which has its interface, or with a sliding group `WindowedKVCache`.

The pool's layers are the storing layers in order (`families.kv_pool_layers`). A KV-shared
layer attends with its source's pool layer: the source's keys, and the source's window,
which is its own (the source is of its kind). A group records its window: its keys older
than the window are never read again, which the windowed pool uses.

Start-up asks this module, and only this one, what the layers keep: the bytes of a page, the
windowed pages' and the recurrent states' share of the budget (window_pages.py's and
state_pool.py's functions), the pool, each pool layer's window, and whether an attention
backend can read the pool.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from minisgl.distributed import rank_heads
from minisgl.kvcache.mha_pool import MHAKVCache

# >>> ch31 the recurrent states, which start-up asks for through this module
from minisgl.kvcache.state_pool import RecurrentStatePool, budget_after_states, make_state_pool

# <<< ch31
from minisgl.models.families import attention_layers, kv_pool_layers, kv_shape, kv_source, sliding

if TYPE_CHECKING:
    from minisgl.attention.base import BaseAttnBackend
    from minisgl.models.config import ModelConfig

# >>> ch31
__all__ = ["GroupedKVCache", "KVGroup", "KVLayout", "RecurrentStatePool", "budget_after_states",
           "make_state_pool"]  # fmt: skip
# <<< ch31
logger = logging.getLogger(__name__)
# The backends whose kernels take each layer's head_dim and KV heads from its cache tensors;
# FlashInfer and flash-attn plan, or are built for, one head_dim (and flash-attn's stop at 256).
READS_GROUPS = ("triton", "torch")


@dataclass(frozen=True)
class KVGroup:
    """Layers whose keys and values have one geometry: one storage in the pool."""

    kv_heads: int  # this rank's
    head_dim: int
    layers: tuple[int, ...]  # the model layers it stores, in order: their index in the storage
    window: int | None  # every layer of it attends to the last `window` positions only

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * len(self.layers) * self.kv_heads * self.head_dim * dtype.itemsize


@dataclass(frozen=True)
class KVLayout:
    groups: tuple[KVGroup, ...]
    place: tuple[tuple[int, int], ...]  # pool layer -> (its group, its index in the group)
    windows: tuple[int | None, ...]  # pool layer -> its sliding window (None: every key)
    shared: tuple[tuple[int, int], ...]  # (layer, the layer whose keys it reads): they store none
    recurrent: tuple[int, ...]  # layers with a recurrent state instead (the state pool's)
    every_layer: tuple[tuple[int, int], ...]  # each attention layer's (KV heads, head_dim)

    @classmethod
    def of(cls, config: ModelConfig, max_seq_len: int, own_pages: bool = True) -> KVLayout:
        """The layout of `config`'s layers on this rank, for an engine of `max_seq_len`
        positions (a window no shorter than that is no window); with `own_pages`, the
        sliding layers apart from the others of their geometry (their pages may be their own)."""
        pool = kv_pool_layers(config)
        storing = [i for i in attention_layers(config) if kv_source(config, i) == i]
        shapes = {i: (rank_heads(config.num_heads, kv_shape(config, i)[0])[1],
                      kv_shape(config, i)[1]) for i in attention_layers(config)}  # fmt: skip
        window = {i: config.sliding_window if sliding(config, i) else None for i in storing}
        window = {i: w if w and w < max_seq_len else None for i, w in window.items()}
        # A group is the layers of one geometry and one window: a window of its own lets a
        # group keep only its last pages (window_pages.py), as Gemma 3's sliding layers do
        # beside its global ones of the same shape.
        members: dict[tuple[int, ...], list[int]] = {}
        for i in storing:
            members.setdefault((*shapes[i], window[i]) if own_pages else shapes[i], []).append(i)
        groups = tuple(
            KVGroup(key[0], key[1], tuple(layers), _one_window([window[i] for i in layers]))
            for key, layers in members.items()
        )
        index = {i: (g, k) for g, group in enumerate(groups) for k, i in enumerate(group.layers)}
        return cls(
            groups=groups,
            place=tuple(index[i] for i in storing),
            windows=tuple(window[i] for i in storing),
            shared=tuple(
                (i, kv_source(config, i))
                for i in attention_layers(config)
                if kv_source(config, i) != i
            ),  # fmt: skip
            recurrent=tuple(i for i, p in enumerate(pool) if p is None),
            every_layer=tuple(shapes[i] for i in attention_layers(config)),
        )

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return sum(g.bytes_per_token(dtype) for g in self.groups)

    @property
    def window(self) -> int | None:
        """The longest window of the sliding groups (None: no group slides): the pages a
        sliding layer may still read lie within it."""
        return max((g.window for g in self.groups if g.window), default=None)

    def split_bytes_per_token(self, dtype: torch.dtype) -> tuple[int, int]:
        """(the groups that keep every position, the sliding groups): a token's bytes in each."""
        full = sum(g.bytes_per_token(dtype) for g in self.groups if not g.window)
        return full, self.bytes_per_token(dtype) - full

    def every_layer_bytes_per_token(self, dtype: torch.dtype) -> int:
        """What a token would cost if every attention layer kept its own keys and values."""
        return sum(2 * heads * dim * dtype.itemsize for heads, dim in self.every_layer)

    def new_pool(
        self,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
        window_pages: int | None = None,
    ) -> MHAKVCache:
        """Chapter 3's pool for one group; one storage per group for several; with
        `window_pages`, the sliding groups in pages of their own (window_pages.py). Each knows
        the model layer each of its layers stores (an FP8 cache's scales are by model layer)."""
        if window_pages is not None and self.window is not None:
            from minisgl.kvcache.window_pages import WindowedKVCache

            pool: MHAKVCache = WindowedKVCache(
                self, num_pages, page_size, dtype, device, window_pages
            )
        elif len(self.groups) > 1:
            pool = GroupedKVCache(self, num_pages, page_size, dtype, device)
        else:
            g = self.groups[0]
            pool = MHAKVCache(
                len(g.layers), num_pages, page_size, g.kv_heads, g.head_dim, dtype, device
            )
        pool.stored_layers = self.stored_layers()  # type: ignore[attr-defined]
        return pool

    def stored_layers(self) -> list[int]:
        """The model layer that each pool layer stores."""
        return [self.groups[g].layers[k] for g, k in self.place]

    def describe(self, dtype: torch.dtype) -> str:
        """One line: each group's bytes a token, the shared layers, the total against every
        layer keeping its own."""
        parts = []
        for g in self.groups:
            kind = f"window {g.window}" if g.window else "all positions"
            parts.append(
                f"{len(g.layers)} layers x {g.kv_heads} KV heads x {g.head_dim} ({kind}): "
                f"{g.bytes_per_token(dtype):,} B"
            )
        if self.shared:
            parts.append(f"{len(self.shared)} layers read another's KV: 0 B")
        total, every = self.bytes_per_token(dtype), self.every_layer_bytes_per_token(dtype)
        return (
            f"KV per token by layer group ({str(dtype).removeprefix('torch.')}): "
            f"{'; '.join(parts)}; {total:,} B in all, against {every:,} B with every layer's "
            f"own KV ({every / total:.2f}x)"
        )


def _one_window(windows: list[int | None]) -> int | None:
    """A group's window: the one all its layers slide by, else None."""
    return windows[0] if windows[0] is not None and len(set(windows)) == 1 else None


class GroupedKVCache(MHAKVCache):
    """MHAKVCache's pool with one storage per layer group, [group layers, pages + 1,
    page_size, its KV heads, its head_dim], every group indexed by the same page ids (and
    one dummy page, the last), or, with `window_pages`, the sliding groups by page ids of
    their own (window_pages.py). Pool layer l lives at `place[l]`: (group, index there).
    Storing and the FP8 scales are MHAKVCache's, through the views below."""

    def __init__(
        self,
        layout: KVLayout,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
        window_pages: int | None = None,
    ) -> None:  # not MHAKVCache's: its one tensor is what this replaces
        if num_pages < 1 or page_size < 1:
            raise ValueError(
                f"need num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}"
            )
        self.num_pages, self.page_size, self.dtype = num_pages, page_size, dtype
        self.place = layout.place
        pages = [window_pages if g.window and window_pages else num_pages for g in layout.groups]
        shapes = [(len(g.layers), n + 1, page_size, g.kv_heads, g.head_dim)
                  for g, n in zip(layout.groups, pages)]  # fmt: skip
        # zeros, not empty: attention may read (and mask) stale slots, which must not be NaN
        self.group_k = [torch.zeros(s, dtype=dtype, device=device) for s in shapes]
        self.group_v = [torch.zeros(s, dtype=dtype, device=device) for s in shapes]
        self.k_scale, self.v_scale = [1.0] * len(self.place), [1.0] * len(self.place)

    def paged(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        group, index = self.place[layer_id]
        return self.group_k[group][index], self.group_v[group][index]

    def k_cache(self, layer_id: int) -> torch.Tensor:
        return self.paged(layer_id)[0].flatten(0, 1)

    def v_cache(self, layer_id: int) -> torch.Tensor:
        return self.paged(layer_id)[1].flatten(0, 1)


# ---- start-up: the engine's questions (engine/startup.py, engine/engine.py)


class EngineShape(Protocol):
    """What the layout reads of the engine's shape (engine/startup.py), by name only."""

    model_config: ModelConfig
    config: Any  # an EngineConfig: its attention_backend
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    max_seq_len: int
    page_size: int


def layout_of(shape: EngineShape) -> KVLayout:
    own_pages = getattr(shape.config, "window_pages", None) != 0
    return KVLayout.of(shape.model_config, shape.max_seq_len, own_pages)


def bytes_per_page(shape: EngineShape) -> int:
    """A page's bytes: page_size tokens of every group (KV-shared layers add nothing); with a
    sliding group, of the groups that keep every position (the windowed pages are apart:
    `budget_after_windows`), at least one byte (a page id of a model whose layers all slide)."""
    layout = layout_of(shape)
    if windowed_pages(shape, layout):
        return max(1, shape.page_size * layout.split_bytes_per_token(shape.kv_dtype)[0])
    return shape.page_size * layout.bytes_per_token(shape.kv_dtype)


def windowed_pages(shape: EngineShape, layout: KVLayout) -> bool:
    """Whether the sliding groups keep pages of their own: where a group slides, unless
    `window_pages` is 0 (then every page holds every group, as for a backend that reads one
    page table: FlashInfer, flash-attn)."""
    return layout.window is not None and getattr(shape.config, "window_pages", None) != 0


def budget_after_windows(shape: EngineShape, budget: int, per_page: int) -> int:
    """The full pages' budget once a sliding group's windowed pages have theirs."""
    from minisgl.kvcache.window_pages import budget_after_windows

    layout = layout_of(shape)
    if not windowed_pages(shape, layout):
        return budget
    return budget_after_windows(shape, layout, budget, per_page)


def new_pool(shape: EngineShape, num_pages: int) -> MHAKVCache:
    """The engine's KV pool, its memory per token by group logged (and, with a sliding
    group, the full and windowed pages)."""
    layout = layout_of(shape)
    logger.info(layout.describe(shape.kv_dtype))
    window_pages = None
    if windowed_pages(shape, layout):
        from minisgl.kvcache.window_pages import describe_split, window_pages_for

        window_pages = window_pages_for(shape, layout, num_pages)
        logger.info(describe_split(layout, num_pages, window_pages, shape.page_size,
                                   shape.kv_dtype))  # fmt: skip
    return layout.new_pool(num_pages, shape.page_size, shape.kv_dtype, shape.device, window_pages)


def windows(shape: EngineShape) -> list[int | None]:
    """Each pool layer's sliding window, for the attention backend."""
    return list(layout_of(shape).windows)


def backend_for(shape: EngineShape, cls: type[BaseAttnBackend]) -> type[BaseAttnBackend]:
    """`cls`, if it can read the pool; else, for `--attn auto`, the first backend that can
    (our Triton kernels on a GPU, torch elsewhere), and for a backend asked for by name a
    ValueError that says why not."""
    layout = layout_of(shape)
    chosen = _reads_pool(shape, layout, cls)
    if windowed_pages(shape, layout):  # the sliding layers read a page table of their own
        from minisgl.kvcache.window_pages import windowed_backend

        return windowed_backend(chosen)
    return chosen


def _reads_pool(shape: EngineShape, layout: KVLayout, cls: type[BaseAttnBackend]) -> type:
    groups, windowed = layout.groups, windowed_pages(shape, layout)
    one_shape = len({(g.kv_heads, g.head_dim) for g in groups}) <= 1
    if (one_shape and not windowed) or cls.name in READS_GROUPS:
        return cls
    from minisgl.attention.registry import BACKENDS, select_backend

    dims = " and ".join(f"{g.kv_heads} x {g.head_dim}" for g in groups)
    why = f"it takes one KV geometry, and {shape.model_config.architecture}'s layers have {dims}"
    if one_shape:
        why = "it reads one page table, and the sliding layers keep pages of their own "
        why += "(window_pages=0: none of their own)"
    if shape.config.attention_backend != "auto":
        raise ValueError(f"attention backend {cls.name!r} cannot run here: {why}")
    for name in READS_GROUPS:
        if shape.device.type not in BACKENDS[name].auto_devices:
            continue
        try:
            fp8 = shape.kv_dtype == torch.float8_e4m3fn
            chosen = select_backend(name, shape.device, shape.dtype, shape.page_size, fp8_kv=fp8)
        except ValueError:
            continue
        logger.info("attention backend: %s (auto), not %s: %s", name, cls.name, why)
        return chosen
    raise AssertionError("the torch backend runs on every device")
