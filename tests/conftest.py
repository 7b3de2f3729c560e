"""Set-up every test shares: without a GPU, Triton kernels run in Triton's interpreter.

Triton decides between compiling and interpreting when a kernel is defined, so this must
happen before any kernel module is imported. The interpreter is slow but exact, which is
what the CPU tests of our kernels need.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def serial():
    """Overlap scheduling off for one test: its forwards run one after another, in order."""
    from minisgl.env import ENV

    saved = ENV.DISABLE_OVERLAP_SCHEDULING.value
    ENV.DISABLE_OVERLAP_SCHEDULING.value = True
    yield
    ENV.DISABLE_OVERLAP_SCHEDULING.value = saved
