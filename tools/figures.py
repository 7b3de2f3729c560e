"""The course's pictures, each drawn from a run of its chapter's own code on the CPU.

Usage: python tools/figures.py [--only ch11 ...] [--out docs/figures]

Where an idea is spatial (the pool and a page table, the shifted causal mask, a request's
life and its pages, the radix tree, the overlap timeline, a padded graph batch, a verify
batch, a pool's layer groups and windowed pages), a chapter shows a picture of it. None is
drawn by hand: each function below runs the chapter's code on a small case (SmolLM2 on the
CPU, a tiny random model built from a seed, or no model at all), records the state it
reached, and draws that. Run from the repository root, after `make models`; each
chapter text shows its picture from docs/figures/.
"""

from __future__ import annotations

import argparse
import ast
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

MODEL = "models/SmolLM2-135M-Instruct"
COLORS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1"]
OWNERS = ["#f28e2b", "#b07aa1", "#9c755f", "#499894"]  # request i's pages, apart from the states
FREE, DUMMY, MUTED = "#eeeeee", "#555555", "#bbbbbb"
plt.rcParams.update(
    {
        "svg.fonttype": "none",
        "svg.hashsalt": "minisgl",
        "font.size": 9,
        "font.family": "DejaVu Sans",
    }
)


def example_constants(path: str, *names: str, **scope: Any) -> list[Any]:
    """The named module-level constants of an example (`WAVES`, `KW`, ...), and the functions
    named (`gemma4`), from its source: its statements that assign upper-case names and the
    named functions' definitions run, given `scope`, and the rest does not. So a figure runs
    the example's own case without running the example."""
    for node in ast.parse(Path(path).read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        roots = [t.value if isinstance(t, ast.Subscript) else t for t in targets]
        named = isinstance(node, ast.FunctionDef) and node.name in names
        if named or roots and all(isinstance(r, ast.Name) and r.id.isupper() for r in roots):
            exec(compile(ast.Module([node], []), path, "exec"), scope)
    return [scope[name] for name in names]


def save(fig: plt.Figure, out: Path, name: str) -> Path:
    path = out / f"{name}.svg"
    fig.savefig(path, bbox_inches="tight", metadata={"Date": None})  # no date: rebuilds diff
    plt.close(fig)
    return path


def cell(ax: plt.Axes, x: float, y: float, text: str, color: str, w: float = 1, **kw) -> None:
    """A box of width w at (x, y) with centred text; dark boxes get white text."""
    ax.add_patch(Rectangle((x, y), w, 1, facecolor=color, edgecolor="white", linewidth=1.5))
    dark = color in COLORS or color in OWNERS or color == DUMMY
    ax.text(
        x + w / 2, y + 0.5, text, ha="center", va="center", color="white" if dark else "black", **kw
    )


def frame(ax: plt.Axes, width: float, height: float) -> None:
    ax.set_xlim(0, width)
    ax.set_ylim(height, 0)
    ax.set_axis_off()


def short(text: str, n: int = 12) -> str:
    text = text.replace("\n", "\u23ce")
    return repr(text if len(text) <= n else text[: n - 1] + "\u2026")


def cpu_scheduler(tok: Any, cache_type: str, num_pages: int, page_size: int = 1) -> Any:
    """A Scheduler over SmolLM2 in fp32 on the CPU with four rows, as the chapters' examples
    build it."""
    from minisgl.scheduler.config import SchedulerConfig
    from minisgl.scheduler.scheduler import Scheduler

    config = SchedulerConfig(
        MODEL,
        dtype=torch.float32,
        device="cpu",
        max_running_req=4,
        num_page_override=num_pages,
        page_size=page_size,
        max_seq_len_override=128,
        cache_type=cache_type,
    )
    return Scheduler(config, tok.eos_token_ids)


# ---- chapter 3: the pool and the page table ------------------------------------------------


def ch03_pool(out: Path) -> Path:
    """The chapter 3 example's state: requests A and B in a pool of 8 pages and a dummy page."""
    from minisgl.kvcache.allocator import PageAllocator, page_slots
    from minisgl.kvcache.mha_pool import MHAKVCache

    pages, ps = 8, 4
    pool = MHAKVCache(1, pages, ps, 1, 1, torch.float32, torch.device("cpu"))
    alloc = PageAllocator(pages)
    table = torch.full((2, 12), -1, dtype=torch.int32)
    owned = {"A": alloc.alloc(2), "B": alloc.alloc(3)}
    owned["A"] += alloc.alloc(1)  # A grows from 6 to 9 tokens: its third page is page 5
    lengths = {"A": 9, "B": 9}
    for row, name in enumerate(owned):
        table[row, : ps * len(owned[name])] = page_slots(owned[name], ps)
    owner = {p: name for name, held in owned.items() for p in held}
    color = {"A": COLORS[0], "B": COLORS[1]}

    fig, ax = plt.subplots(figsize=(9.5, 3.4))
    frame(ax, 13.2, 6.4)
    ax.text(0, -0.3, f"KV pool: {pages} pages of {ps} slots, then the dummy page", weight="bold")
    for page in range(pool.num_pages + 1):
        x = page * 1.45
        name = owner.get(page, "dummy" if page == pool.dummy_page else "")
        c = color.get(name, DUMMY if name == "dummy" else FREE)
        cell(ax, x, 0.2, f"page {page}\n{name or 'free'}", c, w=1.35, fontsize=8)
        ax.text(x + 0.67, 1.5, f"slots {page * ps}-{page * ps + ps - 1}", ha="center", fontsize=7)
    ax.text(0, 2.5, "page table: row r, column p = the slot of position p", weight="bold")
    for row, name in enumerate(owned):
        y = 2.8 + row * 1.2
        ax.text(-0.1, y + 0.5, f"row {row} ({name})", ha="right", va="center")
        for p in range(table.size(1)):
            slot = int(table[row, p])
            used = slot >= 0 and p < lengths[name]
            c = color[name] if used else FREE
            cell(ax, p * 1.1, y, str(slot), c, w=1.05, fontsize=8)
    for p in range(table.size(1)):
        ax.text(p * 1.1 + 0.52, 5.4, f"p={p}", ha="center", fontsize=7)
    note = "grey in a row: slots of the request's last page that no token uses yet"
    ax.text(0, 6.1, note, fontsize=7.5)
    return save(fig, out, "ch03_pool_and_page_table")


# ---- chapter 4: the shifted causal mask ----------------------------------------------------


def attention_weights() -> tuple[torch.Tensor, list]:
    """The chapter 4 example's prefill (A: 5 new tokens; B: 4 new after 6 cached) through the
    reference backend, which reports the weights it gave each key: with zero queries every
    key it sees gets the same weight, and values one-hot in the key's position tell which.
    Returns ([new tokens, key positions] weights, [A, B])."""
    from minisgl.attention.torch_backend import TorchAttnBackend
    from minisgl.core import Batch, Context, Req, SamplingParams, set_global_ctx
    from minisgl.kvcache.allocator import PageAllocator, page_slots
    from minisgl.kvcache.mha_pool import MHAKVCache

    dim, ps, cpu = 16, 4, torch.device("cpu")
    pool = MHAKVCache(1, 16, ps, 1, dim, torch.float32, cpu)
    table = torch.zeros((2, 16), dtype=torch.int32)
    backend = TorchAttnBackend(pool, table, scale=1.0, num_qo_heads=1)
    alloc = PageAllocator(16)
    for row in range(2):
        table[row] = page_slots(alloc.alloc(4), ps)
    # B's first 6 tokens are a cached prefix: their K/V are in the pool already.
    prefix = torch.arange(6)
    pool.store_kv(torch.zeros(6, 1, dim), torch.eye(dim)[prefix][:, None], table[1, :6], 0)
    greedy = SamplingParams()
    a = Req(torch.zeros(5, dtype=torch.int32), 0, 0, 1, 0, greedy)  # A: 5 new, nothing cached
    b = Req(torch.zeros(10, dtype=torch.int32), 1, 6, 1, 1, greedy)  # B: 4 new after 6 cached
    batch = Batch([a, b], "prefill")
    positions = torch.cat([torch.arange(r.cached_len, r.device_len) for r in batch.reqs])
    rows = torch.tensor([0] * 5 + [1] * 4)
    batch.positions, batch.out_loc = positions.to(torch.int32), table[rows, positions]
    backend.prepare_metadata(batch)
    ctx = Context(backend)
    set_global_ctx(ctx)
    try:
        with ctx.forward_batch(batch):
            q, k = torch.zeros(9, 1, dim), torch.zeros(9, 1, dim)
            weights = backend.forward(q, k, torch.eye(dim)[positions][:, None], 0, batch)[:, 0]
    finally:
        set_global_ctx(None)
    return weights, [a, b]


def ch04_mask(out: Path) -> Path:
    """Which keys each new token attends to, as the reference backend weighed them."""
    weights, (a, b) = attention_weights()
    fig, axes = plt.subplots(1, 2, figsize=(8.5, 3.2), gridspec_kw={"width_ratios": [5, 10]})
    for ax, (name, req, first) in zip(axes, [("A", a, 0), ("B", b, 5)]):
        n, keys = req.extend_len, req.device_len
        frame(ax, keys, n)
        for j in range(n):
            for key in range(keys):
                seen = weights[first + j, key].item() > 0
                cached = key < req.cached_len
                c = (COLORS[1] if cached else COLORS[0]) if seen else FREE
                cell(ax, key, j, "", c)
        ax.set_axis_on()
        ax.set_xticks([x + 0.5 for x in range(keys)], range(keys))
        ax.set_yticks([y + 0.5 for y in range(n)], [f"q at {req.cached_len + j}" for j in range(n)])
        ax.tick_params(length=0)
        for side in ax.spines.values():
            side.set_visible(False)
        ax.set_xlabel("key position")
        what = f"{req.cached_len} cached + {n} new" if req.cached_len else f"{n} new"
        ax.set_title(f"request {name}: {what}", fontsize=9)
    fig.text(
        0.5,
        -0.08,
        "orange: a cached key it sees, blue: a new key it sees, grey: masked",
        ha="center",
    )
    return save(fig, out, "ch04_shifted_causal_mask")


# ---- chapter 9: a request's life and its pages ---------------------------------------------

STATES = {
    "waiting": "#d9d9d9",
    "prefill": COLORS[2],
    "decode": COLORS[0],
    "running, not in this batch": "#a0cbe8",
    "preempted": COLORS[3],
}


def ch09_lives(out: Path) -> Path:
    """Four requests through the chapter 9 Scheduler with a pool of 9 pages of 4 tokens: one
    waits for pages, one is preempted and recomputed. Per step: each request's state and
    the pages it owns, and which request owns each page of the pool."""
    from minisgl.core import SamplingParams
    from minisgl.message.backend import UserMsg
    from minisgl.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer(MODEL)
    sched = cpu_scheduler(tok, "naive", num_pages=9, page_size=4)
    prompts = [("The capital of France is", 8), ("def add(a, b):", 9), ("Once upon a time", 8)]
    late = ("1, 2, 3, 4,", 5)  # arrives before step 3
    batches: list = []
    prepare = sched.engine.prepare_batch
    sched.engine.prepare_batch = lambda batch: (batches.append(batch), prepare(batch))[1]

    def submit(uid: int, text: str, n: int) -> None:
        sched.add_request(
            UserMsg(uid, tok.encode(text), SamplingParams(max_tokens=n, ignore_eos=True))
        )

    for uid, (text, n) in enumerate(prompts):
        submit(uid, text, n)
    states: list[dict[int, tuple[str, int]]] = []  # per step: uid -> (state, pages owned)
    pages: list[dict[int, int]] = []  # per step: page -> owner
    ran: set[int] = set()
    while sched.has_work:
        if len(states) == 2:
            submit(3, *late)
        sched.step()
        batch = batches[-1]
        now: dict[int, tuple[str, int]] = {}
        owner: dict[int, int] = {}
        for req in sched.reqs.values():
            own = sched.cache.host_table[req.table_idx, req.shared_len : req.alloc_len][::4] // 4
            owner.update({int(p): req.uid for p in own})
        for req in batch.reqs:
            ran.add(req.uid)
            held = sum(o == req.uid for o in owner.values()) if req.uid in sched.reqs else -1
            now[req.uid] = ("prefill" if batch.is_prefill else "decode", held)  # -1: finished
        for req in sched.reqs.values():
            if req.uid not in now:
                now[req.uid] = (
                    "running, not in this batch",
                    sum(o == req.uid for o in owner.values()),
                )
        for pending in sched.prefill.pending:
            now[pending.uid] = ("preempted" if pending.uid in ran else "waiting", 0)
        states.append(now)
        pages.append(owner)
    sched.check_integrity()
    sched.shutdown()

    steps = len(states)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5.6), gridspec_kw={"height_ratios": [4, 9]})
    frame(top, steps, 4)
    for s, now in enumerate(states):
        for uid, (state, held) in now.items():
            cell(top, s, uid, "done" if held < 0 else str(held or ""), STATES[state], fontsize=8)
    top.set_axis_on()
    top.set_yticks([u + 0.5 for u in range(4)], [f"request {u}" for u in range(4)])
    for label, color in zip(top.get_yticklabels(), OWNERS):
        label.set_color(color)  # the colour of its pages below
    top.set_xticks([])
    top.tick_params(length=0)
    for side in top.spines.values():
        side.set_visible(False)
    top.set_title("state after each step (the number: KV pages it owns)", fontsize=9)
    handles = [Rectangle((0, 0), 1, 1, color=c) for c in STATES.values()]
    top.legend(
        handles,
        list(STATES),
        ncol=5,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.02),
        frameon=False,
    )
    frame(bottom, steps, 9)
    for s, owner in enumerate(pages):
        for page in range(9):
            uid = owner.get(page)
            cell(
                bottom,
                s,
                page,
                "" if uid is None else str(uid),
                FREE if uid is None else OWNERS[uid],
            )
    bottom.set_axis_on()
    bottom.set_yticks([p + 0.5 for p in range(9)], [f"page {p}" for p in range(9)])
    bottom.set_xticks([s + 0.5 for s in range(steps)], range(1, steps + 1))
    bottom.tick_params(length=0)
    for side in bottom.spines.values():
        side.set_visible(False)
    bottom.set_xlabel("step")
    bottom.set_title("who owns each page of the pool (grey: free)", fontsize=9)
    fig.tight_layout()
    return save(fig, out, "ch09_request_lives")


