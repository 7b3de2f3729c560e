"""Token embedding in, vocabulary logits out."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl import core  # [ch04]
from minisgl.core import eager_on_graph  # [ch23]
from minisgl.distributed import Split, all_gather, get_tp_info  # [ch21]
from minisgl.layers.linear import Linear
from minisgl.layers.parallel import embed_rank_slice, mark_split, rank_shape  # [ch21]


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        split = Split.even(0, vocab_size)  # each rank holds a slice of the rows  # [ch21]
        vocab_size, hidden_size = rank_shape(split, vocab_size, hidden_size)  # [ch21]
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
        mark_split(split, self.weight)  # [ch21]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # >>> ch21 each rank looks up the ids in its slice; an all-reduce assembles the rows
        if get_tp_info().size > 1:
            return embed_rank_slice(input_ids, self.weight)
        # <<< ch21
        return F.embedding(input_ids, self.weight)


class LMHead(Linear):
    """Projects hidden states onto the vocabulary, in fp32, only where a next token is wanted.

    A prefill of n tokens needs logits for its last token alone; projecting all n onto a
    49k-word vocabulary would be most of the prefill's work for a small model.
    """

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        # A model with tied embeddings replaces the weight with its VocabEmbedding's.
        super().__init__(
            hidden_size,
            vocab_size,
            split=Split.even(0, vocab_size),  # each rank its slice of the vocabulary  # [ch21]
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # >>> ch04 a batch knows where each request's last token is
        if core.get_global_ctx().batch.is_prefill:
            hidden = self.rows_to_project(hidden)
        # <<< ch04
        return self.project(hidden)

    # >>> ch04
    @eager_on_graph  # which rows moves with every prefill: picked between segments  # [ch23]
    def rows_to_project(self, hidden: torch.Tensor) -> torch.Tensor:
        batch = core.get_global_ctx().batch
        rows = batch.attn_metadata.get_last_indices()
        rows = rows if batch.logit_rows is None else batch.logit_rows  # [ch25]
        return hidden[rows]

    # <<< ch04

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.matmul(hidden)
        logits = all_gather(logits)  # the ranks' slices of the vocabulary, side by side  # [ch21]
        if (out := core.logits_out()) is not None:  # cast in one  # [ch18]
            return out.copy_(logits)  # pass, not a float copy then a copy into it  # [ch18]
        return logits.float()
