"""Set-up every test shares: without a GPU, Triton kernels run in Triton's interpreter.

Triton decides between compiling and interpreting when a kernel is defined, so this must
happen before any kernel module is imported. The interpreter is slow but exact, which is
what the CPU tests of our kernels need.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
