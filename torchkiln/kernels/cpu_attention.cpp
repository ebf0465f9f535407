// torchkiln::attention_bf16: softmax(q k^T * scale + bias) v in bfloat16 on x86 CPUs, as three
// oneDNN primitives (two batched matmuls and a softmax) built once per shape and layout.
//
// Why it is hand-written: the int8 transformer path runs attention in bf16 (passes/sdpa_math.py,
// "math-bf16"). Inside inductor's graph that was baddbmm + an opaque softmax custom op in Python
// + bmm: 228 us per bert-base layer (bs1, seq 128, 12 heads, 2-core Zen 5; 2.74 ms of an 17.8 ms
// int8 call, torch.profiler), of which the Python op's call was 35 us and torch's softmax 71 us.
// oneDNN's own primitives ran the three steps in 129 us standalone (its JIT softmax 38 us on bf16
// scores; RESULTS.md "attention as one op"). torch exposes neither oneDNN's softmax nor a fused
// scale-and-bias matmul epilogue, so this op calls pip's oneDNN (onednn-cpu-gomp, the library the
// int8 net links) from C++, where inductor's C++ wrapper reaches it without Python.
//
// q [B, H, L, D], k [B, H, S, D], v [B, H, S, D]: any strides with a unit last one (the Q/K/V
// projection's output viewed per head is used in place). bias: additive, broadcastable to
// [B, H, L, S], or absent. The output is [B, H, L, D] laid out as [B, L, H, D] (so the usual
// transpose(1, 2).reshape(B, L, H * D) that follows is a view).
#include <oneapi/dnnl/dnnl.hpp>

#include <ATen/core/Tensor.h>
#include <ATen/ops/_softmax.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/matmul.h>
#include <torch/library.h>

#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

namespace {

using dnnl::memory;
using dt = memory::data_type;

struct Plan {  // one shape and layout's primitives
  dnnl::matmul qk, pv;
  dnnl::softmax_forward softmax;
  memory::desc q, kt, s, p, v, o, bias;
  bool has_bias = false;
  size_t scratch = 0;
};

struct Engine {
  dnnl::engine eng{dnnl::engine::kind::cpu, 0};
  std::mutex lock;  // the plan cache; primitives themselves may run concurrently
  std::map<std::vector<int64_t>, std::shared_ptr<Plan>> plans;
};

Engine& engine() {
  static Engine e;
  return e;
}

memory::dims dims_of(const at::Tensor& t) { return memory::dims(t.sizes().begin(), t.sizes().end()); }
memory::dims strides_of(const at::Tensor& t) { return memory::dims(t.strides().begin(), t.strides().end()); }

dt dtype_of(const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kFloat,
              "torchkiln::attention_bf16: bias must be bfloat16 or float32, got ", t.scalar_type());
  return t.scalar_type() == at::kBFloat16 ? dt::bf16 : dt::f32;
}

std::shared_ptr<Plan> make_plan(Engine& e, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const std::optional<at::Tensor>& bias, double scale) {
  auto p = std::make_shared<Plan>();
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), D = q.size(3), S = k.size(2);
  p->q = memory::desc(dims_of(q), dt::bf16, strides_of(q));
  // k^T as a view: [B, H, D, S] with k's strides swapped
  p->kt = memory::desc({B, H, D, S}, dt::bf16, {k.stride(0), k.stride(1), k.stride(3), k.stride(2)});
  // bf16 scores: the softmax accumulates in fp32 inside; bf16's rounding of the scores is within the
  // int8 models' own error (the same choice the math-bf16 form made with baddbmm)
  p->s = memory::desc({B, H, L, S}, dt::bf16, memory::format_tag::abcd);
  p->p = p->s;
  p->v = memory::desc(dims_of(v), dt::bf16, strides_of(v));
  p->o = memory::desc({B, H, L, D}, dt::bf16, {L * H * D, D, H * D, 1});
  dnnl::primitive_attr attr;
  dnnl::post_ops ops;
  ops.append_eltwise(dnnl::algorithm::eltwise_linear, (float)scale, 0.f);
  if (bias) {
    p->has_bias = true;
    p->bias = memory::desc(dims_of(*bias), dtype_of(*bias), strides_of(*bias));
    ops.append_binary(dnnl::algorithm::binary_add, p->bias);
  }
  attr.set_post_ops(ops);
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  auto qk = dnnl::matmul::primitive_desc(e.eng, p->q, p->kt, p->s, attr);
  dnnl::primitive_attr plain;
  plain.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  auto sm = dnnl::softmax_forward::primitive_desc(e.eng, dnnl::prop_kind::forward_inference,
                                                  dnnl::algorithm::softmax_accurate, p->s, p->p, 3, plain);
  auto pv = dnnl::matmul::primitive_desc(e.eng, p->p, p->v, p->o, plain);
  p->scratch = std::max({qk.scratchpad_desc().get_size(), sm.scratchpad_desc().get_size(),
                         pv.scratchpad_desc().get_size()});
  p->qk = dnnl::matmul(qk);
  p->softmax = dnnl::softmax_forward(sm);
  p->pv = dnnl::matmul(pv);
  return p;
}

