// torchkiln's CNN runner: a whole conv net (convolutions with their fused residual add and activation
// (ReLU, ReLU6, SiLU, sigmoid), squeeze-and-excite products, pooling, the input's reorder or quantize and
// each output's) executed as a list of oneDNN primitives built once per input shape, from one C call
// per forward. Its forms: int8 (u8 NHWC activations, the pt2e graph's scales), float32 (NHWC; 3x3
// stride-1 convolutions may run as Winograd, below) and bfloat16 (NHWC bf16 activations and weights,
// float32 bias and accumulation; Winograd as float32).
//
// Why it is hand-written: torch's quantized conv ops run the same oneDNN kernels, but each call
// also allocates its output, rebuilds scales and attributes and looks its primitive up: 6-20 us per
// convolution around the kernel on a 2-core Zen 5 (benchmarks/diag_qconv_overhead.py); resnet50 int8
// at batch 1 ran 6.32 ms through torch's modules and 5.66 ms as this program (1.12x, interleaved,
// benchmarks/diag_int8_net.py; RESULTS.md "oneDNN int8 net"). IPEX 2.8 avoids it with its own
// cached oneDNN Graph partitions; torch's wheel exports no oneDNN symbols, so this
// links the oneDNN that pip's `onednn-cpu-gomp` ships, which runs on the libgomp torch has loaded.
//
// Why Winograd is hand-written: oneDNN 3.x dropped its CPU Winograd convolutions, and its direct
// 3x3 kernels already run near this machine's FMA rate (brgconv: 480-590 GFLOP/s on 2 Zen 5 cores),
// so fewer multiplies is the one way left to go faster. F(4x4, 3x3) does a 3x3 convolution's work as
// 36 GEMMs of a quarter the size (oneDNN's batched matmul) between two small transforms; F(2x2, 3x3)
// as 16 GEMMs with 1.8x (not 4x) the weights' bytes, which wins where those are read from memory.
// Inside resnet50 at bs1 (float32, direct -> chosen, RESULTS.md "Forty-seventh session"): 56x56x64
// 455 -> 205 us (F(4x4)), 28x28x128 430 -> 182 (F(4x4)), 14x14x256 425 -> 285 (F(2x2)), 7x7x512
// 505 -> 480 (F(2x2)). Its rounding differs from the direct sum by about 5e-6 of the output's range
// in float32 (cuDNN's and the old oneDNN's Winograd are used the same way); each eligible
// convolution takes the form that finalize timed fastest inside the net, the direct kernel included.
//
// The C ABI (ctypes; no torch headers, so it builds in about a second): kn_new(dtype, winograd),
// then kn_input / kn_conv / kn_pool / kn_linear / kn_qlinear / kn_scale / kn_output in graph order (each
// returns a tensor id, or -1 with kn_error set), kn_finalize (primitives, buffers, the Winograd
// choice), kn_run per call. A net is not reentrant: callers serialise.
#include <oneapi/dnnl/dnnl.hpp>
#include <omp.h>

#include <chrono>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

using namespace dnnl;
using dt = memory::data_type;
using tag = memory::format_tag;

