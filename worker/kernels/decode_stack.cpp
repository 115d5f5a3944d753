// A decode step's decoder layers in one native call: the CPU's counterpart of replaying a
// CUDA graph. The Python path pays ~40 us a layer in interpreter and dispatcher overhead
// around ten kernels (a 30-layer model at batch 1: ~1.3 ms of a ~6.5 ms step); here the
// same kernels run in the same order from C++, each through the dispatcher's typed handle
// (well under a microsecond), so the step computes bit for bit what the Python path does
// (``tests/worker/test_decode_stack.py``).
//
// Per layer, x and residual [rows, hidden]:
//   x, residual = add_rms_norm(x, residual)      (the first layer: rms_norm(x), residual = x)
//   q | k | v   = qkv(x);  rotary(q, k);  write_kv(k, v);  a = paged_decode(q)
//   x, residual = add_rms_norm(o_proj(a), residual)
//   x           = down(silu_and_mul(gate_up(x)))
// and after the last, the final norm. Each linear is the kernel the Python path calls for
// that layer (``worker/models/decode_stack.py`` builds the stack and says which steps it serves). ``step`` runs the whole decode step: the embedding's lookup (plain,
// or quantized rows dequantized), the layers, and the LM head on the rows that sample.
// the narrow headers, not <ATen/ATen.h> (every op's declaration): a first start compiles faster
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/embedding.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/linear.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <vector>

namespace kervan::stack {

using OptTensor = std::optional<at::Tensor>;

template <typename Signature>
c10::TypedOperatorHandle<Signature> handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// which kernel a linear takes, and its arguments after x
enum Kind : int64_t { kInt8 = 0, kQuant = 1, kBrgemm = 2, kOneDnn = 3, kPlain = 4, kInvariant = 5 };

struct Linear {
  int64_t kind;
  std::vector<OptTensor> tensors;
  std::vector<int64_t> ints;
  double real;
  OptTensor bias;

  at::Tensor operator()(const at::Tensor& x) const {
    switch (kind) {
      case kInt8: {  // data; out_features, group, four_bit, signed_codes, half_params, terms
        static const auto op = handle<at::Tensor(at::Tensor, at::Tensor, int64_t, int64_t, bool, bool, bool, int64_t,
                                                 OptTensor)>("kervan::quant_matmul_i8");
        return op.call(x, *tensors[0], ints[0], ints[1], ints[2], ints[3], ints[4], ints[5], bias);
      }
      case kQuant: {  // codes, scales, zeros?, lut?; format, group; tensor_scale
        static const auto op = handle<at::Tensor(at::Tensor, at::Tensor, at::Tensor, OptTensor, OptTensor, int64_t,
                                                 int64_t, double, OptTensor)>("kervan::quant_matmul");
        return op.call(x, *tensors[0], *tensors[1], tensors[2], tensors[3], ints[0], ints[1], real, bias);
      }
      case kBrgemm: {
        static const auto op = handle<at::Tensor(at::Tensor, at::Tensor, OptTensor)>("kervan::brgemm_linear");
        return op.call(x, *tensors[0], bias);
      }
      case kInvariant: {  // packed; out_features
        static const auto op =
            handle<at::Tensor(at::Tensor, at::Tensor, int64_t, OptTensor)>("kervan::invariant_linear");
        return op.call(x, *tensors[0], ints[0], bias);
      }
      case kOneDnn: {  // oneDNN's packed layout, as packing.packed_linear calls it (boxed: ATen's own schema)
        static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
        std::vector<c10::IValue> stack{x, *tensors[0], bias, std::string("none"),
                                       c10::List<std::optional<at::Scalar>>(), std::string("")};
        op.callBoxed(&stack);
        return stack[0].toTensor();
      }
      default:
        return at::linear(x, *tensors[0], bias);
    }
  }
};

// the embedding's table: a plain weight [vocab, hidden], or quantized rows (codes, scales,
// zeros?, lut?; format, group; tensor_scale) that ``kervan::quant_dequantize`` decodes
struct Embedding {
  std::vector<OptTensor> tensors;
  std::vector<int64_t> ints;
  double tensor_scale = 0.0;
  c10::ScalarType dtype = c10::ScalarType::Float;

