// torchkiln's int8 CNN runner: a whole quantized conv net (convolutions with their fused ReLU and
// residual add, pooling, the input's quantize and the output's dequantize) executed as a list of
// oneDNN primitives built once per input shape, from one C call per forward.
//
// Why it is hand-written: torch's quantized conv ops run the same oneDNN kernels, but each call
// also allocates its output, rebuilds scales and attributes and looks its primitive up: 6-20 us per
// convolution around the kernel on a 2-core Zen 5 (benchmarks/diag_qconv_overhead.py); resnet50 int8
// at batch 1 ran 6.32 ms through torch's modules and 5.66 ms as this program (1.12x, interleaved,
// benchmarks/diag_int8_net.py; RESULTS.md "oneDNN int8 net"). IPEX 2.8 avoids it with its own
// cached oneDNN Graph partitions; torch's wheel exports no oneDNN symbols, so this
// links the oneDNN that pip's `onednn-cpu-gomp` ships, which runs on the libgomp torch has loaded.
//
// The C ABI (ctypes; no torch headers, so it builds in about a second): kn_new, then kn_input /
// kn_conv / kn_pool / kn_output in graph order (each returns a tensor id, or -1 with kn_error set),
// kn_finalize (primitives, buffers), kn_run per call. A net is not reentrant: callers serialise.
#include <oneapi/dnnl/dnnl.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <unordered_map>
#include <vector>

using namespace dnnl;
using dt = memory::data_type;
using tag = memory::format_tag;

