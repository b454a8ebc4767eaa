// CPU kernels for decoding in fp32 (AVX-512), built on first use by eagle.kernels.
//
// stream_linear: y = x W^T (+ b) for a few rows, the weight streamed from memory once. Decoding
// and tree verification multiply 1-16 rows by each weight matrix: the time is the weight's trip
// from memory, and a kernel that reads each 16-float vector of W once and uses it for every row
// costs about as much for 8 rows as for 1. Rows of W are read in order, a few
// rows are prefetched ahead, and the output range is split among torch's intra-op threads.
// Every output is summed in one order (16 lanes along k, then the lanes), whatever the number of
// rows, so a row's result is bit-identical whichever rows are computed with it.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>

namespace {

constexpr int64_t kPrefetchRows = 8;  // measured on the reference machine: 4, 8, 16, 32 rows ahead; 8 best

// Outputs j0..j1 (a multiple of J apart) of the M rows of x [M, K]; w [N, K]; out [M, N].
template <int M, int J>
void block(const float* x, int64_t K, const float* w, int64_t N, const float* bias, float* out,
           int64_t j0, int64_t j1) {
  const int64_t whole = K / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (K - whole)) - 1u);
  for (int64_t j = j0; j < j1; j += J) {
    __m512 acc[M][J];
    for (int i = 0; i < M; ++i)
      for (int b = 0; b < J; ++b) acc[i][b] = _mm512_setzero_ps();
    for (int64_t k = 0; k < whole; k += 16) {
      __m512 wv[J];
      for (int b = 0; b < J; ++b) wv[b] = _mm512_loadu_ps(w + (j + b) * K + k);
      for (int b = 0; b < J; ++b)
        _mm_prefetch(reinterpret_cast<const char*>(w + (j + b + kPrefetchRows) * K + k), _MM_HINT_T0);
      for (int i = 0; i < M; ++i) {
        const __m512 xv = _mm512_loadu_ps(x + i * K + k);
        for (int b = 0; b < J; ++b) acc[i][b] = _mm512_fmadd_ps(xv, wv[b], acc[i][b]);
      }
    }
    if (tail) {
      __m512 wv[J];
      for (int b = 0; b < J; ++b) wv[b] = _mm512_maskz_loadu_ps(tail, w + (j + b) * K + whole);
      for (int i = 0; i < M; ++i) {
        const __m512 xv = _mm512_maskz_loadu_ps(tail, x + i * K + whole);
        for (int b = 0; b < J; ++b) acc[i][b] = _mm512_fmadd_ps(xv, wv[b], acc[i][b]);
      }
    }
    for (int i = 0; i < M; ++i)
      for (int b = 0; b < J; ++b)
        out[i * N + j + b] = _mm512_reduce_add_ps(acc[i][b]) + (bias ? bias[j + b] : 0.0f);
  }
}

// J weight rows at a time: as many as the 32 vector registers hold accumulators for.
template <int M>
void rows(const float* x, int64_t K, const float* w, int64_t N, const float* bias, float* out) {
  constexpr int J = M <= 2 ? 4 : (M <= 6 ? 3 : (M <= 9 ? 2 : 1));
  const int64_t blocks = N / J;
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    block<M, J>(x, K, w, N, bias, out, b0 * J, b1 * J);
  });
  if (blocks * J < N) block<M, 1>(x, K, w, N, bias, out, blocks * J, N);
}

}  // namespace

constexpr int64_t kMaxRows = 16;  // eagle.kernels.STREAM_MAX_ROWS

torch::Tensor stream_linear(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && w.dtype() == torch::kFloat32, "stream_linear: fp32 only");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "stream_linear: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "stream_linear: x [M, K], w [N, K]");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "stream_linear: contiguous x and w only");
  const int64_t M = x.size(0), K = w.size(1), N = w.size(0);
  TORCH_CHECK(M >= 1 && M <= kMaxRows, "stream_linear: 1 to 16 rows, got ", M);
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dtype() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == N,
                "stream_linear: bias fp32 [N]");
    b = bias->data_ptr<float>();
  }
  auto out = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  switch (M) {
#define EAGLE_ROWS(m) \
  case m:             \
    rows<m>(xp, K, wp, N, b, op); \
    break;
    EAGLE_ROWS(1) EAGLE_ROWS(2) EAGLE_ROWS(3) EAGLE_ROWS(4) EAGLE_ROWS(5) EAGLE_ROWS(6) EAGLE_ROWS(7) EAGLE_ROWS(8)
    EAGLE_ROWS(9) EAGLE_ROWS(10) EAGLE_ROWS(11) EAGLE_ROWS(12) EAGLE_ROWS(13) EAGLE_ROWS(14) EAGLE_ROWS(15)
    EAGLE_ROWS(16)
#undef EAGLE_ROWS
  }
  return out;
}

// rms_norm: Llama's RMSNorm in fp32, w * (x * 1 / sqrt(mean(x^2) + eps)) per row of x [..., H], in one
// pass over each row (torch's CPU rms_norm runs five operations, ~50 us for a few rows of 576: 3 ms per
// forward of a 30-layer target).
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && w.dtype() == torch::kFloat32, "rms_norm: fp32 only");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "rms_norm: CPU tensors only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && w.dim() == 1 && x.size(-1) == w.size(0),
              "rms_norm: contiguous x [..., H] and w [H]");
  const int64_t H = w.size(0), rows = x.numel() / H, whole = H / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (H - whole)) - 1u);
  auto out = torch::empty_like(x);
  const float* wp = w.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* xp = x.data_ptr<float>() + r * H;
    float* op = out.data_ptr<float>() + r * H;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t k = 0; k < whole; k += 16) {
      const __m512 v = _mm512_loadu_ps(xp + k);
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    if (tail) {
      const __m512 v = _mm512_maskz_loadu_ps(tail, xp + whole);
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    const float mean = _mm512_reduce_add_ps(acc) / static_cast<float>(H);
    const __m512 scale = _mm512_set1_ps(1.0f / std::sqrt(mean + static_cast<float>(eps)));
    for (int64_t k = 0; k < whole; k += 16)
      _mm512_storeu_ps(op + k, _mm512_mul_ps(_mm512_loadu_ps(wp + k), _mm512_mul_ps(_mm512_loadu_ps(xp + k), scale)));
    if (tail)
      _mm512_mask_storeu_ps(op + whole, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, wp + whole),
                                                            _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, xp + whole), scale)));
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("stream_linear", &stream_linear, "y = x W^T (+ b), fp32, 1-16 rows, W streamed once");
  m.def("rms_norm", &rms_norm, "Llama's RMSNorm, fp32, one pass per row");
}
