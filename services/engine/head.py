"""An LM head that computes the logits of part of the vocabulary (`keep_head_rows`).

A draft model's LM head is a large share of what its pass reads: the default draft's
[151936, 896] head is 27% of its weights, and its int4 product took 1.9 ms of a 12.9 ms decode
step (2 threads, AMD EPYC). A draft only proposes; the target verifies every token, so a draft
that can propose fewer tokens stays exact and loses only the drafts whose tokens it left out
(FR-Spec, Zhao et al. 2025, keeps the most frequent). The head keeps the rows of the tokens
kept, and its output is as wide as the vocabulary, -inf where a token was left out: whatever
reads the logits (top-k, softmax, a grammar's mask) sees a distribution over the kept tokens.
"""

from __future__ import annotations

import torch
from torch import nn

from .gemm import WideLinear
from .quant import Int4Linear, Int8Linear


class SubsetHead(nn.Module):
    """Logits [rows, vocab] from `rows`, a layer that computes those of `ids` ([kept] token
    ids, ascending); every other token's is -inf."""

    def __init__(self, rows: nn.Module, ids: torch.Tensor, vocab: int):
        super().__init__()
        self.rows = rows
        self.register_buffer("ids", ids)
        self.vocab = vocab

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kept = self.rows(x)
        out = kept.new_full((*kept.shape[:-1], self.vocab), -torch.inf)
        return out.index_copy_(-1, self.ids, kept)


@torch.no_grad()
def rows_of(layer: nn.Module, ids: torch.Tensor) -> nn.Module | None:
    """A copy of a linear layer with only the output channels `ids`, or None where its kind
    keeps its outputs in a layout that cannot be cut by rows (torch's packed int4)."""
    if type(layer) in (nn.Linear, WideLinear):
        names = ("weight",)
    elif isinstance(layer, Int8Linear):
        names = ("codes", "scales")
    elif isinstance(layer, Int4Linear) and layer.layout == "blocks":
        names = ("packed", "scale_offset")
    else:
        return None
    cut = object.__new__(type(layer))
    nn.Module.__init__(cut)
    cut.__dict__.update({k: v for k, v in layer.__dict__.items() if not k.startswith("_")})
    for name in names:
        rows = getattr(layer, name)[ids].contiguous()
        if name == "weight":
            if rows.device.type == "cpu":  # column-major, as FlatModel keeps a CPU head
                rows = rows.t().contiguous().t()
            cut.weight = nn.Parameter(rows, requires_grad=False)
        else:
            cut.register_buffer(name, rows)
    cut.bias = None if layer.bias is None else nn.Parameter(layer.bias[ids], requires_grad=False)
    cut.out_features = len(ids)
    return cut


def keep_head_rows(model: nn.Module, ids: torch.Tensor) -> bool:
    """Makes `model`'s LM head a SubsetHead of the tokens `ids` (ascending); returns whether
    it could (a head whose layout cannot be cut by rows is left whole)."""
    head = model.get_output_embeddings()
    vocab = head.out_features
    ids = ids.to(device=next(model.parameters()).device, dtype=torch.long)
    if len(ids) >= vocab or (cut := rows_of(head, ids)) is None:
        return False
    model.set_output_embeddings(SubsetHead(cut, ids, vocab))
    return True
