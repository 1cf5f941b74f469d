"""A draft model's LM head cut to part of the vocabulary (engine/head.py, drafter.draft_vocab):
the kept tokens' logits unchanged, the others -inf, drafts only of kept tokens, and
speculation as exact as with the whole head."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import DEVICE, save_tiny_qwen
from specserve.engine import models, quant
from specserve.engine.flat_model import FlatModel, Segment
from specserve.engine.head import SubsetHead, keep_head_rows, rows_of
from specserve.speculation.draft_model import DraftModelProposer, keep_vocab, vocab_ids
from specserve.speculation.proposer import TreeShape
from speculative_decoder import PROMPTS, speculative_greedy

KEEP = 2000
WIDTH = {"hidden_size": 128, "intermediate_size": 256}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    return save_tiny_qwen(tmp_path_factory.mktemp("head-model"), tokenizer, **WIDTH)


def last_logits(hf, prompt: list[int]) -> torch.Tensor:
    flat = FlatModel(hf)
    return flat.forward([Segment(flat.new_kv(), prompt)])[0][-1]


def test_the_kept_ids_are_the_lowest_and_every_added_token(tokenizer):
    ids = vocab_ids(tokenizer, 151936, KEEP)
    added = sorted(tokenizer.added_tokens_decoder)
    assert ids.tolist() == [*range(KEEP), *added]
    assert tokenizer.eos_token_id in ids.tolist()
    assert len(vocab_ids(tokenizer, 151936, 10**6)) == 151936  # (more than there are: all)


@pytest.mark.parametrize("kind", ["float32", "int8", "int4"])
def test_a_cut_head_gives_the_kept_tokens_their_own_logits_and_the_rest_minus_inf(
    model_dir, tokenizer, kind
):
    prompt = tokenizer("def add(a, b):").input_ids
    whole = last_logits(models.load_model(model_dir, DEVICE, kind), prompt)
    cut_model = models.load_model(model_dir, DEVICE, kind)
    keep_vocab(cut_model, tokenizer, KEEP)
    assert isinstance(cut_model.get_output_embeddings(), SubsetHead)
    cut = last_logits(cut_model, prompt)
    ids = vocab_ids(tokenizer, whole.shape[-1], KEEP).to(cut.device)
    assert cut.shape == whole.shape
    if kind == "float32":  # (BLAS may sum a row in another order for a narrower product: an
        # AVX-512 Xeon's differed in the last bit; a draft's head only proposes)
        torch.testing.assert_close(cut[ids], whole[ids], rtol=1e-5, atol=1e-6)
    else:  # (the int8 and int4 kernels compute each output from its own row and weights)
        assert torch.equal(cut[ids], whole[ids])
    others = torch.ones_like(cut, dtype=torch.bool)
    others[ids] = False
    assert torch.isneginf(cut[others]).all()


@pytest.mark.parametrize("kind", ["float32", "int4"])
def test_a_draft_with_a_cut_head_drafts_only_kept_tokens_and_speculation_stays_exact(
    model_dir, tokenizer, kind
):
    """The target as its own draft, its head cut to the tokens of its plain outputs but one
    that ends an output after other tokens: plain decoding's output, every drafted token a
    kept one, and fewer steps than tokens (drafts of kept tokens are accepted)."""
    target = models.load_model(model_dir, DEVICE, kind)
    draft = models.load_model(model_dir, DEVICE, kind)
    chain = TreeShape(max_depth=8, branching=1, width=1)
    eos, prompts = tokenizer.eos_token_id, PROMPTS[:3]
    plain, _ = speculative_greedy(
        target, DraftModelProposer(FlatModel(target), chain), prompts, 32, 0, eos
    )
    cut = next(output[-1] for output in plain if output[0] != output[-1])
    kept = sorted({t for output in plain for t in output} - {cut})
    assert keep_head_rows(draft, torch.tensor(kept))
    proposer = DraftModelProposer(FlatModel(draft), chain)
    drafted: list[int] = []
    propose = proposer.propose

    def recording(jobs):
        trees = propose(jobs)
        drafted.extend(t for tree in trees for t in tree.token_ids)
        return trees

    proposer.propose = recording
    outputs, steps = speculative_greedy(target, proposer, prompts, 32, 8, eos)
    assert outputs == plain
    assert drafted and set(drafted) <= set(kept)
    assert steps < max(len(o) for o in outputs)


def test_a_head_whose_layout_cannot_be_cut_stays_whole(monkeypatch):
    monkeypatch.setenv("SPECSERVE_INT4_KERNEL", "torch")  # torch's packed int4 layout
    layer = quant.Int4Linear(nn.Linear(256, 64))
    assert rows_of(layer, torch.arange(8)) is None
