"""The two-pass argmax kernel equals torch.argmax: the first index of each row's maximum.

On CPU in Triton's interpreter (tests/conftest.py turns it on without a GPU).
"""

from __future__ import annotations

import os

import pytest
import torch

from minisgl.kernels.argmax import CHUNK, argmax_rows

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a GPU or Triton's interpreter",
)
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("n", [1, 1000, CHUNK, 2 * CHUNK + 17])
def test_argmax_rows_equals_torch(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    logits = torch.randn(5, n, generator=gen)
    if n > CHUNK:  # ties across chunks and inside one: the first index wins
        logits[1, [3, CHUNK + 5, n - 1]] = 50.0
        logits[2, [CHUNK + 1, CHUNK + 2]] = 50.0
    logits[3] = float("-inf")
    logits[3, n - 1] = 0.0
    got = argmax_rows(logits.to(DEV)).cpu()
    assert got.dtype == torch.int64
    assert got.tolist() == logits.argmax(dim=-1).tolist()


def test_argmax_rows_of_a_strided_view_and_no_rows() -> None:
    wide = torch.randn(3, 2 * CHUNK, generator=torch.Generator().manual_seed(1))
    view = wide[:, : CHUNK + 9]  # rows a wider tensor's stride apart
    assert argmax_rows(view.to(DEV)).cpu().tolist() == view.argmax(dim=-1).tolist()
    assert argmax_rows(torch.empty(0, 10, device=DEV)).numel() == 0
