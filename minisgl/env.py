"""ENV: the MINISGL_* environment knobs, read once and overridable in code.

A knob is an object rather than a bare constant so that tests and examples can flip it
(`ENV.CPU_KV_CACHE_MB.value = 64`) and every reader sees the change.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T", bool, int, float, str)


@dataclass
class EnvVar(Generic[T]):
    name: str
    default: T
    value: T

    @classmethod
    def read(cls, name: str, default: T, choices: tuple[str, ...] = ()) -> EnvVar[T]:
        raw = os.environ.get(f"MINISGL_{name}")
        if raw is None:
            return cls(name, default, default)
        if choices and raw not in choices:
            raise ValueError(f"MINISGL_{name}={raw!r} is not one of {', '.join(choices)}")
        if isinstance(default, bool) or default is None:  # None: a flag left to the code
            if raw.lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off", ""):
                raise ValueError(f"MINISGL_{name}={raw!r} is not a boolean (use 1 or 0)")
            return cls(name, default, raw.lower() in ("1", "true", "yes", "on"))  # type: ignore[arg-type]
        try:
            return cls(name, default, type(default)(raw))
        except ValueError as e:
            raise ValueError(f"MINISGL_{name}={raw!r} is not a {type(default).__name__}") from e

    def __bool__(self) -> bool:
        return bool(self.value)


class _Env:
    def __init__(self) -> None:
        # Fraction of free device memory the engine may use for weights + KV cache on CUDA.
        self.MEMORY_FRACTION = EnvVar.read("MEMORY_FRACTION", 0.9)
        # KV cache budget on CPU, in MiB, when no page count is given.
        self.CPU_KV_CACHE_MB = EnvVar.read("CPU_KV_CACHE_MB", 512)
        # >>> ch12 overlap scheduling. 1: off, each batch's results before the next launch
        # (easier to debug, slower on a GPU). 0: on. Unset (None): on where the device runs
        # apart from the host (CUDA); not on CPU, where the forward runs on the host itself.
        self.DISABLE_OVERLAP_SCHEDULING = EnvVar.read("DISABLE_OVERLAP_SCHEDULING", None)
        # <<< ch12
        # >>> ch19 FlashInfer's fused norm / activation / rotary kernels on CUDA, when installed
        self.FUSED_KERNELS = EnvVar.read("FUSED_KERNELS", True)
        # <<< ch19
        # >>> ch20 linear layers of at most this many tokens may use our GEMV kernel on CUDA
        # (0: never); each row count up to it costs its kernels' compilation at start-up
        self.GEMV_MAX_ROWS = EnvVar.read("GEMV_MAX_ROWS", 1)
        # auto: where the start-up measurement saw it beat the matmul library; on, off: always,
        # never (for benchmarks)
        self.GEMV = EnvVar.read("GEMV", "auto", choices=("auto", "on", "off"))
        # decode attention from qkv in one kernel (rotary, KV store, splits and their merge)
        self.FUSED_DECODE = EnvVar.read("FUSED_DECODE", True)
        # where measurements are kept between starts (engine/kernel_cache.py); empty: nowhere
        cache_home = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
        self.CACHE_DIR = EnvVar.read("CACHE_DIR", os.path.join(cache_home, "minisgl"))
        # threads that build the kernel choice's candidates at once (1: one after another)
        self.BUILD_THREADS = EnvVar.read("BUILD_THREADS", 16)
        # build the Triton kernels start-up's forwards and sampler meet in those threads,
        # from a dry run first (0: each call builds its kernels as it meets them)
        self.BUILD_AHEAD = EnvVar.read("BUILD_AHEAD", True)
        # <<< ch20
        # >>> ch26 a verify launched ahead: with overlap scheduling, a verify whose drafts may
        # all be taken is followed at once by the next one, launched before its tokens are
        # read (speculative/step.py); off: every verify waits for its tokens
        self.SPECULATIVE_AHEAD = EnvVar.read("SPECULATIVE_AHEAD", "on", choices=("on", "off"))
        # on: a verify launched behind the plain step in flight, its drafts after a guess of
        # that step's token; off (until a GPU has timed both): that step drained first
        self.SPECULATIVE_BEHIND = EnvVar.read("SPECULATIVE_BEHIND", "off", choices=("on", "off"))
        # from here the GEMV takes up to 16 rows (a verify of up to 15 drafts, small batches)
        # where the start-up measurement finds it faster (kernels/gemv_mma.py)
        self.GEMV_MAX_ROWS = EnvVar.read("GEMV_MAX_ROWS", 16)
        # a verify batch's attention: split (its new tokens over ranges of keys in parallel,
        # kernels/verify_attention.py; split-qkv: in one launch from qkv) or extend (a
        # program per query head walks every key, as a prompt's chunk does)
        self.VERIFY_ATTN = EnvVar.read(
            "VERIFY_ATTN", "split", choices=("extend", "split", "split-qkv")
        )
        # <<< ch26
        # >>> ch29 Gemma 4's head norms and rotary: one Triton kernel a tensor where fused
        # kernels run (triton: 1.07-1.22x faster steps at batch 1-256, docs/benchmarks.md),
        # or the torch code (torch)
        self.GEMMA4_ROPE = EnvVar.read("GEMMA4_ROPE", "triton", choices=("torch", "triton"))
        # <<< ch29
        # >>> ch31 the Gated DeltaNet layers' kernels: torch (the reference), triton (ours),
        # auto: ours on CUDA (measured faster there: docs/benchmarks.md), torch elsewhere
        self.GATED_DELTA = EnvVar.read("GATED_DELTA", "auto", choices=("auto", "torch", "triton"))
        # a prefill's recurrence: one-pass (each request's chunks of 16 walked in turn),
        # two-pass (kernels/gated_delta_chunks.py: every chunk's own work at once, then walks
        # of 64 tokens a step) or auto: two passes past 2,048 tokens a request on average
        self.GATED_DELTA_PREFILL = EnvVar.read(
            "GATED_DELTA_PREFILL", "auto", choices=("auto", "one-pass", "two-pass")
        )
        # a decode step: fused (a program per request and key head holding whole states),
        # split (the recurrence over blocks of value columns, then the norm and the conv
        # state's shift) or auto: split where fused would have few programs
        self.GATED_DELTA_DECODE = EnvVar.read(
            "GATED_DELTA_DECODE", "auto", choices=("auto", "fused", "split")
        )
        # the registers a thread of the fused decode kernel may use (0: the compiler's choice;
        # 128 fits two programs an SM: 1.10-1.20x faster kernels, docs/benchmarks.md)
        self.GATED_DELTA_REGISTERS = EnvVar.read("GATED_DELTA_REGISTERS", 128)
        # <<< ch31


ENV = _Env()
