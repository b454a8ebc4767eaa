// CPU kernels for decoding in fp32 (AVX-512), built on first use by eagle.kernels.
//
// stream_linear: y = x W^T (+ b) for a few rows, the weight streamed from memory once. Decoding
// and tree verification multiply 1-16 rows by each weight matrix: the time is the weight's trip
// from memory, and a kernel that reads each 16-float vector of W once and uses it for every row
// costs about as much for 8 rows as for 1 (in fp32; from 4-bit codes, decoded in the kernel, the
// multiply-adds bound it past 2 rows, and 9-16 rows take two passes: rows_q). Rows of W are read in
// order, a few rows are prefetched ahead, and the output range is split among torch's intra-op threads.
// Every output is summed in one order (16 lanes along k, then the lanes), whatever the number of
// rows, so a row's result is bit-identical whichever rows are computed with it.
//
// rope_cache, attention, silu_mul: the rest of a decoder layer for one sequence of 1-16 rows, where
// torch's ~20 small operations per layer (views, rotary, cache writes, SDPA, SiLU) cost more than
// their arithmetic. attention sums each row
// over its own keys in order, so a tree node's row equals the plain decoding step's, bit for bit.
//
// compact_rows: the accepted path's keys and values moved into place in every layer's cache at once.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kPrefetchRows = 8;  // rows ahead; the best of 4, 8, 16 and 32 (docs/performance.md)

// Prefetch a weight line; `once`: a weight read once per forward (a target's, far larger than the
// caches) is fetched non-temporally, so that streaming it does not push what is read again soon
// (the drafter's weights, the KV cache) out of the last-level cache.
inline void prefetch(const void* p, bool once) {
  if (once) _mm_prefetch(static_cast<const char*>(p), _MM_HINT_NTA);
  else _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
}

// The mask of the first min(n, 16) lanes of a vector (n >= 0): a row's tail, or a group of up to 16.
inline __mmask16 lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1u);
}

// A vector of x held in a register for the J weight rows it meets: without this the compiler
// reloads it from memory for each of them (an FMA with a memory operand), and with several weight
// rows the loads, not the FMAs, bound the loop (8 rows: about 10% slower). With one weight row
// the load is folded into the FMA as before.
template <int J>
inline __m512 in_register(__m512 v) {
  if constexpr (J > 1) asm("" : "+v"(v));
  return v;
}

// Outputs j0..j1 (a multiple of J apart) of the M rows of x [M, K]; w [N, K]; out [M, N].
template <int M, int J>
void block(const float* x, int64_t K, const float* w, int64_t N, const float* bias, float* out,
           int64_t j0, int64_t j1, bool once) {
  const int64_t whole = K / 16 * 16;
  const __mmask16 tail = lanes(K - whole);
  for (int64_t j = j0; j < j1; j += J) {
    __m512 acc[M][J];
    for (int i = 0; i < M; ++i)
      for (int b = 0; b < J; ++b) acc[i][b] = _mm512_setzero_ps();
    for (int64_t k = 0; k < whole; k += 16) {
      __m512 wv[J];
      for (int b = 0; b < J; ++b) wv[b] = _mm512_loadu_ps(w + (j + b) * K + k);
      for (int b = 0; b < J; ++b)
        prefetch(w + (j + b + kPrefetchRows) * K + k, once);
      for (int i = 0; i < M; ++i) {
        const __m512 xv = in_register<J>(_mm512_loadu_ps(x + i * K + k));
        for (int b = 0; b < J; ++b) acc[i][b] = _mm512_fmadd_ps(xv, wv[b], acc[i][b]);
      }
    }
    if (tail) {
      __m512 wv[J];
      for (int b = 0; b < J; ++b) wv[b] = _mm512_maskz_loadu_ps(tail, w + (j + b) * K + whole);
      for (int i = 0; i < M; ++i) {
        const __m512 xv = in_register<J>(_mm512_maskz_loadu_ps(tail, x + i * K + whole));
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
void rows(const float* x, int64_t K, const float* w, int64_t N, const float* bias, float* out, bool once) {
  constexpr int J = M <= 2 ? 4 : (M <= 6 ? 3 : (M <= 9 ? 2 : 1));
  const int64_t blocks = N / J;
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    block<M, J>(x, K, w, N, bias, out, b0 * J, b1 * J, once);
  });
  if (blocks * J < N) block<M, 1>(x, K, w, N, bias, out, blocks * J, N, once);
}

// The same product with W kept as its exact block encoding (eagle.quant): each block of 32 weights
// of a row is w = fma(d, c, m) for 4-bit codes c (0..15, 16 bytes, byte i = c[i] | c[i + 16] << 4)
// and a (d, m) pair of scales, or w = d * c for 8-bit codes (-127..127) and one scale d (kScales).
// A weight vector is decoded to the very fp32 values of W and summed in the same order as block():
// the same bits, from 0.625-0.75 or 1.125 bytes per weight instead of 4.
template <int Bits>
constexpr int64_t kScales = Bits == 4 ? 2 : 1;  // scales per block

template <int Bits>
inline void decode(const uint8_t* codes, const float* scales, __m512& lo, __m512& hi) {
  const __m512 d = _mm512_set1_ps(scales[0]);
  if constexpr (Bits == 4) {
    const __m512 m = _mm512_set1_ps(scales[1]);
    // the block's 16 possible weights fma(d, c, m), c = 0..15, then each code picks its own (vpermps
    // reads an index's low 4 bits): the same values as decoding each code, in 5 operations, not 7
    const __m512 table = _mm512_fmadd_ps(
        d, _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), m);
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
    lo = _mm512_permutexvar_ps(bytes, table);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
  } else {
    const __m128i* c = reinterpret_cast<const __m128i*>(codes);
    lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(c))));
    hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(c + 1))));
  }
}