void check(const at::Tensor& t, const char* name, int64_t dims) {
  TORCH_CHECK(t.device().is_cpu(), "torchkiln::attention_bf16: ", name, " must be on the CPU, got ", t.device());
  TORCH_CHECK(t.dim() == dims, "torchkiln::attention_bf16: ", name, " must have ", dims, " dims, got sizes ",
              t.sizes());
}

at::Tensor attention_bf16(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const std::optional<at::Tensor>& bias, double scale) {
  check(q, "q", 4);
  check(k, "k", 4);
  check(v, "v", 4);
  for (const at::Tensor* t : {&q, &k, &v}) {
    TORCH_CHECK(t->scalar_type() == at::kBFloat16, "torchkiln::attention_bf16: q, k and v must be bfloat16, got ",
                t->scalar_type());
    TORCH_CHECK(t->stride(3) == 1, "torchkiln::attention_bf16: q, k and v need a unit last stride, got strides ",
                t->strides());
  }
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), D = q.size(3), S = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(1) == H && k.size(3) == D && v.size(0) == B && v.size(1) == H &&
                  v.size(2) == S && v.size(3) == D,
              "torchkiln::attention_bf16: q ", q.sizes(), ", k ", k.sizes(), " and v ", v.sizes(),
              " must be [B, H, L, D], [B, H, S, D], [B, H, S, D]");
  if (bias) {
    check(*bias, "bias", 4);
    TORCH_CHECK(bias->stride(3) == 1 || bias->size(3) == 1, "torchkiln::attention_bf16: bias needs a unit last stride");
  }
  int64_t scale_bits;
  std::memcpy(&scale_bits, &scale, sizeof scale_bits);
  std::vector<int64_t> key{scale_bits};
  for (const at::Tensor* t : {&q, &k, &v}) {
    key.insert(key.end(), t->sizes().begin(), t->sizes().end());
    key.insert(key.end(), t->strides().begin(), t->strides().end());
  }
  if (bias) {
    key.push_back((int64_t)bias->scalar_type());
    key.insert(key.end(), bias->sizes().begin(), bias->sizes().end());
    key.insert(key.end(), bias->strides().begin(), bias->strides().end());
  }
  Engine& e = engine();
  std::shared_ptr<Plan> p;
  {
    std::lock_guard<std::mutex> g(e.lock);
    auto it = e.plans.find(key);
    if (it == e.plans.end()) {
      std::shared_ptr<Plan> made;
      try {
        made = make_plan(e, q, k, v, bias, scale);
      } catch (const dnnl::error&) {
        // a layout oneDNN does not take (e.g. a bias broadcast its post-op refuses): torch's ops for
        // this key, so a call never fails where the math form would have worked
      }
      it = e.plans.emplace(key, made).first;
    }
    p = it->second;
  }
  auto out = at::empty({B, L, H, D}, q.options()).transpose(1, 2);
  if (!p) {
    auto s = at::matmul(q, k.transpose(-2, -1)).mul_(scale);
    if (bias) s.add_(*bias);
    out.copy_(at::matmul(at::_softmax(s, -1, false), v));
    return out;
  }
  auto scores = at::empty({B, H, L, S}, q.options());
  auto scratch = at::empty({(int64_t)p->scratch}, q.options().dtype(at::kByte));
  auto mem = [&](const memory::desc& d, const at::Tensor& t) { return memory(d, e.eng, t.data_ptr()); };
  memory pad(memory::desc({(int64_t)p->scratch}, dt::u8, memory::format_tag::a), e.eng, scratch.data_ptr());
  dnnl::stream strm(e.eng);
  std::unordered_map<int, memory> args{{DNNL_ARG_SRC, mem(p->q, q)},
                                       {DNNL_ARG_WEIGHTS, mem(p->kt, k)},
                                       {DNNL_ARG_DST, mem(p->s, scores)},
                                       {DNNL_ARG_SCRATCHPAD, pad}};
  if (p->has_bias) args[DNNL_ARG_ATTR_MULTIPLE_POST_OP(1) | DNNL_ARG_SRC_1] = mem(p->bias, *bias);
  p->qk.execute(strm, args);
  // the softmax in place over the scores (oneDNN allows src == dst)
  p->softmax.execute(strm, {{DNNL_ARG_SRC, mem(p->s, scores)}, {DNNL_ARG_DST, mem(p->p, scores)},
                            {DNNL_ARG_SCRATCHPAD, pad}});
  p->pv.execute(strm, {{DNNL_ARG_SRC, mem(p->p, scores)}, {DNNL_ARG_WEIGHTS, mem(p->v, v)},
                       {DNNL_ARG_DST, mem(p->o, out)}, {DNNL_ARG_SCRATCHPAD, pad}});
  strm.wait();
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torchkiln, m) {
  m.def("attention_bf16(Tensor q, Tensor k, Tensor v, Tensor? bias, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(torchkiln, CPU, m) { m.impl("attention_bf16", attention_bf16); }