# ---- chapter 11: the radix tree after each wave --------------------------------------------


def ch11_tree(out: Path) -> Path:
    """The chapter 11 example's radix run (28 pages of 4 tokens, three waves): the tree after
    each wave, each node with its pages and the most requests that held it during the wave,
    and the leaves the wave evicted."""
    from minisgl.core import SamplingParams
    from minisgl.message.backend import UserMsg
    from minisgl.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer(MODEL)
    waves, params = example_constants(
        "examples/ch11_radix_cache.py", "WAVES", "PARAMS", SamplingParams=SamplingParams
    )
    sched = cpu_scheduler(tok, "radix", num_pages=28, page_size=4)
    cache = sched.cache.cache
    keep: list = []  # every node seen, so that no id() is reused while we draw

    def label(node) -> str:
        return short(tok.decode(node.key[:8].tolist()), 20)

    evicted: list[tuple[int, int, str, int]] = []  # (id, parent id, label, pages)
    inner = cache.evict

    def evict(num_tokens: int) -> torch.Tensor:
        before = {id(n): n for n in cache._nodes() if not n.is_root}
        freed = inner(num_tokens)
        after = {id(n) for n in cache._nodes()}
        evicted.extend(
            (i, id(n.parent), label(n), len(n.key) // 4)
            for i, n in before.items()
            if i not in after
        )
        keep.extend(before.values())
        return freed

    cache.evict = evict
    panels = []
    uid = 0
    for wave in waves:
        peak: dict[int, int] = {}
        for text in wave:
            sched.add_request(UserMsg(uid, tok.encode(text), params))
            uid += 1
        while sched.has_work:
            sched.step()
            for n in cache._nodes():
                peak[id(n)] = max(peak.get(id(n), 0), n.ref_count)
        nodes = cache._nodes()
        keep.extend(nodes)
        panels.append(
            (
                [
                    (
                        id(n),
                        id(n.parent) if n.parent else None,
                        label(n),
                        len(n.key) // 4,
                        peak.get(id(n), 0),
                    )
                    for n in nodes
                ],
                list(evicted),
            )
        )
        evicted.clear()
    sched.check_integrity()
    sched.shutdown()

    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 2.9 * len(panels)))
    for n, (ax, (nodes, gone)) in enumerate(zip(axes, panels), 1):
        draw_tree(ax, nodes, gone)
        evicted = sum(g[3] for g in gone)
        title = f"after wave {n}: {evicted} page{'s' * (evicted != 1)} evicted in this wave; "
        ax.set_title(title + "ref: the most requests that held a node at once", loc="left")
    fig.tight_layout()
    return save(fig, out, "ch11_radix_tree")


