"""Weight-only int8 / int4 models (common/quant.py): close to their weights, batch-independent
rows, and speculation exact relative to the quantised target's own plain decoding."""

from __future__ import annotations

import pytest
import torch
from test_speculative import PROMPTS, speculative_greedy
from torch import nn

from conftest import DEVICE, NOISE, default_target_dir, save_tiny_qwen
from specserve.common import models, quant
from specserve.common.flat_model import FlatModel, Segment
from specserve.common.settings import DrafterSettings, ModelRef, ServiceSettings
from specserve.drafter.draft_model import DraftModelProposer
from specserve.drafter.proposer import TreeShape

KINDS = ["int8", "int4"]
# A 128-wide tiny model: the CUDA int4 layout needs in_features divisible by 128.
WIDTH = {"hidden_size": 128, "intermediate_size": 256}
SHAPES = {
    "chain": TreeShape(max_depth=16, branching=1, width=1),
    "tree": TreeShape(max_depth=6, branching=3, width=4),
}


@pytest.fixture(scope="module")
def quant_dirs(tmp_path_factory, tokenizer):
    target = save_tiny_qwen(tmp_path_factory.mktemp("quant-target"), tokenizer, **WIDTH)
    draft = save_tiny_qwen(tmp_path_factory.mktemp("quant-draft"), tokenizer, NOISE, **WIDTH)
    return target, draft


@pytest.fixture(scope="module", params=KINDS)
def quantised(request, quant_dirs):
    """(kind, quantised tiny target, the same kind of quantised tiny draft)."""
    target, draft = quant_dirs
    kind = request.param
    return kind, models.load_model(target, DEVICE, kind), models.load_model(draft, DEVICE, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_a_quantised_layer_computes_with_its_weights_and_rows_alone(kind):
    torch.manual_seed(0)
    linear = nn.Linear(256, 192).to(DEVICE)
    layer = quant.LAYERS[kind](linear)
    x = torch.randn(7, 256, device=DEVICE)  # [rows, in]
    y = layer(x)  # [rows, out]
    assert y.shape == (7, 192) and y.dtype == torch.float32
    exact = x.float() @ linear.weight.t() + linear.bias
    limit = {"int8": 0.02, "int4": 0.15}[kind]  # of the largest output
    assert (y.float() - exact).abs().max() <= limit * exact.abs().max()
    # Row i does not depend on the other rows: one token's logits are the same whether it is
    # decoded alone or verified with a tree (what keeps speculation exact).
    alone = torch.cat([layer(x[i : i + 1]) for i in range(7)])
    assert torch.equal(y, alone)


def test_load_model_quantises_every_linear_and_says_so(quantised, quant_dirs):
    kind, target, _ = quantised
    assert not any(isinstance(m, nn.Linear) for m in target.modules())
    assert models.loaded_dtype(target) == kind
    flat = FlatModel(target)
    assert flat.dtype == torch.float32  # activations and KV
    ref = ModelRef(path=str(quant_dirs[0]))
    version = models.served_version(ref, "ab" * 32, dtype=kind, device=DEVICE)
    assert version.endswith(f":{kind}:{DEVICE}")
    # Close to the float32 model it came from: the logits point the same way.
    exact = FlatModel(models.load_model(quant_dirs[0], DEVICE, "float32"))
    prompt = PROMPTS[1]
    got = flat.forward([Segment(flat.new_kv(), prompt, logits_from=0)])[0]  # [n, vocab]
    want = exact.forward([Segment(exact.new_kv(), prompt, logits_from=0)])[0]
    cosine = nn.functional.cosine_similarity(got, want, dim=-1)
    assert cosine.min() > {"int8": 0.999, "int4": 0.98}[kind]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("draft", ["same", "other"])
def test_greedy_speculation_equals_the_quantised_targets_plain_decoding(
    quantised, tokenizer, draft, shape
):
    kind, target, other = quantised
    eos, prompts = tokenizer.eos_token_id, PROMPTS[:3]
    plain, _ = speculative_greedy(
        target, DraftModelProposer(FlatModel(target), SHAPES[shape]), prompts, 32, 0, eos
    )
    proposer = DraftModelProposer(FlatModel(target if draft == "same" else other), SHAPES[shape])
    outputs, steps = speculative_greedy(target, proposer, prompts, 32, 16, eos)
    assert outputs == plain
    if draft == "same" and shape == "chain":  # a perfect draft: several tokens per step
        assert steps < max(len(o) for o in outputs) / 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a build without CUDA")
def test_a_dtype_the_device_cannot_run_stops_the_load_naming_the_key(quant_dirs):
    with pytest.raises(models.ModelError, match=r"verifier\.dtype: int8 cannot run on cuda"):
        models.load_model(quant_dirs[0], "cuda", "int8", setting="verifier.dtype")


@pytest.mark.default_model
def test_default_pair_int8_speculation_equals_the_int8_targets_plain_decoding(tokenizer):
    """The real 1.5B target and 0.5B draft, both int8: a chain of 4 drafts per step."""
    target = models.load_model(default_target_dir(), DEVICE, "int8")
    ref = DrafterSettings().draft_model
    path, _ = models.resolve(ref, ServiceSettings.load(None).model_cache_dir)
    draft = FlatModel(models.load_model(path, DEVICE, "int8"))
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a Python function that reverses a list."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    prompt, eos = tokenizer(text).input_ids, tokenizer.eos_token_id
    chain = TreeShape(max_depth=4, branching=1, width=1)
    plain, _ = speculative_greedy(target, DraftModelProposer(draft, chain), [prompt], 24, 0, eos)
    outputs, steps = speculative_greedy(
        target, DraftModelProposer(draft, chain), [prompt], 24, 4, eos
    )
    assert outputs == plain
    assert steps < len(outputs[0])  # the drafts were accepted some of the time


@pytest.mark.parametrize("kind", KINDS)
def test_a_quantised_layer_traces_whole_under_torch_compile(kind):
    """fullgraph: no graph break (the kernels have shape functions for tracing); the
    aot_eager backend traces as inductor would, without compiling C++."""
    torch.manual_seed(0)
    layer = quant.LAYERS[kind](nn.Linear(256, 128).to(DEVICE))
    x = torch.randn(3, 256, device=DEVICE)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), layer(x))
