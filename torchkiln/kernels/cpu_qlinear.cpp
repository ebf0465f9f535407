// torchkiln::qlinear_u8: a pt2e int8 linear (uint8 activations with a zero point, per-channel
// symmetric int8 weights, a float32 bias) as one oneDNN matmul whose weights are reordered once and
// whose primitive is built once per weight and row count; float32 out, or GELU and a uint8 quantize
// fused into the epilogue.
//
// Why it is hand-written: inductor lowers the same pattern to onednn::qlinear_pointwise, which runs
// the same brgemm kernel but looks its primitive up, rebuilds scales and zero points and allocates a
// scratchpad on every call: 11-20 us more per call than this op at bert-base's shapes, 1.07x on the
// whole bert-base int8 bs1 (2-core Zen 5, benchmarks/diag_int8_linear.py; RESULTS.md "int8 linears
// that keep their primitive"). torch keeps no handle to a built primitive that a graph could hold, so
// this op keeps its own, keyed by the weight's address and checked against its storage (held weakly:
// a freed weight's entry is dropped, never reused for another tensor at that address).
//
// x [..., K] uint8; w [N, K] int8 codes; w_scale [N] float32; w_zp [N] zeros (checked once per
// weight); bias [N] float32 or absent.
// post: "none" (float32 out), "gelu_erf" or "gelu_tanh" (with out_scale > 0: uint8 out,
// round(gelu(y) / out_scale) + out_zp, saturated, as pt2e's quantize_per_tensor).
#include <oneapi/dnnl/dnnl.hpp>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

using dnnl::memory;
using dt = memory::data_type;

struct Plan {
  dnnl::matmul prim;
  memory packed;  // the reordered weights (shared by the plans of one weight with the same layout)
  std::vector<float> src_scale, dst_scale;
  std::vector<int32_t> src_zp, dst_zp;
  memory::desc src, dst, bias;
  size_t scratch = 0;
  bool u8_out = false;
};

struct Entry {  // one weight's packed layouts and plans
  // the weight's storage, not held: an entry is valid while it lives and is the storage at this address
  c10::weak_intrusive_ptr<c10::StorageImpl> storage{c10::intrusive_ptr<c10::StorageImpl>()};
  std::vector<std::pair<memory::desc, memory>> packed;
  std::map<std::vector<int64_t>, std::shared_ptr<Plan>> plans;
};

struct Cache {
  dnnl::engine eng{dnnl::engine::kind::cpu, 0};
  std::mutex lock;
  std::unordered_map<const void*, Entry> entries;
};

Cache& cache() {
  static Cache c;
  return c;
}

int64_t bits(double v) {
  int64_t b;
  std::memcpy(&b, &v, sizeof b);
  return b;
}

dnnl::algorithm post_alg(const std::string& post) {
  if (post == "gelu_erf") return dnnl::algorithm::eltwise_gelu_erf;
  if (post == "gelu_tanh") return dnnl::algorithm::eltwise_gelu_tanh;
  TORCH_CHECK(post == "none", "torchkiln::qlinear_u8: post must be 'none', 'gelu_erf' or 'gelu_tanh', got '", post,
              "'");
  return dnnl::algorithm::undef;
}