def draw_tree(ax: plt.Axes, nodes: list[tuple], gone: list[tuple]) -> None:
    """nodes: (id, parent id, label, pages, refs); gone: (id, parent id, label, pages) of the
    evicted leaves, drawn dashed under their parents. Leaves side by side, parents centred."""
    root = next(i for i, parent, *_ in nodes if parent is None)
    info = {i: (parent, text, pages, refs, False) for i, parent, text, pages, refs in nodes}
    info.update({i: (parent, text, pages, 0, True) for i, parent, text, pages in gone})
    children: dict[int, list[int]] = {}
    for i, (parent, *_) in info.items():
        if parent is not None:
            children.setdefault(parent if parent in info else root, []).append(i)
    place: dict[int, tuple[float, int]] = {}
    next_leaf = [0.0]

    def lay(i: int, depth: int) -> float:
        xs = [lay(k, depth + 1) for k in sorted(children.get(i, []), key=lambda k: info[k][1])]
        if not xs:
            xs, next_leaf[0] = [next_leaf[0]], next_leaf[0] + 1
        place[i] = (sum(xs) / len(xs), depth)
        return place[i][0]

    lay(root, 0)
    ax.set_xlim(-0.6, max(x for x, _ in place.values()) + 0.6)
    ax.set_ylim(max(y for _, y in place.values()) + 0.6, -0.6)
    ax.set_axis_off()
    for i, (x, y) in place.items():
        parent, text, pages, refs, dead = info[i]
        if i == root:
            ax.text(x, y, "root", ha="center", va="center", weight="bold")
            continue
        px, py = place.get(parent, place[root])
        line = ":" if dead else "-"
        ax.plot([px, x], [py + 0.18, y - 0.22], color=MUTED, linestyle=line, zorder=0)
        edge = COLORS[3] if dead else DUMMY
        style = dict(boxstyle="round", facecolor="white" if dead else FREE, edgecolor=edge)
        style["linestyle"] = "--" if dead else "-"
        what = "evicted" if dead else f"ref {refs}"
        ax.text(
            x,
            y,
            f"{text}\n{pages} page{'s' * (pages != 1)}, {what}",
            ha="center",
            va="center",
            fontsize=7.5,
            bbox=style,
            color=COLORS[3] if dead else "black",
        )


