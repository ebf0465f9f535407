// torchkiln::cuda_int4_mm_g<group>(x, packed, scale_zero, config=-1, norm, eps, gated, bias, resid):
// up to 32 rows of x (bf16, [M, K]) times int4 weights in this kernel's tile layout (cuda_int4.py `pack`):
// int32 [N/16, K/64, 32, 4], one word per lane of a warp per 16 x 16 tile of the weight, in the order the
// tensor cores' A operand wants it; scale_zero (`pack_scales`) int32 [N/16, K/G, 16], per 16 rows and
// group the rows' bf16 (scale, zero) pairs, w = q * scale + zero per group of G inputs. Out: [M, N] bf16,
// accumulated in float32. The decode step's neighbours, optional (struct Fold): an RMSNorm of x first
// (one row), silu(gate) * up of the weight's two halves, bias, a residual.
//
// Why hand-written (built by cuda_int4.py on first use, where nvcc is present): a batch-1 int4
// product only has to stream half a byte per weight, but torch's own kernel (tinygemm,
// aten._weight_int4pack_mm) read Llama-3-8B's weights at ~1.85 TB/s on the H200, under half its
// copy bandwidth, and torchkiln's Triton kernels (quantization/gemv.py) were 1.3-1.5x slower still.
// The integer work of turning nibbles into numbers bounds such kernels as much as the loads: a
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
// Work split: a block owns RB blocks of 16 output rows; its W warps split K by groups and sum their
// partial outputs through shared memory at the end. Each warp streams its groups' weights and
// scales through a ring of ST slots in shared memory with cp.async, ST - 1 groups in flight while
// it converts one: the loads then hold no registers. (ncu, forty-first session, on a form that
// double-buffered one group in registers: the top stall was waiting on global loads, 4.6 of 13
// cycles per instruction, at 59 registers and 50% occupancy, DRAM at 51%.) Nothing in the loop
// branches by lane: MMA columns past the M rows of x read row M - 1 again (columns are independent
// and those outputs are never stored), and row blocks past N re-read the last.
//
// pack() orders each 64 columns so that lane t's B operands for the block's 4 tiles are x's 16
// consecutive values at 16t: two 16-byte loads a lane where the MMA's own order takes eight 4-byte ones.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>

// One library per group size (cuda_int4.py passes -DKILN_GROUP=64, 128 or 256; its op is
// cuda_int4_mm_g<group>): a model uses one, and a build of one holds a third of the instances.
#ifndef KILN_GROUP
#define KILN_GROUP 128
#endif

