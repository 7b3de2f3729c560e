"""Token embedding in, vocabulary logits out."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.core import get_global_ctx  # [ch04]
from minisgl.distributed import Split, all_gather, all_reduce, get_tp_info  # [ch21]
from minisgl.engine.breakable import eager_on_graph  # [ch23]
from minisgl.layers.fused import gemv_kernel  # [ch20]


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        # >>> ch21 each rank holds a contiguous slice of the vocabulary's rows
        split = Split.even(0, vocab_size)
        self.vocab_start = get_tp_info().rank * split.local_size
        vocab_size = split.local_size
        # <<< ch21
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
        self.weight.tp_split = split  # [ch21]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # >>> ch21 a rank looks up the ids in its slice and gives zeros for the others; the
        # all-reduce then hands every rank each id's row from the rank that holds it.
        if get_tp_info().size > 1:
            ids = input_ids - self.vocab_start
            outside = (ids < 0) | (ids >= self.weight.size(0))
            x = F.embedding(ids.masked_fill(outside, 0), self.weight)
            return all_reduce(x.masked_fill_(outside[:, None], 0.0))
        # <<< ch21
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """Projects hidden states to fp32 logits, only where a next token is wanted.

    A prefill of n tokens needs logits for its last token alone; projecting all n onto a
    49k-word vocabulary would be most of the prefill's work for a small model.
    """

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        # >>> ch21 each rank projects onto its slice of the vocabulary
        split = Split.even(0, vocab_size)
        vocab_size = split.local_size
        # <<< ch21
        # A model with tied embeddings replaces this with its VocabEmbedding's weight.
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
        self.weight.tp_split = split  # [ch21]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # >>> ch04 a batch knows where each request's last token is
        if get_global_ctx().batch.is_prefill:
            hidden = self.rows_to_project(hidden)
        # <<< ch04
        return self.project(hidden)

    # >>> ch04
    # Which rows moves with every prefill: in a prefill graph they are picked eagerly.
    @eager_on_graph  # [ch23]
    def rows_to_project(self, hidden: torch.Tensor) -> torch.Tensor:
        batch = get_global_ctx().batch
        rows = batch.attn_metadata.get_last_indices()
        rows = rows if batch.logit_rows is None else batch.logit_rows  # [ch25]
        return hidden[rows]

    # <<< ch04

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.matmul(hidden)
        logits = all_gather(logits)  # the ranks' slices of the vocabulary, side by side  # [ch21]
        return logits.float()

    def matmul(self, hidden: torch.Tensor) -> torch.Tensor:
        # >>> ch20 one token: our GEMV kernel reads the vocabulary's rows at full speed
        if gemv := gemv_kernel(hidden):
            return gemv(hidden, self.weight)
        # <<< ch20
        return F.linear(hidden, self.weight)