# ---- chapter 12: the overlap timeline ------------------------------------------------------


def ch12_timeline(out: Path) -> Path:
    """The chapter 12 example's three requests, overlap off and on, with the host's time
    stamps of every launch (its forward inside) and every process."""
    from minisgl.core import SamplingParams
    from minisgl.env import ENV
    from minisgl.message.backend import UserMsg
    from minisgl.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer(MODEL)
    prompts, params = example_constants(
        "examples/ch12_overlap.py", "PROMPTS", "PARAMS", tok=tok, SamplingParams=SamplingParams
    )

    def run(overlap: bool) -> list[tuple[str, str, float, float]]:
        ENV.DISABLE_OVERLAP_SCHEDULING.value = not overlap
        sched = cpu_scheduler(tok, "naive", num_pages=128)
        spans: list[tuple[str, str, float, float]] = []  # (what, batch, start, end)
        names: dict[int, str] = {}  # id of an InFlight -> its batch's name

        def timed(what: str, fn: Callable, name: Callable) -> Callable:
            def wrapper(arg):
                start = time.perf_counter()
                result = fn(arg)
                spans.append((what, name(arg, result), start, time.perf_counter()))
                return result

            return wrapper

        def launched(batch, flight):
            names[id(flight)] = f"B{sum(s[0] == 'launch' for s in spans) + 1}"
            return names[id(flight)]

        sched.launch = timed("launch", sched.launch, launched)
        forward = sched.engine.forward_batch
        sched.engine.forward_batch = timed("forward", forward, lambda b, r: "")
        sched.process = timed("process", sched.process, lambda f, r: names[id(f)])
        for uid, text in enumerate(prompts):
            sched.add_request(UserMsg(uid, tok.encode(text), params))
        while sched.has_work:
            sched.step()
        sched.shutdown()
        t0 = min(s[2] for s in spans)
        return [(w, b, s - t0, e - t0) for w, b, s, e in spans]

    run(False)  # the process's first forwards warm torch up; time neither mode with them
    runs = {"overlap off": run(False), "overlap on": run(True)}
    ENV.DISABLE_OVERLAP_SCHEDULING.value = None

    total = max(e for spans in runs.values() for *_, e in spans)
    fig, axes = plt.subplots(2, 1, figsize=(10, 3.6), sharex=True)
    colors = {"launch": COLORS[0], "forward": "#a0cbe8", "process": COLORS[1]}
    order = {"launch": 0, "forward": 1, "process": 2}  # a forward is drawn inside its launch
    for ax, (title, spans) in zip(axes, runs.items()):
        for what, name, start, end in sorted(spans, key=lambda s: order[s[0]]):
            y, h = {"launch": (0.3, 0.6), "forward": (0.4, 0.4), "process": (0.3, 0.6)}[what]
            width = max(end - start, total / 300)  # a process is under a millisecond: a tick
            bar = Rectangle((start, y), width, h, facecolor=colors[what], edgecolor="none")
            ax.add_patch(bar)
            if what == "launch":
                ax.text(start + 0.004 * total, 0.95, f"launch {name}", va="bottom", fontsize=7)
            elif what == "process":
                ax.text(
                    start,
                    0.24 - 0.13 * (int(name[1:]) % 2),
                    f"{name} out",
                    ha="center",
                    va="top",
                    fontsize=7,
                    color=COLORS[1],
                )
        ax.set_ylim(-0.1, 1.25)
        ax.set_yticks([])
        ax.set_title(f"{title}: the host's time line", fontsize=9, loc="left")
        for side in ("top", "right", "left"):
            ax.spines[side].set_visible(False)
    axes[1].set_xlim(0, total)
    axes[1].set_xlabel("seconds since the first launch (measured on the CPU)")
    handles = [Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    labels = [
        "launch Bn: schedule, pages, metadata, then",
        "its forward (on a CPU, host work too)",
        "process Bn: its tokens out (drawn as a tick)",
    ]
    axes[1].legend(
        handles, labels, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.5), frameon=False
    )
    return save(fig, out, "ch12_overlap_timeline")