namespace {

constexpr int KILN_TG = KILN_GROUP / 16;  // 16-wide tiles per group

__device__ __forceinline__ void mma(const uint32_t (&a)[4], uint32_t b0, uint32_t b1, float (&d)[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// the nibbles at bits 0-3 and 16-19 of v as a bf16 pair (128 + q each), in one LOP3: written as
// C++ the AND and the OR took one each, a LOP3 having room for one immediate (SASS of the first form)
__device__ __forceinline__ uint32_t pair(uint32_t v) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(r) : "r"(v), "n"(0x000F000F), "n"(0x43004300));  // (a & b) | c
  return r;
}


__device__ __forceinline__ void cp_async16(uint32_t smem, const void* gmem) {  // smem: a shared-window address
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// TG: 16-wide tiles per group (4, 8 or 16); RB: 16-row blocks per block; ST: ring slots per warp.
// A slot holds one group: RB * Q uint4 of weights per lane ([b][q][lane]), then RB * 16 scale-zero words.
template <int TG, int RB>
__host__ __device__ constexpr int slot_words() {  // uint4s
  return RB * (TG / 4) * 32 + RB * 4;
}

// The decode step's neighbours of a product, folded in (llm/fused.py says why). All null / 0: the plain product.
struct Fold {
  const float* norm;      // [K] float32: x (one row) RMS-normalised, then scaled by it (a NORM kernel)
  float eps;
  const uint16_t* bias;   // [N] bf16, added before the gate
  const uint16_t* resid;  // [rows, N out] bf16, added last
  int gated;              // rows [0, N/2) gate, [N/2, N) up: out = silu(gate) * up, N/2 wide (RB even)
};

// NB: 8-column blocks of x (up to 8 NB rows), each weight tile converted once for all of them;
// NORM: one row, staged normalised (x * g, bf16) in shared memory by the block before its loop.
template <int TG, int RB, int ST, int NB, bool NORM>
__global__ void __launch_bounds__(512) int4_mm(const uint16_t* __restrict__ x, int M,
                                               const uint4* __restrict__ packed, const uint4* __restrict__ sz,
                                               uint16_t* __restrict__ out, int N, int K, Fold fold) {
  static_assert(!NORM || NB == 1, "the norm prologue takes one row");
  constexpr int Q = TG / 4;  // 64-column blocks per group: a uint4 of weights per lane per row block, two of x
  constexpr int SLOT = slot_words<TG, RB>();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int groups = K / (16 * TG), per_warp = (groups + warps - 1) / warps;
  const int first = warp * per_warp, last = min(groups, first + per_warp);
  const int quads = K / 64, blocks16 = N / 16;
  // row block b of this block: gated, the first RB / 2 are gate rows and the rest the same rows' up
  // rows, N / 2 further on; blocks past the end re-read the last (their outputs are not stored)
  const int half = blocks16 / 2, own = fold.gated ? RB / 2 : RB;
  auto row_block = [&](int b) {
    const int i = static_cast<int>(blockIdx.x) * own + (b < own ? b : b - own);
    return fold.gated ? (b < own ? min(i, half - 1) : half + min(i, half - 1)) : min(i, blocks16 - 1);
  };
  const uint4* wq[RB];
#pragma unroll
  for (int b = 0; b < RB; ++b) wq[b] = packed + static_cast<int64_t>(row_block(b)) * quads * 32 + lane;
  // lanes 4b .. 4b + 3 copy row block b's 16 scale-zero words of a group (4 uint4)
  const uint4* szq = sz + static_cast<int64_t>(row_block(min(lane >> 2, RB - 1))) * groups * 4 + (lane & 3);
  constexpr uint32_t ONES = 0x3F803F80u;  // bf16 pair (1, 1)
  const uint32_t ones[4] = {ONES, ONES, ONES, ONES};

  // This warp's ring, its slots filled and read in turn. Pointers advance by a group: computing each
  // copy's addresses from the group index took ~40 of the loop's ~164 instructions a group (SASS).
  extern __shared__ uint4 smem[];
  const uint4* const ring = smem + warp * ST * SLOT;
  const uint32_t fill_lo = static_cast<uint32_t>(__cvta_generic_to_shared(ring + lane));
  const uint32_t fill_hi = fill_lo + (ST - 1) * SLOT * 16;
  uint32_t fill = fill_lo;
  const uint4* wnext[RB];
#pragma unroll
  for (int b = 0; b < RB; ++b) wnext[b] = wq[b] + first * Q * 32;
  const uint4* sznext = szq + first * 4;
  auto issue = [&]() {
#pragma unroll
    for (int b = 0; b < RB; ++b) {
#pragma unroll
      for (int q = 0; q < Q; ++q) cp_async16(fill + (b * Q + q) * 32 * 16, wnext[b] + q * 32);
      wnext[b] += Q * 32;
    }
    if (lane < 4 * RB) cp_async16(fill + RB * Q * 32 * 16, sznext);
    sznext += 4;
    fill = fill == fill_hi ? fill_lo : fill + SLOT * 16;
  };

  float acc[NB][RB][4];
#pragma unroll
  for (int c = 0; c < NB; ++c)
#pragma unroll
    for (int b = 0; b < RB; ++b) acc[c][b][0] = acc[c][b][1] = acc[c][b][2] = acc[c][b][3] = 0.f;
#pragma unroll
  for (int i = 0; i < ST - 1; ++i) {  // one commit per slot, empty or not: wait_group counts commits
    if (first + i < last) issue();
    cp_async_commit();
  }
  // x's rows for MMA column g of each column block (past the M rows, row M - 1 again: never stored)
  const uint4* xq[NB];
#pragma unroll
  for (int c = 0; c < NB; ++c)
    xq[c] = reinterpret_cast<const uint4*>(x + static_cast<int64_t>(min(8 * c + g, M - 1)) * K) + 2 * t;
  float rs = 1.f;  // NORM: the row's rsqrt(mean(x^2) + eps)
  if constexpr (NORM) {
    // x * g into shared memory past the rings, in x's own order, while the first groups' copies fly;
    // the sum of squares of x over the block, in float32
    uint4* xs_smem = smem + warps * ST * SLOT;
    float* red = reinterpret_cast<float*>(xs_smem + K / 8);
    float ss = 0.f;
    for (int i = threadIdx.x; i < K / 8; i += blockDim.x) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(x) + i);
      const float4 g0 = __ldg(reinterpret_cast<const float4*>(fold.norm) + 2 * i);
      const float4 g1 = __ldg(reinterpret_cast<const float4*>(fold.norm) + 2 * i + 1);
      const float gs[8] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w};
      uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float lo = __uint_as_float(w[e] << 16), hi = __uint_as_float(w[e] & 0xFFFF0000u);
        ss = fmaf(lo, lo, fmaf(hi, hi, ss));
        w[e] = static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(lo * gs[2 * e]))) |
               (static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(hi * gs[2 * e + 1]))) << 16);
      }
      xs_smem[i] = make_uint4(w[0], w[1], w[2], w[3]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xFFFFFFFFu, ss, o);
    if (lane == 0) red[warp] = ss;
    __syncthreads();
    ss = 0.f;
    for (int w = 0; w < warps; ++w) ss += red[w];
    rs = rsqrtf(ss / K + fold.eps);
    xq[0] = xs_smem + 2 * t;
  }
  const uint4* cur = ring;
  const uint4* xnext[NB];
