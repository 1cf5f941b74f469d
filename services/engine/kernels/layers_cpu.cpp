// A step's decoder layers as one op on the CPU (specserve::int4_layers): every layer of a
// model whose projections are int4_mm's layout, run from C++ over the engine's own kernels and
// ATen's ops, with the step's KV written to the pool and read through the paged kernel.
//
// Why: at decode sizes the ops between the int4 products cost their dispatch, not their
// arithmetic. The default target's step took 40 ms, of which its 113 int4 products alone took
// 31 ms; the same step with every product replaced by a ready tensor took 6.5 ms, about 0.2 ms
// a layer of Python, module calls and ATen dispatch for some twenty small ops. Here a layer is
// a dozen calls through the dispatcher (about a microsecond each) with no Python between them.
//
// The same ops in the same order as DecoderLayer.front/back, write_kv and paged_group (layers.py,
// attention.py), on the same tensors: the outputs are those of the Python layers, bit for bit
// (tests/unit/engine/test_int4_layers.py holds them to it).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>

namespace {

using Product = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&);
using Norm = at::Tensor(const at::Tensor&, const at::Tensor&, double);
using Attention = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, const at::Tensor&, const at::Tensor&, double);

// The engine's kernels, found once (each is registered by its own source file).
struct Kernels {
  c10::TypedOperatorHandle<Product> int4_mm, rotary;
  c10::TypedOperatorHandle<Norm> rms_norm;
  c10::TypedOperatorHandle<Attention> paged_attention;
};

const Kernels& kernels() {
  static const Kernels found = [] {
    auto& d = c10::Dispatcher::singleton();
    return Kernels{d.findSchemaOrThrow("specserve::int4_mm", "").typed<Product>(),
                   d.findSchemaOrThrow("specserve::rotary", "").typed<Product>(),
                   d.findSchemaOrThrow("specserve::rms_norm", "").typed<Norm>(),
                   d.findSchemaOrThrow("specserve::paged_attention", "").typed<Attention>()};
  }();
  return found;
}

// Tensors a layer brings, in `weights` (kParts of them a layer, in this order); an
// absent bias is an empty tensor.
enum Part : int64_t {
  kNormIn, kQkvCodes, kQkvPairs, kQkvBias, kOutCodes, kOutPairs,
  kNormPost, kGateUpCodes, kGateUpPairs, kDownCodes, kDownPairs, kParts
};

// hidden [T, hidden] float32 (the step's embedded tokens), cos and sin [T, 1, D] ->
// hidden after every layer. keys and values: the pool's [layers, S, KVH, D] (any strides,
// last 1); the new tokens' entries go to write_slots, then each layer attends through slots,
// mask and query_rows as paged_attention does.
at::Tensor int4_layers(const at::Tensor& hidden_in, const at::Tensor& cos, const at::Tensor& sin,
                       at::TensorList weights, const at::Tensor& keys, const at::Tensor& values,
                       const at::Tensor& write_slots, const at::Tensor& slots,
                       const at::Tensor& mask, const at::Tensor& query_rows, int64_t heads,
                       int64_t kv_heads, double eps, double scale) {
  const int64_t layers = keys.size(0);
  TORCH_CHECK(hidden_in.dim() == 2 && hidden_in.scalar_type() == at::kFloat,
              "int4_layers: hidden must be float32 [T, hidden]");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kParts,
              "int4_layers: weights must be ", kParts, " tensors a layer for ", layers, " layers");
  TORCH_CHECK(values.sizes() == keys.sizes() && keys.size(2) == kv_heads,
              "int4_layers: keys and values must be [layers, S, kv_heads, D] alike");
  const Kernels& k = kernels();
  const int64_t tokens = hidden_in.size(0), d = keys.size(3);
  const auto product = [&](const at::Tensor& x, const at::Tensor* w) {
    return k.int4_mm.call(x, w[0], w[1]);
  };
  at::Tensor hidden = hidden_in;
  for (int64_t layer = 0; layer < layers; ++layer) {
    const at::Tensor* w = weights.data() + layer * kParts;
    // DecoderLayer.front
    at::Tensor qkv = product(k.rms_norm.call(hidden, w[kNormIn], eps), w + kQkvCodes);
    if (w[kQkvBias].numel() > 0) qkv = qkv + w[kQkvBias];
    qkv = qkv.view({tokens, heads + 2 * kv_heads, d});
    const at::Tensor qk = k.rotary.call(qkv.narrow(1, 0, heads + kv_heads), cos, sin);
    const at::Tensor q = qk.narrow(1, 0, heads);
    // write_kv
    const at::Tensor layer_keys = keys.select(0, layer), layer_values = values.select(0, layer);
    layer_keys.index_copy_(0, write_slots, qk.narrow(1, heads, kv_heads));
    layer_values.index_copy_(0, write_slots, qkv.narrow(1, heads + kv_heads, kv_heads));
    // paged_group
    const at::Tensor attended =
        k.paged_attention.call(q, layer_keys, layer_values, slots, mask, query_rows, scale);
    // DecoderLayer.back
    hidden = hidden + product(attended.reshape({attended.size(0), -1}), w + kOutCodes);
    const at::Tensor gate_up =
        product(k.rms_norm.call(hidden, w[kNormPost], eps), w + kGateUpCodes);
    const auto halves = gate_up.chunk(2, -1);
    hidden = hidden + product(at::silu(halves[0]) * halves[1], w + kDownCodes);
  }
  return hidden;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.def("int4_layers(Tensor hidden, Tensor cos, Tensor sin, Tensor[] weights, Tensor keys, "
        "Tensor values, Tensor write_slots, Tensor slots, Tensor mask, Tensor query_rows, "
        "int heads, int kv_heads, float eps, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(specserve, CPU, m) { m.impl("int4_layers", int4_layers); }