  at::Tensor operator()(const at::Tensor& ids) const {
    if (ints.empty()) return at::embedding(*tensors[0], ids);
    static const auto dequantize = handle<at::Tensor(at::Tensor, at::Tensor, OptTensor, OptTensor, int64_t, int64_t,
                                                     double, c10::ScalarType)>("kervan::quant_dequantize");
    auto rows = [&](const OptTensor& t) -> OptTensor {
      return t.has_value() ? OptTensor(at::index_select(*t, 0, ids)) : std::nullopt;
    };
    return dequantize.call(*rows(tensors[0]), *rows(tensors[1]), rows(tensors[2]), tensors[3], ints[0], ints[1],
                           tensor_scale, dtype);
  }
};

struct Layer {
  at::Tensor input_norm, post_norm, kv;
  int64_t qkv, o_proj, gate_up, down;  // indices into DecodeStack::linears
};

struct DecodeStack : torch::CustomClassHolder {
  int64_t heads, kv_heads, head_dim;
  double scale, eps;
  at::Tensor cos, sin, final_norm;
  std::vector<Linear> linears;
  std::vector<Layer> layers;
  std::optional<Embedding> embedding;
  int64_t head = -1;  // index into linears

  DecodeStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double scale, double eps, at::Tensor cos,
              at::Tensor sin, at::Tensor final_norm)
      : heads(heads), kv_heads(kv_heads), head_dim(head_dim), scale(scale), eps(eps), cos(std::move(cos)),
        sin(std::move(sin)), final_norm(std::move(final_norm)) {}

  int64_t add_linear(int64_t kind, std::vector<OptTensor> tensors, std::vector<int64_t> ints, double real,
                     OptTensor bias) {
    TORCH_CHECK(kind >= kInt8 && kind <= kInvariant, "unknown linear kind ", kind);
    TORCH_CHECK(!tensors.empty() && tensors[0].has_value(), "a linear needs its weight");
    const size_t want_ints = kind == kInt8 ? 6 : kind == kQuant ? 2 : kind == kInvariant ? 1 : 0;
    TORCH_CHECK(ints.size() == want_ints && (kind != kQuant || tensors.size() == 4), "linear kind ", kind,
                " takes ", want_ints, " ints");
    linears.push_back({kind, std::move(tensors), std::move(ints), real, std::move(bias)});
    return static_cast<int64_t>(linears.size()) - 1;
  }

  void add_layer(at::Tensor input_norm, at::Tensor post_norm, at::Tensor kv, int64_t qkv, int64_t o_proj,
                 int64_t gate_up, int64_t down) {
    const int64_t n = static_cast<int64_t>(linears.size());
    for (int64_t i : {qkv, o_proj, gate_up, down}) TORCH_CHECK(i >= 0 && i < n, "no linear ", i);
    layers.push_back({std::move(input_norm), std::move(post_norm), std::move(kv), qkv, o_proj, gate_up, down});
  }

  // the embedding's table (``ints`` empty: a plain weight; else format, group) and the head's linear
  void set_ends(std::vector<OptTensor> tensors, std::vector<int64_t> ints, double tensor_scale, int64_t head_linear) {
    TORCH_CHECK(!tensors.empty() && tensors[0].has_value(), "the embedding needs its table");
    TORCH_CHECK(ints.empty() || (ints.size() == 2 && tensors.size() == 4), "a quantized embedding takes ",
                "codes, scales, zeros, lut and two ints");
    TORCH_CHECK(head_linear >= 0 && head_linear < static_cast<int64_t>(linears.size()), "no linear ", head_linear);
    embedding = Embedding{std::move(tensors), std::move(ints), tensor_scale, final_norm.scalar_type()};
    head = head_linear;
  }

