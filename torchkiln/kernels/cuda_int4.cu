// torchkiln::cuda_int4_mm(x, packed, scale, zero, group, config=-1): up to 8 rows of x (bf16, [M, K])
// times int4 weights in this kernel's tile layout (cuda_int4.py `pack`): int32 [N/16, K/64, 32, 4],
// one word per lane of a warp per 16 x 16 tile of the weight, in the order the tensor cores' A
// operand wants it; scale and zero [N, K/G] in bf16, w = q * scale + zero per group of G inputs.
// Out: [M, N] bf16, accumulated in float32.
//
// Why hand-written (built by cuda_int4.py on first use, where nvcc is present): a batch-1 int4
// product only has to stream half a byte per weight, but torch's own kernel (tinygemm,
// aten._weight_int4pack_mm) read Llama-3-8B's weights at ~1.85 TB/s on the H200, under half its
// copy bandwidth, and torchkiln's Triton kernels (quantization/gemv.py) were 1.3-1.5x slower still.
// What bounds these kernels is the integer work of turning nibbles into numbers, not the loads: a
// first form here (one float per nibble, FMAs on the CUDA cores, ~2.9 instructions per value) read
// at 1.7-2.1 TB/s, and the same loads with the arithmetic left out at 3.5-4.4 (RESULTS.md, fortieth
// session). So this one leaves the multiply-adds to the tensor cores (mma.sync m16n8k16, x as the
// B operand, its 8 columns up to 8 rows of x) and makes each pair of nibbles a bf16 pair with one
// AND-OR (LOP3) into the bits of 128.0: a nibble in a half's low mantissa bits reads 128 + q,
// exactly (bf16 holds 8 significant bits). Per 16 x 16 tile that is 3 shifts, 4 LOP3 and one MMA.
// Per group the float32 sums get the scale and zero, and the offset back: s * (D - 128 X) + z * X,
// where X, the group's sum of x, comes from a second MMA with an A operand of ones (the tensor cores
// are otherwise idle here), exact in float32.
//
// Work split: a block owns RB blocks of 16 output rows; its W warps split K by groups, each keeping
// one group's weights in flight while it converts the previous one, and sum their partial outputs
// through shared memory at the end.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <torch/library.h>

#include <cstdint>