// n float16 values (scales as GGUF stores them: half the bytes of fp32) -> fp32 in dst, exactly.
void half_to_float(const uint16_t* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
  if (i < n) {
    uint16_t tail[16] = {0};
    std::memcpy(tail, src + i, (n - i) * sizeof(uint16_t));
    _mm512_mask_storeu_ps(dst + i, lanes(n - i),
                          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tail))));
  }
}

// Outputs j0..j1 (a multiple of J apart) of the M rows of x [M, K]; codes [N, K * Bits / 8];
// scales: fp32 [j1 - j0, K / 32, kScales], those of rows j0..j1; out [M, N]. K is a multiple of 32. Pointers
// step through the blocks (with indices computed per block, the compiler spent more instructions on
// addresses than on products).
template <int Bits, int M, int J>
void block_q(const float* x, int64_t K, const uint8_t* codes, const float* scales, int64_t N, const float* bias,
             float* out, int64_t j0, int64_t j1, bool once) {
  constexpr int64_t kBlockBytes = 32 * Bits / 8;
  const int64_t row_bytes = K * Bits / 8, blocks = K / 32, row_scales = blocks * kScales<Bits>;
  for (int64_t j = j0; j < j1; j += J) {
    const float* sp = scales + (j - j0) * row_scales;
    __m512 acc[M][J];
    for (int i = 0; i < M; ++i)
      for (int b = 0; b < J; ++b) acc[i][b] = _mm512_setzero_ps();
    const uint8_t* cp = codes + j * row_bytes;
    const float* xp = x;
    for (int64_t kb = 0; kb < blocks; ++kb, cp += kBlockBytes, sp += kScales<Bits>, xp += 32) {
      __m512 lo[J], hi[J];
      for (int b = 0; b < J; ++b) {
        decode<Bits>(cp + b * row_bytes, sp + b * row_scales, lo[b], hi[b]);
        prefetch(cp + (b + kPrefetchRows) * row_bytes, once);
      }
      for (int i = 0; i < M; ++i) {
        const __m512 xv = in_register<J>(_mm512_loadu_ps(xp + i * K));
        for (int b = 0; b < J; ++b) acc[i][b] = _mm512_fmadd_ps(xv, lo[b], acc[i][b]);
      }
      for (int i = 0; i < M; ++i) {
        const __m512 xv = in_register<J>(_mm512_loadu_ps(xp + i * K + 16));
        for (int b = 0; b < J; ++b) acc[i][b] = _mm512_fmadd_ps(xv, hi[b], acc[i][b]);
      }
    }
    for (int i = 0; i < M; ++i)
      for (int b = 0; b < J; ++b)
        out[i * N + j + b] = _mm512_reduce_add_ps(acc[i][b]) + (bias ? bias[j + b] : 0.0f);
  }
}

