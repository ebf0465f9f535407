// torchkiln::cpu_gemv(x, w, scale=None): y = (x @ w.T) * scale for a few rows of x (decode's
// batch-1 projections), w float32, bfloat16 or int8 [N, K], x float32 or bfloat16 [..., K].
//
// Why hand-written (built by cpu_gemv.py on first use): a one-row product only has to stream the
// weight once, but on a 2-core AMD EPYC (Zen 3, AVX2) torch's own kernels read it well below the
// copy bandwidth: F.linear 14-19 GB/s in float32 and bfloat16, _weight_int8pack_mm 9-13 GB/s in
// int8, inductor's compiled reduction 12-19 GB/s in float/bf16 and 1-2 GB/s in int8 (its int8
// vector load goes through a buffer). This kernel: 28-32 GB/s float32, 19-28 bf16 on llama-350m's
// shapes (benchmarks/llm_gemv_cpu.py; RESULTS.md, thirteenth session). What it does differently:
// several weight rows per step share each x load (R independent streams in flight), two
// accumulators per row (FMA latency), and bf16 widens in registers.
//
// int8 weights take an integer path: x is rounded to int16 per chunk of 256 values (one float
// scale each), each weight is widened to int16 and multiplied-and-paired into int32 with
// _mm256_madd_epi16, and each chunk's int32 sums are scaled into float once. Widening every int8
// to float32 (the first form) cost ~3 instructions per weight and read 10-17 GB/s at one row; this
// reads 16-22 GB/s, with a software prefetch 2 KB ahead (1.21-1.72x on llama-350m's shapes, two
// cores; benchmarks/diag_cpu_gemv_ab.py, RESULTS.md nineteenth session). The price is x's rounding: at most half a step of 1/32767 of
// its chunk's largest |x| per value (~3e-5 relative error in a float32 output), against the int8
// weights' own 1/254.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace {

