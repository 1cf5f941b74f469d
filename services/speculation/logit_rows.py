"""A step's logits as the forward pass leaves them: each sequence's rows a view of one
[rows, vocab] buffer, back to back. Selection reads them there, in place, where it can."""

from __future__ import annotations

import torch


def stacked(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors' rows one after another: a view when they already lie back to back in one
    buffer (as a forward pass's split logits do), else a copy."""
    whole = back_to_back(tensors)
    return torch.cat(tensors) if whole is None else whole


def row_sums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """[rows]: the sum of each row of the tensors, one after another; never a copy of them."""
    whole = back_to_back(tensors)
    if whole is None:
        return torch.cat([t.sum(-1) for t in tensors])
    return whole.sum(-1)


def back_to_back(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensors' rows as one view, if they lie back to back in one buffer; else None."""
    first = tensors[0]
    storage, end = first.untyped_storage().data_ptr(), first.data_ptr()
    for t in tensors:
        same = t.untyped_storage().data_ptr() == storage and t.dtype == first.dtype
        if not (same and t.is_contiguous() and t.data_ptr() == end):
            return None
        end += t.numel() * t.element_size()
    rows = sum(t.shape[0] for t in tensors)
    return first.as_strided((rows, *first.shape[1:]), first.stride())