template <int Bits, int M>
void rows_q(const float* x, int64_t K, const uint8_t* codes, const void* scales, bool half, int64_t N,
            const float* bias, float* out, bool once) {
  if constexpr (M > 8) {
    // two passes over W, each with at most 8 rows of x: with more, a block of W met every row of x before the
    // next, and x outgrew the first-level cache (16 rows of 1536: 96 KB): the target's products of 12 and 16 rows
    // cost 1.9x and 3.0x those of 8 in one pass, 1.4x and 2.0x in two; each row's outputs are summed as before
    // (the same bits)
    constexpr int H = M / 2;
    rows_q<Bits, H>(x, K, codes, scales, half, N, bias, out, once);
    rows_q<Bits, M - H>(x + H * K, K, codes, scales, half, N, bias, out + H * N, once);
    return;
  }
  // weight rows decoded at a time per row count of x, the fastest timed (more spill registers); 5-8 rows
  // as block()
  constexpr int J = M <= 1 ? 8 : (M <= 3 ? 4 : (M <= 6 ? 3 : 2));
  const int64_t blocks = N / J, row_scales = K / 32 * kScales<Bits>;
  // rows j0..j1 (a multiple of W apart) by block_q; fp16 scales converted W rows at a time, outside it
  // (converted inside its loop, they take registers from the products)
  auto run = [&](auto w, int64_t j0, int64_t j1) {
    constexpr int W = decltype(w)::value;
    if (!half) return block_q<Bits, M, W>(x, K, codes, static_cast<const float*>(scales) + j0 * row_scales, N, bias,
                                          out, j0, j1, once);
    std::vector<float> converted(W * row_scales);
    for (int64_t j = j0; j < j1; j += W) {
      half_to_float(static_cast<const uint16_t*>(scales) + j * row_scales, W * row_scales, converted.data());
      block_q<Bits, M, W>(x, K, codes, converted.data(), N, bias, out, j, j + W, once);
    }
  };
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) { run(std::integral_constant<int, J>(), b0 * J, b1 * J); });
  if (blocks * J < N) run(std::integral_constant<int, 1>(), blocks * J, N);
}

}  // namespace

constexpr int64_t kMaxRows = 16;  // eagle.kernels.STREAM_MAX_ROWS

namespace {

// bias fp32 [N] -> its data, or nullptr without one.
const float* bias_data(const c10::optional<torch::Tensor>& bias, int64_t N, const char* name) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->dtype() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == N, name, ": bias fp32 [N]");
  return bias->data_ptr<float>();
}

// f(std::integral_constant<int, m>()) for the row count m, 1 to kMaxRows (each a compiled kernel).
template <typename F>
void for_rows(int64_t m, const char* name, F&& f) {
  TORCH_CHECK(m >= 1 && m <= kMaxRows, name, ": 1 to 16 rows, got ", m);
  switch (m) {
#define EAGLE_ROWS(r) \
  case r:             \
    f(std::integral_constant<int, r>()); \
    break;
    EAGLE_ROWS(1) EAGLE_ROWS(2) EAGLE_ROWS(3) EAGLE_ROWS(4) EAGLE_ROWS(5) EAGLE_ROWS(6) EAGLE_ROWS(7) EAGLE_ROWS(8)
    EAGLE_ROWS(9) EAGLE_ROWS(10) EAGLE_ROWS(11) EAGLE_ROWS(12) EAGLE_ROWS(13) EAGLE_ROWS(14) EAGLE_ROWS(15)
    EAGLE_ROWS(16)
#undef EAGLE_ROWS
  }
}

}  // namespace

torch::Tensor stream_linear(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
                            bool once) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && w.dtype() == torch::kFloat32, "stream_linear: fp32 only");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "stream_linear: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "stream_linear: x [M, K], w [N, K]");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "stream_linear: contiguous x and w only");
  const int64_t M = x.size(0), K = w.size(1), N = w.size(0);
  const float* b = bias_data(bias, N, "stream_linear");
  auto out = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for_rows(M, "stream_linear", [&](auto m) { rows<decltype(m)::value>(xp, K, wp, N, b, op, once); });
  return out;
}

