"""Chapter 21: tensor parallelism on CPU over gloo, checked against one rank and Hugging Face.

Ranks are real processes. The logits test runs every tiny model (and one with a single KV
head, which ranks must share) in one pair of ranks, to pay for process start-up once.
Every process runs torch on one thread: the test machine has two cores.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from dataclasses import replace
from pathlib import Path

import httpx
import openai
import pytest
import torch
import torch.multiprocessing as mp
from helpers import (
    CPU,
    SMOL,
    TINY,
    alive,
    all_logits,
    descendants,
    free_port,
    hf_greedy,
    launch,
    make_engine,
    need,
    stop,
    titles,
    two_ranks,
    wait_gone,
    wait_ready,
)

from minisgl.core import Req, SamplingParams
from minisgl.distributed import Split, destroy_distributed, get_tp_info, init_distributed
from minisgl.distributed.info import set_tp_info
from minisgl.engine.limits import EngineLimits
from minisgl.engine.ranks import check_ranks_agree
from minisgl.kvcache.allocator import page_slots
from minisgl.layers.parallel import check_tp
from minisgl.llm import LLM
from minisgl.models.config import ModelConfig
from minisgl.tokenizer.tokenizer import Tokenizer

PROMPT = list(range(5, 17))
DECODED = [7, 8, 9]  # teacher-forced tokens after the prompt


def one_kv_head_model(folder: Path) -> Path:
    """tiny-qwen3 with one KV head: with two ranks, both must hold it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    src = need(TINY["qwen3"])
    raw = json.loads((src / "config.json").read_text())
    raw["num_key_value_heads"] = 1
    config = AutoConfig.for_model(
        "qwen3", **{k: v for k, v in raw.items() if k not in ("model_type", "transformers_version")}
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, folder / name)
    return folder


def teacher_forced(path: Path, tp_size: int, rank: int, port: int) -> torch.Tensor:
    """Logits of a prefill and three decode steps, every position, on one rank."""
    engine = make_engine(path, tp_size=tp_size, tp_rank=rank, dist_init_addr=f"127.0.0.1:{port}")
    try:
        n = len(PROMPT) + len(DECODED)
        req = Req(torch.tensor(PROMPT, dtype=torch.int32), 0, 0, n, 0, SamplingParams())
        engine.page_table[0, :n] = page_slots(list(range(1, n + 1)), 1)
        engine.token_pool[0, : len(PROMPT)] = req.input_ids
        out = [all_logits(engine, [req], "prefill")]
        for token in DECODED:
            engine.token_pool[0, req.device_len] = token
            req.append_host(token)
            out.append(all_logits(engine, [req], "decode"))
        return torch.cat(out)
    finally:
        engine.shutdown()


def rank_main(paths: list[Path], ports: list[int], rank: int, results: mp.Queue) -> None:
    torch.set_num_threads(1)
    for path, port in zip(paths, ports):
        logits = teacher_forced(path, 2, rank, port)
        if rank == 0:
            results.put((str(path), logits.numpy()))


def test_tp2_logits_match_tp1(tmp_path: Path) -> None:
    paths = [need(p) for p in TINY.values()] + [one_kv_head_model(tmp_path / "one-kv")]
    got = two_ranks(rank_main, paths, [free_port() for _ in paths], results=len(paths))
    for path in paths:
        want = teacher_forced(path, 1, 0, 0)
        diff = (torch.from_numpy(got[str(path)]) - want).abs().max().item()
        assert diff < 1e-4, f"{path.name}: tp=2 logits differ from tp=1 by {diff}"
    assert get_tp_info().size == 1  # the reference ran alone