#pragma unroll
  for (int c = 0; c < NB; ++c) xnext[c] = xq[c] + first * Q * 8;
  for (int grp = first; grp < last; ++grp) {
    // the slot read last iteration takes group grp + ST - 1 (the __syncwarp below ordered the reads first)
    if (grp + ST - 1 < last) issue();
    cp_async_commit();
    // one column block: the group's x in registers up front; several: a 64-column block's at a time
    constexpr int XG = NB == 1 ? 2 * Q : 2;
    uint4 xv[NB][XG];
    auto load_x = [&](int q) {
#pragma unroll
      for (int c = 0; c < NB; ++c)
#pragma unroll
        for (int i = 0; i < XG; ++i) {
          const uint4* p = xnext[c] + (q + i / 2) * 8 + i % 2;
          if constexpr (NORM) xv[c][i] = *p;  // shared memory
          else xv[c][i] = __ldg(p);
        }
    };
    if constexpr (NB == 1) load_x(0);
    cp_async_wait<ST - 1>();  // this lane's copies of group grp have landed
    __syncwarp();             // and every lane's (the scales were copied by lanes 0 .. 4 RB - 1)
    float d[NB][RB][4], xs[NB][4];
#pragma unroll
    for (int c = 0; c < NB; ++c) {
      xs[c][0] = xs[c][1] = xs[c][2] = xs[c][3] = 0.f;
#pragma unroll
      for (int b = 0; b < RB; ++b) d[c][b][0] = d[c][b][1] = d[c][b][2] = d[c][b][3] = 0.f;
    }
#pragma unroll
    for (int q = 0; q < Q; ++q) {
      if constexpr (NB > 1) load_x(q);
      uint4 w[RB];
#pragma unroll
      for (int b = 0; b < RB; ++b) w[b] = cur[(b * Q + q) * 32 + lane];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint32_t a[RB][4];
#pragma unroll
        for (int b = 0; b < RB; ++b) {
          const uint32_t v = j == 0 ? w[b].x : j == 1 ? w[b].y : j == 2 ? w[b].z : w[b].w;
          a[b][0] = pair(v), a[b][1] = pair(v >> 4), a[b][2] = pair(v >> 8), a[b][3] = pair(v >> 12);
        }
#pragma unroll
        for (int c = 0; c < NB; ++c) {
          const uint4 xa = xv[c][(NB == 1 ? 2 * q : 0) + j / 2];
          const uint32_t b0 = (j & 1) ? xa.z : xa.x, b1 = (j & 1) ? xa.w : xa.y;
          mma(ones, b0, b1, xs[c]);
#pragma unroll
          for (int b = 0; b < RB; ++b) mma(a[b], b0, b1, d[c][b]);
        }
      }
    }
    // xs[c][0], xs[c][1]: the group's sum of x for columns 2t, 2t+1 (every row of the ones product)
    const uint32_t* scales = reinterpret_cast<const uint32_t*>(cur + RB * Q * 32);
