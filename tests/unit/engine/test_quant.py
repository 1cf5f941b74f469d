"""Weight-only int8 / int4 models (engine/quant.py): close to their weights, batch-independent
rows, and speculation exact relative to the quantised target's own plain decoding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import DEVICE, NOISE, default_target_dir, save_tiny_qwen
from specserve.common.settings import DrafterSettings, ModelRef, ServiceSettings
from specserve.engine import dtypes, gemm, kernels, models, quant
from specserve.engine.flat_model import FlatModel, Segment
from specserve.speculation import draft_model
from specserve.speculation.draft_model import DraftModelProposer
from specserve.speculation.proposer import TreeShape
from specserve.verifier.sequence import common_prefix
from speculative_decoder import PROMPTS, speculative_greedy

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


# int4 on an x86 CPU: the engine's kernel (inputs a multiple of its 256-input blocks, and
# padded to one) and torch's; elsewhere torch's kernel twice.
LAYER_CASES = [
    ("int8", 256, None),
    ("int4", 256, None),
    ("int4", 288, None),
    ("int4", 256, "torch"),
]


@pytest.mark.parametrize("kind,inputs,kernel", LAYER_CASES)
def test_a_quantised_layer_computes_with_its_weights_and_rows_alone(
    kind, inputs, kernel, monkeypatch
):
    if kernel:
        monkeypatch.setenv("SPECSERVE_INT4_KERNEL", kernel)
    torch.manual_seed(0)
    linear = nn.Linear(inputs, 192).to(DEVICE)
    layer = quant.LAYERS[kind](linear)
    if kind == "int4":
        on_x86 = DEVICE == "cpu" and kernels.cpu_supported()
        assert layer.layout == ("blocks" if on_x86 and kernel is None else "torch")
    x = torch.randn(7, inputs, device=DEVICE)  # [rows, in]
    y = layer(x)  # [rows, out]
    assert y.shape == (7, 192) and y.dtype == torch.float32
    exact = x.float() @ linear.weight.t() + linear.bias
    limit = {"int8": 0.02, "int4": 0.15}[kind]  # of the largest output
    assert (y.float() - exact).abs().max() <= limit * exact.abs().max()
    if kind == "int4":  # against the weights its codes encode: the activations' rounding only
        codes, scales, offsets = quant.int4_codes(linear.weight.detach().float())
        kept = [t.to(quant.KERNEL_DTYPE).float() for t in (scales, offsets)]
        encoded = x.float() @ quant.int4_dequantized(codes, *kept).t() + linear.bias
        assert (y.float() - encoded).abs().max() <= 0.02 * encoded.abs().max()
    # Row i does not depend on the other rows: one token's logits are the same whether it is
    # decoded alone or verified with a tree (what keeps speculation exact).
    alone = torch.cat([layer(x[i : i + 1]) for i in range(7)])
    assert torch.equal(y, alone)


def test_int4_without_the_engines_kernel_takes_torchs_and_says_why(monkeypatch, caplog):
    """A host where the C++ kernel cannot be built (no compiler, no AVX2) serves int4 on
    torch's kernel, with a warning naming the reason; the layer computes the same product."""

    def no_kernel():
        raise kernels.KernelError("no compiler here")

    monkeypatch.setattr(kernels, "load", no_kernel)
    quant._warn_once.cache_clear()
    torch.manual_seed(0)
    linear = nn.Linear(256, 64)
    with caplog.at_level("WARNING", logger="specserve.engine.quant"):
        layer = quant.Int4Linear(linear)
    assert layer.layout == "torch"
    assert "int4 layers use torch's kernel: no compiler here" in caplog.text
    x = torch.randn(3, 256)
    exact = x @ linear.weight.t() + linear.bias
    assert (layer(x) - exact).abs().max() <= 0.15 * exact.abs().max()


