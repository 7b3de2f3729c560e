"""Shared test helpers: model paths, Hugging Face references, a bare engine driver, the
one way the tests start a server (`serving`, or `launch` and `stop` where a test must hold the
process itself), and what the tests of several chapters share: a chapter's tree holds its
own chapter's tests only, so a test module imports nothing from another chapter's."""

from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

# >>> ch07 the engine driver
from minisgl.core import Batch, Req, SamplingParams
from minisgl.engine.config import EngineConfig
from minisgl.engine.engine import Engine
from minisgl.kvcache.allocator import PageAllocator, page_slots

# <<< ch07

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"
SMOL = MODELS / "SmolLM2-135M-Instruct"
TINY = {name: MODELS / f"tiny-{name}" for name in ("llama", "qwen2", "qwen3", "qwen3-moe")}


def need(path: Path) -> Path:
    if not (path / "config.json").is_file():
        pytest.fail(f"{path} is missing: run `make models`")
    return path


def run_tool(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """tools/<script> as a command, on this interpreter. Its torch threads follow
    OMP_NUM_THREADS, which conftest.py sets for this process and so for its children."""
    cmd = [sys.executable, str(ROOT / "tools" / script), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@functools.cache
def hf_model(path: Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@functools.cache
def tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def hf_logits(path: Path, ids: list[int]) -> torch.Tensor:
    """Teacher-forced logits [len(ids), vocab] in fp32 from Hugging Face."""
    with torch.no_grad():
        return hf_model(path)(torch.tensor([ids])).logits[0].float()


def hf_greedy(path: Path, ids: list[int], max_new_tokens: int) -> list[int]:
    return list(_hf_greedy(path, tuple(ids), max_new_tokens))


@functools.cache
def _hf_greedy(path: Path, ids: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    model = hf_model(path)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return tuple(out[0, len(ids) :].tolist())


# >>> ch07 the engine driver
def all_logits(engine: Engine, reqs: list[Req], phase: str) -> torch.Tensor:
    """Logits at every new position of the batch (the LM head normally keeps only the last)."""
    batch = Batch(reqs, phase)  # type: ignore[arg-type]
    new_tokens = sum(r.extend_len for r in reqs)
    engine.prepare_batch(batch)  # may pad the batch for a graph: its tokens come first
    batch.logit_rows = torch.arange(new_tokens)  # every row: a model may skip others  # [ch29]
    with torch.inference_mode(), engine.ctx.forward_batch(batch):
        logits = engine.model.lm_head.project(engine.model.model(batch.input_ids))
    for req in reqs:
        req.complete_one()
    return logits[:new_tokens]


def make_engine(path: Path, **kw) -> Engine:
    kw.setdefault("dtype", torch.float32)
    kw.setdefault("device", "cpu")
    kw.setdefault("num_page_override", 256)
    kw.setdefault("max_running_req", 8)
    return Engine(EngineConfig(str(path), **kw))


class Driver:
    """Runs a fixed set of requests to completion on a bare Engine: the smallest scheduler.

    Each request gets a page-table row and, up front, every page it can ever need.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.pages = PageAllocator(engine.num_pages)
        self.owned: dict[int, list[int]] = {}
        # >>> ch29 a pool with windowed pages: one for each page, up front too
        self.window_pages = PageAllocator(getattr(engine.kv_cache, "num_window_pages", 0))
        self.window_owned: dict[int, list[int]] = {}
        # <<< ch29

    def add(self, ids: list[int], params: SamplingParams, row: int) -> Req:
        e = self.engine
        req = Req(torch.tensor(ids, dtype=torch.int32), row, 0, params.max_tokens, row, params)
        pages = self.pages.alloc(-(-req.max_device_len // e.page_size))
        self.owned[row] = pages
        slots = page_slots(pages, e.page_size)
        e.page_table[row, : len(slots)] = slots
        e.token_pool[row, : len(ids)] = req.input_ids
        # >>> ch29
        if self.window_pages.num_pages:
            window = self.window_owned[row] = self.window_pages.alloc(len(pages))
            e.kv_cache.window_map[pages] = torch.tensor(window, dtype=torch.int32)
            e.kv_cache.window_table[row, : len(slots)] = page_slots(window, e.page_size)
        # <<< ch29
        return req

    def release(self, req: Req) -> None:
        self.pages.free(self.owned.pop(req.table_idx))
        if self.window_pages.num_pages:  # [ch29]
            self.window_pages.free(self.window_owned.pop(req.table_idx))  # [ch29]

    def step(self, reqs: list[Req], phase: str) -> list[int]:
        batch = Batch(reqs, phase)  # type: ignore[arg-type]
        self.engine.prepare_batch(batch)
        out = self.engine.forward_batch(batch)
        tokens = out.next_tokens_cpu.tolist()
        for req, token in zip(reqs, tokens):
            req.complete_one()
            req.append_host(token)
        return tokens

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        reqs = [self.add(ids, params, row) for row, ids in enumerate(prompts)]
        outputs: list[list[int]] = [[] for _ in reqs]
        running = list(range(len(reqs)))
        phase = "prefill"
        while running:
            tokens = self.step([reqs[i] for i in running], phase)
            for i, token in zip(running, tokens):
                outputs[i].append(token)
            for i in list(running):
                if len(outputs[i]) >= params.max_tokens:
                    running.remove(i)
                    self.release(reqs[i])
            phase = "decode"
        return outputs


# <<< ch07


# >>> ch16 servers: `python -m minisgl` in a process of its own
try:
    import httpx
except ModuleNotFoundError:  # the openai client may come with the httpx2 fork instead
    import httpx2 as httpx

CPU = ("--device", "cpu", "--dtype", "float32")  # the flags of most servers the tests start
CONTEXT = 256  # SMOL_CPU's --max-seq-len-override: a too-long prompt is cheap to write
SMOL_CPU = (*CPU, "--max-seq-len-override", str(CONTEXT))  # the API tests' server on SmolLM2
TOOLS_CPU = (*CPU, "--max-seq-len-override", "1024")  # room for a tool list's ~200 tokens
MODEL = SMOL.name  # the name SmolLM2 is served under: its folder's
START_TIMEOUT = 180.0  # loading a model on a busy two-core machine


@dataclass
class Server:
    """A process the tests started, the base URL it answers on, and the file its output goes to."""

    proc: subprocess.Popen
    base: str
    log: Path
    metrics: str = ""  # a router's Prometheus page
    events: str = ""  # a worker's KV-event endpoint, where it publishes them
    workers: list[int] = field(default_factory=list)  # its processes once ready; see `stop`

    @property
    def port(self) -> int:
        return int(self.base.rsplit(":", 1)[1])

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(cmd: list[str], log: Path, port: int) -> Server:
    """Start `cmd`, which will answer on `port`, with its output in `log`. One torch thread,
    and a session of its own: a SIGINT to its process group is a terminal's Ctrl-C, and no
    signal meant for pytest reaches it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    return Server(proc, f"http://127.0.0.1:{port}", log)


def launch(log_dir: Path, *args: str, model: Path = SMOL, port: int | None = None) -> Server:
    """`python -m minisgl --model MODEL --port PORT *args`, not waited for (see `wait_ready`);
    its log is LOG_DIR/server-PORT.log."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "minisgl", "--model", str(need(model)), "--port", str(port)]
    return spawn([*cmd, *args], log_dir / f"server-{port}.log", port)


def wait_ready(server: Server, path: str = "/health", timeout: float = START_TIMEOUT) -> str:
    """Wait until `path` answers 200; the base URL. Fails the test, with the log's tail, if
    the process exits first or takes longer than `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            pytest.fail(f"{server.base} exited with {server.proc.returncode}:\n{server.tail()}")
        try:
            if httpx.get(server.base + path, timeout=2).status_code == 200:
                server.workers = descendants(server.proc.pid)
                return server.base
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    pytest.fail(f"{server.base}{path} did not answer 200 in {timeout:.0f} s:\n{server.tail()}")


def descendants(pid: int) -> list[int]:
    """Every process under `pid` (children, their children, ...), from /proc."""
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for children in Path(f"/proc/{parent}/task").glob("*/children"):
            try:
                kids = [int(k) for k in children.read_text().split()]
            except OSError:  # the thread or the process just went
                continue
            out += kids
            todo += kids
    return out


def alive(pid: int) -> bool:
    """Running; a zombie counts as gone (a container's init may never reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait up to `timeout` for the processes to end; those still running."""
    deadline = time.monotonic() + timeout
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def titles(pids: list[int]) -> list[str]:
    """The process titles (minisgl::scheduler, ...) of `pids`."""
    return [Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[0].decode() for p in pids]


def stop(server: Server, timeout: float = 20) -> bool:
    """End the server whatever state a test left it in: SIGTERM (it drains and stops its
    workers), SIGKILL after `timeout`, then SIGKILL to any process of it still running.
    Whether it ended by itself: exited within `timeout` of SIGTERM, leaving no process."""
    tree = [*server.workers, *descendants(server.proc.pid)]  # workers outlive a killed parent
    clean = True
    if server.proc.poll() is None:
        server.proc.terminate()
        try:
            server.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()
            clean = False
    for pid in wait_gone(tree, 5):
        os.kill(pid, signal.SIGKILL)
        clean = False
    return clean


@contextmanager
def serving(
    log_dir: Path, *args: str, model: Path = SMOL, path: str = "/health"
) -> Iterator[Server]:
    """A server (see `launch`), ready; at the end stopped, and checked to have stopped by
    itself when the test left it running."""
    server = launch(log_dir, *args, model=model)
    try:
        wait_ready(server, path)
        yield server
    except BaseException:
        stop(server)
        raise
    running = server.proc.poll() is None
    assert stop(server) or not running, f"the server did not stop on SIGTERM:\n{server.tail()}"


def socket_paths(pid: int) -> dict[str, set[str]]:
    """Paths of the unix sockets a process holds (zmq's ipc:// endpoints), by path."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    paths: dict[str, set[str]] = {}
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and fields[6] in inodes:
            paths.setdefault(fields[7], set()).add(fields[6])
    return paths


def ipc_dir(pid: int) -> Path:
    """The private socket folder of the server whose launcher is `pid`."""
    dirs = {Path(p).parent for p in socket_paths(pid) if Path(p).parent.name.startswith("minisgl-")}
    assert len(dirs) == 1, f"expected one minisgl-* socket folder, found {dirs}"
    return dirs.pop()


def metrics(server: Server) -> dict[str, float]:
    """The server's /metrics, series (labels included) -> value."""
    text = httpx.get(server.base + "/metrics", timeout=10).text
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def wait_idle(server: Server, timeout: float = 30.0) -> dict[str, float]:
    """Poll /metrics until nothing runs and no KV page is held; returns the last sample."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        idle = m["minisgl:num_requests_running"] == 0 and m["minisgl:kv_pages_used"] == 0
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.25)


def check_error(r: httpx.Response, status: int) -> dict[str, Any]:
    """An error in OpenAI's shape, with the status expected; its `error` object."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    return err


# <<< ch16


# >>> ch20 our elementwise kernels, and how close to the torch references they must come
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def assert_ulps(got: torch.Tensor, want: torch.Tensor) -> None:
    """got equals want to one unit in the last place of want's dtype, and in fp16 (and bf16
    on a GPU) nearly everywhere to the bit: a rounding step left out or taken in another
    order changes a quarter of the values by one unit. bf16 in the interpreter truncates
    each rounding: three units. fp32 rounds nothing lower, but the sum and rsqrt differ."""
    assert got.dtype == want.dtype and got.shape == want.shape
    exact = want.dtype == torch.float16 or (want.dtype == torch.bfloat16 and DEV.type == "cuda")
    most = {torch.float32: 16, torch.float16: 1}.get(want.dtype, 1 if exact else 3)
    info = torch.finfo(want.dtype)
    w = want.detach().float()
    ulp = info.eps * torch.exp2(torch.floor(torch.log2(w.abs().clamp_min(info.tiny))))
    off = ((got.float() - w).abs() / ulp).max().item()
    assert off <= most, f"{off} units in the last place apart"
    same = (got == want).float().mean().item()
    assert not exact or same >= 0.95, f"only {same:.1%} of the values equal to the bit"


def ours_only(dtype: torch.dtype):
    """A KernelPlan with our elementwise kernels and nothing else, for CPU tensors too."""
    from minisgl.kernels import elementwise
    from minisgl.layers.kernel_plan import KernelPlan

    return KernelPlan(dtype, True, None, elementwise, None, None, None)


# <<< ch20


# >>> ch21 ranks as processes
def two_ranks(target: Any, *args: Any, results: int, timeout: float = 300) -> dict:
    """Run `target(*args, rank, queue)` as ranks 0 and 1; the (key, value) pairs they put."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    ranks = [ctx.Process(target=target, args=(*args, r, queue)) for r in (0, 1)]
    for p in ranks:
        p.start()
    try:
        got = dict(queue.get(timeout=timeout) for _ in range(results))
    finally:
        for p in ranks:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in ranks] == [0, 0]
    return got


# <<< ch21


# >>> ch26 drafts that verify steps accept in part
def oracle_drafter(prompts: list[list[int]], want: list[list[int]], vocab: int = 1000):
    """Drafts from a plain run's own output, up to 3, the second one wrong every third step:
    verify steps that accept all, some and none of their drafts."""

    def draft(req: Req, k: int) -> list[int]:
        ids = req.input_ids.tolist()
        i = next(i for i, p in enumerate(prompts) if ids[: len(p)] == p)
        done = len(ids) - len(prompts[i])
        tokens = want[i][done : done + min(3, k)]
        if done % 3 == 0 and len(tokens) > 1:
            tokens[1] = (tokens[1] + 1) % vocab  # the model will not agree with this one
        return tokens

    return lambda self, reqs, ks: [draft(r, k) if k > 0 else [] for r, k in zip(reqs, ks)]


def pending_oracle(prompts: list[list[int]], want: list[list[int]], spoil):
    """Drafts from a plain run's own output after the host's tokens and any pending ones (a
    verify's in flight), up to k, passed through `spoil(done, tokens)` to make some wrong."""

    def draft(req: Req, k: int, pending: list[int]) -> list[int]:
        ids = req.input_ids.tolist() + pending
        i = next(i for i, p in enumerate(prompts) if ids[: len(p)] == p)
        done = len(ids) - len(prompts[i])
        return spoil(done, want[i][done : done + k])

    def propose(self, reqs, ks, pending=None):
        extra = pending or [[] for _ in reqs]
        return [draft(r, k, p) if k > 0 else [] for r, k, p in zip(reqs, ks, extra)]

    return propose


def ahead_oracle(prompts: list[list[int]], want: list[list[int]], vocab: int = 1000):
    """Now and then the last draft (a verify's guess of its own token, where verifies go
    ahead) wrong, and now and then the second."""

    def spoil(done: int, tokens: list[int]) -> list[int]:
        if done % 4 == 1 and tokens:
            tokens[-1] = (tokens[-1] + 1) % vocab
        if done % 5 == 2 and len(tokens) > 2:
            tokens[1] = (tokens[1] + 1) % vocab
        return tokens

    return pending_oracle(prompts, want, spoil)


def behind_oracle(prompts: list[list[int]], want: list[list[int]], vocab: int = 1000):
    """No drafts every fourth token, so plain steps come between verifies and the next verify
    may be launched behind one; every third the first one wrong, which is, behind a plain
    step, the guess of that step's token."""

    def spoil(done: int, tokens: list[int]) -> list[int]:
        if done % 4 == 3:
            return []
        if done % 3 == 0 and tokens:
            tokens[0] = (tokens[0] + 1) % vocab
        return tokens

    return pending_oracle(prompts, want, spoil)


# <<< ch26


# >>> ch29 tiny random models whose sliding layers keep a windowed pool (window_pages.py)
WINDOWED_VOCAB = 256


def windowed_configs() -> dict[str, Any]:
    """Gemma 4 shaped like E2B (sliding, full and KV-shared layers, window 8), Gemma 3 (a
    sliding and a full layer of one shape, window 12) and Mistral (every layer slides,
    window 8)."""
    from transformers import Gemma3TextConfig, Gemma4TextConfig, MistralConfig

    S, F = "sliding_attention", "full_attention"
    small = dict(vocab_size=WINDOWED_VOCAB, hidden_size=32, intermediate_size=64, bos_token_id=1,
                 max_position_embeddings=128, eos_token_id=2, pad_token_id=0)  # fmt: skip
    return {
        "gemma4": Gemma4TextConfig(
            **small, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
            head_dim=16, global_head_dim=32, layer_types=[S, S, F] * 2, sliding_window=8,
            num_kv_shared_layers=2, hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=WINDOWED_VOCAB, final_logit_softcapping=30.0,
            architectures=["Gemma4ForCausalLM"],
        ),
        "gemma3": Gemma3TextConfig(
            **small, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, sliding_window=12, query_pre_attn_scalar=24, layer_types=[S, F],
            architectures=["Gemma3ForCausalLM"],
        ),
        "mistral": MistralConfig(
            **small, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            sliding_window=8, architectures=["MistralForCausalLM"],
        ),
    }  # fmt: skip


def windowed_models(root: Path) -> dict[str, Path]:
    """The three models of `windowed_configs`, seed 0, fp32, every weight random (norms
    included), with the tiny Llama's tokenizer, saved under ROOT; name -> folder."""
    from transformers import AutoModelForCausalLM

    tok, out = need(TINY["llama"]), {}
    for name, config in windowed_configs().items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():  # every weight random, norms included
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        model.save_pretrained(root / name)
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (tok / f).is_file():
                (root / name / f).write_bytes((tok / f).read_bytes())
        out[name] = root / name
    return out


def windowed_token_ids(seed: int, n: int) -> list[int]:
    """n random tokens of the windowed models' vocabulary, none of the special ones."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, WINDOWED_VOCAB, (n,), generator=gen).tolist()


# <<< ch29


# >>> ch31 the published configs of Qwen3.5-0.8B and 9B (values from their config.json)
def qwen3_5_published(hidden: int, inter: int, layers: int, heads: int, kv: int,
                      value_heads: int, tied: bool) -> dict[str, Any]:  # fmt: skip
    text = dict(
        model_type="qwen3_5_text", vocab_size=248320, hidden_size=hidden,
        intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, head_dim=256, attn_output_gate=True, attention_bias=False,
        full_attention_interval=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention",
                     "full_attention"] * (layers // 4),
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
        linear_num_value_heads=value_heads, linear_conv_kernel_dim=4, mamba_ssm_dtype="float32",
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                         "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                         "mrope_interleaved": True},
        max_position_embeddings=262144, rms_norm_eps=1e-6, hidden_act="silu",
        mtp_num_hidden_layers=1, tie_word_embeddings=tied, dtype="bfloat16",
    )  # fmt: skip
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
            "text_config": text, "vision_config": {"depth": 12},
            "tie_word_embeddings": tied}  # fmt: skip


QWEN3_5_PUBLISHED = {
    "0.8B": qwen3_5_published(1024, 3584, 24, 8, 2, 16, True),
    "9B": qwen3_5_published(4096, 12288, 32, 16, 4, 32, False),
}


# <<< ch31


# ---- paged attention: a page table of random pages and the reference the kernels meet --
ROWS, WIDTH = 8, 320  # page-table rows, and slots a row


def paged_table(page_size: int, gen: torch.Generator) -> torch.Tensor:
    """Every row a random set of whole pages, as the allocator hands them out."""
    pages = torch.randperm(ROWS * WIDTH // page_size, generator=gen)
    per_row = WIDTH // page_size
    table = torch.empty(ROWS, WIDTH, dtype=torch.int32)
    for r in range(ROWS):
        own = pages[r * per_row : (r + 1) * per_row]
        table[r] = (own[:, None] * page_size + torch.arange(page_size)).flatten()
    return table


def attention_reference(q, k_cache, v_cache, table, rows, seq_lens, qo, scale) -> torch.Tensor:
    """Causal attention of each request's new tokens q[qo[i]:qo[i+1]] (its last positions)
    over its keys, found through row `rows[i]` of the page table: the kernels' reference."""
    out = torch.empty_like(q)
    for i, (row, n_kv) in enumerate(zip(rows, seq_lens)):
        start, end = qo[i], qo[i + 1]
        slots = table[row, :n_kv].long()
        keys, values = k_cache[slots].transpose(0, 1), v_cache[slots].transpose(0, 1)
        q_pos = torch.arange(n_kv - (end - start), n_kv)
        mask = torch.arange(n_kv)[None, :] <= q_pos[:, None]
        out[start:end] = torch.nn.functional.scaled_dot_product_attention(
            q[start:end].transpose(0, 1), keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        ).transpose(0, 1)
    return out


def hopper_report(*groups: str) -> dict[str, list[str]]:
    """tools/kernel_report.py's rows for `groups` (the kernels built for sm_90 on the CPU),
    by kernel: its cells. Skips where this Triton cannot build for the GPU."""
    run = run_tool("kernel_report.py", "--only", ",".join(groups), timeout=600)
    if run.returncode != 0 and any(w in run.stderr for w in ("ptxas", "GPUTarget", "nvdisasm")):
        pytest.skip(f"Triton cannot build for sm_90 here: {run.stderr[-300:]}")  # pragma: no cover
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line.strip("|").split("|") for line in run.stdout.splitlines() if line[:2] == "| "]
    return {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in rows[1:]}