// stream_linear_q: stream_linear with W given by its exact block encoding (codes uint8 [N, K / 2] and
// scales [N, K / 32, 2] for 4 bits, or int8 [N, K] and [N, K / 32, 1] for 8 bits; scales fp32 or fp16):
// the same outputs, bit for bit.
torch::Tensor stream_linear_q(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                              const c10::optional<torch::Tensor>& bias, bool once) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && (scales.dtype() == torch::kFloat32 || scales.dtype() == torch::kHalf),
              "stream_linear_q: fp32 x, fp32 or fp16 scales");
  TORCH_CHECK(codes.dtype() == torch::kUInt8 || codes.dtype() == torch::kInt8, "stream_linear_q: uint8 or int8 codes");
  TORCH_CHECK(x.device().is_cpu() && codes.device().is_cpu() && scales.device().is_cpu(), "stream_linear_q: CPU only");
  TORCH_CHECK(x.is_contiguous() && codes.is_contiguous() && scales.is_contiguous() && x.dim() == 2 && codes.dim() == 2,
              "stream_linear_q: contiguous x [M, K], codes [N, K * bits / 8], scales [N, K / 32, 2 or 1]");
  const int bits = codes.dtype() == torch::kUInt8 ? 4 : 8;
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  const int64_t per_block = bits == 4 ? kScales<4> : kScales<8>;
  TORCH_CHECK(K % 32 == 0 && codes.size(1) == K * bits / 8 && scales.numel() == N * (K / 32) * per_block,
              "stream_linear_q: shapes do not match x [M, K] with K a multiple of 32");
  const float* b = bias_data(bias, N, "stream_linear_q");
  auto out = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* cp = static_cast<const uint8_t*>(codes.data_ptr());
  const void* sp = scales.data_ptr();
  const bool half = scales.dtype() == torch::kHalf;
  float* op = out.data_ptr<float>();
  for_rows(M, "stream_linear_q", [&](auto m) {
    if (bits == 4) rows_q<4, decltype(m)::value>(xp, K, cp, sp, half, N, b, op, once);
    else rows_q<8, decltype(m)::value>(xp, K, cp, sp, half, N, b, op, once);
  });
  return out;
}

// A weight for decoder_layer: fp32 [N, K], or codes with their scales (stream_linear_q).
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& scales,
                     const c10::optional<torch::Tensor>& bias, bool once) {
  return scales.has_value() ? stream_linear_q(x, w, *scales, bias, once) : stream_linear(x, w, bias, once);
}

// rms_norm: Llama's RMSNorm in fp32, w * (x * 1 / sqrt(mean(x^2) + eps)) per row of x [..., H], in one
// pass over each row (torch's CPU rms_norm runs five operations).
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && w.dtype() == torch::kFloat32, "rms_norm: fp32 only");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "rms_norm: CPU tensors only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && w.dim() == 1 && x.size(-1) == w.size(0),
              "rms_norm: contiguous x [..., H] and w [H]");
  const int64_t H = w.size(0), rows = x.numel() / H, whole = H / 16 * 16;
  const __mmask16 tail = lanes(H - whole);
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

namespace {

// exp for 16 floats: 2^n * p(r), r = x - n ln 2 (Cephes' expf polynomial, ~1 ulp); 0 below -87 (where
// expf is 0 or subnormal: a softmax term that small cannot change a sum of terms up to 1).
inline __m512 exp16(__m512 x) {
  const __m512 clamped = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(clamped, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), clamped);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
  return _mm512_mask_mov_ps(_mm512_scalef_ps(p, n), tiny, _mm512_setzero_ps());
}

// reduce_add16: lane c of the result is the sum of the 16 lanes of the vector in slot c of v
// (kSlotKey[s]: the lane whose vector goes in slot s; it is its own inverse), each summed by
// _mm512_reduce_add_ps's tree (halves, quarters, pairs, then the last two): the bits that
// reduction gives each vector alone, for 16 vectors in 45 operations instead of about 130.
constexpr int kSlotKey[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};