# ---- chapter 18: a batch of 3 padded to a graph of 4 ---------------------------------------


def ch18_padding(out: Path) -> Path:
    """The chapter 18 example's first replay: three live requests in the graph of batch 4,
    the fourth slot filled by the dummy request, whose K/V goes to the dummy page."""
    from minisgl.core import SamplingParams
    from minisgl.env import ENV
    from minisgl.llm import LLM

    ENV.DISABLE_OVERLAP_SCHEDULING.value = True
    prompts, kw = example_constants("examples/ch18_cuda_graph.py", "PROMPTS", "KW", torch=torch)
    llm = LLM(MODEL, cuda_graph_max_bs=4, **kw)
    runner, seen = llm.engine.graph_runner, {}
    replay = runner.replay

    def record(batch):
        logits = replay(batch)
        if not seen:
            buf = runner.buffer
            seen.update(
                uids=[r.uid for r in batch.padded_reqs],
                size=batch.size,
                ids=buf.input_ids[: batch.padded_size].tolist(),
                pos=buf.positions[: batch.padded_size].tolist(),
                loc=buf.out_loc[: batch.padded_size].tolist(),
                rows=len(logits),
                top=buf.logits[: batch.padded_size].argmax(-1).tolist(),
            )
        return logits

    runner.replay = record
    llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    dummy_page, ps = llm.engine.kv_cache.dummy_page, llm.engine.page_size
    dummy_uid = llm.engine.dummy_req.uid
    tok = llm.tokenizer
    llm.shutdown()
    ENV.DISABLE_OVERLAP_SCHEDULING.value = None

    slots = len(seen["uids"])
    fig, ax = plt.subplots(figsize=(9, 3.6))
    frame(ax, slots * 2 + 2.4, 7.4)
    rows = ["request", "input id", "position", "out_loc (KV slot)", "logits row"]
    for r, title in enumerate(rows):
        ax.text(2.2, r * 1.25 + 0.5, title, ha="right", va="center")
    for s, uid in enumerate(seen["uids"]):
        real = s < seen["size"]
        x, c = 2.4 + s * 2, COLORS[s] if real else DUMMY
        page = seen["loc"][s] // ps
        values = [
            f"request {uid}" if real else f"dummy (uid {dummy_uid})",
            f"{seen['ids'][s]} {short(tok.decode([seen['ids'][s]]), 8)}",
            str(seen["pos"][s]),
            f"{seen['loc'][s]} (page {page})",
            f"-> {short(tok.decode([seen['top'][s]]), 8)}" if real else "dropped",
        ]
        for r, value in enumerate(values):
            cell(ax, x, r * 1.25, value, c if r != 4 or real else FREE, w=1.9, fontsize=8)
    ax.text(
        2.4,
        6.6,
        f"graph of batch {slots}, live batch {seen['size']}: the dummy request's "
        f"K/V goes to page {dummy_page}, the dummy page; the replay returns {seen['rows']} of "
        f"the {slots} logits rows",
        fontsize=8,
    )
    return save(fig, out, "ch18_padded_batch")