#pragma unroll
    for (int b = 0; b < RB; ++b) {
      const uint32_t p0 = scales[b * 16 + g], p1 = scales[b * 16 + g + 8];
      const float s0 = __uint_as_float(p0 << 16), z0 = __uint_as_float(p0 & 0xFFFF0000u);
      const float s1 = __uint_as_float(p1 << 16), z1 = __uint_as_float(p1 & 0xFFFF0000u);
#pragma unroll
      for (int c = 0; c < NB; ++c) {
        acc[c][b][0] += s0 * fmaf(-128.f, xs[c][0], d[c][b][0]) + z0 * xs[c][0];
        acc[c][b][1] += s0 * fmaf(-128.f, xs[c][1], d[c][b][1]) + z0 * xs[c][1];
        acc[c][b][2] += s1 * fmaf(-128.f, xs[c][0], d[c][b][2]) + z1 * xs[c][0];
        acc[c][b][3] += s1 * fmaf(-128.f, xs[c][1], d[c][b][3]) + z1 * xs[c][1];
      }
    }
#pragma unroll
    for (int c = 0; c < NB; ++c) xnext[c] += Q * 8;  // after the loads (several column blocks load per q)
    cur = cur == ring + (ST - 1) * SLOT ? ring : cur + SLOT;
    __syncwarp();  // every lane is done with this slot before the next iteration refills it
  }
  cp_async_wait<0>();
  __syncthreads();  // the ring is free: the warps' partial sums go through it, red[warp][b][row][column]
  constexpr int COLS = 8 * NB;
  float* red = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int b = 0; b < RB; ++b)
#pragma unroll
    for (int c = 0; c < NB; ++c) {
      float* r = red + (warp * RB * 16 + b * 16) * COLS + 8 * c;
      r[g * COLS + 2 * t] = acc[c][b][0];
      r[g * COLS + 2 * t + 1] = acc[c][b][1];
      r[(g + 8) * COLS + 2 * t] = acc[c][b][2];
      r[(g + 8) * COLS + 2 * t + 1] = acc[c][b][3];
    }
  __syncthreads();
  auto sum = [&](int i) {  // row-in-block * COLS + column, summed over the warps, in warp order
    float v = 0.f;
    for (int w = 0; w < warps; ++w) v += red[w * RB * 16 * COLS + i];
    return v * rs;
  };
  auto bf = [](uint16_t h) { return __uint_as_float(static_cast<uint32_t>(h) << 16); };
  const int n_out = fold.gated ? N / 2 : N;
  for (int i = threadIdx.x; i < own * 16 * COLS; i += blockDim.x) {
    const int row = i / COLS, col = i % COLS, n = blockIdx.x * own * 16 + row;
    if (col >= M || n >= n_out) continue;
    float v = sum(i);
    if (fold.gated) {  // the same row's up sum sits own * 16 rows further in the block
      float u = sum(i + own * 16 * COLS);
      if (fold.bias) v += bf(fold.bias[n]), u += bf(fold.bias[n + n_out]);
      v = v / (1.f + __expf(-v)) * u;
    } else if (fold.bias) {
      v += bf(fold.bias[n]);
    }
    if (fold.resid) v += bf(fold.resid[static_cast<int64_t>(col) * n_out + n]);
    out[static_cast<int64_t>(col) * n_out + n] = __bfloat16_as_ushort(__float2bfloat16_rn(v));
  }
}

// launch shapes: (RB row blocks per block, W warps, ST ring slots per warp). 16 warps for layers
// of few rows (4096 x 4096: 256 row blocks, with 8 warps a block half the H200's warp slots idle)
struct Config {
  int rb, w, st;
};
constexpr Config CONFIGS[] = {{1, 8, 4}, {1, 16, 4}, {1, 8, 3}, {1, 16, 3}, {2, 8, 3}, {2, 4, 4}, {1, 8, 6}, {2, 16, 3}};
constexpr int N_CONFIGS = sizeof(CONFIGS) / sizeof(CONFIGS[0]);

int smem_bytes(int tg, Config cfg, int nb, int norm_k) {  // the ring (+ NORM's x), or the end's partial sums
  const int ring = cfg.w * cfg.st * (cfg.rb * (tg / 4) * 32 + cfg.rb * 4) * 16 + (norm_k ? norm_k * 2 + 64 : 0);
  const int red = cfg.w * cfg.rb * 16 * 8 * nb * 4;
  return ring > red ? ring : red;
}

