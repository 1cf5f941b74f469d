"""The flat forward with tree attention against plain Hugging Face passes (float32)."""

from __future__ import annotations

import pytest
import torch

from helpers import make_sequence
from specserve.common.tree import DraftTree
from specserve.engine.batch import Batch
from specserve.engine.flat_model import FlatModel, Segment
from specserve.verifier.runner import tree_segment


def hf_last_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids], device=model.device)).logits[0, -1].float()


def random_tree(nodes: int, vocab: int, seed: int) -> DraftTree:
    g = torch.Generator().manual_seed(seed)
    tree = DraftTree()
    for i in range(nodes):
        parent = int(torch.randint(-1, i, (), generator=g)) if i else -1
        tree.add(int(torch.randint(vocab, (), generator=g)), parent)
    return tree


@pytest.mark.parametrize("nodes,seed", [(1, 0), (5, 1), (16, 2), (64, 3)])
def test_every_tree_node_matches_a_plain_pass_over_its_path(tiny_model, nodes, seed):
    flat = FlatModel(tiny_model)
    vocab = tiny_model.config.vocab_size
    prompt = torch.randint(vocab, (23,), generator=torch.Generator().manual_seed(seed)).tolist()
    seq = make_sequence(prompt[:20], prompt[20:])
    seq.kv = flat.new_kv()
    flat.forward([Segment(seq.kv, prompt[:20])])  # the prompt is cached; 3 tokens pending
    tree = random_tree(nodes, vocab, seed)
    (logits,) = flat.forward([tree_segment(seq, tree)])
    assert logits.shape == (nodes + 1, vocab)
    torch.testing.assert_close(logits[0], hf_last_logits(tiny_model, prompt), atol=1e-4, rtol=1e-4)
    for node in range(nodes):
        expected = hf_last_logits(tiny_model, prompt + tree.path(node))
        torch.testing.assert_close(logits[node + 1], expected, atol=1e-4, rtol=1e-4)


def test_keeping_an_accepted_path_leaves_the_cache_of_that_path(tiny_model):
    flat = FlatModel(tiny_model, kv_tokens=16, block_size=4)  # small: the pool has to grow
    prompt = list(range(100, 130))
    seq = make_sequence(prompt)
    seq.kv = flat.new_kv()
    tree = DraftTree()
    a = tree.add(7, -1)
    tree.add(8, -1)
    b = tree.add(9, a)
    flat.forward([tree_segment(seq, tree)])
    seq.kv.keep(seq.kv.length - len(tree), [a, b])
    assert seq.kv.length == len(prompt) + 2
    (after,) = flat.forward([Segment(seq.kv, [11])])
    expected = hf_last_logits(tiny_model, prompt + [7, 9, 11])
    torch.testing.assert_close(after[0], expected, atol=1e-4, rtol=1e-4)


def test_one_batch_of_sequences_equals_separate_passes(tiny_model):
    flat = FlatModel(tiny_model)
    prompts = [list(range(10, 10 + n)) for n in (3, 17, 8)]
    kvs = [flat.new_kv() for _ in prompts]
    batched = flat.forward([Segment(kv, p) for kv, p in zip(kvs, prompts, strict=True)])
    for p, rows in zip(prompts, batched, strict=True):
        torch.testing.assert_close(rows[0], hf_last_logits(tiny_model, p), atol=1e-4, rtol=1e-4)
    more = flat.forward([Segment(kv, [5, 6]) for kv in kvs])
    for p, rows in zip(prompts, more, strict=True):
        expected = hf_last_logits(tiny_model, p + [5, 6])
        torch.testing.assert_close(rows[0], expected, atol=1e-4, rtol=1e-4)


def test_a_step_mixing_prompt_chunks_with_trees_attends_in_two_groups(tiny_model):
    """Prompt chunks longer than SHORT_TOKENS take one attention call and the decode and tree
    sequences another; every row equals a plain pass all the same."""
    flat = FlatModel(tiny_model)
    vocab = tiny_model.config.vocab_size
    ids = torch.randint(vocab, (400,), generator=torch.Generator().manual_seed(7)).tolist()
    chunks = [ids[:150], ids[150:220]]  # two prompt chunks of different lengths
    decoding = make_sequence(ids[220:250], ids[250:251])  # one token pending
    branching = make_sequence(ids[300:340], ids[340:342])  # two pending, then a tree
    for seq in (decoding, branching):
        seq.kv = flat.new_kv()
        flat.forward([Segment(seq.kv, seq.prompt_ids)])
    tree = random_tree(9, vocab, 7)
    segments = [
        Segment(flat.new_kv(), chunks[0]),
        tree_segment(branching, tree),
        Segment(flat.new_kv(), chunks[1], logits_from=0),
        tree_segment(decoding, DraftTree()),
    ]
    layout = Batch.build(segments, flat.device)  # (takes blocks; lengths stay as they are)
    assert [group.shape[0] for group in layout.groups] == [2, 2]  # (short, long)
    first, tree_rows, second, decode_rows = flat.forward(segments)
    torch.testing.assert_close(
        first[0], hf_last_logits(tiny_model, chunks[0]), atol=1e-4, rtol=1e-4
    )
    for i in range(len(chunks[1])):
        expected = hf_last_logits(tiny_model, chunks[1][: i + 1])
        torch.testing.assert_close(second[i], expected, atol=1e-4, rtol=1e-4)
    expected = hf_last_logits(tiny_model, ids[220:251])
    torch.testing.assert_close(decode_rows[0], expected, atol=1e-4, rtol=1e-4)
    prefix = ids[300:342]
    torch.testing.assert_close(
        tree_rows[0], hf_last_logits(tiny_model, prefix), atol=1e-4, rtol=1e-4
    )
    for node in range(len(tree)):
        expected = hf_last_logits(tiny_model, prefix + tree.path(node))
        torch.testing.assert_close(tree_rows[node + 1], expected, atol=1e-4, rtol=1e-4)