# ---- chapter 26: a verify batch and its logits rows ----------------------------------------


def ch26_verify(out: Path) -> Path:
    """A verify step of the chapter 26 example (n-gram drafts, emulated verify graphs): the
    front-packed tokens, padded to the graph's tier, and what each logits row decided."""
    import minisgl.speculative.verify as spec_verify
    from minisgl.core import SamplingParams
    from minisgl.env import ENV
    from minisgl.llm import LLM

    ENV.DISABLE_OVERLAP_SCHEDULING.value = True
    prompts, kw, params = example_constants(
        "examples/ch26_speculative.py",
        "PROMPTS",
        "KW",
        "PARAMS",
        torch=torch,
        SamplingParams=SamplingParams,
    )
    kw.update(speculative="ngram", speculative_always=True)
    llm = LLM(MODEL, cuda_graph_max_bs=4, **kw)  # the example's last run
    steps: list[dict] = []
    accept, replay = spec_verify.accept_drafts, llm.engine.graph_runner.replay
    tier: list[int] = []

    def record_replay(batch):
        if batch.phase == "verify":
            tier.append(len(batch.input_ids))
        return replay(batch)

    def record(logits, reqs, drafts, pool):
        accepted, final = accept(logits, reqs, drafts, pool)
        steps.append(
            dict(
                uids=[r.uid for r in reqs],
                drafts=drafts,
                tier=tier.pop() if tier else 0,
                last=[int(pool[r.table_idx, r.cached_len]) for r in reqs],
                top=logits.argmax(-1).tolist(),
                accepted=accepted.tolist(),
            )
        )
        return accepted, final

    spec_verify.accept_drafts, llm.engine.graph_runner.replay = record, record_replay
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        spec_verify.accept_drafts = accept
    tok = llm.tokenizer
    llm.shutdown()
    ENV.DISABLE_OVERLAP_SCHEDULING.value = None

    # The step with the most requests, then drafts, that had a rejection.
    # The step that shows most: drafts partly taken, then most requests drafting, most drafts.
    def shows(s: dict) -> tuple[int, int, int]:
        pairs = list(zip(s["accepted"], map(len, s["drafts"])))
        return (
            any(0 < a < k for a, k in pairs),
            sum(k > 0 for _, k in pairs),
            sum(k for _, k in pairs),
        )

    step = max(steps, key=shows)
    step["tier"] = max(step["tier"], sum(1 + len(d) for d in step["drafts"]))  # eager: no padding

    real = sum(1 + len(d) for d in step["drafts"])
    width = real * 1.2 + 1.8 + (2.4 if step["tier"] > real else 0)
    fig, ax = plt.subplots(figsize=(width * 0.72, 3.3))
    frame(ax, width, 5.9)
    ax.text(1.6, 0.5, "token", ha="right", va="center")
    ax.text(1.6, 1.75, "its logits row\npredicts", ha="right", va="center")
    ax.text(1.6, 3.0, "verdict", ha="right", va="center")
    x, row = 1.8, 0
    for i, (uid, last, draft, acc) in enumerate(
        zip(step["uids"], step["last"], step["drafts"], step["accepted"])
    ):
        tokens = [last, *draft]
        for j, token in enumerate(tokens):
            kept = j <= acc  # the last token and the accepted drafts are the request's now
            name = "last" if j == 0 else f"d{j}"
            cell(
                ax,
                x,
                0,
                f"{name} {short(tok.decode([token]), 7)}",
                COLORS[i] if kept else MUTED,
                w=1.15,
                fontsize=7,
            )
            cell(ax, x, 1.25, short(tok.decode([step["top"][row]]), 8), FREE, w=1.15, fontsize=7)
            if j < acc:
                verdict = f"d{j + 1} ok"
            elif j == acc:
                verdict = "the model's" if j == len(draft) else f"d{j + 1} no:\nthe model's"
            else:
                verdict = "after a\nrejection"
            cell(ax, x, 2.5, verdict, COLORS[i] if j <= acc else FREE, w=1.15, fontsize=7)
            x, row = x + 1.2, row + 1
        ax.text(
            x - 1.2 * len(tokens) + 0.05,
            3.9,
            f"request {uid}:\n{len(draft)} drafts,\n{acc} taken",
            fontsize=7.5,
            va="top",
        )
    if step["tier"] > real:
        cell(ax, x, 0, f"filler: {step['tier'] - real} tokens", DUMMY, w=2.35, fontsize=7)
        cell(ax, x, 1.25, f"{step['tier'] - real} rows\nthrown away", FREE, w=2.35, fontsize=7)
    ax.text(
        1.8,
        5.5,
        f"one verify forward of {row} tokens, packed front to back and padded to "
        f"the {step['tier']}-token graph by a filler request in the dummy row",
        fontsize=8,
    )
    return save(fig, out, "ch26_verify_batch")