  // A whole decode step: ids, positions, slots [rows]; tables [rows, max_blocks]; lens [rows];
  // logit_rows: the rows that sample, in order (None: every row once). Returns the final
  // hidden states [rows, hidden] and the logits [logit rows, vocab].
  std::vector<at::Tensor> step(at::Tensor ids, at::Tensor positions, at::Tensor slots, at::Tensor tables,
                               at::Tensor lens, OptTensor logit_rows) const {
    TORCH_CHECK(embedding.has_value() && head >= 0, "the stack has no embedding and head (set_ends)");
    at::Tensor hidden = run((*embedding)(ids), positions, slots, tables, lens);
    const at::Tensor sampled = logit_rows.has_value() ? at::index_select(hidden, 0, *logit_rows) : hidden;
    return {hidden, linears[head](sampled)};
  }

  // x: [rows, hidden] (the embedding's output); positions, slots: [rows]; tables: [rows, max_blocks];
  // lens: [rows]. Returns the final hidden states [rows, hidden].
  at::Tensor run(at::Tensor x, at::Tensor positions, at::Tensor slots, at::Tensor tables, at::Tensor lens) const {
    static const auto rms_norm = handle<void(at::Tensor, at::Tensor, at::Tensor, double)>("kervan::rms_norm");
    static const auto add_rms_norm = handle<void(at::Tensor, at::Tensor, at::Tensor, double)>("kervan::add_rms_norm");
    static const auto rotary =
        handle<void(at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor)>("kervan::rotary");
    static const auto write_kv = handle<void(at::Tensor, at::Tensor, at::Tensor, at::Tensor)>("kervan::write_kv");
    static const auto paged_decode =
        handle<at::Tensor(at::Tensor, at::Tensor, at::Tensor, at::Tensor, double)>("kervan::paged_decode");
    static const auto silu_and_mul = handle<void(at::Tensor, at::Tensor)>("kervan::silu_and_mul");
    TORCH_CHECK(!layers.empty(), "the stack has no layers");
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [rows, hidden] tensor");
    const int64_t rows = x.size(0), q_size = heads * head_dim, kv_size = kv_heads * head_dim;
    at::Tensor residual;
    for (const Layer& layer : layers) {
      if (!residual.defined()) {
        residual = x;
        x = at::empty_like(residual);
        rms_norm.call(x, residual, layer.input_norm, eps);
      } else {
        add_rms_norm.call(x, residual, layer.input_norm, eps);
      }
      const at::Tensor qkv = linears[layer.qkv](x);
      const at::Tensor q = qkv.narrow(1, 0, q_size).view({rows, heads, head_dim});
      const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({rows, kv_heads, head_dim});
      const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({rows, kv_heads, head_dim});
      rotary.call(q, k, cos, sin, positions);
      write_kv.call(layer.kv, k, v, slots);
      const at::Tensor attention = paged_decode.call(q, layer.kv, tables, lens, scale);
      x = linears[layer.o_proj](attention.view({rows, q_size}));
      add_rms_norm.call(x, residual, layer.post_norm, eps);
      const at::Tensor gate_up = linears[layer.gate_up](x);
      const at::Tensor act = at::empty({rows, gate_up.size(1) / 2}, gate_up.options());
      silu_and_mul.call(act, gate_up);
      x = linears[layer.down](act);
    }
    add_rms_norm.call(x, residual, final_norm, eps);
    return x;
  }
};

}  // namespace kervan::stack

TORCH_LIBRARY_FRAGMENT(kervan, m) {
  using kervan::stack::DecodeStack;
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<int64_t, int64_t, int64_t, double, double, at::Tensor, at::Tensor, at::Tensor>())
      .def("add_linear", &DecodeStack::add_linear)
      .def("add_layer", &DecodeStack::add_layer)
      .def("set_ends", &DecodeStack::set_ends)
      .def("run", &DecodeStack::run)
      .def("step", &DecodeStack::step);
}