// The checks' messages are built with std::to_string and handed to TORCH_CHECK as one C string,
// which it passes on without a stream. On the H200 image the compiler (Ubuntu's g++-real 13.3)
// linked libstdc++'s stream code into this library, and inserting an integer into c10::str's
// ostringstream there segfaulted (fifteenth session: SIGSEGV in this library's copy of
// std::ostream::_M_insert<long>; a message of C strings alone raised normally).
std::string str(at::IntArrayRef values) {
  std::string out = "[";
  for (size_t i = 0; i < values.size(); ++i) out += (i ? ", " : "") + std::to_string(values[i]);
  return out + "]";
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {  // bf16 is the top half of a float32
  __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline float hsum(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}

// Rows [n0, n0 + count) of w (count <= R) against one float32 row x; sums into out[0..count).
template <int R, typename W>
void block(const float* x, const W* w, int64_t K, int64_t n0, int64_t count, float* out) {
  __m256 a[R], b[R];
  for (int r = 0; r < R; r++) a[r] = b[r] = _mm256_setzero_ps();
  const W* base = w + n0 * K;
  int64_t k = 0;
  if (count == R) {  // the hot loop: R is a constant, the accumulators stay in registers
    for (; k + 16 <= K; k += 16) {
      __m256 x0 = load8(x + k), x1 = load8(x + k + 8);
      for (int r = 0; r < R; r++) {
        a[r] = _mm256_fmadd_ps(x0, load8(base + r * K + k), a[r]);
        b[r] = _mm256_fmadd_ps(x1, load8(base + r * K + k + 8), b[r]);
      }
    }
  } else {
    for (; k + 16 <= K; k += 16) {
      for (int64_t r = 0; r < count; r++) {
        a[r] = _mm256_fmadd_ps(load8(x + k), load8(base + r * K + k), a[r]);
        b[r] = _mm256_fmadd_ps(load8(x + k + 8), load8(base + r * K + k + 8), b[r]);
      }
    }
  }
  for (int64_t r = 0; r < count; r++) {
    float s = hsum(_mm256_add_ps(a[r], b[r]));
    for (int64_t t = k; t < K; t++) s += x[t] * static_cast<float>(base[r * K + t]);
    out[r] = s;
  }
}

constexpr int64_t CHUNK = 256;  // x values per int16 scale (int32 sums cannot overflow: 32 products of
                                // at most 127 * 32767 per lane and chunk)
constexpr int64_t AHEAD = 2048;  // software prefetch distance in weight bytes (1024: slower, 4096: no faster)

// x (M rows of K) rounded to int16 per chunk: xq[m * K + k] * xs[m * chunks + c] ~ x[m * K + k].
// A row holding inf or NaN is marked in ``finite`` (its products are then summed in float, as F.linear's).
void quantize_rows(const float* x, int64_t M, int64_t K, int16_t* xq, float* xs, std::vector<char>& finite) {
  const int64_t chunks = (K + CHUNK - 1) / CHUNK;
  for (int64_t m = 0; m < M; m++) {
    const float* xr = x + m * K;
    for (int64_t c = 0; c < chunks; c++) {
      const int64_t k0 = c * CHUNK, k1 = std::min(K, k0 + CHUNK);
      float top = 0;
      for (int64_t k = k0; k < k1; k++) top = std::max(top, std::fabs(xr[k]));
      if (!std::isfinite(top)) {
        finite[m] = 0;
        continue;
      }
      const float step = top > 0 ? top / 32767.f : 1.f, inv = 1.f / step;
      xs[m * chunks + c] = step;
      for (int64_t k = k0; k < k1; k++) xq[m * K + k] = static_cast<int16_t>(std::nearbyint(xr[k] * inv));
    }
  }
}

inline __m256i pairs(const int8_t* w, const int16_t* x) {  // 16 weights times 16 x: 8 int32 sums of two
  __m256i w16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  return _mm256_madd_epi16(w16, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
}

// One int8 weight row against one quantized row of x: sum_k w[k] * xq[k] * xs[k / CHUNK].
float int8_row(const int16_t* xq, const float* xs, const int8_t* w, int64_t K) {
  __m256 f = _mm256_setzero_ps();
  float tail = 0;
  for (int64_t c = 0, k0 = 0; k0 < K; c++, k0 += CHUNK) {
    const int64_t k1 = std::min(K, k0 + CHUNK);
    __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();
    int64_t k = k0;
    for (; k + 64 <= k1; k += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(w + k + AHEAD), _MM_HINT_T0);
      a = _mm256_add_epi32(a, _mm256_add_epi32(pairs(w + k, xq + k), pairs(w + k + 32, xq + k + 32)));
      b = _mm256_add_epi32(b, _mm256_add_epi32(pairs(w + k + 16, xq + k + 16), pairs(w + k + 48, xq + k + 48)));
    }
    for (; k + 16 <= k1; k += 16) a = _mm256_add_epi32(a, pairs(w + k, xq + k));
    int32_t rest = 0;
    for (; k < k1; k++) rest += int32_t(w[k]) * xq[k];
    f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(a, b)), _mm256_set1_ps(xs[c]), f);
    tail += float(rest) * xs[c];
  }
  return hsum(f) + tail;
}

template <typename O>
void run_int8(const float* x, int64_t M, const int8_t* w, const float* scale, O* y, int64_t N, int64_t K) {
  const int64_t chunks = (K + CHUNK - 1) / CHUNK;
  std::vector<int16_t> xq(M * K);
  std::vector<float> xs(M * chunks);
  std::vector<char> finite(M, 1);
  quantize_rows(x, M, K, xq.data(), xs.data(), finite);
  // at least ~64 KB of weight per task, so small layers don't pay for waking threads
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(K, 1));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; n++)
      for (int64_t m = 0; m < M; m++) {  // the row's weights stay in cache across rows of x
        float sum = 0;
        if (finite[m]) {
          sum = int8_row(xq.data() + m * K, xs.data() + m * chunks, w + n * K, K);
        } else {
          for (int64_t k = 0; k < K; k++) sum += x[m * K + k] * float(w[n * K + k]);
        }
        y[m * N + n] = static_cast<O>(sum * scale[n]);
      }
  });
}

template <int R, typename W, typename O>
void run(const float* x, int64_t M, const W* w, const float* scale, O* y, int64_t N, int64_t K) {
  int64_t blocks = (N + R - 1) / R;
  // at least ~64 KB of weight per task, so small layers don't pay for waking threads
  int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / (R * K * int64_t(sizeof(W))));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    float out[R];
    for (int64_t i = begin; i < end; i++) {
      int64_t n0 = i * R, count = std::min<int64_t>(R, N - n0);
      for (int64_t m = 0; m < M; m++) {  // the block's weights stay in cache across rows of x
        block<R>(x + m * K, w, K, n0, count, out);
        for (int64_t r = 0; r < count; r++)
          y[m * N + n0 + r] = static_cast<O>(scale ? out[r] * scale[n0 + r] : out[r]);
      }
    }
  });
}