int smem_optin(int device) {  // the most dynamic shared memory a block may ask for here
  static std::atomic<int> cached[64] = {};
  int v = cached[device & 63].load();
  if (v == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    cached[device & 63].store(v);
  }
  return v;
}

template <int RB, int ST, int NB, bool NORM>
void launch(const at::Tensor& x, int M, const at::Tensor& packed, const at::Tensor& sz, at::Tensor& out, int N,
            int K, int warps, const Fold& fold) {
  const int bytes = smem_bytes(KILN_TG, {RB, warps, ST}, NB, NORM ? K : 0), device = x.get_device();
  // past 48 KB a kernel's dynamic shared memory must be asked for, once per kernel and device
  static std::atomic<uint64_t> opted_in{0};
  const uint64_t bit = uint64_t{1} << (device & 63);
  if (bytes > 48 * 1024 && !(opted_in.load() & bit)) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(int4_mm<KILN_TG, RB, ST, NB, NORM>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, smem_optin(device)));
    opted_in.fetch_or(bit);
  }
  const int own = fold.gated ? RB / 2 : RB, blocks = ((fold.gated ? N / 32 : N / 16) + own - 1) / own;
  int4_mm<KILN_TG, RB, ST, NB, NORM><<<blocks, warps * 32, bytes, c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const uint16_t*>(x.data_ptr()), M, reinterpret_cast<const uint4*>(packed.data_ptr()),
      reinterpret_cast<const uint4*>(sz.data_ptr()), reinterpret_cast<uint16_t*>(out.data_ptr()), N, K, fold);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The instances built (each one adds ~2 s to the cold build): every launch shape for the plain
// product of up to 8 rows; 16 and 32 rows in one launch (prefill) at RB 1, ST 3 with the layer's
// warps; the norm prologue at the shapes with 3-4 slots (the gated product needs RB 2).
void dispatch(const at::Tensor& x, int M, const at::Tensor& packed, const at::Tensor& sz, at::Tensor& out, int N,
              int K, Config cfg, const Fold& fold) {
  const int nb = (M + 7) / 8;
#define KILN_CASE(RB_, ST_, NB_, NORM_) \
  if (cfg.rb == RB_ && cfg.st == ST_ && nb <= NB_ && (NORM_ == (fold.norm != nullptr))) \
    return launch<RB_, ST_, NB_, NORM_>(x, M, packed, sz, out, N, K, cfg.w, fold);
  if (nb > 1) {
    KILN_CASE(1, 3, 2, false)
    KILN_CASE(1, 3, 4, false)
  }
  KILN_CASE(1, 3, 1, false)
  KILN_CASE(1, 4, 1, false)
  KILN_CASE(1, 6, 1, false)
  KILN_CASE(2, 3, 1, false)
  KILN_CASE(2, 4, 1, false)
  KILN_CASE(1, 3, 1, true)
  KILN_CASE(1, 4, 1, true)
  KILN_CASE(2, 3, 1, true)
  KILN_CASE(2, 4, 1, true)
#undef KILN_CASE
  TORCH_CHECK(false, "torchkiln::cuda_int4_mm: no kernel for this launch shape and fold");
}

const uint16_t* bf16_ptr(const c10::optional<at::Tensor>& t) {
  return t ? reinterpret_cast<const uint16_t*>(t->data_ptr()) : nullptr;
}