inline __m512 reduce_add16(const __m512* v) {
  __m512 halves[8], quarters[4], pairs[2];
  for (int j = 0; j < 8; ++j)  // lanes i + (i + 8) of v[j] (low half) and of v[j + 8] (high half)
    halves[j] = _mm512_add_ps(_mm512_shuffle_f32x4(v[j], v[j + 8], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_f32x4(v[j], v[j + 8], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int j = 0; j < 4; ++j)  // lanes i + (i + 4) of each half
    quarters[j] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[j], halves[j + 4], _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm512_shuffle_f32x4(halves[j], halves[j + 4], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int j = 0; j < 2; ++j)  // lanes i + (i + 2) of each quarter
    pairs[j] = _mm512_add_ps(_mm512_shuffle_ps(quarters[j], quarters[j + 2], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(quarters[j], quarters[j + 2], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

constexpr float kMasked = -1e30f;  // an additive bias at or below this excludes the key

}  // namespace

// rope_cache: the rotary embedding (rotate-half layout) of queries and keys for q rows, keys and values
// written into the cache buffers at rows start..start+q-1. qkv [q, (nh + 2 nkv) d] (one row per token,
// q heads then k heads then v heads); cos, sin [q, d]; key_buf, value_buf [nkv, capacity, d]. Returns the
// rotated queries [nh, q, d]. Multiplies and adds as torch's x * cos + cat(-x2, x1) * sin does (no fused
// multiply-add), so keys written here equal the ones the unfused forward writes.
torch::Tensor rope_cache(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                         torch::Tensor key_buf, torch::Tensor value_buf, int64_t nh, int64_t start) {
  TORCH_CHECK(qkv.dtype() == torch::kFloat32 && qkv.is_contiguous() && qkv.dim() == 2, "rope_cache: qkv fp32 [q, F]");
  TORCH_CHECK(key_buf.is_contiguous() && value_buf.is_contiguous() && key_buf.dim() == 3, "rope_cache: buffers [kv, cap, d]");
  const int64_t q = qkv.size(0), nkv = key_buf.size(0), cap = key_buf.size(1), d = key_buf.size(2), half = d / 2;
  TORCH_CHECK(d % 32 == 0 && qkv.size(1) == (nh + 2 * nkv) * d, "rope_cache: head_dim a multiple of 32, qkv width");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == q && cos.size(1) == d, "rope_cache: cos/sin [q, d]");
  TORCH_CHECK(start >= 0 && start + q <= cap, "rope_cache: rows past the buffer");
  auto out = torch::empty({nh, q, d}, qkv.options());
  const float* src = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* kp = key_buf.data_ptr<float>();
  float* vp = value_buf.data_ptr<float>();
  const int64_t width = qkv.size(1);
  for (int64_t i = 0; i < q; ++i) {
    const float* row = src + i * width;
    const float* c = cp + i * d;
    const float* s = sp + i * d;
    for (int64_t h = 0; h < nh + nkv; ++h) {
      const float* x = row + h * d;
      float* dst = h < nh ? op + (h * q + i) * d : kp + ((h - nh) * cap + start + i) * d;
      for (int64_t t = 0; t < half; t += 16) {
        const __m512 x1 = _mm512_loadu_ps(x + t), x2 = _mm512_loadu_ps(x + half + t);
        _mm512_storeu_ps(dst + t, _mm512_sub_ps(_mm512_mul_ps(x1, _mm512_loadu_ps(c + t)),
                                                _mm512_mul_ps(x2, _mm512_loadu_ps(s + t))));
        _mm512_storeu_ps(dst + half + t, _mm512_add_ps(_mm512_mul_ps(x2, _mm512_loadu_ps(c + half + t)),
                                                       _mm512_mul_ps(x1, _mm512_loadu_ps(s + half + t))));
      }
    }
    for (int64_t h = 0; h < nkv; ++h)
      std::memcpy(vp + (h * cap + start + i) * d, row + (nh + nkv + h) * d, d * sizeof(float));
  }
  return out;
}

// One query row of one head (attention, below): softmax(q k^T * sc + add) v over its n keys, listed
// in idx (cache rows) with their biases in add; V vectors of 16 per head; score: room for n + 16.
template <int V>
void attend_row(const float* qv, const float* kh, const float* vh, const int32_t* idx, const float* add,
                int64_t n, float sc, float* score, float* dst) {
  constexpr int64_t d = 16 * V;
  __m512 qreg[V];
  for (int64_t v = 0; v < V; ++v) qreg[v] = _mm512_loadu_ps(qv + 16 * v);
  __m512 most = _mm512_set1_ps(-INFINITY);
  for (int64_t c0 = 0; c0 < n; c0 += 16) {  // the scores of 16 keys at a time
    const int64_t count = std::min<int64_t>(16, n - c0);
    __m512 dots[16];
    for (int s = 0; s < 16; ++s) {
      const int64_t c = kSlotKey[s];
      if (c >= count) {
        dots[s] = _mm512_setzero_ps();
        continue;
      }
      const float* k = kh + static_cast<int64_t>(idx[c0 + c]) * d;
      __m512 acc = _mm512_mul_ps(qreg[0], _mm512_loadu_ps(k));
      for (int64_t v = 1; v < V; ++v) acc = _mm512_fmadd_ps(qreg[v], _mm512_loadu_ps(k + 16 * v), acc);
      dots[s] = acc;
    }
    const __mmask16 live = lanes(count);
    const __m512 scores = _mm512_add_ps(_mm512_mul_ps(reduce_add16(dots), _mm512_set1_ps(sc)),
                                        _mm512_maskz_loadu_ps(live, add + c0));
    _mm512_mask_storeu_ps(score + c0, live, scores);
    most = _mm512_mask_max_ps(most, live, most, scores);
  }
  const float best = _mm512_reduce_max_ps(most);
  const __m512 top = _mm512_set1_ps(best);
  __m512 total = _mm512_setzero_ps();
  for (int64_t c = 0; c < n; c += 16) {
    const __mmask16 live = lanes(n - c);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, score + c), top));
    const __m512 kept = _mm512_maskz_mov_ps(live, e);
    _mm512_storeu_ps(score + c, kept);
    total = _mm512_add_ps(total, kept);
  }
  const float inv = 1.0f / _mm512_reduce_add_ps(total);
  __m512 acc[V];
  for (int64_t v = 0; v < V; ++v) acc[v] = _mm512_setzero_ps();
  for (int64_t c = 0; c < n; ++c) {
    const __m512 w = _mm512_set1_ps(score[c]);
    const float* val = vh + static_cast<int64_t>(idx[c]) * d;
    for (int64_t v = 0; v < V; ++v) acc[v] = _mm512_fmadd_ps(w, _mm512_loadu_ps(val + 16 * v), acc[v]);
  }
  const __m512 scale_out = _mm512_set1_ps(inv);
  for (int64_t v = 0; v < V; ++v) _mm512_storeu_ps(dst + 16 * v, _mm512_mul_ps(acc[v], scale_out));
}

// attention: softmax(q k^T * scale + bias) v for a few query rows over the first `length` cached keys,
// grouped-query heads. q [nh, q, d]; key_buf, value_buf [nkv, capacity, d]; bias [q, length] additive
// (a key with bias <= -1e30 is left out) or none: causal, row i sees keys 0 .. length - q + i. Returns
// [q, nh * d] (the layout the output projection reads). Each row's keys are first listed in order, the
// excluded ones left out, and every sum runs over that list, so a row's output does not depend on
// which other rows are computed with it or where masked keys sit between its own: a token verified
// in a tree gets the bits it gets in a plain decoding step.
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& key_buf, const torch::Tensor& value_buf,
                        int64_t length, const c10::optional<torch::Tensor>& bias, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && q.is_contiguous() && q.dim() == 3, "attention: q fp32 [nh, q, d]");
  TORCH_CHECK(key_buf.is_contiguous() && value_buf.is_contiguous() && key_buf.dim() == 3, "attention: buffers [kv, cap, d]");
  const int64_t nh = q.size(0), rows = q.size(1), d = q.size(2), nkv = key_buf.size(0), cap = key_buf.size(1);
  TORCH_CHECK(d % 16 == 0 && d <= 128 && key_buf.size(2) == d && nh % nkv == 0,
              "attention: head_dim a multiple of 16 up to 128, heads");
  TORCH_CHECK(length >= rows && length <= cap, "attention: length");
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dtype() == torch::kFloat32 && bias->is_contiguous() && bias->size(0) == rows &&
                bias->size(1) == length, "attention: bias fp32 [q, length]");
    bp = bias->data_ptr<float>();
  }
  // per row: the keys it sees, in order, and their biases
  std::vector<int32_t> keys(rows * length);
  std::vector<float> adds(rows * length);
  std::vector<int64_t> counts(rows);
  for (int64_t i = 0; i < rows; ++i) {
    int64_t n = 0;
    const int64_t visible = bp ? length : length - rows + i + 1;
    for (int64_t j = 0; j < visible; ++j) {
      const float b = bp ? bp[i * length + j] : 0.0f;
      if (b > kMasked) {
        keys[i * length + n] = static_cast<int32_t>(j);
        adds[i * length + n] = b;
        ++n;
      }
    }
    counts[i] = n;
  }
  auto out = torch::empty({rows, nh * d}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = key_buf.data_ptr<float>();
  const float* vp = value_buf.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t group = nh / nkv, vecs = d / 16;
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, nh * rows, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> score(length + 16);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t h = t / rows, i = t % rows, n = counts[i];
      const float* qv = qp + (h * rows + i) * d;
      const float* kh = kp + (h / group) * cap * d;
      const float* vh = vp + (h / group) * cap * d;
      const int32_t* idx = keys.data() + i * length;
      const float* add = adds.data() + i * length;
      float* dst = op + i * nh * d + h * d;
      switch (vecs) {
#define EAGLE_VECS(v) \
  case v:             \
    attend_row<v>(qv, kh, vh, idx, add, n, sc, score.data(), dst); \
    break;
        EAGLE_VECS(1) EAGLE_VECS(2) EAGLE_VECS(3) EAGLE_VECS(4) EAGLE_VECS(5) EAGLE_VECS(6) EAGLE_VECS(7) EAGLE_VECS(8)
#undef EAGLE_VECS
      }
    }
  });
  return out;
}

