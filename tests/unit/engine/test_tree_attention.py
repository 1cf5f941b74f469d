"""The flat forward with tree attention against plain Hugging Face passes (float32), through
each attention kernel: torch's SDPA over a padded batch, and the engine's paged CPU kernel."""

from __future__ import annotations

import pytest
import torch

from conftest import CPU_KERNELS, CPU_KERNELS_RUN, CPU_KERNELS_WHY_NOT
from helpers import make_sequence
from specserve.engine import kernels, models
from specserve.engine.batch import Batch
from specserve.engine.flat_model import FlatModel, Segment, UnsupportedAttention
from specserve.engine.kv_cache import head_major
from specserve.speculation.tree import DraftTree
from specserve.verifier.runner import tree_segment


@pytest.fixture(params=["padded", "paged"])
def attention(request) -> str:
    if request.param == "paged" and not CPU_KERNELS_RUN:
        pytest.skip(CPU_KERNELS_WHY_NOT)
    return request.param


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
def test_every_tree_node_matches_a_plain_pass_over_its_path(tiny_model, attention, nodes, seed):
    flat = FlatModel(tiny_model, attention=attention)
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


def test_keeping_an_accepted_path_leaves_the_cache_of_that_path(tiny_model, attention):
    # a small pool: it has to grow
    flat = FlatModel(tiny_model, kv_tokens=16, block_size=4, attention=attention)
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


def test_one_batch_of_sequences_equals_separate_passes(tiny_model, attention):
    flat = FlatModel(tiny_model, attention=attention)
    prompts = [list(range(10, 10 + n)) for n in (3, 17, 8)]
    kvs = [flat.new_kv() for _ in prompts]
    batched = flat.forward([Segment(kv, p) for kv, p in zip(kvs, prompts, strict=True)])
    for p, rows in zip(prompts, batched, strict=True):
        torch.testing.assert_close(rows[0], hf_last_logits(tiny_model, p), atol=1e-4, rtol=1e-4)
    more = flat.forward([Segment(kv, [5, 6]) for kv in kvs])
    for p, rows in zip(prompts, more, strict=True):
        expected = hf_last_logits(tiny_model, p + [5, 6])
        torch.testing.assert_close(rows[0], expected, atol=1e-4, rtol=1e-4)


def test_a_step_mixing_prompt_chunks_with_trees_attends_in_two_groups(tiny_model, attention):
    """Prompt chunks longer than SHORT_TOKENS take one attention call and the decode and tree
    sequences another; every row equals a plain pass all the same."""
    flat = FlatModel(tiny_model, attention=attention)
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


@CPU_KERNELS
def test_the_paged_kernel_gives_a_sequence_the_same_bits_whatever_its_batch():
    """A token's attention reads only what its mask shows, summed in an order that does not
    depend on the other sequences of the call (their lengths pad L)."""
    kernels.load()
    g = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(200, 2, 16, generator=g) for _ in range(2))
    q = torch.randn(3, 4, 16, generator=g)  # 3 tree nodes of one sequence
    own = torch.tensor([[5, 9, 11, 40, 41, 42, 43, 44, 45, 46, 47]])  # 8 past entries + 3
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # node 2: not 1
    mask = torch.ones(1, 1, 3, 11, dtype=torch.bool)
    mask[0, 0, :, 8:] = tree
    alone = torch.ops.specserve.paged_attention(
        q, keys, values, own, mask, torch.empty(0, dtype=torch.long), 0.25
    )
    other = torch.arange(100, 137)[None]  # a longer sequence beside it: L = 37
    slots = torch.zeros(2, 37, dtype=torch.long)
    slots[0, :11], slots[1] = own[0], other[0]
    both_mask = torch.zeros(2, 1, 3, 37, dtype=torch.bool)
    both_mask[0, :, :, :11] = mask[0]
    both_mask[1, 0, 0, :] = True  # its one token sees everything
    q_both = torch.cat([q, torch.randn(1, 4, 16, generator=g)])
    rows = torch.tensor([0, 1, 2, 3])  # padded rows b * N + n (N = 3)
    beside = torch.ops.specserve.paged_attention(q_both, keys, values, slots, both_mask, rows, 0.25)
    assert torch.equal(beside[:3], alone)
    # and it is attention: node 2 against its visible entries by hand
    seen = own[0][mask[0, 0, 2]]
    k, v = keys[seen].transpose(0, 1), values[seen].transpose(0, 1)  # [2, n, 16]
    weights = torch.softmax(q[2].view(2, 2, 16) @ k.transpose(1, 2) * 0.25, dim=-1)
    torch.testing.assert_close(alone[2], (weights @ v).reshape(4, 16), atol=1e-6, rtol=1e-5)


@CPU_KERNELS
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(12, 2, 128), (14, 2, 64), (4, 4, 8)])
@pytest.mark.parametrize("context", [1, 13, 301])
def test_the_paged_kernel_is_attention_and_a_chain_token_gets_its_decode_steps_bits(
    heads, kv_heads, head_dim, context
):
    """The default target's and draft model's head shapes (and a small one), contexts that
    fill no whole block of 8 entries, entries scattered through a pool stored head by head
    (the engine's; the test above reads one stored slot by slot): each token of a
    5-token chain matches float64 attention over what it sees, and has the same bits as the
    same token decoded alone, one step after the other."""
    kernels.load()
    g = torch.Generator().manual_seed(context)
    keys, values = (
        head_major((1, 400, kv_heads, head_dim), torch.float32, "cpu")[0].copy_(
            torch.randn(400, kv_heads, head_dim, generator=g)
        )
        for _ in range(2)
    )
    slots = torch.randperm(400, generator=g)[: context + 5][None]
    q = torch.randn(5, heads, head_dim, generator=g)
    mask = torch.ones(1, 1, 5, context + 5, dtype=torch.bool)
    mask[0, 0, :, context:] = torch.tril(torch.ones(5, 5, dtype=torch.bool))
    scale = head_dim**-0.5
    chain = torch.ops.specserve.paged_attention(
        q, keys, values, slots, mask, torch.arange(5), scale
    )
    none = torch.empty(0, dtype=torch.long)
    for i in range(5):
        seen = slots[0, : context + i + 1]
        alone = torch.ops.specserve.paged_attention(
            q[i : i + 1], keys, values, seen[None], none, none, scale
        )
        assert torch.equal(chain[i], alone[0])
        k = keys[seen].double().repeat_interleave(heads // kv_heads, dim=1)  # [n, heads, d]
        v = values[seen].double().repeat_interleave(heads // kv_heads, dim=1)
        weights = torch.softmax(torch.einsum("hd,nhd->hn", q[i].double(), k) * scale, dim=-1)
        expected = torch.einsum("hn,nhd->hd", weights, v).float()
        torch.testing.assert_close(chain[i], expected, atol=1e-5, rtol=1e-5)


@CPU_KERNELS
def test_paged_attention_where_it_cannot_run_is_refused_and_auto_takes_padded(tiny_model_dir):
    half = models.load_model(tiny_model_dir, "cpu", "bfloat16")  # (the kernel reads float32)
    assert FlatModel(half, attention="auto").attention == "padded"
    with pytest.raises(UnsupportedAttention, match="use auto or padded"):
        FlatModel(half, attention="paged")