std::shared_ptr<Plan> make_plan(Cache& c, Entry& e, const at::Tensor& w, int64_t M, int64_t K, int64_t N,
                                double x_scale, int64_t x_zp, const std::string& post, double out_scale,
                                int64_t out_zp, bool has_bias) {
  auto p = std::make_shared<Plan>();
  p->u8_out = out_scale > 0;
  p->src = memory::desc({M, K}, dt::u8, memory::format_tag::ab);
  p->dst = memory::desc({M, N}, p->u8_out ? dt::u8 : dt::f32, memory::format_tag::ab);
  auto wany = memory::desc({K, N}, dt::s8, memory::format_tag::any);
  if (has_bias) p->bias = memory::desc({1, N}, dt::f32, memory::format_tag::ab);
  dnnl::primitive_attr attr;
  attr.set_scales_mask(DNNL_ARG_SRC, 0);
  attr.set_scales_mask(DNNL_ARG_WEIGHTS, 1 << 1);
  attr.set_zero_points_mask(DNNL_ARG_SRC, 0);
  auto alg = post_alg(post);
  if (alg != dnnl::algorithm::undef) {
    dnnl::post_ops ops;
    ops.append_eltwise(alg, 0.f, 0.f);
    attr.set_post_ops(ops);
  }
  if (p->u8_out) {
    attr.set_scales_mask(DNNL_ARG_DST, 0);
    attr.set_zero_points_mask(DNNL_ARG_DST, 0);
  }
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  auto pd = has_bias ? dnnl::matmul::primitive_desc(c.eng, p->src, wany, p->bias, p->dst, attr)
                     : dnnl::matmul::primitive_desc(c.eng, p->src, wany, p->dst, attr);
  p->prim = dnnl::matmul(pd);
  p->scratch = pd.scratchpad_desc().get_size();
  auto wdesc = pd.weights_desc();
  for (auto& [d, m] : e.packed)
    if (d == wdesc) p->packed = m;
  if (!p->packed) {
    // w is [N, K] row-major: as [K, N] that is column-major (format ba)
    memory user({{K, N}, dt::s8, memory::format_tag::ba}, c.eng, w.data_ptr());
    p->packed = memory(wdesc, c.eng);
    dnnl::stream s(c.eng);
    dnnl::reorder(user, p->packed).execute(s, user, p->packed);
    s.wait();
    e.packed.emplace_back(wdesc, p->packed);
  }
  p->src_scale = {(float)x_scale};
  p->src_zp = {(int32_t)x_zp};
  p->dst_scale = {(float)out_scale};
  p->dst_zp = {(int32_t)out_zp};
  return p;
}

c10::intrusive_ptr<c10::StorageImpl> storage_of(const at::Tensor& t) {
  return c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(t.storage().unsafeGetStorageImpl());
}

bool valid(const Entry& e, const at::Tensor& w) {
  auto live = e.storage.lock();
  return live && live.get() == w.storage().unsafeGetStorageImpl();
}

void sweep(Cache& c) {  // drop the entries of freed weights
  for (auto it = c.entries.begin(); it != c.entries.end();) {
    if (it->second.storage.expired())
      it = c.entries.erase(it);
    else
      ++it;
  }
}

bool all_zero(const at::Tensor& t) {  // a weight's zero points (once per weight)
  TORCH_CHECK(t.scalar_type() == at::kLong || t.scalar_type() == at::kInt,
              "torchkiln::qlinear_u8: w_zp must be int64 or int32, got ", t.scalar_type());
  auto c = t.contiguous();
  for (int64_t i = 0; i < c.numel(); ++i)
    if ((c.scalar_type() == at::kLong ? c.data_ptr<int64_t>()[i] : c.data_ptr<int32_t>()[i]) != 0) return false;
  return true;
}