// silu_mul: silu(gate) * up for gate_up [rows, 2 I] (gate first): [rows, I].
torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dtype() == torch::kFloat32 && gate_up.is_contiguous() && gate_up.dim() == 2 &&
              gate_up.size(1) % 32 == 0, "silu_mul: fp32 [rows, 2 I], I a multiple of 16");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = torch::empty({rows, inter}, gate_up.options());
  const float* src = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t t = 0; t < inter; t += 16) {
      const __m512 g = _mm512_loadu_ps(src + i * 2 * inter + t);
      const __m512 u = _mm512_loadu_ps(src + i * 2 * inter + inter + t);
      const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
      _mm512_storeu_ps(op + i * inter + t, _mm512_mul_ps(silu, u));
    }
  return out;
}

// A decoder layer's weights: each product fp32, or codes with their scales (*_s given: stream_linear_q).
// Without input_norm, qkv reads x itself (an EAGLE drafter's first layer: its input is fc's output).
struct LayerWeights {
  c10::optional<torch::Tensor> input_norm;
  double input_eps;
  torch::Tensor qkv_w;
  c10::optional<torch::Tensor> qkv_s, qkv_b;
  torch::Tensor o_w;
  c10::optional<torch::Tensor> o_s, o_b;
  torch::Tensor post_norm;
  double post_eps;
  torch::Tensor gate_up_w;
  c10::optional<torch::Tensor> gate_up_s, gate_up_b;
  torch::Tensor down_w;
  c10::optional<torch::Tensor> down_s, down_b;
};

