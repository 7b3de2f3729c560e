"""The kernel choice's times on disk: read back as written, and only by the same GPU and
software. The measurement itself needs CUDA; here its timer is a fake that counts its calls,
so a second start that reads the cache is seen to time nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import TINY, need

import minisgl.engine.kernel_cache as kernel_cache
from minisgl.engine.kernel_cache import SOURCES, TimesCache, sources_hash
from minisgl.engine.kernel_choice import choose_gemv
from minisgl.env import ENV
from minisgl.llm import LLM

H200 = {"gpu": "NVIDIA H200", "capability": "9.0", "torch": "2.11.0", "triton": "3.6.0"}


def test_times_come_back_as_written(tmp_path: Path) -> None:
    path = tmp_path / "times.json"
    cache = TimesCache(path, H200)
    assert cache.get("bf16 [4096x1024] rows 1", ["library", "gemv a"]) is None
    cache.put("bf16 [4096x1024] rows 1", {"library": 2e-6, "gemv a": 1.5e-6})
    cache.save()
    again = TimesCache(path, H200)
    assert again.get("bf16 [4096x1024] rows 1", ["library", "gemv a"]) == {
        "library": 2e-6,
        "gemv a": 1.5e-6,
    }
    assert again.hits == 1 and again.changed == 0
    # Other candidates than those measured (another kernel version): measured again.
    assert again.get("bf16 [4096x1024] rows 1", ["library", "gemv a", "gemv b"]) is None
    assert again.get("bf16 [4096x1024] rows 2", ["library", "gemv a"]) is None


def test_never_trusted_for_other_hardware_or_software(tmp_path: Path, monkeypatch, caplog):
    monkeypatch.setattr(ENV.CACHE_DIR, "value", str(tmp_path))
    identity = dict(H200)
    monkeypatch.setattr(kernel_cache, "gpu_identity", lambda device: dict(identity))
    cuda = torch.device("cuda")  # only named: nothing here touches a GPU
    first = TimesCache.for_device(cuda)
    assert first.path is not None and first.path.parent == tmp_path / "kernel_choice"
    first.put("entry", {"library": 1.0})
    first.save()
    assert TimesCache.for_device(cuda).get("entry", ["library"]) == {"library": 1.0}
    for field, other in [("gpu", "NVIDIA H100 80GB HBM3"), ("torch", "2.12.0"), ("sources", "x")]:
        identity = {**H200, field: other}
        elsewhere = TimesCache.for_device(cuda)
        assert elsewhere.path != first.path, field
        assert elsewhere.get("entry", ["library"]) is None, field
    # A file whose name fits but whose contents were written for another GPU is not read.
    shutil.copy(first.path, tmp_path / "copied.json")
    assert TimesCache(tmp_path / "copied.json", {**H200, "gpu": "NVIDIA A100"}).entries == {}
    assert "for other hardware or software" in caplog.text
    # No cache on a CPU, nor with MINISGL_CACHE_DIR empty.
    assert TimesCache.for_device(torch.device("cpu")).path is None
    monkeypatch.setattr(ENV.CACHE_DIR, "value", "")
    assert TimesCache.for_device(cuda).path is None


def test_a_broken_file_is_measured_again_and_replaced(tmp_path: Path, caplog) -> None:
    path = tmp_path / "times.json"
    path.write_text('{"identity": {"gpu": ')  # cut short, as by a crash mid-write
    cache = TimesCache(path, H200)
    assert cache.entries == {} and "unreadable" in caplog.text
    cache.put("entry", {"library": 1.0})
    cache.save()
    assert json.loads(path.read_text())["entries"] == {"entry": {"library": 1.0}}
    assert [p.name for p in tmp_path.iterdir()] == ["times.json"]  # no temporary left behind


def test_an_edited_kernel_makes_a_new_cache(tmp_path: Path) -> None:
    package = Path(kernel_cache.__file__).parent.parent
    for source in SOURCES:
        copy = tmp_path / source
        if (package / source).is_dir():
            shutil.copytree(package / source, copy)
        else:
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(package / source, copy)
    assert sources_hash(tmp_path) == sources_hash()
    gemv = tmp_path / "kernels" / "gemv.py"
    gemv.write_text(gemv.read_text() + "\n# tuned\n")
    assert sources_hash(tmp_path) != sources_hash()


@pytest.fixture(scope="module")
def llm():
    llm = LLM(str(need(TINY["llama"])), device="cpu", max_running_req=1,
              num_page_override=64, max_seq_len_override=32)  # fmt: skip
    yield llm
    llm.shutdown()


def test_a_second_start_reads_the_choice_and_times_nothing(llm, tmp_path, monkeypatch) -> None:
    from minisgl.kernels.gemv import gemv
    from minisgl.layers import kernel_plan
    from minisgl.layers.kernel_plan import KernelPlan

    # the GEMV allowed for CPU tensors of one row, as in test_kernel_choice
    monkeypatch.setattr(kernel_plan, "gemv_kernel", lambda fused: gemv)
    monkeypatch.setattr(ENV.GEMV, "value", "auto")
    monkeypatch.setattr(ENV.GEMV_MAX_ROWS, "value", 1)
    e = llm.engine

    def choose_gemv_with(cache: TimesCache):
        return choose_gemv(e, KernelPlan.at_start(e.device, e.dtype, e.attn_backend), timer, cache)

    timed: list[str] = []

    def timer(what: str, run) -> float:  # the GEMV wins at qkv only
        timed.append(what)
        return 0.5 if "qkv_proj" in what and "gemv" in what.split(": ")[-1] else 1.0

    path = tmp_path / "times.json"
    cache = TimesCache(path, H200)
    first = choose_gemv_with(cache)
    assert first is not None and timed and cache.hits == 0
    shapes = cache.changed  # one entry per projection shape and row count
    cache.save()
    measured = len(timed)
    again = TimesCache(path, H200)
    second = choose_gemv_with(again)
    assert second is not None and len(timed) == measured  # the timer was not called again
    assert second.blocks == first.blocks and again.hits == shapes and again.changed == 0
    assert any(b is not None for b in second.blocks.values())  # the GEMV's win came back
    # The same shapes on another GPU are measured anew.
    elsewhere = TimesCache(path, {**H200, "gpu": "NVIDIA B200"})
    choose_gemv_with(elsewhere)
    assert len(timed) == 2 * measured and elsewhere.hits == 0