namespace {

struct Tensor {  // an activation, NHWC: u8 with its quantization, or f32 / bf16
  memory::dims dims;  // N, C, H, W
  float scale;
  int zp;
  int buffer = -1;  // index into Net::buffers, set by finalize
  bool f32 = false;  // float32 in an int8 net: its classifier head's output
};

struct Op {
  enum Kind { INPUT, CONV, POOL, LINEAR, SCALE, OUTPUT } kind;
  int src = -1, other = -1, dst = -1;  // other: a CONV's residual, a SCALE's (N, C, 1, 1) factor
  // conv
  std::vector<int8_t> weight;  // OIHW codes (G*O/G, I/G, KH, KW)
  std::vector<float> fweight;  // float32 net: OIHW weights
  std::vector<float> wscale, bias, sscale, dscale;
  memory::dims wdims, strides, pad_l, pad_r, dil;
  int groups = 1;
  bool has_bias = false, flat = false;  // flat: an output's (N, C*H*W) in NCHW order
  // the activation after the convolution (and its sum): 0 none, 1 ReLU, 2 clamp to [lo, hi] (ReLU6),
  // 3 SiLU (swish), 4 sigmoid
  int act = 0;
  float lo = 0.f, hi = 0.f;
  // pool
  algorithm alg = algorithm::pooling_max;
  memory::dims kernel;
  // built
  primitive prim;
  std::unordered_map<int, memory> args;
  memory wmem, bmem, zp_src, zp_dst, sc_src, sc_w, sc_dst;
  bool copy_other = false;  // the residual operand is read later: copy it into dst before the conv
  bool rows = false;  // INPUT: converted by input_nhwc (few channels), not by a reorder primitive
  // Winograd forms of a float 3x3 stride-1 convolution (see the top of the file): F(4x4, 3x3) and
  // F(2x2, 3x3); `form` is the one that runs (-1: the direct primitive)
  struct Wino {
    int m = 0;  // output tile: 4 or 2
    int64_t tiles_h = 0, tiles_w = 0, tiles = 0;
    int64_t chunk = 0;  // tiles per GEMM call (the last call takes the rest: `tail`)
    primitive gemm, tail;
    std::unordered_map<int, memory> args, tail_args;
    memory u;  // transformed weights ((m + 2)^2, C, K) in the matmul's layout
  };
  std::vector<Wino> winos;
  int form = -1;
};

struct Net {
  dt adt = dt::u8;  // the activations' type: u8 (an int8 net), f32 or bf16
  int winograd = 0;  // 0: direct kernels only; 1: each eligible convolution's fastest form; 4, 2: that tile
  engine eng{engine::kind::cpu, 0};
  stream strm{eng};
  std::vector<Tensor> tensors;
  std::vector<Op> ops;
  std::vector<std::vector<uint8_t>> buffers;
  std::vector<uint8_t> scratch;
  memory wino_v, wino_m;  // the Winograd convolutions' transformed input and GEMM output, shared
  memory::dims in_dims;
  memory in_mem;
  std::vector<memory> outs;  // one per OUTPUT op, in the order they were added
  std::string error;
};

bool floating(const Net* n) { return n->adt != dt::u8; }
// An activation's memory: NHWC in every form. For floats it is the layout oneDNN's brgconv kernels
// pick for themselves ("any"); given nChw16c instead, oneDNN 3.2 runs its older jit kernels
// (resnet50's 7x7x512 3x3 convolution: 402 us NHWC, 520 us nChw16c on 2 Zen 5 cores).
memory::desc act(const Net* n, const Tensor& t) { return memory::desc(t.dims, t.f32 ? dt::f32 : n->adt, tag::nhwc); }
void* data(Net* n, int t) { return n->buffers[n->tensors[t].buffer].data(); }

// `plain` (weights in torch's order, at `src`) reordered once into a primitive's own layout `want`
memory packed(Net* n, const memory::desc& plain, const void* src, const memory::desc& want) {
  memory from(plain, n->eng, const_cast<void*>(src)), to(want, n->eng);
  reorder(from, to).execute(n->strm, from, to);
  n->strm.wait();
  return to;
}
memory::dim numel(const memory::dims& d) {
  memory::dim n = 1;
  for (auto v : d) n *= v;
  return n;
}
size_t bytes(const Net* n, const Tensor& t) { return act(n, t).get_size(); }

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

// a step's input; an int8 net's float32 head output is for kn_output only
Tensor operand(Net* n, int id) {
  const Tensor& t = n->tensors.at(id);
  if (t.f32) throw std::runtime_error("only kn_output reads an int8 net's float32 head output");
  return t;
}

// ---- Winograd F(m x m, 3x3), Lavin & Gray's transforms: (m + 2)^2 inputs give m x m outputs ----
struct F43 {
  static constexpr int M = 4, A = 6;
  static constexpr float BT[6][6] = {{4, 0, -5, 0, 1, 0}, {0, -4, -4, 1, 1, 0}, {0, 4, -4, -1, 1, 0},
                                     {0, -2, -1, 2, 1, 0}, {0, 2, -1, -2, 1, 0}, {0, 4, 0, -5, 0, 1}};
  static constexpr float G[6][3] = {{1.f / 4, 0, 0},           {-1.f / 6, -1.f / 6, -1.f / 6},
                                    {-1.f / 6, 1.f / 6, -1.f / 6}, {1.f / 24, 1.f / 12, 1.f / 6},
                                    {1.f / 24, -1.f / 12, 1.f / 6}, {0, 0, 1}};
  static constexpr float AT[4][6] = {{1, 1, 1, 1, 1, 0}, {0, 1, -1, 2, -2, 0}, {0, 1, 1, 4, 4, 0}, {0, 1, -1, 8, -8, 1}};
};
struct F23 {
  static constexpr int M = 2, A = 4;
  static constexpr float BT[4][4] = {{1, 0, -1, 0}, {0, 1, 1, 0}, {0, -1, 1, 0}, {0, 1, 0, -1}};
  static constexpr float G[4][3] = {{1, 0, 0}, {.5f, .5f, .5f}, {.5f, -.5f, .5f}, {0, 0, 1}};
  static constexpr float AT[2][4] = {{1, 1, 1, 0}, {0, 1, -1, -1}};
};

bool wino_eligible(const Net* n, const Op& op) {
  const Tensor &s = n->tensors[op.src], &d = n->tensors[op.dst];
  return floating(n) && n->winograd != 0 && op.groups == 1 && op.wdims[2] == 3 && op.wdims[3] == 3 &&
         op.strides == memory::dims{1, 1} && op.dil == memory::dims{0, 0} && op.pad_l == memory::dims{1, 1} &&
         op.pad_r == memory::dims{1, 1} && s.dims[1] % 16 == 0 && d.dims[1] % 16 == 0 && op.act <= 2;
}

// bf16 storage as uint16_t: widened exactly, narrowed to nearest even (as oneDNN's conversions)
inline float ld(float v) { return v; }
inline float ld(uint16_t v) {
  uint32_t u = (uint32_t)v << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void st(float& d, float v) { d = v; }
inline void st(uint16_t& d, float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  d = (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

// One tile and 16 channels: x (NHWC image) -> v ((A*A, T, C)), zero outside the image
template <class F, class T_>
inline __attribute__((always_inline)) void input_tile(const T_* img, int64_t C, int64_t H, int64_t W, int64_t y0,
                                                      int64_t x0, int64_t T, int64_t t, T_* v) {
  constexpr int A = F::A;
  float d[A][A][16], m[A][A][16];
  for (int i = 0; i < A; i++)
    for (int j = 0; j < A; j++) {
      const int64_t y = y0 + i, xx = x0 + j;
      const bool in = y >= 0 && y < H && xx >= 0 && xx < W;
      const T_* p = img + (y * W + xx) * C;
      for (int c = 0; c < 16; c++) d[i][j][c] = in ? ld(p[c]) : 0.f;
    }
  for (int i = 0; i < A; i++)
    for (int j = 0; j < A; j++)
      for (int c = 0; c < 16; c++) {
        float acc = 0;
        for (int k = 0; k < A; k++) acc += F::BT[i][k] * d[k][j][c];
        m[i][j][c] = acc;
      }
  for (int i = 0; i < A; i++)
    for (int j = 0; j < A; j++) {
      T_* o = v + ((i * A + j) * T + t) * C;
      for (int c = 0; c < 16; c++) {
        float acc = 0;
        for (int k = 0; k < A; k++) acc += m[i][k][c] * F::BT[j][k];
        st(o[c], acc);
      }
    }
}

// One tile and 16 channels: r ((A*A, T, K), float32) -> y (NHWC image), plus bias, plus what y
// holds (sum), clamped to [lo, hi] (ReLU: [0, inf], none: [-inf, inf])
template <class F, class T_>
inline __attribute__((always_inline)) void output_tile(const float* r, int64_t K, int64_t H, int64_t W, int64_t y0,
                                                       int64_t x0, int64_t T, int64_t t, const float* bias, bool sum,
                                                       float lo, float hi, T_* img) {
  constexpr int A = F::A, M = F::M;
  float q[A][A][16], a[M][A][16];
  for (int i = 0; i < A; i++)
    for (int j = 0; j < A; j++) {
      const float* p = r + ((i * A + j) * T + t) * K;
      for (int c = 0; c < 16; c++) q[i][j][c] = p[c];
    }
  for (int i = 0; i < M; i++)
    for (int j = 0; j < A; j++)
      for (int c = 0; c < 16; c++) {
        float acc = 0;
        for (int k = 0; k < A; k++) acc += F::AT[i][k] * q[k][j][c];
        a[i][j][c] = acc;
      }
  for (int i = 0; i < M && y0 + i < H; i++)
    for (int j = 0; j < M && x0 + j < W; j++) {
      T_* o = img + ((y0 + i) * W + x0 + j) * K;
      for (int c = 0; c < 16; c++) {
        float acc = bias ? bias[c] : 0.f;
        for (int k = 0; k < A; k++) acc += a[i][k][c] * F::AT[j][k];
        if (sum) acc += ld(o[c]);
        st(o[c], std::min(std::max(acc, lo), hi));
      }
    }
}

// x: NHWC -> v: (A*A, tn, C) for tiles t0 .. t0 + tn of the N * th * tw tiles of m x m outputs;
// bf16: both are
__attribute__((target_clones("avx512f", "avx2", "default")))
void wino_input(int mt, bool bf16, const void* x, int64_t C, int64_t H, int64_t W, int64_t th, int64_t tw, int64_t t0,
                int64_t tn, void* v) {
  const int64_t CB = C / 16;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t t = t0; t < t0 + tn; t++)
    for (int64_t cb = 0; cb < CB; cb++) {
      const int64_t b = t / (th * tw), y0 = (t / tw % th) * mt - 1, x0 = (t % tw) * mt - 1;
      const int64_t at = b * H * W * C + cb * 16;
      if (bf16 && mt == 4)
        input_tile<F43>((const uint16_t*)x + at, C, H, W, y0, x0, tn, t - t0, (uint16_t*)v + cb * 16);
      else if (bf16)
        input_tile<F23>((const uint16_t*)x + at, C, H, W, y0, x0, tn, t - t0, (uint16_t*)v + cb * 16);
      else if (mt == 4)
        input_tile<F43>((const float*)x + at, C, H, W, y0, x0, tn, t - t0, (float*)v + cb * 16);
      else
        input_tile<F23>((const float*)x + at, C, H, W, y0, x0, tn, t - t0, (float*)v + cb * 16);
    }
}

// The input: NCHW float32 -> the activations' NHWC (u8 codes, float32 or bf16), for an image's few
// channels, in one pass that writes each pixel's channels together. oneDNN 3.2's reorder walks the
// 3-wide channel dimension innermost: resnet50's 8x3x224x224 input took 529 us to quantize (IPEX's,
// a u8 NCHW -> NHWC reorder after torch's quantize, 148 us), 307 us to float32 NHWC and 359 us to bf16,
// where this loop takes 80, 45 and 36 us on 2 Zen 5 cores (RESULTS.md "Forty-ninth session"). Only
// with AVX-512 (BW): compiled for AVX2, the interleaving stores kept the u8 form at 590 us, so
// elsewhere the reorder stays. Codes are the pt2e graph's (quantized_decomposed.quantize_per_tensor):
// x * (1 / scale) rounded to nearest even (adding and taking 1.5 * 2^23: no libm call, so it
// vectorises), plus the zero point, saturated; oneDNN's reorder rounds the same way. (torch 2.13's
// own quantize_per_tensor adds the zero point before rounding: an exact tie can land one code away.)
constexpr int64_t ROWS_MAX_C = 4;

template <int C, class T_>
__attribute__((target("avx512f,avx512bw,avx512vl")))
void input_rows(const float* x, T_* y, int64_t N, int64_t H, int64_t W, float inv, float zp) {
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < N; b++)
    for (int64_t h = 0; h < H; h++) {
      const float* s = x + (b * C * H + h) * W;
      T_* d = y + (b * H + h) * W * C;
      for (int64_t w = 0; w < W; w++)
        for (int c = 0; c < C; c++) {
          const float v = s[c * H * W + w];
          if constexpr (std::is_same_v<T_, uint8_t>) {
            const float r = std::min(4096.f, std::max(-4096.f, v * inv));  // NaN -> -4096 -> code 0
            d[w * C + c] = (uint8_t)(int)std::min(255.f, std::max(0.f, (r + 12582912.f) - 12582912.f + zp));
          } else {
            st(d[w * C + c], v);
          }
        }
    }
}

template <int C>
void input_as(dt adt, const float* x, void* y, int64_t N, int64_t H, int64_t W, float scale, int zp) {
  if (adt == dt::u8)
    input_rows<C>(x, (uint8_t*)y, N, H, W, (float)(1.0 / scale), (float)zp);  // as torch: 1 / scale in double
  else if (adt == dt::bf16)
    input_rows<C>(x, (uint16_t*)y, N, H, W, 0.f, 0.f);
  else
    input_rows<C>(x, (float*)y, N, H, W, 0.f, 0.f);
}

bool rows_here(const memory::dims& in) {
  return in[1] <= ROWS_MAX_C && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
}

void input_nhwc(dt adt, const float* x, void* y, const memory::dims& d, float scale, int zp) {
  switch (d[1]) {
    case 1: return input_as<1>(adt, x, y, d[0], d[2], d[3], scale, zp);
    case 2: return input_as<2>(adt, x, y, d[0], d[2], d[3], scale, zp);
    case 3: return input_as<3>(adt, x, y, d[0], d[2], d[3], scale, zp);
    default: return input_as<4>(adt, x, y, d[0], d[2], d[3], scale, zp);
  }
}

// r: (A*A, tn, K) float32, tiles t0 .. t0 + tn -> y: NHWC, float32 or bf16
__attribute__((target_clones("avx512f", "avx2", "default")))
void wino_output(int mt, bool bf16, const float* r, int64_t K, int64_t H, int64_t W, int64_t th, int64_t tw, int64_t t0,
                 int64_t tn, const float* bias, bool sum, float lo, float hi, void* y) {
  const int64_t KB = K / 16;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t t = t0; t < t0 + tn; t++)
    for (int64_t kb = 0; kb < KB; kb++) {
      const int64_t b = t / (th * tw), y0 = (t / tw % th) * mt, x0 = (t % tw) * mt;
      const int64_t at = b * H * W * K + kb * 16;
      const float* bk = bias ? bias + kb * 16 : nullptr;
      if (bf16 && mt == 4)
        output_tile<F43>(r + kb * 16, K, H, W, y0, x0, tn, t - t0, bk, sum, lo, hi, (uint16_t*)y + at);
      else if (bf16)
        output_tile<F23>(r + kb * 16, K, H, W, y0, x0, tn, t - t0, bk, sum, lo, hi, (uint16_t*)y + at);
      else if (mt == 4)
        output_tile<F43>(r + kb * 16, K, H, W, y0, x0, tn, t - t0, bk, sum, lo, hi, (float*)y + at);
      else
        output_tile<F23>(r + kb * 16, K, H, W, y0, x0, tn, t - t0, bk, sum, lo, hi, (float*)y + at);
    }
}

// The weights' transform G g G^T for every (K, C) pair, as (A*A, C, K)
template <class F>
std::vector<float> transform_weights(const std::vector<float>& w, int64_t K, int64_t C) {
  constexpr int A = F::A;
  std::vector<float> u((size_t)A * A * C * K);
  for (int64_t k = 0; k < K; k++)
    for (int64_t c = 0; c < C; c++) {
      const float* g = &w[(k * C + c) * 9];
      float gg[A][3];
      for (int i = 0; i < A; i++)
        for (int j = 0; j < 3; j++) gg[i][j] = F::G[i][0] * g[j] + F::G[i][1] * g[3 + j] + F::G[i][2] * g[6 + j];
      for (int i = 0; i < A; i++)
        for (int j = 0; j < A; j++)
          u[((i * A + j) * C + c) * K + k] = gg[i][0] * F::G[j][0] + gg[i][1] * F::G[j][1] + gg[i][2] * F::G[j][2];
    }
  return u;
}

// The transformed input and GEMM output of one GEMM call stay under this many bytes: the tiles go
// through in chunks, so a large batch neither holds the whole transformed tensor (resnet50 bs64's
// first F(2x2) layer: 205 MB each for input and output) nor spills it from cache between the steps.
constexpr int64_t CHUNK_BYTES = 4 << 20;

// one Winograd form of an eligible convolution: its transformed weights and batched GEMMs
void build_wino(Net* n, Op& op, int mt) {
  const Tensor& s = n->tensors[op.src];
  const int64_t C = op.wdims[1], K = op.wdims[0], A = mt + 2;
  Op::Wino f;
  f.m = mt;
  f.tiles_h = (s.dims[2] + mt - 1) / mt;
  f.tiles_w = (s.dims[3] + mt - 1) / mt;
  f.tiles = s.dims[0] * f.tiles_h * f.tiles_w;
  f.chunk = std::min(f.tiles, std::max<int64_t>(1, CHUNK_BYTES / (A * A * std::max(C, K) * 4)));
  std::vector<float> u = mt == 4 ? transform_weights<F43>(op.fweight, K, C) : transform_weights<F23>(op.fweight, K, C);
  primitive_attr attr;
  attr.set_scratchpad_mode(scratchpad_mode::user);
  // bf16: the transformed input and weights in bf16, the GEMM's sums and the output transform in f32
  auto gemm = [&](int64_t tiles) {
    return matmul::primitive_desc(n->eng, memory::desc({A * A, tiles, C}, n->adt, tag::abc),
                                  memory::desc({A * A, C, K}, n->adt, tag::any),
                                  memory::desc({A * A, tiles, K}, dt::f32, tag::abc), attr);
  };
  auto pd = gemm(f.chunk);
  f.u = packed(n, {{A * A, C, K}, dt::f32, tag::abc}, u.data(), pd.weights_desc());
  n->scratch.resize(std::max<size_t>(n->scratch.size(), pd.scratchpad_desc().get_size()));
  f.gemm = matmul(pd);
  if (f.tiles % f.chunk) {
    auto tail = gemm(f.tiles % f.chunk);
    if (tail.weights_desc() != pd.weights_desc()) throw std::runtime_error("Winograd GEMMs differ in weight layout");
    n->scratch.resize(std::max<size_t>(n->scratch.size(), tail.scratchpad_desc().get_size()));
    f.tail = matmul(tail);
  }
  op.winos.push_back(std::move(f));
}

void run_wino(Net* n, Op& op) {
  const Tensor &s = n->tensors[op.src], &d = n->tensors[op.dst];
  Op::Wino& f = op.winos[op.form];
  const bool bf16 = n->adt == dt::bf16;
  const float inf = std::numeric_limits<float>::infinity();
  const float lo = op.act == 0 ? -inf : op.act == 1 ? 0.f : op.lo, hi = op.act == 2 ? op.hi : inf;
  for (int64_t t0 = 0; t0 < f.tiles; t0 += f.chunk) {
    const int64_t tn = std::min(f.chunk, f.tiles - t0);
    wino_input(f.m, bf16, data(n, op.src), s.dims[1], s.dims[2], s.dims[3], f.tiles_h, f.tiles_w, t0, tn,
               n->wino_v.get_data_handle());
    if (tn == f.chunk)
      f.gemm.execute(n->strm, f.args);
    else
      f.tail.execute(n->strm, f.tail_args);
    wino_output(f.m, bf16, static_cast<const float*>(n->wino_m.get_data_handle()), d.dims[1], d.dims[2], d.dims[3],
                f.tiles_h, f.tiles_w, t0, tn, op.has_bias ? op.bias.data() : nullptr, op.other >= 0, lo, hi,
                data(n, op.dst));
  }
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
  post_ops po;
  if (!floating(n)) {
    attr.set_scales_mask(DNNL_ARG_SRC, 0);
    attr.set_scales_mask(DNNL_ARG_WEIGHTS, mask);
    attr.set_scales_mask(DNNL_ARG_DST, 0);
    if (s.zp) attr.set_zero_points_mask(DNNL_ARG_SRC, 0);
    if (d.zp) attr.set_zero_points_mask(DNNL_ARG_DST, 0);
    if (op.other >= 0) {  // residual: dst holds the other operand; sum adds scale * (code - zp) of it
      const Tensor& o = n->tensors[op.other];
      po.append_sum(o.scale, o.zp, dt::u8);
    }
  } else if (op.other >= 0) {
    po.append_sum(1.f);
  }
  if (op.act == 1) po.append_eltwise(algorithm::eltwise_relu, 0.f, 0.f);
  if (op.act == 2) po.append_eltwise(algorithm::eltwise_clip, op.lo, op.hi);
  if (op.act == 3) po.append_eltwise(algorithm::eltwise_swish, 1.f, 0.f);
  if (op.act == 4) po.append_eltwise(algorithm::eltwise_logistic, 0.f, 0.f);
  attr.set_post_ops(po);
  const dt wt = floating(n) ? n->adt : dt::s8;  // a bf16 net's weights: converted by their reorder
  auto wany = memory::desc(wd, wt, tag::any);
  auto bmd = op.has_bias ? memory::desc({d.dims[1]}, dt::f32, tag::a) : memory::desc();
  auto pd = convolution_forward::primitive_desc(n->eng, prop_kind::forward_inference,
                                                algorithm::convolution_direct, act(n, s), wany, bmd, act(n, d),
                                                op.strides, op.dil, op.pad_l, op.pad_r, attr);
  const void* wsrc = floating(n) ? (const void*)op.fweight.data() : (const void*)op.weight.data();
  op.wmem = packed(n, {wd, floating(n) ? dt::f32 : dt::s8, op.groups > 1 ? tag::goihw : tag::oihw}, wsrc,
                   pd.weights_desc());
  if (wino_eligible(n, op)) {
    // In a bf16 net, the transformed input and weights are rounded to bf16 as well. F(4x4)'s
    // transforms (coefficients to 25) amplify that rounding more than F(2x2)'s, but the activations'
    // own bf16 rounding still dominates: resnet50 bs1 against eager float32, 5.4e-3 of the output's
    // norm with F(4x4) everywhere, 5.1e-3 with F(2x2), 5.4e-3 with direct kernels, 5.3e-3 for the
    // plain bf16 cast; and optimize()'s guard holds each model to its plain cast's error.
    build_wino(n, op, 4);
    build_wino(n, op, 2);
  }
  op.weight = {};
  op.fweight = {};
  op.args = {{DNNL_ARG_WEIGHTS, op.wmem}};
  if (!floating(n)) {
    op.sscale = {s.scale};
    op.dscale = {d.scale};
    op.sc_src = scalar_f32(n->eng, op.sscale);
    op.sc_w = scalar_f32(n->eng, op.wscale);
    op.sc_dst = scalar_f32(n->eng, op.dscale);
    op.args[DNNL_ARG_ATTR_SCALES | DNNL_ARG_SRC] = op.sc_src;
    op.args[DNNL_ARG_ATTR_SCALES | DNNL_ARG_WEIGHTS] = op.sc_w;
    op.args[DNNL_ARG_ATTR_SCALES | DNNL_ARG_DST] = op.sc_dst;
    if (s.zp) op.args[DNNL_ARG_ATTR_ZERO_POINTS | DNNL_ARG_SRC] = op.zp_src = scalar_s32(n->eng, s.zp);
    if (d.zp) op.args[DNNL_ARG_ATTR_ZERO_POINTS | DNNL_ARG_DST] = op.zp_dst = scalar_s32(n->eng, d.zp);
  }
  if (op.has_bias) {
    op.bmem = memory(bmd, n->eng, op.bias.data());
    op.args[DNNL_ARG_BIAS] = op.bmem;
  }
  n->scratch.resize(std::max<size_t>(n->scratch.size(), pd.scratchpad_desc().get_size()));
  op.prim = convolution_forward(pd);
}

// an int8 net's head: u8 (N, C) codes times s8 (C, K) with per-column scales, float32 out, as IPEX
// runs resnet50's fc; a matmul, as oneDNN 3.2's inner product takes no source zero point
void build_qlinear(Net* n, Op& op) {
  const Tensor &s = n->tensors[op.src], &d = n->tensors[op.dst];
  const memory::dim N = s.dims[0], C = s.dims[1], K = d.dims[1];
  primitive_attr attr;
  attr.set_scratchpad_mode(scratchpad_mode::user);
  attr.set_scales_mask(DNNL_ARG_SRC, 0);
  attr.set_scales_mask(DNNL_ARG_WEIGHTS, 1 << 1);
  if (s.zp) attr.set_zero_points_mask(DNNL_ARG_SRC, 0);
  auto bmd = op.has_bias ? memory::desc({1, K}, dt::f32, tag::ab) : memory::desc();
  auto pd = matmul::primitive_desc(n->eng, memory::desc({N, C}, dt::u8, tag::ab), memory::desc({C, K}, dt::s8, tag::any),
                                   bmd, memory::desc({N, K}, dt::f32, tag::ab), attr);
  op.wmem = packed(n, {{C, K}, dt::s8, tag::ba}, op.weight.data(), pd.weights_desc());
  op.weight = {};
  op.sscale = {s.scale};
  op.sc_src = scalar_f32(n->eng, op.sscale);
  op.sc_w = memory({{K}, dt::f32, tag::x}, n->eng, op.wscale.data());
  op.args = {{DNNL_ARG_WEIGHTS, op.wmem}, {DNNL_ARG_ATTR_SCALES | DNNL_ARG_SRC, op.sc_src},
             {DNNL_ARG_ATTR_SCALES | DNNL_ARG_WEIGHTS, op.sc_w}};
  if (s.zp) op.args[DNNL_ARG_ATTR_ZERO_POINTS | DNNL_ARG_SRC] = op.zp_src = scalar_s32(n->eng, s.zp);
  if (op.has_bias) {
    op.bmem = memory(bmd, n->eng, op.bias.data());
    op.args[DNNL_ARG_BIAS] = op.bmem;
  }
  n->scratch.resize(std::max<size_t>(n->scratch.size(), pd.scratchpad_desc().get_size()));
  op.prim = matmul(pd);
}

// a float net's classifier head: (N, C, 1, 1) -> (N, O, 1, 1), whose NHWC bytes are (N, O)'s
void build_linear(Net* n, Op& op) {
  if (!floating(n)) return build_qlinear(n, op);
  const Tensor &s = n->tensors[op.src], &d = n->tensors[op.dst];
  primitive_attr attr;
  attr.set_scratchpad_mode(scratchpad_mode::user);
  auto bmd = op.has_bias ? memory::desc({d.dims[1]}, dt::f32, tag::a) : memory::desc();
  auto pd = inner_product_forward::primitive_desc(
      n->eng, prop_kind::forward_inference, memory::desc({s.dims[0], s.dims[1]}, n->adt, tag::ab),
      memory::desc({d.dims[1], s.dims[1]}, n->adt, tag::any), bmd, memory::desc({d.dims[0], d.dims[1]}, n->adt, tag::ab),
      attr);
  op.wmem = packed(n, {{d.dims[1], s.dims[1]}, dt::f32, tag::ab}, op.fweight.data(), pd.weights_desc());
  op.fweight = {};
  op.args = {{DNNL_ARG_WEIGHTS, op.wmem}};
  if (op.has_bias) {
    op.bmem = memory(bmd, n->eng, op.bias.data());
    op.args[DNNL_ARG_BIAS] = op.bmem;
  }
  n->scratch.resize(std::max<size_t>(n->scratch.size(), pd.scratchpad_desc().get_size()));
  op.prim = inner_product_forward(pd);
}

void build_pool(Net* n, Op& op) {
  const Tensor &s = n->tensors[op.src], &d = n->tensors[op.dst];
  primitive_attr attr;
  attr.set_scratchpad_mode(scratchpad_mode::user);
  auto pd = pooling_forward::primitive_desc(n->eng, prop_kind::forward_inference, op.alg, act(n, s), act(n, d),
                                            op.strides, op.kernel, op.dil, op.pad_l, op.pad_r, attr);
  n->scratch.resize(std::max<size_t>(n->scratch.size(), pd.scratchpad_desc().get_size()));
  op.prim = pooling_forward(pd);
}

// x * s with s (N, C, 1, 1) broadcast over H and W (a squeeze-and-excite block's gate)
void build_scale(Net* n, Op& op) {
  const Tensor &s = n->tensors[op.src], &f = n->tensors[op.other], &d = n->tensors[op.dst];
  primitive_attr attr;
  attr.set_scratchpad_mode(scratchpad_mode::user);
  auto pd = binary::primitive_desc(n->eng, algorithm::binary_mul, act(n, s), act(n, f), act(n, d), attr);
  n->scratch.resize(std::max<size_t>(n->scratch.size(), pd.scratchpad_desc().get_size()));
  op.prim = binary(pd);
}

// quantize (f32 NCHW -> u8 NHWC) or dequantize (u8 -> f32, NCHW or (N, C)) as one reorder; in a
// float net, NCHW to and from the activations' layout (a flattened output is NCHW's bytes)
void build_reorder(Net* n, Op& op, bool quantize) {
  const Tensor& t = n->tensors[quantize ? op.dst : op.src];
  if (floating(n)) {
    memory::desc plain(t.dims, dt::f32, tag::nchw);
    op.prim = reorder(quantize ? reorder::primitive_desc(n->eng, plain, n->eng, act(n, t))
                               : reorder::primitive_desc(n->eng, act(n, t), n->eng, plain));
    return;
  }
  memory::desc plain = (!quantize && op.flat) ? memory::desc({t.dims[0], t.dims[1] * t.dims[2] * t.dims[3]},
                                                                 dt::f32, tag::ab)
                                                  : memory::desc(t.dims, dt::f32, tag::nchw);
  if (!quantize && t.f32) {  // the head's float32 output: a copy into the caller's tensor
    op.prim = reorder(reorder::primitive_desc(n->eng, op.flat ? plain : act(n, t), n->eng, plain));
    return;
  }
  memory::desc q = act(n, t);
  if (!quantize && op.flat) q = memory::desc(plain.get_dims(), dt::u8, tag::ab);  // H = W = 1 or C-major
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

// the shared transform buffers (sized for the largest Winograd form's chunk) and each form's arguments
bool bind_wino(Net* n, memory& scratch) {
  size_t v = 0, m = 0;
  for (auto& op : n->ops)
    for (auto& f : op.winos) {
      const int64_t a2 = (f.m + 2) * (f.m + 2);
      v = std::max<size_t>(v, (size_t)a2 * f.chunk * op.wdims[1]);
      m = std::max<size_t>(m, (size_t)a2 * f.chunk * op.wdims[0]);
    }
  if (!v) return false;
  n->wino_v = memory({{(memory::dim)v}, n->adt, tag::a}, n->eng);
  n->wino_m = memory({{(memory::dim)m}, dt::f32, tag::a}, n->eng);
  for (auto& op : n->ops) {
    for (auto& f : op.winos) {
      const int64_t a2 = (f.m + 2) * (f.m + 2);
      auto args = [&](int64_t tiles) {
        return std::unordered_map<int, memory>{
            {DNNL_ARG_SRC, memory({{a2, tiles, op.wdims[1]}, n->adt, tag::abc}, n->eng, n->wino_v.get_data_handle())},
            {DNNL_ARG_WEIGHTS, f.u},
            {DNNL_ARG_DST, memory({{a2, tiles, op.wdims[0]}, dt::f32, tag::abc}, n->eng, n->wino_m.get_data_handle())},
            {DNNL_ARG_SCRATCHPAD, scratch}};
      };
      f.args = args(f.chunk);
      if (f.tiles % f.chunk) f.tail_args = args(f.tiles % f.chunk);
    }
  }
  return true;
}

// One call of the whole net; with ``times``, each op's least seconds so far are kept in it.
void run_ops(Net* n, std::vector<double>* times) {
  for (size_t i = 0; i < n->ops.size(); i++) {
    Op& op = n->ops[i];
    const auto t0 = times ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point();
    if (op.copy_other) {
      Tensor &o = n->tensors[op.other], &d = n->tensors[op.dst];
      std::memcpy(n->buffers[d.buffer].data(), n->buffers[o.buffer].data(), bytes(n, d));
    }
    if (op.form >= 0) {
      run_wino(n, op);
    } else if (op.rows) {
      const Tensor& t = n->tensors[op.dst];
      input_nhwc(n->adt, (const float*)n->in_mem.get_data_handle(), data(n, op.dst), t.dims, t.scale, t.zp);
    } else {
      op.prim.execute(n->strm, op.args);
      n->strm.wait();  // a CPU stream runs in order anyway; the Winograd transforms read what it wrote
    }
    if (times)
      (*times)[i] = std::min((*times)[i], std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
}

// the net's own input and outputs pointed at zeros (a timing run needs no caller's tensors)
struct ZeroIO {
  std::vector<float> in;
  std::vector<std::vector<float>> outs;
  explicit ZeroIO(Net* n) : in((size_t)numel(n->in_dims)) {
    n->in_mem.set_data_handle(in.data());
    for (auto& o : n->outs) {
      outs.emplace_back(o.get_desc().get_size() / sizeof(float));
      o.set_data_handle(outs.back().data());
    }
  }
};

// Each eligible convolution runs in the form that timed fastest inside whole runs of the net (the
// direct kernel, F(4x4, 3x3), F(2x2, 3x3); the least of 5 interleaved calls each after a warm-up,
// on a zero input: a sum of 3 flipped between the two Winograd forms from build to build). Alone,
// with its weights and buffers hot in cache, Winograd timed 1.5-2x faster than it runs between the
// net's other layers; the unchosen forms' weights are then freed.
void choose_wino(Net* n) {
  if (n->winograd == 4 || n->winograd == 2) {
    for (auto& op : n->ops)
      if (!op.winos.empty()) {
        for (int form = 0; form < (int)op.winos.size(); form++)
          if (op.winos[form].m == n->winograd) op.form = form;
        for (int form = 0; form < (int)op.winos.size(); form++)
          if (form != op.form) op.winos[form] = Op::Wino();
      }
    return;
  }
  ZeroIO io(n);
  int forms = 0;
  for (auto& op : n->ops) forms = std::max(forms, (int)op.winos.size());
  std::vector<std::vector<double>> t(forms + 1, std::vector<double>(n->ops.size(), 1e30));
  auto use = [&](int form) {
    for (auto& op : n->ops) op.form = form < (int)op.winos.size() ? form : -1;
  };
  for (int form = -1; form < forms; form++) {  // warm-up: each form's first call touches its weights
    use(form);
    run_ops(n, nullptr);
  }
  for (int r = 0; r < 5; r++)  // interleaved, so a burst of other work on the machine hits every form
    for (int form = -1; form < forms; form++) {
      use(form);
      run_ops(n, &t[form + 1]);
    }
  for (size_t i = 0; i < n->ops.size(); i++) {
    Op& op = n->ops[i];
    op.form = -1;
    for (int form = 0; form < (int)op.winos.size(); form++)
      if (t[form + 1][i] < t[op.form + 1][i]) op.form = form;
    for (int form = 0; form < (int)op.winos.size(); form++)
      if (form != op.form) op.winos[form] = Op::Wino();
  }
}

}  // namespace

extern "C" {

// dtype: 0 int8 (u8 activations), 1 float32, 2 bfloat16 (float32 in and out); winograd (float32):
// 0 never, 1 where timed fastest, 4 or 2 the F(4x4, 3x3) or F(2x2, 3x3) form wherever eligible (tests)
void* kn_new(int dtype, int winograd) {
  Net* n = new Net();
  n->adt = dtype == 1 ? dt::f32 : dtype == 2 ? dt::bf16 : dt::u8;
  n->winograd = winograd;
  return n;
}
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

// weight: OIHW (O = all output channels, I = input channels per group), int8 codes with their
// per-channel wscale, or float32 in a float net (wscale, scale and zp unused); pads: t, l, b, r
int kn_conv(void* net, int src, int other, int64_t out_c, int64_t kh, int64_t kw, const int64_t* stride,
            const int64_t* pads, const int64_t* dilation, int64_t groups, const void* weight,
            const float* wscale, const float* bias, float scale, int zp, int act, float lo, float hi) {
  Net* n = static_cast<Net*>(net);
  return guarded(n, [&] {
    const Tensor s = operand(n, src);
    Op op;
    op.kind = Op::CONV;
    op.src = src;
    op.other = other;
    op.groups = (int)groups;
    op.act = act;
    op.lo = lo;
    op.hi = hi;
    int64_t in_per_group = s.dims[1] / groups;
    op.wdims = {out_c, in_per_group, kh, kw};
    if (floating(n)) {
      op.fweight.assign((const float*)weight, (const float*)weight + numel(op.wdims));
    } else {
      op.weight.assign((const int8_t*)weight, (const int8_t*)weight + numel(op.wdims));
      op.wscale.assign(wscale, wscale + out_c);
    }
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
    const Tensor s = operand(n, src);
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

// a float net's Linear on a flattened (N, C, 1, 1) value; weight: (out_f, C) float32
int kn_linear(void* net, int src, int64_t out_f, const float* weight, const float* bias) {
  Net* n = static_cast<Net*>(net);
  return guarded(n, [&] {
    const Tensor s = operand(n, src);
    if (!floating(n) || s.dims[2] * s.dims[3] != 1) throw std::runtime_error("a Linear needs a float net's 1 x 1 value");
    Op op;
    op.kind = Op::LINEAR;
    op.src = src;
    op.fweight.assign(weight, weight + out_f * s.dims[1]);
    op.has_bias = bias != nullptr;
    if (bias) op.bias.assign(bias, bias + out_f);
    op.dst = add_tensor(n, {s.dims[0], out_f, 1, 1}, 1.f, 0);
    n->ops.push_back(std::move(op));
    return n->ops.back().dst;
  });
}

// an int8 net's classifier head on a (N, C, 1, 1) value: int8 codes (out_f, C) with per-row scales,
// float32 bias; its output is float32 (N, out_f, 1, 1), for kn_output only
int kn_qlinear(void* net, int src, int64_t out_f, const int8_t* weight, const float* wscale, const float* bias) {
  Net* n = static_cast<Net*>(net);
  return guarded(n, [&] {
    const Tensor s = operand(n, src);
    if (floating(n) || s.dims[2] * s.dims[3] != 1)
      throw std::runtime_error("an int8 Linear needs an int8 net's 1 x 1 value");
    Op op;
    op.kind = Op::LINEAR;
    op.src = src;
    op.weight.assign(weight, weight + out_f * s.dims[1]);
    op.wscale.assign(wscale, wscale + out_f);
    op.has_bias = bias != nullptr;
    if (bias) op.bias.assign(bias, bias + out_f);
    op.dst = add_tensor(n, {s.dims[0], out_f, 1, 1}, 1.f, 0);
    n->tensors[op.dst].f32 = true;
    n->ops.push_back(std::move(op));
    return n->ops.back().dst;
  });
}

// a float net's x * s, s (N, C, 1, 1) broadcast over x's (N, C, H, W)
int kn_scale(void* net, int src, int by) {
  Net* n = static_cast<Net*>(net);
  return guarded(n, [&] {
    const Tensor s = operand(n, src), f = n->tensors.at(by);
    if (!floating(n) || f.dims != memory::dims{s.dims[0], s.dims[1], 1, 1})
      throw std::runtime_error("a scale needs a float net's (N, C, 1, 1) factor");
    Op op;
    op.kind = Op::SCALE;
    op.src = src;
    op.other = by;
    op.dst = add_tensor(n, s.dims, 1.f, 0);
    n->ops.push_back(std::move(op));
    return n->ops.back().dst;
  });
}

// one more of the net's outputs (kn_run's outs, in this order); flat: the output is (N, C*H*W) in
// NCHW order (a flatten), allowed where H = W = 1
int kn_output(void* net, int src, int flat) {
  Net* n = static_cast<Net*>(net);
  return guarded(n, [&] {
    const Tensor& t = n->tensors.at(src);
    if (flat && t.dims[2] * t.dims[3] != 1) throw std::runtime_error("flattened output needs H = W = 1");
    Op op;
    op.kind = Op::OUTPUT;
    op.src = src;
    op.flat = flat != 0;
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
        size_t size = bytes(n, d);
        const bool sums = op.kind == Op::CONV && op.other >= 0;  // a SCALE's factor is only read
        if (sums && last[op.other] == i && op.other != op.src) {
          d.buffer = n->tensors[op.other].buffer;  // the sum post-op accumulates in place
        } else {
          op.copy_other = sums;
          auto it = std::find_if(free_list.begin(), free_list.end(),
                                 [&](auto& f) { return f.first >= size; });
          if (it != free_list.end()) {
            d.buffer = it->second;
            free_list.erase(it);
          } else {
            n->buffers.emplace_back(size);
            d.buffer = (int)n->buffers.size() - 1;
          }
        }
      }
      // freed after this op, unless the dst took it over; conv(x) + x reads x twice but frees it once
      std::vector<int> reads{op.src};
      if (op.other >= 0 && op.other != op.src) reads.push_back(op.other);
      for (int t : reads) {
        if (t >= 0 && last[t] == i && !(t == op.other && op.kind == Op::CONV && !op.copy_other)) {
          free_list.emplace_back(n->buffers[n->tensors[t].buffer].size(), n->tensors[t].buffer);
          std::sort(free_list.begin(), free_list.end());
        }
      }
    }
    for (auto& op : n->ops) {
      if (op.kind == Op::CONV) build_conv(n, op);
      if (op.kind == Op::POOL) build_pool(n, op);
      if (op.kind == Op::SCALE) build_scale(n, op);
      if (op.kind == Op::LINEAR) build_linear(n, op);
      if (op.kind == Op::INPUT) {
        op.rows = rows_here(n->in_dims);
        if (!op.rows) build_reorder(n, op, true);
      }
      if (op.kind == Op::OUTPUT) build_reorder(n, op, false);
    }
    // every memory bound once: a call only points the input and output at the caller's tensors
    memory scratch(memory::desc({(memory::dim)n->scratch.size()}, dt::u8, tag::x), n->eng, n->scratch.data());
    auto mem = [&](int t) {
      Tensor& x = n->tensors[t];
      return memory(act(n, x), n->eng, n->buffers[x.buffer].data());
    };
    for (auto& op : n->ops) {
      if (op.kind == Op::INPUT) {
        n->in_mem = memory({n->in_dims, dt::f32, tag::nchw}, n->eng, nullptr);
        op.args[DNNL_ARG_FROM] = n->in_mem;
        op.args[DNNL_ARG_TO] = mem(op.dst);
      } else if (op.kind == Op::OUTPUT && floating(n)) {
        Tensor& x = n->tensors[op.src];
        op.args[DNNL_ARG_FROM] = mem(op.src);
        n->outs.push_back(memory({x.dims, dt::f32, tag::nchw}, n->eng, nullptr));
        op.args[DNNL_ARG_TO] = n->outs.back();
      } else if (op.kind == Op::OUTPUT) {
        Tensor& x = n->tensors[op.src];
        memory::dims flat{x.dims[0], numel(x.dims) / x.dims[0]};
        op.args[DNNL_ARG_FROM] = op.flat ? memory({flat, x.f32 ? dt::f32 : dt::u8, tag::ab}, n->eng,
                                                  n->buffers[x.buffer].data())
                                         : mem(op.src);
        n->outs.push_back(op.flat ? memory({flat, dt::f32, tag::ab}, n->eng, nullptr)
                                  : memory({x.dims, dt::f32, tag::nchw}, n->eng, nullptr));
        op.args[DNNL_ARG_TO] = n->outs.back();
      } else if (op.kind == Op::LINEAR) {  // (N, C, 1, 1) NHWC is (N, C)
        auto flat = [&](int t) {
          Tensor& x = n->tensors[t];
          return memory({{x.dims[0], x.dims[1]}, x.f32 ? dt::f32 : n->adt, tag::ab}, n->eng, n->buffers[x.buffer].data());
        };
        op.args[DNNL_ARG_SRC] = flat(op.src);
        op.args[DNNL_ARG_DST] = flat(op.dst);
        op.args[DNNL_ARG_SCRATCHPAD] = scratch;
      } else {
        op.args[DNNL_ARG_SRC] = mem(op.src);  // a SCALE's DNNL_ARG_SRC_0
        op.args[DNNL_ARG_DST] = mem(op.dst);
        op.args[DNNL_ARG_SCRATCHPAD] = scratch;
        if (op.kind == Op::SCALE) op.args[DNNL_ARG_SRC_1] = mem(op.other);
      }
    }
    if (bind_wino(n, scratch)) choose_wino(n);
    return 0;
  });
}

// each op's least seconds over `calls` calls on a zero input (after one more): the input reorder,
// the steps in order, the output reorder; returns the op count
int kn_times(void* net, int calls, double* out, int cap) {
  Net* n = static_cast<Net*>(net);
  return guarded(n, [&] {
    ZeroIO io(n);
    std::vector<double> t(n->ops.size(), 1e30);
    run_ops(n, nullptr);
    for (int r = 0; r < calls; r++) run_ops(n, &t);
    for (int i = 0; i < (int)t.size() && i < cap; i++) out[i] = t[i];
    return (int)t.size();
  });
}

// each op's form, in program order (as kn_times): a Winograd convolution's output tile (4 or 2), 0 for
// an eligible one on the direct kernel, -1 for every other op; returns the op count
int kn_forms(void* net, int* out, int cap) {
  Net* n = static_cast<Net*>(net);
  for (int i = 0; i < (int)n->ops.size() && i < cap; i++) {
    const Op& op = n->ops[i];
    out[i] = op.winos.empty() ? -1 : op.form < 0 ? 0 : op.winos[op.form].m;
  }
  return (int)n->ops.size();
}

// outs: one float32 pointer per kn_output, in that order
int kn_run(void* net, const float* in, float* const* outs) {
  Net* n = static_cast<Net*>(net);
  return guarded(n, [&] {
    n->in_mem.set_data_handle(const_cast<float*>(in));
    for (size_t i = 0; i < n->outs.size(); i++) n->outs[i].set_data_handle(outs[i]);
    run_ops(n, nullptr);
    return 0;
  });
}

}  // extern "C"
