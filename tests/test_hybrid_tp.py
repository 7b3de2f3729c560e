"""Tensor parallelism for the hybrids: Qwen3.5 (dense), Qwen3.5-MoE and Qwen3-Next over two
ranks on CPU (gloo) give what one rank gives.

The tiny models are the other hybrid tests' (seed 0, fp32): 2 key heads and 4 value heads in
each linear layer, so a rank keeps one key head and the two value heads that read it; 2 query
heads and one KV head in the attention layer, so a rank keeps one (query, gate) pair and both
ranks hold the KV head. One pair of rank processes runs all three models: the logits under
teacher forcing (a prefill in two chunks, the second over the state the first left, then
decode steps) and the greedy tokens of three prompts batched, each compared with one rank;
the offline API over two ranks (the scheduler on rank 0) gives the tokens of one.
The published configs' state pools are sized per rank, and a rank count that does not divide
the linear heads is refused by name before anything loads.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from helpers import TINY, Driver, free_port, make_engine, need, two_ranks
from test_qwen3_5 import PUBLISHED, TEXT, VISION, _perturb, teacher_forced, token_ids
from test_qwen3_5_moe import MOE, fuse_experts, published_35b
from test_qwen3_next import CONFIG, PUBLISHED_80B

from minisgl.core import SamplingParams
from minisgl.distributed import get_tp_info
from minisgl.distributed.info import set_tp_info
from minisgl.engine.config import EngineConfig, check_model_files
from minisgl.engine.startup import EngineShape
from minisgl.kvcache.state_pool import state_pool_bytes
from minisgl.layers.gated_deltanet import GatedDeltaNet
from minisgl.layers.parallel import check_tp
from minisgl.models.config import ModelConfig
from minisgl.models.qwen3_next import FusedProjGatedDeltaNet

TOL = 1e-4
PROMPTS = [token_ids(30 + i, n) for i, n in enumerate((5, 9, 14))]
GREEDY = SamplingParams(max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each family in the layout its checkpoints are published in."""
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeConfig,
        Qwen3_5MoeForConditionalGeneration,
        Qwen3NextConfig,
        Qwen3NextForCausalLM,
    )

    root = tmp_path_factory.mktemp("hybrid_tp")
    text = {k: v for k, v in TEXT.items() if k != "intermediate_size"}
    build = {
        "qwen3_5": lambda: Qwen3_5ForConditionalGeneration(
            Qwen3_5Config(text_config=TEXT, vision_config=VISION)
        ),
        "qwen3_5_moe": lambda: Qwen3_5MoeForConditionalGeneration(
            Qwen3_5MoeConfig(text_config={**text, **MOE}, vision_config=VISION)
        ),
        "qwen3_next": lambda: Qwen3NextForCausalLM(Qwen3NextConfig(**CONFIG)),
    }
    out = {}
    for name, make in build.items():
        torch.manual_seed(0)
        model = make()
        _perturb(model.float())
        model.save_pretrained(root / name)
        out[name] = root / name
    fuse_experts(root / "qwen3_5_moe", root / "qwen3_5_moe_fused")  # experts as published
    out["qwen3_5_moe"] = root / "qwen3_5_moe_fused"
    return out


def run(path: Path, tp_size: int = 1, rank: int = 0, port: int = 0) -> tuple[Any, list]:
    """Teacher-forced logits of one prompt, then the greedy tokens of PROMPTS together."""
    kw = dict(page_size=4, max_running_req=4)
    if tp_size > 1:
        kw.update(tp_size=tp_size, tp_rank=rank, dist_init_addr=f"127.0.0.1:{port}")
    engine = make_engine(path, **kw)
    try:
        state = engine.state_pool
        logits = teacher_forced(engine, token_ids(0, 24))
        tokens = Driver(engine).generate(PROMPTS, GREEDY)
        return logits, [tokens, tuple(state.conv.shape), tuple(state.ssm.shape)]
    finally:
        engine.shutdown()


def rank_main(paths: list[Path], ports: list[int], rank: int, results: mp.Queue) -> None:
    torch.set_num_threads(1)
    for path, port in zip(paths, ports):
        logits, rest = run(path, 2, rank, port)
        results.put(((str(path), rank), (logits.numpy(), rest)))


