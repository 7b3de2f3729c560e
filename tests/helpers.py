"""Shared test helpers: model paths, Hugging Face references, and a bare engine driver."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

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

    def add(self, ids: list[int], params: SamplingParams, row: int) -> Req:
        e = self.engine
        req = Req(torch.tensor(ids, dtype=torch.int32), row, 0, params.max_tokens, row, params)
        pages = self.pages.alloc(-(-req.max_device_len // e.page_size))
        self.owned[row] = pages
        slots = page_slots(pages, e.page_size)
        e.page_table[row, : len(slots)] = slots
        e.token_pool[row, : len(ids)] = req.input_ids
        return req

    def release(self, req: Req) -> None:
        self.pages.free(self.owned.pop(req.table_idx))

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
