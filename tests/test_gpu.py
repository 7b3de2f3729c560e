"""On a CUDA device: the engine equals Hugging Face there too, and the graph runner behaves.

Skipped without CUDA. The models are built here from a seed (a GPU machine may have no
prepared model folders), with the SmolLM2 tokenizer files.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from helpers import SMOL, Driver, all_logits, make_engine

from minisgl.core import SamplingParams
from minisgl.env import ENV
from minisgl.llm import LLM

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("gpu-llama")
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=49152,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        architectures=["LlamaForCausalLM"],
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SMOL / name, out / name)
    return out


def hf_logits_cuda(path: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        return model(torch.tensor([ids], device="cuda")).logits[0].float()


def test_logits_equal_hf_on_cuda(model_dir: Path) -> None:
    ids = torch.randint(0, 49152, (48,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = hf_logits_cuda(model_dir, ids)
    engine = make_engine(model_dir, device="cuda", page_size=16)
    req = Driver(engine).add(ids, SamplingParams(max_tokens=1), row=0)
    req.device_len = 20  # a prefix, then the rest over the cached prefix
    first = all_logits(engine, [req], "prefill")
    req.device_len = len(ids)
    second = all_logits(engine, [req], "prefill")
    got = torch.cat([first, second])
    assert (got - ref).abs().max().item() <= 1e-3


def test_torch_backend_turns_graphs_off_on_cuda(model_dir: Path, caplog) -> None:
    with caplog.at_level(logging.INFO):
        llm = LLM(str(model_dir), dtype=torch.float32, device="cuda", max_running_req=8)
    assert llm.engine.graph_runner.graph_map == {}
    assert "CUDA graphs off" in caplog.text
    llm.shutdown()


def test_debug_mode_on_cuda_equals_eager(model_dir: Path) -> None:
    ENV.DISABLE_OVERLAP_SCHEDULING.value = True
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    kw = dict(dtype=torch.float32, device="cuda", max_running_req=8, max_seq_len_override=256)
    eager = LLM(str(model_dir), cuda_graph_max_bs=0, **kw)
    want = [o["token_ids"] for o in eager.generate(prompts, params, use_tqdm=False)]
    eager.shutdown()
    debug = LLM(str(model_dir), cuda_graph_max_bs=4, debug_cuda_graph=True, **kw)
    assert sorted(debug.engine.graph_runner.graph_map) == [1, 2, 4]
    got = [o["token_ids"] for o in debug.generate(prompts, params, use_tqdm=False)]
    debug.shutdown()
    ENV.DISABLE_OVERLAP_SCHEDULING.value = False
    assert got == want


def test_overlap_on_cuda_equals_serial(model_dir: Path) -> None:
    prompts = [[i, i + 1, i + 2] * (i % 5 + 1) for i in range(1, 20)]
    params = [SamplingParams(max_tokens=4 + i % 7, ignore_eos=True) for i in range(19)]
    outputs = []
    for overlap in (False, True):
        ENV.DISABLE_OVERLAP_SCHEDULING.value = not overlap
        llm = LLM(
            str(model_dir),
            dtype=torch.float32,
            device="cuda",
            max_running_req=8,
            max_seq_len_override=256,
            page_size=4,
        )
        outputs.append([o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)])
        llm.scheduler.check_integrity()
        llm.shutdown()
    ENV.DISABLE_OVERLAP_SCHEDULING.value = False
    assert outputs[0] == outputs[1]
