"""Set-up every test shares: one CPU thread per process, and Triton's interpreter without a GPU.

torch's CPU threads meet at the end of every op. On a shared machine, with a core taken by
something else, two threads wait for each other and a test runs several times slower than
on one thread; on an idle machine the small batches of the tests gain little from a second
one. The environment variable carries the choice to the servers and ranks tests start.

Triton decides between compiling and interpreting when a kernel is defined, so this must
happen before any kernel module is imported. The interpreter is slow but exact, which is
what the CPU tests of our kernels need.
"""

import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# >>> ch12 overlap scheduling, and a way to turn it off
@pytest.fixture
def serial():
    """Overlap scheduling off for one test: its forwards run one after another, in order."""
    from minisgl.env import ENV

    saved = ENV.DISABLE_OVERLAP_SCHEDULING.value
    ENV.DISABLE_OVERLAP_SCHEDULING.value = True
    yield
    ENV.DISABLE_OVERLAP_SCHEDULING.value = saved


# <<< ch12