def test_tp2_equals_tp1(models) -> None:
    paths = list(models.values())
    got = two_ranks(rank_main, paths, [free_port() for _ in paths], results=2 * len(paths))
    assert get_tp_info().size == 1
    for path in paths:
        logits, (tokens, conv, ssm) = run(path)
        for rank in (0, 1):
            rank_logits, (rank_tokens, rank_conv, rank_ssm) = got[str(path), rank]
            diff = (torch.from_numpy(rank_logits) - logits).abs().max().item()
            assert diff <= TOL, f"{path.name} rank {rank}: tp=2 logits differ by {diff}"
            assert rank_tokens == tokens, f"{path.name} rank {rank}"
            # Each rank's state: half the conv channels and half the value heads.
            assert rank_conv == (*conv[:2], conv[2] // 2, conv[3]), path.name
            assert rank_ssm == (*ssm[:2], ssm[2] // 2, *ssm[3:]), path.name


def test_ranks_the_linear_heads_do_not_divide_among_are_refused(models) -> None:
    for path in models.values():
        check_model_files(EngineConfig(str(path), tp_size=2))
        with pytest.raises(ValueError, match="linear_num_key_heads 2 is not divisible by 4"):
            check_model_files(EngineConfig(str(path), tp_size=4))  # before any process
    with pytest.raises(ValueError, match="by 3; shared_expert_intermediate_size 40 is not"):
        check_model_files(EngineConfig(str(models["qwen3_5_moe"]), tp_size=3))


# ---- the published configs, per rank ------------------------------------------------------

PUBLISHED_CONFIGS = {**PUBLISHED, "35B-A3B": published_35b(), "Next-80B-A3B": PUBLISHED_80B}


@pytest.mark.parametrize("name", sorted(PUBLISHED_CONFIGS))
def test_published_configs_size_per_rank(tmp_path: Path, name: str) -> None:
    """At tp 2, 4 and 8 (every count their heads divide by) a rank's state pool is the
    whole one over tp, and a linear layer built for the rank (on the meta device) has the
    pool's shape: its conv channels and its value heads."""
    raw = PUBLISHED_CONFIGS[name]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    mc = ModelConfig.from_path(tmp_path)
    assert mc.linear is not None
    fused = raw["architectures"][0] == "Qwen3NextForCausalLM"
    layer_cls = FusedProjGatedDeltaNet if fused else GatedDeltaNet

    def pool_bytes(tp: int) -> int:
        config = EngineConfig(str(tmp_path), device="cpu", max_running_req=8, tp_size=tp)
        check_model_files(config)
        shape = EngineShape(config, mc, torch.device("cpu"), torch.bfloat16, torch.bfloat16,
                            4096, mc.num_heads, mc.num_kv_heads, 0)  # fmt: skip
        return state_pool_bytes(shape)

    whole = pool_bytes(1)
    try:
        for tp in (2, 4, 8):
            check_tp(mc, tp)
            for rank in (0, tp - 1):
                set_tp_info(rank, tp)
                assert pool_bytes(tp) * tp == whole, (name, tp)
                with torch.device("meta"):
                    layer = layer_cls(mc.hidden_size, mc.linear, mc.rms_norm_eps, 0)
                share = layer.shape
                assert share.num_key_heads * tp == mc.linear.num_key_heads
                assert share.num_value_heads * tp == mc.linear.num_value_heads
                assert layer.conv1d.weight.shape[0] == share.conv_dim == mc.linear.conv_dim // tp
                assert layer.A_log.shape == (share.num_value_heads,)
                assert layer.out_proj.weight.shape[1] * tp == (
                    mc.linear.num_value_heads * mc.linear.value_head_dim
                )
    finally:
        set_tp_info(0, 1)


def test_tp2_serves_through_the_scheduler(models) -> None:
    """The offline API over two ranks (rank 0 schedules, the other follows), prompts batched
    and chunked: the greedy tokens of one rank."""
    from minisgl.llm import LLM

    kw: dict[str, Any] = dict(device="cpu", dtype="float32", max_running_req=4, page_size=4,
                              num_page_override=64, max_prefill_length=7)  # fmt: skip
    path = models["qwen3_5"]
    tok = need(TINY["llama"])  # a tokenizer for the offline API (the prompts are token ids)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / f, path / f)
    out = []
    for tp in (1, 2):
        llm = LLM(str(path), tp_size=tp, **kw)
        try:
            assert len(llm._followers) == tp - 1 and all(p.is_alive() for p in llm._followers)
            out.append([o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)])
        finally:
            llm.shutdown()
    assert out[0] == out[1]