def test_indivisible_shapes_are_named_before_loading() -> None:
    config = ModelConfig.from_path(need(SMOL))  # 9 query heads, 3 KV heads
    check_tp(config, 3)
    with pytest.raises(ValueError, match="num_attention_heads 9 is not divisible by 2"):
        check_tp(config, 2)
    with pytest.raises(ValueError, match="num_key_value_heads 3 neither divides 4"):
        check_tp(config, 4)
    with pytest.raises(ValueError, match="num_attention_heads 9"):
        LLM(str(SMOL), device="cpu", tp_size=2)  # refused before any rank starts


def limits_rank(rows: list[int], port: int, rank: int, results: mp.Queue) -> None:
    """Two rounds over two ranks: equal limits, then `rows[rank]` requests at once."""
    init_distributed(rank, 2, f"127.0.0.1:{port}", torch.device("cpu"))
    try:
        limits = EngineLimits(256, 64, 4, 8, 49152)
        check_ranks_agree(limits)
        try:
            check_ranks_agree(replace(limits, max_running_req=rows[rank]))
            results.put((rank, None))
        except ValueError as e:
            results.put((rank, str(e)))
    finally:
        destroy_distributed()


def test_ranks_whose_limits_differ_all_refuse_to_start() -> None:
    # A rank on another machine has a command line of its own: told 16 rows where rank 0
    # has 8, it would schedule otherwise and wait in collectives rank 0 never joins.
    errors = two_ranks(limits_rank, [8, 16], free_port(), results=2, timeout=120)
    assert errors[0] is not None and "another rank's limits differ" in errors[0], errors
    assert errors[1] is not None and "max_running_req=16" in errors[1], errors
    assert "max_running_req=8" in errors[1] and "same settings" in errors[1], errors


def test_kv_heads_are_shared_when_fewer_than_ranks() -> None:
    # 4 query heads and 2 KV heads of 8 features over 4 ranks: each rank one query head, and
    # ranks 0-1 share KV head 0, ranks 2-3 KV head 1.
    try:
        for rank, (q, k) in enumerate([(0, 0), (8, 0), (16, 8), (24, 8)]):
            set_tp_info(rank, 4)
            split = Split.qkv(4, 2, 8)
            assert split.local_size == 3 * 8
            assert split.ranges(range(3)) == [(q, q + 8), (32 + k, 40 + k), (48 + k, 56 + k)]
            assert split.ranges((1,)) == [(k, k + 8)]  # k_proj alone
    finally:
        set_tp_info(0, 1)


def test_smollm2_tp3_greedy_matches_tp1_and_hf() -> None:
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    kw = dict(dtype=torch.float32, device="cpu", max_running_req=4, num_page_override=128)
    kw["max_seq_len_override"] = 64
    one = LLM(str(need(SMOL)), **kw)
    try:
        want = [o["token_ids"] for o in one.generate(prompts, params, use_tqdm=False)]
        ids = [one.tokenizer.encode(p) for p in prompts]
    finally:
        one.shutdown()
    three = LLM(str(SMOL), tp_size=3, **kw)
    try:
        assert len(three._followers) == 2 and all(p.is_alive() for p in three._followers)
        got = [o["token_ids"] for o in three.generate(prompts, params, use_tqdm=False)]
        again = three.generate([ids[0]], SamplingParams(max_tokens=4, ignore_eos=True))
    finally:
        three.shutdown()
    assert got == want
    assert got == [hf_greedy(SMOL, i, 6) for i in ids]
    assert again[0]["token_ids"] == want[0][:4]  # a second call: the ranks kept in step
    assert not any(p.is_alive() for p in three._followers), "shutdown() leaves no rank behind"


# ---- servers ------------------------------------------------------------------------------


TP_SERVER = (*CPU, "--max-seq-len-override", "128", "--num-pages", "256")


def greedy_offline(model: Path, prompt: str, n: int) -> list[int]:
    llm = LLM(str(model), dtype=torch.float32, device="cpu", num_page_override=64)
    try:
        return llm.generate([prompt], SamplingParams(max_tokens=n), use_tqdm=False)[0]["token_ids"]
    finally:
        llm.shutdown()