// decoder_layer: one Llama decoder layer for one sequence of 1-16 rows, in place on x [q, H]:
// x += o(attention(rope(qkv(rms(x))))), then x += down(silu_mul(gate_up(rms(x)))), the same kernels
// and sums as the separate calls (x += y gives x + y's bits). Keys and values go to rows start..start+q-1
// of the buffers; bias and scale as for attention; once: the weights are read once per forward (a
// target's: prefetch).
void decoder_layer(torch::Tensor x, const LayerWeights& l, const torch::Tensor& cos, const torch::Tensor& sin,
                   torch::Tensor key_buf, torch::Tensor value_buf, int64_t nh, int64_t start,
                   const c10::optional<torch::Tensor>& bias, double scale, bool once) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2, "decoder_layer: x fp32 [q, H]");
  const torch::Tensor h = l.input_norm.has_value() ? rms_norm(x, *l.input_norm, l.input_eps) : x;
  const torch::Tensor qkv = linear(h, l.qkv_w, l.qkv_s, l.qkv_b, once);
  const torch::Tensor q = rope_cache(qkv, cos, sin, key_buf, value_buf, nh, start);
  x.add_(linear(attention(q, key_buf, value_buf, start + x.size(0), bias, scale), l.o_w, l.o_s, l.o_b, once));
  x.add_(linear(silu_mul(linear(rms_norm(x, l.post_norm, l.post_eps), l.gate_up_w, l.gate_up_s, l.gate_up_b, once)),
                l.down_w, l.down_s, l.down_b, once));
}

// DecoderStack: decoder layers whose weights are handed over once (add), run by one call a forward
// (forward), instead of a call per layer from Python that converts some 25 arguments each time.
class DecoderStack {
 public:
  DecoderStack(int64_t nh, double scale) : nh_(nh), scale_(scale) {}

  // One more layer: its weights, in LayerWeights' order.
  void add(const c10::optional<torch::Tensor>& input_norm, double input_eps, const torch::Tensor& qkv_w,
           const c10::optional<torch::Tensor>& qkv_s, const c10::optional<torch::Tensor>& qkv_b,
           const torch::Tensor& o_w, const c10::optional<torch::Tensor>& o_s, const c10::optional<torch::Tensor>& o_b,
           const torch::Tensor& post_norm, double post_eps, const torch::Tensor& gate_up_w,
           const c10::optional<torch::Tensor>& gate_up_s, const c10::optional<torch::Tensor>& gate_up_b,
           const torch::Tensor& down_w, const c10::optional<torch::Tensor>& down_s,
           const c10::optional<torch::Tensor>& down_b) {
    layers_.push_back({input_norm, input_eps, qkv_w, qkv_s, qkv_b, o_w, o_s, o_b, post_norm, post_eps, gate_up_w,
                       gate_up_s, gate_up_b, down_w, down_s, down_b});
  }