namespace {

struct Tensor {  // a uint8 activation, NHWC, with its quantization
  memory::dims dims;  // N, C, H, W
  float scale;
  int zp;
  int buffer = -1;  // index into Net::buffers, set by finalize
};

struct Op {
  enum Kind { INPUT, CONV, POOL, OUTPUT } kind;
  int src = -1, other = -1, dst = -1;
  // conv
  std::vector<int8_t> weight;  // OIHW codes (G*O/G, I/G, KH, KW)
  std::vector<float> wscale, bias, sscale, dscale;
  memory::dims wdims, strides, pad_l, pad_r, dil;
  int groups = 1;
  bool relu = false, has_bias = false;
  // pool
  algorithm alg = algorithm::pooling_max;
  memory::dims kernel;
  // built
  primitive prim;
  std::unordered_map<int, memory> args;
  memory wmem, bmem, zp_src, zp_dst, sc_src, sc_w, sc_dst;
  bool copy_other = false;  // the residual operand is read later: copy it into dst before the conv
};

struct Net {
  engine eng{engine::kind::cpu, 0};
  stream strm{eng};
  std::vector<Tensor> tensors;
  std::vector<Op> ops;
  std::vector<std::vector<uint8_t>> buffers;
  std::vector<uint8_t> scratch;
  memory::dims in_dims;
  memory in_mem, out_mem;
  bool out_flat = false;
  std::string error;
};

memory::desc nhwc(const Tensor& t) { return memory::desc(t.dims, dt::u8, tag::nhwc); }
memory::dim numel(const memory::dims& d) {
  memory::dim n = 1;
  for (auto v : d) n *= v;
  return n;
}

memory scalar_f32(const engine& e, std::vector<float>& v) {
  return memory({{(memory::dim)v.size()}, dt::f32, tag::x}, e, v.data());
}
memory scalar_s32(const engine& e, int value) {
  memory m({{1}, dt::s32, tag::x}, e);
  *static_cast<int32_t*>(m.get_data_handle()) = value;
  return m;
}

template <typename F>
int guarded(Net* n, F f) {
  try {
    return f();
  } catch (const std::exception& e) {
    n->error = e.what();
    return -1;
  }
}

int add_tensor(Net* n, memory::dims dims, float scale, int zp) {
  n->tensors.push_back({dims, scale, zp});
  return (int)n->tensors.size() - 1;
}

void build_conv(Net* n, Op& op) {
  const Tensor &s = n->tensors[op.src], &d = n->tensors[op.dst];
  memory::dims wd = op.wdims;
  int mask = 1;
  if (op.groups > 1) {  // (G, O/G, I/G, KH, KW): per-output-channel scales span the first two dims
    wd = {op.groups, op.wdims[0] / op.groups, op.wdims[1], op.wdims[2], op.wdims[3]};
    mask = 3;
  }
  primitive_attr attr;
  attr.set_scratchpad_mode(scratchpad_mode::user);
  attr.set_scales_mask(DNNL_ARG_SRC, 0);
  attr.set_scales_mask(DNNL_ARG_WEIGHTS, mask);
  attr.set_scales_mask(DNNL_ARG_DST, 0);
  if (s.zp) attr.set_zero_points_mask(DNNL_ARG_SRC, 0);
  if (d.zp) attr.set_zero_points_mask(DNNL_ARG_DST, 0);
  post_ops po;
  if (op.other >= 0) {  // residual: dst holds the other operand; sum adds scale * (code - zp) of it
    const Tensor& o = n->tensors[op.other];
    po.append_sum(o.scale, o.zp, dt::u8);
  }
  if (op.relu) po.append_eltwise(algorithm::eltwise_relu, 0.f, 0.f);
  attr.set_post_ops(po);
  auto wany = memory::desc(wd, dt::s8, tag::any);
  auto bmd = op.has_bias ? memory::desc({d.dims[1]}, dt::f32, tag::a) : memory::desc();
  auto pd = convolution_forward::primitive_desc(n->eng, prop_kind::forward_inference,
                                                algorithm::convolution_direct, nhwc(s), wany, bmd, nhwc(d),
                                                op.strides, op.dil, op.pad_l, op.pad_r, attr);
  // weights reordered once into the kernel's own layout
  memory plain({wd, dt::s8, op.groups > 1 ? tag::goihw : tag::oihw}, n->eng, op.weight.data());
  op.wmem = memory(pd.weights_desc(), n->eng);
  reorder(plain, op.wmem).execute(n->strm, plain, op.wmem);
  n->strm.wait();
  op.weight.clear();
  op.weight.shrink_to_fit();
  op.sscale = {s.scale};
  op.dscale = {d.scale};
  op.sc_src = scalar_f32(n->eng, op.sscale);
  op.sc_w = scalar_f32(n->eng, op.wscale);
  op.sc_dst = scalar_f32(n->eng, op.dscale);
  op.args = {{DNNL_ARG_WEIGHTS, op.wmem},
             {DNNL_ARG_ATTR_SCALES | DNNL_ARG_SRC, op.sc_src},
             {DNNL_ARG_ATTR_SCALES | DNNL_ARG_WEIGHTS, op.sc_w},
             {DNNL_ARG_ATTR_SCALES | DNNL_ARG_DST, op.sc_dst}};
  if (op.has_bias) {
    op.bmem = memory(bmd, n->eng, op.bias.data());
    op.args[DNNL_ARG_BIAS] = op.bmem;
  }
  if (s.zp) op.args[DNNL_ARG_ATTR_ZERO_POINTS | DNNL_ARG_SRC] = op.zp_src = scalar_s32(n->eng, s.zp);
  if (d.zp) op.args[DNNL_ARG_ATTR_ZERO_POINTS | DNNL_ARG_DST] = op.zp_dst = scalar_s32(n->eng, d.zp);
  n->scratch.resize(std::max<size_t>(n->scratch.size(), pd.scratchpad_desc().get_size()));
  op.prim = convolution_forward(pd);
}

void build_pool(Net* n, Op& op) {
  const Tensor &s = n->tensors[op.src], &d = n->tensors[op.dst];
  primitive_attr attr;
  attr.set_scratchpad_mode(scratchpad_mode::user);
  auto pd = pooling_forward::primitive_desc(n->eng, prop_kind::forward_inference, op.alg, nhwc(s), nhwc(d),
                                            op.strides, op.kernel, op.dil, op.pad_l, op.pad_r, attr);
  n->scratch.resize(std::max<size_t>(n->scratch.size(), pd.scratchpad_desc().get_size()));
  op.prim = pooling_forward(pd);
}

// quantize (f32 NCHW -> u8 NHWC) or dequantize (u8 -> f32, NCHW or (N, C)) as one reorder
void build_reorder(Net* n, Op& op, bool quantize) {
  const Tensor& t = n->tensors[quantize ? op.dst : op.src];
  memory::desc plain = (!quantize && n->out_flat) ? memory::desc({t.dims[0], t.dims[1] * t.dims[2] * t.dims[3]},
                                                                 dt::f32, tag::ab)
                                                  : memory::desc(t.dims, dt::f32, tag::nchw);
  memory::desc q = nhwc(t);
  if (!quantize && n->out_flat) q = memory::desc(plain.get_dims(), dt::u8, tag::ab);  // H = W = 1 or C-major
  primitive_attr attr;
  int arg = quantize ? DNNL_ARG_DST : DNNL_ARG_SRC;
  attr.set_scales_mask(arg, 0);
  if (t.zp) attr.set_zero_points_mask(arg, 0);
  auto pd = quantize ? reorder::primitive_desc(n->eng, plain, n->eng, q, attr)
                     : reorder::primitive_desc(n->eng, q, n->eng, plain, attr);
  op.sscale = {t.scale};
  op.sc_src = scalar_f32(n->eng, op.sscale);
  op.args = {{DNNL_ARG_ATTR_SCALES | arg, op.sc_src}};
  if (t.zp) op.args[DNNL_ARG_ATTR_ZERO_POINTS | arg] = op.zp_src = scalar_s32(n->eng, t.zp);
  op.prim = reorder(pd);
}

}  // namespace

