"""The kernel choice's measurements, kept on disk, so that the next start reads them.

On a fresh machine most of the kernel choice's time goes to compiling every candidate
kernel, including the ones that lose; Triton keeps what it compiled, but the choice would
still load and time every candidate at each start. So, as Triton caches its kernels, we
keep each candidate's measured time in a small JSON file under MINISGL_CACHE_DIR (default
~/.cache/minisgl; empty: no cache), in `kernel_choice/`.

A file holds the times of one GPU and one software stack only. Its name is a hash of that
identity (the GPU's name and compute capability; the versions of torch, CUDA, Triton and
minisgl; the source of every kernel that was timed and of the code around it; the knobs
that change those kernels), and the identity is written inside as well and compared when
the file is read: a file from another GPU, or from before an upgrade or an edit of a
kernel, is never used. Inside, one entry per shape (the projection as the GEMV sees it,
the dtypes and the row count) maps each candidate to its seconds per call, so a model
that brings a new shape measures only that one, and `pick` still decides from the times.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch

import minisgl
from minisgl.env import ENV

logger = logging.getLogger(__name__)
PACKAGE = Path(minisgl.__file__).parent
# What the timed code is made of: the kernels, the layers that launch them, the choice.
SOURCES = (
    "kernels",
    "layers/triton_ops.py",
    "layers/elementwise_ops.py",
    "layers/norm.py",
    "layers/activation.py",
    "layers/kernel_plan.py",
    "quant/fp8.py",  # [ch28]
    "quant/fp8_choice.py",  # [ch28]
    "engine/kernel_choice.py",
)


class TimesCache:
    """Measured seconds per call, by shape entry and candidate; on disk where `path` is set."""

    def __init__(self, path: Path | None = None, identity: dict[str, str] | None = None) -> None:
        self.path, self.identity = path, identity or {}
        self.entries: dict[str, dict[str, float]] = {}
        self.hits = self.changed = 0
        if path is not None and path.is_file():
            self.entries = self._read(path)

    @classmethod
    def for_device(cls, device: torch.device) -> TimesCache:
        """The cache of this GPU and software; one in memory only on a CPU or with the cache
        off (MINISGL_CACHE_DIR empty)."""
        if device.type != "cuda" or not ENV.CACHE_DIR.value:
            return cls()
        identity = gpu_identity(device)
        name = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
        return cls(
            Path(ENV.CACHE_DIR.value).expanduser() / "kernel_choice" / f"{name}.json", identity
        )

    def has(self, entry: str, labels: Iterable[str]) -> bool:
        """Whether `get` would find the times of `entry` (and count a hit)."""
        times = self.entries.get(entry)
        return times is not None and set(times) == set(labels)

    def get(self, entry: str, labels: Iterable[str]) -> dict[str, float] | None:
        """The times of `entry`, if every one of `labels` was measured; else None."""
        if not self.has(entry, labels):
            return None
        self.hits += 1
        return self.entries[entry]

    def put(self, entry: str, times: dict[str, float]) -> None:
        self.entries[entry] = times
        self.changed += 1

    def save(self) -> None:
        """Write the file if anything was measured (atomically: ranks may write at once)."""
        if self.path is None or not self.changed:
            return
        body = {"identity": self.identity, "entries": self.entries}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(body, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except OSError as e:  # a read-only home: the next start measures again, that is all
            logger.warning("could not keep the kernel choice's times in %s: %s", self.path, e)

    def _read(self, path: Path) -> dict[str, dict[str, float]]:
        try:
            body = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            logger.warning("kernel choice cache %s unreadable (%s): measuring again", path, e)
            return {}
        if not isinstance(body, dict) or body.get("identity") != self.identity:
            logger.warning("kernel choice cache %s is for other hardware or software", path)
            return {}
        entries = body.get("entries")
        return entries if isinstance(entries, dict) else {}


def gpu_identity(device: torch.device) -> dict[str, str]:
    """What measured times depend on, besides the shape: they hold for this and nothing else."""
    import triton

    major, minor = torch.cuda.get_device_capability(device)
    return {
        "gpu": torch.cuda.get_device_name(device),
        "capability": f"{major}.{minor}",
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "triton": triton.__version__,
        "minisgl": minisgl.__version__,
        "sources": sources_hash(),
        "knobs": f"FUSED_KERNELS={ENV.FUSED_KERNELS.value}",
    }


def sources_hash(root: Path = PACKAGE) -> str:
    """A hash of the timed code's source files: an edit of any kernel makes a new cache."""
    digest = hashlib.sha256()
    for source in SOURCES:
        path = root / source
        for file in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            if file.is_file():
                digest.update(str(file.relative_to(root)).encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()[:16]