def test_an_int8_call_past_the_kernels_rows_computes_the_same_product_by_gemm():
    """More than INT8_KERNEL_ROWS rows (a prompt chunk) go through a GEMM over the widened
    codes (gemm.wide_dtype): the same weights, so each row is the int8 kernel's up to
    rounding."""
    torch.manual_seed(0)
    linear = nn.Linear(256, 192).to(DEVICE)
    layer = quant.Int8Linear(linear)
    x = torch.randn(quant.INT8_KERNEL_ROWS + 9, 256, device=DEVICE)
    by_gemm = layer(x)
    by_kernel = torch.cat([layer(x[i : i + 8]) for i in range(0, len(x), 8)])
    assert by_gemm.shape == by_kernel.shape == (len(x), 192)
    exact = x.float() @ linear.weight.t() + linear.bias
    assert (by_gemm - exact).abs().max() <= 0.02 * exact.abs().max()
    torch.testing.assert_close(by_gemm, by_kernel, rtol=1e-2, atol=1e-2 * exact.abs().max().item())
    assert not torch.equal(by_gemm, by_kernel)  # another kernel ran


def test_a_wide_linear_runs_large_calls_in_float32_and_small_ones_as_before():
    """gemm.WideLinear: up to WIDE_ROWS rows the layer's own half-precision product, past them
    a float32 one over the widened weights, returned in the input's dtype."""
    torch.manual_seed(0)
    linear = nn.Linear(96, 80).to(DEVICE, torch.bfloat16)
    wide = nn.Linear(96, 80).to(DEVICE, torch.bfloat16)
    wide.load_state_dict(linear.state_dict())
    wide.__class__ = gemm.WideLinear
    few = torch.randn(3, gemm.WIDE_ROWS // 3, 96, device=DEVICE).to(torch.bfloat16)
    assert torch.equal(wide(few), linear(few))
    many = torch.randn(gemm.WIDE_ROWS + 1, 96, device=DEVICE).to(torch.bfloat16)
    want = nn.functional.linear(many.float(), linear.weight.float(), linear.bias.float())
    want = want.to(torch.bfloat16)
    assert wide(many).dtype == torch.bfloat16
    assert torch.equal(wide(many), want)


def test_half_precision_layers_widen_only_where_the_device_lacks_bfloat16_matmul(quant_dirs):
    target, _ = quant_dirs
    slow = gemm.wide_dtype(torch.device(DEVICE).type) == torch.float32
    half = models.load_model(target, DEVICE, "bfloat16")
    linears = [m for m in half.modules() if isinstance(m, nn.Linear)]
    widened = [m for m in linears if type(m) is gemm.WideLinear]
    assert len(widened) == (len(linears) if slow else 0)
    assert models.loaded_dtype(half) == "bfloat16"
    full = models.load_model(target, DEVICE, "float32")
    assert not any(type(m) is gemm.WideLinear for m in full.modules())
    flat = FlatModel(half)
    prompt = list(range(3, 3 + gemm.WIDE_ROWS + 20))  # one call past WIDE_ROWS
    (logits,) = flat.forward([Segment(flat.new_kv(), prompt)])
    assert logits.shape[0] == 1 and torch.isfinite(logits).all()


def test_load_model_quantises_every_linear_and_says_so(quantised, quant_dirs):
    kind, target, _ = quantised
    assert not any(isinstance(m, nn.Linear) for m in target.modules())
    assert models.loaded_dtype(target) == kind
    flat = FlatModel(target)
    assert flat.dtype == torch.float32  # activations and KV
    ref = ModelRef(path=str(quant_dirs[0]))
    version = models.served_version(ref, "ab" * 32, dtype=kind, device=DEVICE)
    assert f":{kind}:{DEVICE}" in version  # (cpu-paged2 on a CPU: the attention kernel's)
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


def test_auto_takes_the_fastest_dtype_the_device_runs_and_says_why():
    """CUDA: bfloat16 (or float16). CPU: each candidate the device runs, timed on a decode row
    through layers of the model's MLP shape; the fastest wins, and what it cannot run is named
    with the reason (int4 needs in_features divisible by its group)."""
    choice = dtypes.choose(DEVICE, 48, 96)  # 48: not a multiple of int4's group of 32
    if DEVICE.startswith("cuda"):
        assert choice.dtype == ("bfloat16" if torch.cuda.is_bf16_supported() else "float16")
        return
    assert "not a multiple of 32" in choice.refused["int4"]
    native_bf16 = gemm.wide_dtype("cpu") == torch.bfloat16
    assert ("bfloat16" in choice.ms_per_row) == native_bf16
    assert choice.dtype == min(choice.ms_per_row, key=choice.ms_per_row.get)
    assert set(choice.ms_per_row) | set(choice.refused) == set(dtypes.CPU_CANDIDATES)
    assert choice.dtype in choice.reason and all(ms > 0 for ms in choice.ms_per_row.values())


def test_auto_resolves_before_the_load_and_an_explicit_dtype_is_kept(quant_dirs, tmp_path):
    target = quant_dirs[0]
    chosen = models.resolve_dtype("auto", DEVICE, target, "verifier.dtype")
    assert chosen in ("int4", "int8", "bfloat16", "float16", "float32")
    assert models.resolve_dtype("float32", DEVICE, tmp_path) == "float32"  # (nothing read)
    with pytest.raises(models.ModelError, match=r"drafter\.dtype: auto needs the model's config"):
        models.resolve_dtype("auto", DEVICE, tmp_path, "drafter.dtype")
    settings = DrafterSettings(draft_model_path=str(target), device=DEVICE, dtype="auto")
    assert draft_model.with_dtype(settings).dtype in ("int4", "int8", "bfloat16", "float32")
    assert draft_model.with_dtype(settings.model_copy(update={"dtype": "int8"})).dtype == "int8"


def plain_greedy_with_margins(target, prompt: list[int], tokens: int, eos: int):
    """Plain greedy decoding of `target` through FlatModel, up to `tokens` tokens or EOS: the
    tokens, and at each (its logit, the margin to the runner-up's)."""
    flat = FlatModel(target)
    kv = flat.new_kv()
    (rows,) = flat.forward([Segment(kv, prompt)])
    out, margins = [], []
    for _ in range(tokens):
        top = torch.topk(rows[-1], 2)
        out.append(int(top.indices[0]))
        margins.append((float(top.values[0]), float(top.values[0] - top.values[1])))
        if out[-1] == eos:
            break
        (rows,) = flat.forward([Segment(kv, [out[-1]])])
    return out, margins


@pytest.mark.default_model
def test_default_pair_int8_speculation_equals_the_int8_targets_plain_decoding(tokenizer):
    """The real 1.5B target and 0.5B draft, both int8: a chain of 4 drafts per step.

    The int8 LM head's logits are bfloat16, so the top two often tie exactly; float32
    attention rounds differently for passes of other shapes on some CPUs (1e-7), which can
    tip such a tie either way. So the outputs are equal, or part where plain decoding's top
    two logits were within one bfloat16 step of each other; anywhere else is a fault."""
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
    plain, margins = plain_greedy_with_margins(target, prompt, 24, eos)
    chain = TreeShape(max_depth=4, branching=1, width=1)
    (output,), steps = speculative_greedy(
        target, DraftModelProposer(draft, chain), [prompt], 24, 4, eos
    )
    same = common_prefix(output, plain)
    if output != plain:
        top, margin = margins[same]
        assert margin <= abs(top) * 2**-7, f"token {same} differs with a margin of {margin}"
    assert steps < len(output)  # the drafts were accepted some of the time


@pytest.mark.parametrize("kind", KINDS)
def test_a_quantised_layer_traces_whole_under_torch_compile(kind):
    """fullgraph: no graph break (the kernels have shape functions for tracing); the
    aot_eager backend traces as inductor would, without compiling C++."""
    torch.manual_seed(0)
    layer = quant.LAYERS[kind](nn.Linear(256, 128).to(DEVICE))
    x = torch.randn(3, 256, device=DEVICE)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), layer(x))