# ---- chapter 29: a Gemma 4 pool's layer groups, and its windowed pages over a run ----------


def windowed_run() -> tuple[Any, int, int, list[dict]]:
    """A tiny random Gemma 4 shaped like E2B (the chapter 29 example's `gemma4` fields: 4
    sliding layers of window 8, a full one, then 5 that read their keys) through the
    Scheduler with the windowed pool, pages of 4, on the CPU: request 0's 20-token prompt in
    two chunks, then request 1 from step 7, both decoding well past the window. Returns the
    layout, the page size, the windowed pool's pages and, after every step, the full and
    windowed pages in use and each running request's tokens with keys in the pool."""
    import tempfile

    from transformers import AutoModelForCausalLM, Gemma4TextConfig

    from minisgl.core import SamplingParams
    from minisgl.env import ENV
    from minisgl.kvcache.layout import KVLayout
    from minisgl.message.backend import UserMsg
    from minisgl.scheduler.config import SchedulerConfig
    from minisgl.scheduler.scheduler import Scheduler

    [gemma4] = example_constants("examples/ch29_model_families.py", "gemma4", torch=torch)
    text = gemma4(10, 5, 1, None, 5, 8)["text_config"]  # E2B: gemma4(35, 5, 1, None, 20, 512)
    text.update(head_dim=16, global_head_dim=32)  # E2B's 256 and 512, scaled down
    config = Gemma4TextConfig(
        **text, vocab_size=256, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=256, bos_token_id=1,
        eos_token_id=2, pad_token_id=0, architectures=["Gemma4ForCausalLM"],
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (20, 12)]
    ENV.DISABLE_OVERLAP_SCHEDULING.value = True  # each step's state is the step's own
    steps: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp)
        sched = Scheduler(
            SchedulerConfig(
                tmp, dtype=torch.float32, device="cpu", max_running_req=2, page_size=4,
                num_page_override=64, max_seq_len_override=128, max_prefill_length=16,
                cache_type="naive", cuda_graph_max_bs=0,
            ),
            {config.eos_token_id},
        )  # fmt: skip
        cm, pool = sched.cache, sched.engine.kv_cache
        layout = KVLayout.of(sched.engine.model_config, sched.engine.max_seq_len)

        def submit(uid: int, n: int) -> None:
            params = SamplingParams(max_tokens=n, ignore_eos=True)
            sched.add_request(UserMsg(uid, prompts[uid], params))

        submit(0, 56)
        while sched.has_work:
            if len(steps) == 6:
                submit(1, 36)
            sched.step()
            sched.check_integrity()
            steps.append(
                dict(
                    full=cm.num_pages - cm.allocator.num_free,
                    windowed=pool.num_window_pages - cm.window_free,
                    tokens={r.uid: r.cached_len for r in sched.reqs.values()},
                )
            )
        sched.shutdown()
    ENV.DISABLE_OVERLAP_SCHEDULING.value = None
    return layout, cm.page_size, pool.num_window_pages, steps


