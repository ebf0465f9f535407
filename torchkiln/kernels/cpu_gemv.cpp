// torchkiln::cpu_gemv(x, w, scale=None): y = (x @ w.T) * scale for a few rows of x (decode's
// batch-1 projections), w float32, bfloat16 or int8 [N, K], x float32 or bfloat16 [..., K].
//
// Why hand-written (built by cpu_gemv.py on first use): a one-row product only has to stream the
// weight once, but on a 2-core AMD EPYC (Zen 3, AVX2) torch's own kernels read it well below the
// copy bandwidth: F.linear 14-19 GB/s in float32 and bfloat16, _weight_int8pack_mm 9-13 GB/s in
// int8, inductor's compiled reduction 12-19 GB/s in float/bf16 and 1-2 GB/s in int8 (its int8
// vector load goes through a buffer). This kernel: 28-32 GB/s float32, 19-28 bf16, 14-21 int8 on
// llama-350m's shapes (benchmarks/llm_gemv_cpu.py; RESULTS.md, thirteenth session). What it does
// differently: several weight rows per step share each x load (R independent streams in flight),
// two accumulators per row (FMA latency), and int8/bf16 widen in registers.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <type_traits>

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
inline __m256 widen(__m128i low8) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(low8)); }
inline __m256 load8(const int8_t* p) { return widen(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
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
  if constexpr (std::is_same_v<W, int8_t>) {  // one 32-byte load per step, four accumulators
    for (; count == R && k + 32 <= K; k += 32) {
      __m256 x0 = load8(x + k), x1 = load8(x + k + 8), x2 = load8(x + k + 16), x3 = load8(x + k + 24);
      for (int r = 0; r < R; r++) {
        __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + r * K + k));
        __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
        a[r] = _mm256_fmadd_ps(x0, widen(lo), a[r]);
        b[r] = _mm256_fmadd_ps(x1, widen(_mm_srli_si128(lo, 8)), b[r]);
        a[r] = _mm256_fmadd_ps(x2, widen(hi), a[r]);
        b[r] = _mm256_fmadd_ps(x3, widen(_mm_srli_si128(hi, 8)), b[r]);
      }
    }
  }
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
  // Rows per block, the fastest of 1/2/4/8 per type on the shapes above: 8 for bf16, 4 for float32;
  // int8 one row at a time, 32 bytes a step (R = 4 with 8-byte steps read 11-15 GB/s, this 17-21)
  constexpr int R = std::is_same_v<W, at::BFloat16> ? 8 : std::is_same_v<W, int8_t> ? 1 : 4;
  if (y.scalar_type() == at::kBFloat16)
    run<R>(x, M, w, scale, y.data_ptr<at::BFloat16>(), N, K);
  else
    run<R>(x, M, w, scale, y.data_ptr<float>(), N, K);
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
  at::Tensor s;
  if (scale.has_value()) {
    TORCH_CHECK(scale->numel() == N, ("torchkiln::cpu_gemv: scale must hold " + std::to_string(N) +
                                      " values, got " + std::to_string(scale->numel())).c_str());
    s = scale->to(at::kFloat).contiguous();
  }
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t M = K ? xf.numel() / K : 0;
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end());
  sizes.back() = N;
  at::Tensor y = at::empty(sizes, x.options());
  if (M == 0 || N == 0) return y;
  const float* sp = s.defined() ? s.data_ptr<float>() : nullptr;
  if (wt == at::kFloat)
    dispatch_out(xf.data_ptr<float>(), M, w.data_ptr<float>(), sp, y, N, K);
  else if (wt == at::kBFloat16)
    dispatch_out(xf.data_ptr<float>(), M, w.data_ptr<at::BFloat16>(), sp, y, N, K);
  else
    dispatch_out(xf.data_ptr<float>(), M, w.data_ptr<int8_t>(), sp, y, N, K);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torchkiln, m) { m.def("cpu_gemv(Tensor x, Tensor w, Tensor? scale=None) -> Tensor"); }
TORCH_LIBRARY_IMPL(torchkiln, CPU, m) { m.impl("cpu_gemv", cpu_gemv); }