def test_tp2_server_serves_the_openai_client_and_drains_on_sigterm(tmp_path: Path) -> None:
    model = need(TINY["llama"])
    server = launch(tmp_path, *TP_SERVER, "--tp-size", "2", model=model)
    try:
        base = wait_ready(server)
        pids = [server.proc.pid, *descendants(server.proc.pid)]
        assert {"minisgl::scheduler", "minisgl::scheduler-1"} <= set(titles(pids)), titles(pids)
        client = openai.OpenAI(base_url=base + "/v1", api_key="none")
        reply = client.completions.create(
            model=model.name, prompt="Hello there", max_tokens=5, temperature=0, logprobs=1
        )
        chunks = client.completions.create(
            model=model.name, prompt="Hello there", max_tokens=5, temperature=0, stream=True
        )
        streamed = "".join(c.choices[0].text for c in chunks)
        want = greedy_offline(model, "Hello there", 5)
        assert reply.choices[0].logprobs.tokens is not None
        assert reply.usage.completion_tokens == 5
        assert reply.choices[0].text == streamed
        assert reply.choices[0].text == Tokenizer(str(model)).decode(want)
        # SIGTERM to every process, as systemd sends it: the running request still finishes.
        # Counted by the usage the stream ends with: a token may add no text to a chunk.
        body = dict(model=model.name, prompt="Hello there", max_tokens=60, stream=True,
                    temperature=0, stream_options={"include_usage": True})  # fmt: skip
        chunks = client.completions.create(**body, extra_body={"ignore_eos": True})
        next(iter(chunks))
        os.killpg(server.proc.pid, signal.SIGTERM)
        rest = list(chunks)
        reasons = [c.choices[0].finish_reason for c in rest if c.choices]
        assert reasons[-1] == "length", rest[-3:]
        usage = [c.usage for c in rest if c.usage is not None]
        assert usage and usage[-1].completion_tokens == 60, rest[-3:]
        assert server.proc.wait(15) == 0, server.tail()
        assert not wait_gone(pids, 10), f"left after SIGTERM: {[p for p in pids if alive(p)]}"
    finally:
        stop(server)


def test_two_nodes_on_one_host_serve_and_a_dead_rank_stops_the_server(tmp_path: Path) -> None:
    model = need(TINY["qwen3"])
    addr = f"127.0.0.1:{free_port()}"
    nodes = ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", addr]
    node1 = launch(tmp_path, *TP_SERVER, *nodes, "--node-rank", "1", model=model)
    node0 = launch(tmp_path, *TP_SERVER, *nodes, "--node-rank", "0", model=model)
    try:
        base = wait_ready(node0)
        client = openai.OpenAI(base_url=base + "/v1", api_key="none")
        reply = client.chat.completions.create(
            model=model.name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, seed=5
        )
        assert reply.usage.completion_tokens == 4 and reply.choices[0].message.content
        node1_pids = [node1.proc.pid, *descendants(node1.proc.pid)]
        ranks = [p for p, t in zip(node1_pids, titles(node1_pids)) if t.startswith("minisgl::")]
        assert titles(ranks) == ["minisgl::scheduler-1"], titles(node1_pids)
        # The rank on the other "machine" dies: node 0 answers 503, then exits non-zero.
        os.kill(ranks[0], signal.SIGKILL)
        deadline, status = time.monotonic() + 20, 200
        while status == 200 and time.monotonic() < deadline:
            try:
                status = httpx.get(base + "/health", timeout=5).status_code
            except httpx.TransportError:
                break
            time.sleep(0.1)
        assert status == 503
        assert node0.proc.wait(20) != 0
        assert node1.proc.wait(20) != 0  # its only rank died
        assert not wait_gone([node0.proc.pid, *descendants(node0.proc.pid), *node1_pids], 10)
    finally:
        stop(node0)
        stop(node1)