def ch29_pages(out: Path) -> Path:
    """Left, which layer keeps its keys in which group of the pool (or reads another's) and
    what a token costs each group; right, the pages in use after every step of a run: the
    full pages grow with the sequences, the windowed ones stay at the window's few."""
    layout, ps, window_pages, steps = windowed_run()
    dtype = torch.float32
    shared = dict(layout.shared)
    layers = len(layout.every_layer)
    group_of = {layer: g for g, group in enumerate(layout.groups) for layer in group.layers}
    color = [COLORS[0] if g.window else COLORS[1] for g in layout.groups]
    [slide] = [g for g, group in enumerate(layout.groups) if group.window]  # E2B: one of each
    [whole] = [g for g, group in enumerate(layout.groups) if not group.window]

    fig = plt.figure(figsize=(10, 4.4))
    grid = fig.add_gridspec(2, 2, width_ratios=[1, 1.4], height_ratios=[1, 2], wspace=0.3)
    ax = fig.add_subplot(grid[:, 0])
    frame(ax, 6.2, layers + 5.4)
    ax.text(0, -0.3, "the pool's groups, a row per layer", weight="bold")
    for layer in range(layers):
        heads, dim = layout.every_layer[layer]
        ax.text(1.25, layer + 0.5, f"layer {layer}", ha="right", va="center")
        if layer in shared:
            src = shared[layer]
            what = f"reads layer {src}'s keys: stores none"
            cell(ax, 1.4, layer, "", FREE, w=4.6)
            ax.text(3.7, layer + 0.5, what, ha="center", va="center", fontsize=7.5,
                    color=color[group_of[src]])  # fmt: skip
            continue
        group = layout.groups[group_of[layer]]
        kind = f"sliding, window {group.window}" if group.window else "full"
        what = f"group {group_of[layer]}: {kind}, {heads} x {dim}"
        cell(ax, 1.4, layer, what, color[group_of[layer]], w=4.6, fontsize=7.5)
    for g, group in enumerate(layout.groups):
        pages = "windowed pages: its last window" if group.window else "full pages: every token"
        first, last, n = group.layers[0], group.layers[-1], len(group.layers)
        span = f"layers {first}-{last}" if last > first else f"layer {first}"
        ax.text(
            0,
            layers + 0.7 + 1.9 * g,
            f"group {g} ({span}): {n} layer{'s' * (n > 1)} x {group.kv_heads} KV head x "
            f"{group.head_dim} x K,V\n= {group.bytes_per_token(dtype):,} B a token (fp32), "
            f"kept in\n{pages}",
            va="top",
            fontsize=7.5,
            color=color[g],
        )
    ax.text(0, layers + 4.6, f"KV-shared layers {min(shared)}-{max(shared)}: 0 B", va="top",
            fontsize=7.5)  # fmt: skip

    x = range(1, len(steps) + 1)
    top = fig.add_subplot(grid[0, 1])
    for uid in sorted({u for s in steps for u in s["tokens"]}):
        y = [s["tokens"].get(uid, float("nan")) for s in steps]
        top.plot(x, y, color=OWNERS[1 + uid], label=f"request {uid}")
    top.axhline(layout.window, color=MUTED, linestyle=":", linewidth=1)
    top.text(len(steps), layout.window + 2, "the window", ha="right", fontsize=7, color="#777777")
    top.set_ylabel("tokens in\nthe pool", fontsize=8)
    top.set_title("a run: tokens of each sequence, pages in use after every step", fontsize=9)
    top.legend(fontsize=7, frameon=False, loc="upper left")
    top.tick_params(labelbottom=False)
    bottom = fig.add_subplot(grid[1, 1], sharex=top)
    full = [s["full"] for s in steps]
    windowed = [s["windowed"] for s in steps]
    kib = [ps * g.bytes_per_token(dtype) / 1024 for g in layout.groups]
    bottom.step(x, full, where="post", color=color[whole],
                label=f"full pages ({kib[whole]:g} KiB each)")  # fmt: skip
    bottom.step(x, windowed, where="post", color=color[slide],
                label=f"windowed pages ({kib[slide]:g} KiB each)")  # fmt: skip
    bottom.axhline(window_pages, color=color[slide], linestyle=":", linewidth=1)
    bottom.text(1, window_pages + 0.5, f"the windowed pool: {window_pages} pages", fontsize=7,
                color=color[slide])  # fmt: skip
    bottom.set_ylabel(f"pages of {ps} tokens", fontsize=8)
    bottom.set_xlabel("step")
    bottom.legend(fontsize=7, frameon=False, loc="lower right", bbox_to_anchor=(1, 0.3))
    for a in (top, bottom):
        a.spines[["top", "right"]].set_visible(False)
        a.tick_params(labelsize=7)
    return save(fig, out, "ch29_window_pages")


# ---- chapter 31: what the prefix cache serves a hybrid model, turn by turn ----------------


def ch31_state(out: Path) -> Path:
    """The chapter 31 example's chat, run with its own code: per turn, the prompt tokens the
    model computed and those the cache served, for the hybrid with state snapshots, the
    hybrid with the naive cache and the attention-only model."""
    import importlib.util
    import tempfile

    spec = importlib.util.spec_from_file_location("ch31_state", "examples/ch31_state.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)  # its main() does not run: only the functions load
    with tempfile.TemporaryDirectory() as tmp:
        results = example.runs(Path(tmp))
    turns = len(next(iter(results.values())))
    fig, ax = plt.subplots(figsize=(8, 3.4))
    width = 0.26
    for k, (name, run) in enumerate(results.items()):
        x = [t + (k - 1) * width for t in range(turns)]
        served = [r["cached"] for r in run]
        computed = [r["prompt"] - r["cached"] for r in run]
        ax.bar(x, served, width * 0.92, color=COLORS[k], label=f"{name}: served from the cache")
        ax.bar(x, computed, width * 0.92, bottom=served, color=COLORS[k], alpha=0.3,
               hatch="//", edgecolor="white")  # fmt: skip
        for xi, s, c in zip(x, served, computed):
            ax.text(xi, s + c + 3, f"{s}", ha="center", fontsize=7)
    ax.bar([0], [0], color=MUTED, alpha=0.3, hatch="//", label="computed (light)")
    ax.set_xticks(range(turns), [f"turn {t + 1}" for t in range(turns)])
    ax.set_ylabel("prompt tokens (all conversations)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    ax.set_title("a hybrid's cached prefix is usable where a state snapshot ends it", fontsize=9)
    return save(fig, out, "ch31_prefix_hits")


FIGURES: dict[str, Callable[[Path], Path]] = {
    "ch03": ch03_pool,
    "ch04": ch04_mask,
    "ch09": ch09_lives,
    "ch11": ch11_tree,
    "ch12": ch12_timeline,
    "ch18": ch18_padding,
    "ch26": ch26_verify,
    "ch29": ch29_pages,
    "ch31": ch31_state,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="+", default=[], choices=sorted(FIGURES), metavar="CHAPTER")
    ap.add_argument("--out", type=Path, default=Path("docs/figures"))
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    for chapter, draw in FIGURES.items():
        if args.only and chapter not in args.only:
            continue
        start = time.perf_counter()
        path = draw(args.out)
        took = time.perf_counter() - start
        print(f"{chapter}: {path} ({path.stat().st_size // 1024} KiB, {took:.1f}s)")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