  // Every layer in order on x [q, H], in place; layer i's keys and values go to rows start..start+q-1 of
  // keys[i][0], values[i][0] (buffers [1, kv, capacity, d]); bias and once as for decoder_layer. Returns
  // copies of x after each layer listed in aux, in aux's order.
  std::vector<torch::Tensor> forward(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin,
                                     const std::vector<torch::Tensor>& keys, const std::vector<torch::Tensor>& values,
                                     int64_t start, const c10::optional<torch::Tensor>& bias, bool once,
                                     const std::vector<int64_t>& aux) {
    TORCH_CHECK(keys.size() == layers_.size() && values.size() == layers_.size(), "DecoderStack: a buffer per layer");
    std::vector<torch::Tensor> outputs(aux.size());
    for (size_t i = 0; i < layers_.size(); ++i) {
      decoder_layer(x, layers_[i], cos, sin, keys[i][0], values[i][0], nh_, start, bias, scale_, once);
      for (size_t j = 0; j < aux.size(); ++j)
        if (aux[j] == static_cast<int64_t>(i)) outputs[j] = x.clone();
    }
    return outputs;
  }

 private:
  int64_t nh_;
  double scale_;
  std::vector<LayerWeights> layers_;
};

// compact_rows: in each buffer [B, h, capacity, d] (contiguous CPU, any dtype), row keep[j] of the capacity
// axis is copied to row start + j (keep increasing, keep[j] >= start + j, so no source is overwritten before
// it is read): a verified tree's accepted path made contiguous in the cache of every layer in one call,
// instead of two torch operations per buffer.
void compact_rows(const std::vector<torch::Tensor>& buffers, int64_t start, const std::vector<int64_t>& keep) {
  for (size_t j = 0; j < keep.size(); ++j)
    TORCH_CHECK(keep[j] >= start + static_cast<int64_t>(j) && (j == 0 || keep[j] > keep[j - 1]),
                "compact_rows: keep must increase, each at or after its destination");
  for (const auto& buf : buffers) {
    TORCH_CHECK(buf.device().is_cpu() && buf.is_contiguous() && buf.dim() == 4 && (keep.empty() || keep.back() < buf.size(2)),
                "compact_rows: contiguous CPU buffers [B, h, capacity, d] holding the kept rows");
    const int64_t outer = buf.size(0) * buf.size(1), cap = buf.size(2), row = buf.size(3) * buf.element_size();
    char* data = static_cast<char*>(buf.data_ptr());
    for (int64_t o = 0; o < outer; ++o)
      for (size_t j = 0; j < keep.size(); ++j) {
        const int64_t to = start + static_cast<int64_t>(j);
        if (keep[j] != to) std::memcpy(data + (o * cap + to) * row, data + (o * cap + keep[j]) * row, row);
      }
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("stream_linear", &stream_linear, "y = x W^T (+ b), fp32, 1-16 rows, W streamed once", py::arg("x"),
        py::arg("w"), py::arg("bias"), py::arg("once") = false);
  m.def("stream_linear_q", &stream_linear_q, "stream_linear with W as exact block codes and scales: the same bits",
        py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("bias"), py::arg("once") = false);
  m.def("rms_norm", &rms_norm, "Llama's RMSNorm, fp32, one pass per row");
  m.def("rope_cache", &rope_cache, "rotary queries and keys, keys and values into the cache buffers, fp32");
  m.def("attention", &attention, "grouped-query attention of a few rows over the cache, fp32, row-independent");
  m.def("silu_mul", &silu_mul, "silu(gate) * up, fp32");
  m.def("compact_rows", &compact_rows, "copy rows keep[j] of each cache buffer to start + j, for all layers at once");
  py::class_<DecoderStack>(m, "DecoderStack", "decoder layers run by one call a forward (decoder_layer each)")
      .def(py::init<int64_t, double>(), py::arg("nh"), py::arg("scale"))
      .def("add", &DecoderStack::add, "append a layer: decoder_layer's weight arguments")
      .def("forward", &DecoderStack::forward, "every layer in place on x [q, H]; copies of x after the aux layers",
           py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("keys"), py::arg("values"), py::arg("start"),
           py::arg("bias"), py::arg("once"), py::arg("aux"));
}