template <typename W>
void dispatch_out(const float* x, int64_t M, const W* w, const float* scale, const at::Tensor& y,
                  int64_t N, int64_t K) {
  // Rows per block, the fastest of 1/2/4/8 per type on the shapes above: 8 for bf16, 4 for float32
  constexpr int R = std::is_same_v<W, at::BFloat16> ? 8 : 4;
  const bool bf = y.scalar_type() == at::kBFloat16;
  if constexpr (std::is_same_v<W, int8_t>) {
    if (bf)
      run_int8(x, M, w, scale, y.data_ptr<at::BFloat16>(), N, K);
    else
      run_int8(x, M, w, scale, y.data_ptr<float>(), N, K);
  } else if (bf) {
    run<R>(x, M, w, scale, y.data_ptr<at::BFloat16>(), N, K);
  } else {
    run<R>(x, M, w, scale, y.data_ptr<float>(), N, K);
  }
}

// A contiguous float32 or bfloat16 tensor's values as float32: its own data, or widened into buf.
const float* as_float(const at::Tensor& t, std::vector<float>& buf) {
  if (t.scalar_type() == at::kFloat) return t.data_ptr<float>();
  const at::BFloat16* p = t.data_ptr<at::BFloat16>();
  buf.resize(t.numel());
  for (int64_t i = 0; i < t.numel(); i++) buf[i] = static_cast<float>(p[i]);
  return buf.data();
}

at::Tensor cpu_gemv(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& scale) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "torchkiln::cpu_gemv: CPU tensors only");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(),
              ("torchkiln::cpu_gemv: weight must be a contiguous 2-D tensor, got sizes " + str(w.sizes()) +
               " strides " + str(w.strides())).c_str());
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K,
              ("torchkiln::cpu_gemv: x's last dim must be " + std::to_string(K) +
               " (the weight's in_features), got sizes " + str(x.sizes())).c_str());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              (std::string("torchkiln::cpu_gemv: x must be float32 or bfloat16, got ") +
               c10::toString(x.scalar_type())).c_str());
  const auto wt = w.scalar_type();
  TORCH_CHECK(wt == at::kFloat || wt == at::kBFloat16 || wt == at::kChar,
              (std::string("torchkiln::cpu_gemv: weight must be float32, bfloat16 or int8, got ") +
               c10::toString(wt)).c_str());
  TORCH_CHECK(wt != at::kChar || scale.has_value(), "torchkiln::cpu_gemv: int8 weights need scale");
  if (scale.has_value())
    TORCH_CHECK(scale->numel() == N, ("torchkiln::cpu_gemv: scale must hold " + std::to_string(N) +
                                      " values, got " + std::to_string(scale->numel())).c_str());
  // x and scale in float32 without going through ATen ops when they are float32 or bfloat16: in the
  // compiled llama-350m int8 decode step (97 calls a step) the two .to() copies per call were ~1 ms
  // of a 21 ms step (torch.profiler, RESULTS.md nineteenth session)
  const at::Tensor xc = x.is_contiguous() ? x : x.contiguous();
  const int64_t M = K ? xc.numel() / K : 0;
  std::vector<float> xbuf, sbuf;
  const float* xp = as_float(xc, xbuf);
  at::Tensor s;
  const float* sp = nullptr;
  if (scale.has_value()) {  // kept in s: as_float may point into it
    const auto st = scale->scalar_type();
    s = (st == at::kFloat || st == at::kBFloat16 ? *scale : scale->to(at::kFloat)).contiguous();
    sp = as_float(s, sbuf);
  }
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end());
  sizes.back() = N;
  at::Tensor y = at::empty(sizes, x.options());
  if (M == 0 || N == 0) return y;
  if (wt == at::kFloat)
    dispatch_out(xp, M, w.data_ptr<float>(), sp, y, N, K);
  else if (wt == at::kBFloat16)
    dispatch_out(xp, M, w.data_ptr<at::BFloat16>(), sp, y, N, K);
  else
    dispatch_out(xp, M, w.data_ptr<int8_t>(), sp, y, N, K);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torchkiln, m) { m.def("cpu_gemv(Tensor x, Tensor w, Tensor? scale=None) -> Tensor"); }
TORCH_LIBRARY_IMPL(torchkiln, CPU, m) { m.impl("cpu_gemv", cpu_gemv); }