at::Tensor cuda_int4_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale_zero, int64_t config,
                        const c10::optional<at::Tensor>& norm, double eps, bool gated,
                        const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& resid) {
  // the Python wrapper (cuda_int4.py) checks operands and names what is wrong; these are a backstop
  TORCH_CHECK(x.is_cuda() && packed.is_cuda() && scale_zero.is_cuda(), "torchkiln::cuda_int4_mm: CUDA tensors only");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "torchkiln::cuda_int4_mm: x must be bfloat16");
  TORCH_CHECK(packed.scalar_type() == at::kInt && packed.dim() == 4 && packed.is_contiguous() &&
                  packed.size(2) == 32 && packed.size(3) == 4,
              "torchkiln::cuda_int4_mm: packed must be a contiguous int32 [N/16, K/64, 32, 4] tensor");
  const int64_t N = packed.size(0) * 16, K = packed.size(1) * 64, group = 16 * KILN_TG;
  const int64_t max_rows = norm ? 1 : 32;
  TORCH_CHECK(x.is_contiguous() && x.size(-1) == K && x.numel() / K >= 1 && x.numel() / K <= max_rows,
              "torchkiln::cuda_int4_mm: x must be 1-32 contiguous rows of K (one with a norm)");
  TORCH_CHECK(K % group == 0, "torchkiln::cuda_int4_mm: K must be a multiple of the group");
  TORCH_CHECK(scale_zero.scalar_type() == at::kInt && scale_zero.is_contiguous() &&
                  scale_zero.numel() == N * (K / group),
              "torchkiln::cuda_int4_mm: scale_zero must be a contiguous int32 [N/16, K / group, 16] tensor");
  TORCH_CHECK(config >= -1 && config < N_CONFIGS, "torchkiln::cuda_int4_mm: config out of range");
  TORCH_CHECK(!norm || (norm->is_cuda() && norm->scalar_type() == at::kFloat && norm->is_contiguous() &&
                        norm->numel() == K),
              "torchkiln::cuda_int4_mm: norm must be a contiguous float32 [K] CUDA tensor");
  const int64_t n_out = gated ? N / 2 : N, M = x.numel() / K;
  // the gated epilogue pairs row blocks (RB 2), which the wide (RB 1) instances do not
  TORCH_CHECK(!gated || (N % 32 == 0 && M <= 8), "torchkiln::cuda_int4_mm: gated needs N a multiple of 32, 1-8 rows");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == N),
              "torchkiln::cuda_int4_mm: bias must be a contiguous bf16 [N] tensor");
  TORCH_CHECK(!resid || (resid->scalar_type() == at::kBFloat16 && resid->is_contiguous() &&
                         resid->numel() == M * n_out),
              "torchkiln::cuda_int4_mm: resid must be a contiguous bf16 tensor of the output's size");
  c10::cuda::CUDAGuard guard(x.device());
  auto sizes = x.sizes().vec();
  sizes.back() = n_out;
  at::Tensor out = at::empty(sizes, x.options());
  // x (and norm) are read 16 bytes a load: a view at another offset is copied
  const at::Tensor xa = reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 ? x.clone() : x;
  const at::Tensor na = norm && reinterpret_cast<uintptr_t>(norm->data_ptr()) % 16 ? norm->clone()
                        : norm ? *norm : at::Tensor();
  const Fold fold{norm ? na.data_ptr<float>() : nullptr, static_cast<float>(eps), bf16_ptr(bias), bf16_ptr(resid),
                  gated ? 1 : 0};
  const int n = static_cast<int>(N), k = static_cast<int>(K), nb = static_cast<int>((M + 7) / 8);
  Config cfg = CONFIGS[config >= 0 ? config : 0];
  if (gated && cfg.rb % 2) cfg = {2, cfg.w, 3};              // gate and up rows pair up in a block
  if (nb > 1) cfg = {1, cfg.w, 3};                            // the wide instances; the layer's warps
  if (norm && cfg.st > 4) cfg.st = 4;                         // the norm instances hold 3-4 slots
  const int optin = smem_optin(x.get_device());
  // a shape whose ring this GPU cannot hold (large groups, smaller GPUs) takes fewer warps; tune() times what ran
  while (smem_bytes(KILN_TG, cfg, nb, norm ? k : 0) > optin && cfg.w > 4) cfg.w /= 2;
  TORCH_CHECK(smem_bytes(KILN_TG, cfg, nb, norm ? k : 0) <= optin, "torchkiln::cuda_int4_mm: not enough shared memory");
  dispatch(xa, static_cast<int>(M), packed, scale_zero, out, n, k, cfg, fold);
  return out;
}

}  // namespace

#define KILN_STR2(x) #x
#define KILN_STR(x) KILN_STR2(x)
#define KILN_OP "cuda_int4_mm_g" KILN_STR(KILN_GROUP)
TORCH_LIBRARY_FRAGMENT(torchkiln, m) {
  m.def(KILN_OP "(Tensor x, Tensor packed, Tensor scale_zero, int config=-1, Tensor? norm=None, float eps=0.0, "
        "bool gated=False, Tensor? bias=None, Tensor? resid=None) -> Tensor");
}
TORCH_LIBRARY_IMPL(torchkiln, CUDA, m) { m.impl(KILN_OP, cuda_int4_mm); }