extern "C" {

void* kn_new() { return new Net(); }
void kn_free(void* net) { delete static_cast<Net*>(net); }
const char* kn_error(void* net) { return static_cast<Net*>(net)->error.c_str(); }

int kn_input(void* net, int64_t nb, int64_t c, int64_t h, int64_t w, float scale, int zp) {
  Net* n = static_cast<Net*>(net);
  return guarded(n, [&] {
    n->in_dims = {nb, c, h, w};
    Op op;
    op.kind = Op::INPUT;
    op.dst = add_tensor(n, n->in_dims, scale, zp);
    n->ops.push_back(std::move(op));
    return n->ops.back().dst;
  });
}

// weight: OIHW int8 codes (O = all output channels, I = input channels per group); pads: t, l, b, r
int kn_conv(void* net, int src, int other, int64_t out_c, int64_t kh, int64_t kw, const int64_t* stride,
            const int64_t* pads, const int64_t* dilation, int64_t groups, const int8_t* weight,
            const float* wscale, const float* bias, float scale, int zp, int relu) {
  Net* n = static_cast<Net*>(net);
  return guarded(n, [&] {
    const Tensor s = n->tensors.at(src);
    Op op;
    op.kind = Op::CONV;
    op.src = src;
    op.other = other;
    op.groups = (int)groups;
    op.relu = relu != 0;
    int64_t in_per_group = s.dims[1] / groups;
    op.wdims = {out_c, in_per_group, kh, kw};
    op.weight.assign(weight, weight + numel(op.wdims));
    op.wscale.assign(wscale, wscale + out_c);
    op.has_bias = bias != nullptr;
    if (bias) op.bias.assign(bias, bias + out_c);
    op.strides = {stride[0], stride[1]};
    op.pad_l = {pads[0], pads[1]};
    op.pad_r = {pads[2], pads[3]};
    op.dil = {dilation[0] - 1, dilation[1] - 1};  // oneDNN counts dilation from 0
    auto out = [&](int64_t in, int i, int64_t k) {
      return (in + pads[i] + pads[i + 2] - dilation[i] * (k - 1) - 1) / stride[i] + 1;
    };
    memory::dims d{s.dims[0], out_c, out(s.dims[2], 0, kh), out(s.dims[3], 1, kw)};
    if (other >= 0 && n->tensors.at(other).dims != d) throw std::runtime_error("residual operand's shape differs");
    op.dst = add_tensor(n, d, scale, zp);
    n->ops.push_back(std::move(op));
    return n->ops.back().dst;
  });
}

// max (avg = 0) or average excluding padding (avg = 1); output size given by the caller (ceil mode)
int kn_pool(void* net, int src, int avg, const int64_t* kernel, const int64_t* stride, const int64_t* pads,
            int64_t out_h, int64_t out_w) {
  Net* n = static_cast<Net*>(net);
  return guarded(n, [&] {
    const Tensor s = n->tensors.at(src);
    Op op;
    op.kind = Op::POOL;
    op.src = src;
    op.alg = avg ? algorithm::pooling_avg_exclude_padding : algorithm::pooling_max;
    op.kernel = {kernel[0], kernel[1]};
    op.strides = {stride[0], stride[1]};
    op.pad_l = {pads[0], pads[1]};
    // oneDNN wants the right/bottom padding that yields the requested size (ceil mode)
    op.pad_r = {(out_h - 1) * stride[0] + kernel[0] - s.dims[2] - pads[0],
                (out_w - 1) * stride[1] + kernel[1] - s.dims[3] - pads[1]};
    op.dil = {0, 0};
    op.dst = add_tensor(n, {s.dims[0], s.dims[1], out_h, out_w}, s.scale, s.zp);
    n->ops.push_back(std::move(op));
    return n->ops.back().dst;
  });
}

// flat: the output is (N, C*H*W) in NCHW order (a flatten); allowed where H = W = 1
int kn_output(void* net, int src, int flat) {
  Net* n = static_cast<Net*>(net);
  return guarded(n, [&] {
    const Tensor& t = n->tensors.at(src);
    if (flat && t.dims[2] * t.dims[3] != 1) throw std::runtime_error("flattened output needs H = W = 1");
    Op op;
    op.kind = Op::OUTPUT;
    op.src = src;
    n->out_flat = flat != 0;
    n->ops.push_back(std::move(op));
    return 0;
  });
}

int kn_finalize(void* net) {
  Net* n = static_cast<Net*>(net);
  return guarded(n, [&] {
    // Buffers by liveness: a tensor's buffer returns to the pool after its last reader, so a few
    // buffers cycle through the net and stay warm in cache (as torch's allocator reuse does).
    std::vector<int> last(n->tensors.size(), -1);
    for (int i = 0; i < (int)n->ops.size(); i++) {
      for (int t : {n->ops[i].src, n->ops[i].other})
        if (t >= 0) last[t] = i;
    }
    std::vector<std::pair<size_t, int>> free_list;  // (bytes, buffer)
    for (int i = 0; i < (int)n->ops.size(); i++) {
      Op& op = n->ops[i];
      if (op.dst >= 0) {
        Tensor& d = n->tensors[op.dst];
        size_t bytes = (size_t)numel(d.dims);
        if (op.other >= 0 && last[op.other] == i && op.other != op.src) {
          d.buffer = n->tensors[op.other].buffer;  // the sum post-op accumulates in place
        } else {
          op.copy_other = op.other >= 0;
          auto it = std::find_if(free_list.begin(), free_list.end(),
                                 [&](auto& f) { return f.first >= bytes; });
          if (it != free_list.end()) {
            d.buffer = it->second;
            free_list.erase(it);
          } else {
            n->buffers.emplace_back(bytes);
            d.buffer = (int)n->buffers.size() - 1;
          }
        }
      }
      // freed after this op, unless the dst took it over; conv(x) + x reads x twice but frees it once
      std::vector<int> reads{op.src};
      if (op.other >= 0 && op.other != op.src) reads.push_back(op.other);
      for (int t : reads) {
        if (t >= 0 && last[t] == i && !(t == op.other && !op.copy_other)) {
          free_list.emplace_back(n->buffers[n->tensors[t].buffer].size(), n->tensors[t].buffer);
          std::sort(free_list.begin(), free_list.end());
        }
      }
    }
    for (auto& op : n->ops) {
      if (op.kind == Op::CONV) build_conv(n, op);
      if (op.kind == Op::POOL) build_pool(n, op);
      if (op.kind == Op::INPUT) build_reorder(n, op, true);
      if (op.kind == Op::OUTPUT) build_reorder(n, op, false);
    }
    // every memory bound once: a call only points the input and output at the caller's tensors
    memory scratch(memory::desc({(memory::dim)n->scratch.size()}, dt::u8, tag::x), n->eng, n->scratch.data());
    auto mem = [&](int t) {
      Tensor& x = n->tensors[t];
      return memory(nhwc(x), n->eng, n->buffers[x.buffer].data());
    };
    for (auto& op : n->ops) {
      if (op.kind == Op::INPUT) {
        n->in_mem = memory({n->in_dims, dt::f32, tag::nchw}, n->eng, nullptr);
        op.args[DNNL_ARG_FROM] = n->in_mem;
        op.args[DNNL_ARG_TO] = mem(op.dst);
      } else if (op.kind == Op::OUTPUT) {
        Tensor& x = n->tensors[op.src];
        memory::dims flat{x.dims[0], numel(x.dims) / x.dims[0]};
        op.args[DNNL_ARG_FROM] = n->out_flat ? memory({flat, dt::u8, tag::ab}, n->eng, n->buffers[x.buffer].data())
                                             : mem(op.src);
        n->out_mem = n->out_flat ? memory({flat, dt::f32, tag::ab}, n->eng, nullptr)
                                 : memory({x.dims, dt::f32, tag::nchw}, n->eng, nullptr);
        op.args[DNNL_ARG_TO] = n->out_mem;
      } else {
        op.args[DNNL_ARG_SRC] = mem(op.src);
        op.args[DNNL_ARG_DST] = mem(op.dst);
        op.args[DNNL_ARG_SCRATCHPAD] = scratch;
      }
    }
    return 0;
  });
}

int kn_run(void* net, const float* in, float* out) {
  Net* n = static_cast<Net*>(net);
  return guarded(n, [&] {
    n->in_mem.set_data_handle(const_cast<float*>(in));
    n->out_mem.set_data_handle(out);
    for (auto& op : n->ops) {
      if (op.copy_other) {
        Tensor &o = n->tensors[op.other], &d = n->tensors[op.dst];
        std::memcpy(n->buffers[d.buffer].data(), n->buffers[o.buffer].data(), (size_t)numel(d.dims));
      }
      op.prim.execute(n->strm, op.args);
    }
    n->strm.wait();
    return 0;
  });
}

}  // extern "C"