at::Tensor qlinear_u8(const at::Tensor& x_in, double x_scale, int64_t x_zp, const at::Tensor& w,
                      const at::Tensor& w_scale, const at::Tensor& w_zp, const std::optional<at::Tensor>& bias,
                      std::string post, double out_scale, int64_t out_zp) {
  TORCH_CHECK(x_in.device().is_cpu() && w.device().is_cpu(), "torchkiln::qlinear_u8: CPU tensors only");
  TORCH_CHECK(x_in.scalar_type() == at::kByte, "torchkiln::qlinear_u8: x must be uint8, got ", x_in.scalar_type());
  TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 2 && w.is_contiguous(),
              "torchkiln::qlinear_u8: w must be a contiguous 2-D int8 tensor, got ", w.scalar_type(), " sizes ",
              w.sizes());
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) == K, "torchkiln::qlinear_u8: x's last dim must be ", K,
              " (w's in_features), got sizes ", x_in.sizes());
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.numel() == N && w_scale.is_contiguous(),
              "torchkiln::qlinear_u8: w_scale must hold ", N, " contiguous float32 values");
  if (bias)
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N && bias->is_contiguous(),
                "torchkiln::qlinear_u8: bias must hold ", N, " contiguous float32 values");
  at::Tensor x = x_in.contiguous();
  const int64_t M = x.numel() / K;
  // what the primitive is built from (the scales and bias themselves are passed at each call)
  std::vector<int64_t> key{M, K, N, bits(x_scale), x_zp, bits(out_scale), out_zp, (int64_t)post_alg(post),
                           bias.has_value()};
  Cache& c = cache();
  std::shared_ptr<Plan> p;
  {
    std::lock_guard<std::mutex> g(c.lock);
    auto found = c.entries.find(w.data_ptr());
    if (found == c.entries.end() || !valid(found->second, w)) {
      if (found != c.entries.end()) c.entries.erase(found);  // another tensor at a freed weight's address
      sweep(c);  // once per new weight: the packed copies of freed models' weights go as the next one comes
      TORCH_CHECK(all_zero(w_zp), "torchkiln::qlinear_u8: int8 weights must be symmetric (zero points 0): "
                  "oneDNN's are");
      found = c.entries.emplace(w.data_ptr(), Entry{}).first;
      found->second.storage = c10::weak_intrusive_ptr<c10::StorageImpl>(storage_of(w));
    }
    Entry& e = found->second;
    auto it = e.plans.find(key);
    if (it == e.plans.end())
      it = e.plans.emplace(key, make_plan(c, e, w, M, K, N, x_scale, x_zp, post, out_scale, out_zp, bias.has_value()))
               .first;
    p = it->second;
  }
  std::vector<int64_t> out_sizes(x.sizes().begin(), x.sizes().end());
  out_sizes.back() = N;
  auto out = at::empty(out_sizes, x.options().dtype(p->u8_out ? at::kByte : at::kFloat));
  thread_local std::vector<uint8_t> scratch;
  if (scratch.size() < p->scratch) scratch.resize(p->scratch);
  auto& eng = c.eng;
  auto f32 = [&](std::vector<float>& v) { return memory({{(int64_t)v.size()}, dt::f32, memory::format_tag::a}, eng, v.data()); };
  auto s32 = [&](std::vector<int32_t>& v) { return memory({{1}, dt::s32, memory::format_tag::a}, eng, v.data()); };
  std::unordered_map<int, memory> args{
      {DNNL_ARG_SRC, memory(p->src, eng, x.data_ptr())},
      {DNNL_ARG_WEIGHTS, p->packed},
      {DNNL_ARG_DST, memory(p->dst, eng, out.data_ptr())},
      {DNNL_ARG_SCRATCHPAD, memory({{(int64_t)p->scratch}, dt::u8, memory::format_tag::a}, eng, scratch.data())},
      {DNNL_ARG_ATTR_SCALES | DNNL_ARG_SRC, f32(p->src_scale)},
      {DNNL_ARG_ATTR_SCALES | DNNL_ARG_WEIGHTS,
       memory({{N}, dt::f32, memory::format_tag::a}, eng, w_scale.data_ptr())},
      {DNNL_ARG_ATTR_ZERO_POINTS | DNNL_ARG_SRC, s32(p->src_zp)}};
  if (bias) args[DNNL_ARG_BIAS] = memory(p->bias, eng, bias->data_ptr());
  if (p->u8_out) {
    args[DNNL_ARG_ATTR_SCALES | DNNL_ARG_DST] = f32(p->dst_scale);
    args[DNNL_ARG_ATTR_ZERO_POINTS | DNNL_ARG_DST] = s32(p->dst_zp);
  }
  thread_local dnnl::stream s(eng);
  p->prim.execute(s, args);
  s.wait();
  return out;
}

int64_t qlinear_u8_entries() {  // for tests: how many weights the cache holds
  std::lock_guard<std::mutex> g(cache().lock);
  sweep(cache());
  return (int64_t)cache().entries.size();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torchkiln, m) {
  m.def("qlinear_u8(Tensor x, float x_scale, int x_zp, Tensor w, Tensor w_scale, Tensor w_zp, Tensor? bias, str post, "
        "float out_scale, int out_zp) -> Tensor");
  m.def("qlinear_u8_entries() -> int");
}
TORCH_LIBRARY_IMPL(torchkiln, CPU, m) { m.impl("qlinear_u8", qlinear_u8); }
TORCH_LIBRARY_IMPL(torchkiln, CompositeExplicitAutograd, m) { m.impl("qlinear_u8_entries", qlinear_u8_entries); }