namespace {

__device__ __forceinline__ void mma(const uint32_t (&a)[4], uint32_t b0, uint32_t b1, float (&d)[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// the nibbles at bits 0-3 and 16-19 of v as a bf16 pair (128 + q each)
__device__ __forceinline__ uint32_t pair(uint32_t v) { return (v & 0x000F000Fu) | 0x43004300u; }

__device__ __forceinline__ float bf(uint16_t bits) { return __uint_as_float(static_cast<uint32_t>(bits) << 16); }

// TG: 16-wide tiles per group (4, 8 or 16); RB: 16-row blocks per block; S: groups per step (the
// loads of the next step are in flight while a step converts: RB * S * TG * 4 bytes a lane)
template <int TG, int RB, int S>
__global__ void __launch_bounds__(256) int4_mm(const uint16_t* __restrict__ x, int M,
                                               const uint4* __restrict__ packed, const uint16_t* __restrict__ scale,
                                               const uint16_t* __restrict__ zero, uint16_t* __restrict__ out, int N,
                                               int K) {
  constexpr int Q = TG / 4;  // uint4s (4 tiles each) per lane per group per row block
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int groups = K / (16 * TG), per_warp = (groups + warps - 1) / warps;
  const int first = warp * per_warp, last = min(groups, first + per_warp);
  const int rb0 = blockIdx.x * RB, quads = K / 64;  // uint4s per lane per row block
  const uint16_t* xrow = x + static_cast<int64_t>(g) * K + 2 * t;  // this lane's B column (x row g)
  const bool has_col = g < M;
  constexpr uint32_t ONES = 0x3F803F80u;  // bf16 pair (1, 1)
  const uint32_t ones[4] = {ONES, ONES, ONES, ONES};

  float acc[RB][4];
#pragma unroll
  for (int b = 0; b < RB; ++b) acc[b][0] = acc[b][1] = acc[b][2] = acc[b][3] = 0.f;
  uint4 cur[RB][S * Q], nxt[RB][S * Q];
  auto load = [&](uint4 (&w)[RB][S * Q], int grp0) {
#pragma unroll
    for (int b = 0; b < RB; ++b)
#pragma unroll
      for (int j = 0; j < S * Q; ++j)
        w[b][j] = grp0 + j / Q < last && rb0 + b < N / 16
                      ? __ldg(packed + (static_cast<int64_t>(rb0 + b) * quads + grp0 * Q + j) * 32 + lane)
                      : make_uint4(0, 0, 0, 0);
  };
  load(cur, first);
  for (int grp0 = first; grp0 < last; grp0 += S) {
    load(nxt, grp0 + S);
#pragma unroll
    for (int sg = 0; sg < S; ++sg) {
      const int grp = grp0 + sg;
      if (grp >= last) break;
      float d[RB][4], xs[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int b = 0; b < RB; ++b) d[b][0] = d[b][1] = d[b][2] = d[b][3] = 0.f;
#pragma unroll
      for (int j = 0; j < TG; ++j) {
        const int k0 = (grp * TG + j) * 16;
        uint32_t b0 = 0, b1 = 0;
        if (has_col) {
          b0 = __ldg(reinterpret_cast<const uint32_t*>(xrow + k0));
          b1 = __ldg(reinterpret_cast<const uint32_t*>(xrow + k0 + 8));
        }
        mma(ones, b0, b1, xs);
#pragma unroll
        for (int b = 0; b < RB; ++b) {
          const uint4 q4 = cur[b][sg * Q + j / 4];
          const uint32_t v = (j & 3) == 0 ? q4.x : (j & 3) == 1 ? q4.y : (j & 3) == 2 ? q4.z : q4.w;
          const uint32_t a[4] = {pair(v), pair(v >> 4), pair(v >> 8), pair(v >> 12)};
          mma(a, b0, b1, d[b]);
        }
      }
      // xs[0], xs[1]: the group's sum of x for columns 2t, 2t+1 (every row of the ones product)
#pragma unroll
      for (int b = 0; b < RB; ++b) {
        const int r0 = (rb0 + b) * 16 + g;
        if (r0 >= N) break;
        const int64_t q0 = static_cast<int64_t>(r0) * groups + grp, q1 = q0 + 8 * static_cast<int64_t>(groups);
        const float s0 = bf(__ldg(scale + q0)), z0 = bf(__ldg(zero + q0));
        const float s1 = bf(__ldg(scale + q1)), z1 = bf(__ldg(zero + q1));
        acc[b][0] += s0 * fmaf(-128.f, xs[0], d[b][0]) + z0 * xs[0];
        acc[b][1] += s0 * fmaf(-128.f, xs[1], d[b][1]) + z0 * xs[1];
        acc[b][2] += s1 * fmaf(-128.f, xs[0], d[b][2]) + z1 * xs[0];
        acc[b][3] += s1 * fmaf(-128.f, xs[1], d[b][3]) + z1 * xs[1];
      }
    }
#pragma unroll
    for (int b = 0; b < RB; ++b)
#pragma unroll
      for (int j = 0; j < S * Q; ++j) cur[b][j] = nxt[b][j];
  }

  // the warps' partial sums through shared memory: red[warp][row in block][column]
  extern __shared__ float red[];
#pragma unroll
  for (int b = 0; b < RB; ++b) {
    float* r = red + (warp * RB * 16 + b * 16) * 8;
    r[g * 8 + 2 * t] = acc[b][0];
    r[g * 8 + 2 * t + 1] = acc[b][1];
    r[(g + 8) * 8 + 2 * t] = acc[b][2];
    r[(g + 8) * 8 + 2 * t + 1] = acc[b][3];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < RB * 16 * 8; i += blockDim.x) {
    const int row = i / 8, col = i % 8, n = rb0 * 16 + row;
    if (col >= M || n >= N) continue;
    float v = 0.f;
    for (int w = 0; w < warps; ++w) v += red[w * RB * 16 * 8 + i];
    out[static_cast<int64_t>(col) * N + n] = __bfloat16_as_ushort(__float2bfloat16_rn(v));
  }
}

// launch shapes: (RB row blocks per block, W warps, S groups per step)
struct Config {
  int rb, w, s;
};
constexpr Config CONFIGS[] = {{1, 8, 1}, {1, 4, 1}, {1, 8, 2}, {1, 4, 2}, {1, 4, 4}, {2, 4, 2}, {1, 8, 4}, {2, 8, 2}};
constexpr int N_CONFIGS = sizeof(CONFIGS) / sizeof(CONFIGS[0]);

template <int TG, int RB, int S>
void launch(const at::Tensor& x, int M, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& zero,
            at::Tensor& out, int N, int K, int warps) {
  const int blocks = (N / 16 + RB - 1) / RB, bytes = warps * RB * 16 * 8 * 4;
  int4_mm<TG, RB, S><<<blocks, warps * 32, bytes, c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const uint16_t*>(x.data_ptr()), M, reinterpret_cast<const uint4*>(packed.data_ptr()),
      reinterpret_cast<const uint16_t*>(scale.data_ptr()), reinterpret_cast<const uint16_t*>(zero.data_ptr()),
      reinterpret_cast<uint16_t*>(out.data_ptr()), N, K);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int TG>
void dispatch(const at::Tensor& x, int M, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& zero,
              at::Tensor& out, int N, int K, Config cfg) {
#define KILN_CASE(RB_, S_) \
  if (cfg.rb == RB_ && cfg.s == S_) return launch<TG, RB_, S_>(x, M, packed, scale, zero, out, N, K, cfg.w);
  KILN_CASE(1, 1)
  KILN_CASE(1, 2)
  KILN_CASE(1, 4)
  KILN_CASE(2, 2)
#undef KILN_CASE
  TORCH_CHECK(false, "torchkiln::cuda_int4_mm: no kernel for this config");
}

at::Tensor cuda_int4_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                        const at::Tensor& zero, int64_t group, int64_t config) {
  // the Python wrapper (cuda_int4.py) checks operands and names what is wrong; these are a backstop
  TORCH_CHECK(x.is_cuda() && packed.is_cuda() && scale.is_cuda() && zero.is_cuda(),
              "torchkiln::cuda_int4_mm: CUDA tensors only");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && scale.scalar_type() == at::kBFloat16 &&
                  zero.scalar_type() == at::kBFloat16,
              "torchkiln::cuda_int4_mm: x, scale and zero must be bfloat16");
  TORCH_CHECK(packed.scalar_type() == at::kInt && packed.dim() == 4 && packed.is_contiguous() &&
                  packed.size(2) == 32 && packed.size(3) == 4,
              "torchkiln::cuda_int4_mm: packed must be a contiguous int32 [N/16, K/64, 32, 4] tensor");
  const int64_t N = packed.size(0) * 16, K = packed.size(1) * 64;
  TORCH_CHECK(x.is_contiguous() && x.size(-1) == K && x.numel() / K >= 1 && x.numel() / K <= 8,
              "torchkiln::cuda_int4_mm: x must be 1-8 contiguous rows of K");
  TORCH_CHECK(group == 64 || group == 128 || group == 256, "torchkiln::cuda_int4_mm: group must be 64, 128 or 256");
  TORCH_CHECK(scale.is_contiguous() && zero.is_contiguous() && scale.numel() == N * (K / group) &&
                  zero.numel() == N * (K / group),
              "torchkiln::cuda_int4_mm: scale and zero must be contiguous [N, K / group]");
  TORCH_CHECK(config >= -1 && config < N_CONFIGS, "torchkiln::cuda_int4_mm: config out of range");
  c10::cuda::CUDAGuard guard(x.device());
  const int M = static_cast<int>(x.numel() / K);
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  at::Tensor out = at::empty(sizes, x.options());
  // B operand loads are 4 bytes: a view at an odd offset is copied
  const at::Tensor xa = reinterpret_cast<uintptr_t>(x.data_ptr()) % 4 ? x.clone() : x;
  // default: 8 warps, and two row blocks a block once there are enough of them to fill the GPU
  const Config cfg = CONFIGS[config >= 0 ? config : (N >= 16384 ? 1 : 0)];
  const int n = static_cast<int>(N), k = static_cast<int>(K);
  if (group == 64) dispatch<4>(xa, M, packed, scale, zero, out, n, k, cfg);
  else if (group == 128) dispatch<8>(xa, M, packed, scale, zero, out, n, k, cfg);
  else dispatch<16>(xa, M, packed, scale, zero, out, n, k, cfg);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torchkiln, m) {
  m.def("cuda_int4_mm(Tensor x, Tensor packed, Tensor scale, Tensor zero, int group, int config=-1) -> Tensor");
}
TORCH_LIBRARY_IMPL(torchkiln, CUDA, m) { m.impl("cuda_int4_mm", cuda_int4_mm); }
