"""Token embedding in, vocabulary logits out."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.core import get_global_ctx  # [ch04]


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """Projects hidden states to fp32 logits, only where a next token is wanted.

    A prefill of n tokens needs logits for its last token alone; projecting all n onto a
    49k-word vocabulary would be most of the prefill's work for a small model.
    """

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        # A model with tied embeddings replaces this with its VocabEmbedding's weight.
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # >>> ch04 a batch knows where each request's last token is
        batch = get_global_ctx().batch
        if batch.is_prefill:
            rows = batch.attn_metadata.get_last_indices()
            rows = rows if batch.logit_rows is None else batch.logit_rows  # [ch25]
            hidden = hidden[rows]
        # <<< ch04
        return self.project(hidden)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight).float()
