// CPU kernels for decoding in fp32, built on first use by eagle.runtime.kernels, once per instruction set:
// EAGLE_ISA_AVX512 (-mavx512f), EAGLE_ISA_AVX2 (-mavx2 -mfma -mf16c), or neither: portable C++ whose loops any
// compiler vectorizes for the machine it targets. Every kernel is written against one 16-lane vector type V
// (below): the same sums in the same order on every instruction set, so AVX2 gives AVX-512's bits (fused
// multiply-adds on both); the portable path multiplies and adds separately (two roundings), so its bits differ
// from theirs but not between its own rows.
//
// stream_linear: y = x W^T (+ b) for a few rows, the weight streamed from memory once. Decoding
// and tree verification multiply 1-16 rows by each weight matrix: the time is the weight's trip
// from memory, and a kernel that reads each 16-float vector of W once and uses it for every row
// costs about as much for 8 rows as for 1 (in fp32; from 4-bit codes, decoded in the kernel, the
// multiply-adds bound it past 2 rows, and 9-16 rows take two passes: rows_q; on AVX2, whose registers hold the
// sums of 4 rows only, 5 or more rows take one pass of panels_q, any number of them). Rows of W are read in
// order, a few rows are prefetched ahead, and the output range is split among torch's intra-op threads.
// Every output is summed in one order (16 lanes along k, then the lanes), whatever the number of
// rows, so a row's result is bit-identical whichever rows are computed with it.
//
// rope_cache, attention, silu_mul: the rest of a decoder layer for one sequence of a few rows, where
// torch's ~20 small operations per layer (views, rotary, cache writes, SDPA, SiLU) cost more than
// their arithmetic. attention sums each row
// over its own keys in order, so a tree node's row equals the plain decoding step's, bit for bit.
//
// stream_linear_gguf: the same products with W in its GGUF block layouts; 1-4 rows decode each block of codes in
// registers (the fused path), more rows decode a few rows of W at a time into a buffer that every row meets.
// With int8 (an option of stream_linear_q and stream_linear_gguf; AVX2 and AVX-512 builds): x quantized to int8 per
// block of 32 (per super-block of 256 for Q4_K, Q5_K and Q6_K, as ggml's Q8_K; those on every build) meets the codes
// in integers, as llama.cpp's dot products do: not the fp32 product's bits, but still a row's bits whatever rows come
// with it.
//
// DecoderStack, GemmaStack: a Llama/Qwen2/Qwen3 or a Gemma-3 target's decoder layers run by one call a forward.
//
// compact_rows: the accepted path's keys and values moved into place in every layer's cache at once.
// argmax_rows: torch's argmax of each row of logits, vectorized.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(EAGLE_ISA_AVX512) || defined(EAGLE_ISA_AVX2)
#include <immintrin.h>
#endif
#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#endif
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

// Each instruction set's build is its own extension module, and one process may load several (the tests do):
// their symbols live in a namespace of their own, and their Python class is local to its module.
#if defined(EAGLE_ISA_AVX512)
#define EAGLE_ISA_NS eagle_avx512
#elif defined(EAGLE_ISA_AVX2)
#define EAGLE_ISA_NS eagle_avx2
#else
#define EAGLE_ISA_NS eagle_portable
#endif

namespace EAGLE_ISA_NS {

namespace {


// ---- V: 16 floats, and the few operations the kernels need -----------------------------------------------
// vsum is _mm512_reduce_add_ps's tree on every instruction set (lanes i + (i + 8), then i + (i + 4), then
// (0 + 2) + (1 + 3)), so a sum's bits do not depend on the instruction set that computed it.
#if defined(EAGLE_ISA_AVX512)
struct V { __m512 r; };
inline __mmask16 lanes(int64_t n) {  // the first min(n, 16) lanes (n >= 0)
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1u);
}
inline V vzero() { return {_mm512_setzero_ps()}; }
inline V vset1(float a) { return {_mm512_set1_ps(a)}; }
inline V vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline V vloadn(const float* p, int64_t n) { return {_mm512_maskz_loadu_ps(lanes(n), p)}; }
inline void vstore(float* p, V v) { _mm512_storeu_ps(p, v.r); }
inline void vstoren(float* p, V v, int64_t n) { _mm512_mask_storeu_ps(p, lanes(n), v.r); }
inline V vadd(V a, V b) { return {_mm512_add_ps(a.r, b.r)}; }
inline V vsub(V a, V b) { return {_mm512_sub_ps(a.r, b.r)}; }
inline V vmul(V a, V b) { return {_mm512_mul_ps(a.r, b.r)}; }
inline V vdiv(V a, V b) { return {_mm512_div_ps(a.r, b.r)}; }
inline V vmax(V a, V b) { return {_mm512_max_ps(a.r, b.r)}; }
inline V vmin(V a, V b) { return {_mm512_min_ps(a.r, b.r)}; }
inline V vfma(V a, V b, V c) { return {_mm512_fmadd_ps(a.r, b.r, c.r)}; }  // a * b + c
inline V vfnma(V a, V b, V c) { return {_mm512_fnmadd_ps(a.r, b.r, c.r)}; }  // c - a * b
inline float vsum(V v) { return _mm512_reduce_add_ps(v.r); }
inline float vmaxall(V v) { return _mm512_reduce_max_ps(v.r); }
inline V vfirst(V v, int64_t n, float fill) { return {_mm512_mask_mov_ps(_mm512_set1_ps(fill), lanes(n), v.r)}; }
inline V viota() { return {_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)}; }
inline V vround(V v) { return {_mm512_roundscale_ps(v.r, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline V vscale2(V p, V n) { return {_mm512_scalef_ps(p.r, n.r)}; }  // p * 2^n, n whole in [-126, 127]
inline V vzero_below(V v, V x, float t) {  // v where x >= t, else 0
  return {_mm512_mask_mov_ps(v.r, _mm512_cmp_ps_mask(x.r, _mm512_set1_ps(t), _CMP_LT_OQ), _mm512_setzero_ps())};
}
// A vector of x held in a register for the J weight rows it meets: without this the compiler reloads it from
// memory for each of them (an FMA with a memory operand), and with several weight rows the loads, not the FMAs,
// bound the loop (8 rows: about 10% slower). With one weight row the load is folded into the FMA as before.
template <int J>
inline V in_register(V v) {
  if constexpr (J > 1) asm("" : "+v"(v.r));
  return v;
}
// A block's 32 weights from its codes: 4 bits, w = fma(d, c, m) (byte i: codes i and i + 16), the block's 16
// possible weights computed once and each code picking its own (vpermps reads an index's low 4 bits); 8 bits,
// w = d * c.
inline void decode4(const uint8_t* codes, float d, float m, V& lo, V& hi) {
  const __m512 table = _mm512_fmadd_ps(_mm512_set1_ps(d), viota().r, _mm512_set1_ps(m));
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
  lo.r = _mm512_permutexvar_ps(bytes, table);
  hi.r = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
}
inline void decode8(const uint8_t* codes, float d, V& lo, V& hi) {
  const __m512 dv = _mm512_set1_ps(d);
  const __m128i* c = reinterpret_cast<const __m128i*>(codes);
  lo.r = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(c))));
  hi.r = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(c + 1))));
}
inline void half16(const uint16_t* src, float* dst) {
  _mm512_storeu_ps(dst, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))));
}
// lane i: value where bit i of bits is set, else 0
inline V vbitmask(uint32_t bits, float value) {
  return {_mm512_maskz_mov_ps(static_cast<__mmask16>(bits & 0xFFFF), _mm512_set1_ps(value))};
}
#if defined(EAGLE_VNNI)
constexpr const char* kIsa = "avx512vnni";
#else
constexpr const char* kIsa = "avx512";
#endif

#elif defined(EAGLE_ISA_AVX2)
struct V { __m256 a, b; };  // lanes 0-7, 8-15
inline __m256i lanes8(int64_t n) {  // the first min(max(n, 0), 8) of 8 lanes, as a load/store mask
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(std::max<int64_t>(n, 0), 8))), idx);
}
inline V vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V vset1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline V vloadn(const float* p, int64_t n) {
  return {_mm256_maskload_ps(p, lanes8(n)), _mm256_maskload_ps(p + 8, lanes8(n - 8))};
}
inline void vstore(float* p, V v) { _mm256_storeu_ps(p, v.a); _mm256_storeu_ps(p + 8, v.b); }
inline void vstoren(float* p, V v, int64_t n) {
  _mm256_maskstore_ps(p, lanes8(n), v.a);
  _mm256_maskstore_ps(p + 8, lanes8(n - 8), v.b);
}
#define EAGLE_V2(name, op) \
  inline V name(V x, V y) { return {op(x.a, y.a), op(x.b, y.b)}; }
EAGLE_V2(vadd, _mm256_add_ps) EAGLE_V2(vsub, _mm256_sub_ps) EAGLE_V2(vmul, _mm256_mul_ps)
EAGLE_V2(vdiv, _mm256_div_ps) EAGLE_V2(vmax, _mm256_max_ps) EAGLE_V2(vmin, _mm256_min_ps)
#undef EAGLE_V2
inline V vfma(V x, V y, V z) { return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
inline V vfnma(V x, V y, V z) { return {_mm256_fnmadd_ps(x.a, y.a, z.a), _mm256_fnmadd_ps(x.b, y.b, z.b)}; }
inline float vsum(V v) {
  const __m256 h = _mm256_add_ps(v.b, v.a);                                                // i + (i + 8)
  const __m128 q = _mm_add_ps(_mm256_extractf128_ps(h, 1), _mm256_castps256_ps128(h));      // i + (i + 4)
  const __m128 p = _mm_add_ps(q, _mm_shuffle_ps(q, q, _MM_SHUFFLE(1, 0, 3, 2)));           // i + (i + 2)
  return _mm_cvtss_f32(p) + _mm_cvtss_f32(_mm_shuffle_ps(p, p, _MM_SHUFFLE(1, 1, 1, 1)));
}
inline float vmaxall(V v) {
  const __m256 h = _mm256_max_ps(v.b, v.a);
  const __m128 q = _mm_max_ps(_mm256_extractf128_ps(h, 1), _mm256_castps256_ps128(h));
  const __m128 p = _mm_max_ps(q, _mm_shuffle_ps(q, q, _MM_SHUFFLE(1, 0, 3, 2)));
  return std::max(_mm_cvtss_f32(p), _mm_cvtss_f32(_mm_shuffle_ps(p, p, _MM_SHUFFLE(1, 1, 1, 1))));
}
inline V vfirst(V v, int64_t n, float fill) {
  const __m256 f = _mm256_set1_ps(fill);
  return {_mm256_blendv_ps(f, v.a, _mm256_castsi256_ps(lanes8(n))),
          _mm256_blendv_ps(f, v.b, _mm256_castsi256_ps(lanes8(n - 8)))};
}
inline V viota() { return {_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), _mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15)}; }
inline V vround(V v) {
  return {_mm256_round_ps(v.a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
          _mm256_round_ps(v.b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
inline __m256 pow2(__m256 n) {  // 2^n for whole n in [-126, 127], built in the exponent field
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline V vscale2(V p, V n) { return {_mm256_mul_ps(p.a, pow2(n.a)), _mm256_mul_ps(p.b, pow2(n.b))}; }
inline V vzero_below(V v, V x, float t) {
  const __m256 tv = _mm256_set1_ps(t), z = _mm256_setzero_ps();
  return {_mm256_blendv_ps(v.a, z, _mm256_cmp_ps(x.a, tv, _CMP_LT_OQ)),
          _mm256_blendv_ps(v.b, z, _mm256_cmp_ps(x.b, tv, _CMP_LT_OQ))};
}
template <int J>
inline V in_register(V v) {
  if constexpr (J > 1) asm("" : "+x"(v.a), "+x"(v.b));
  return v;
}
// fma(d, c, m) per code: the value AVX-512's table holds for that code
inline void decode4(const uint8_t* codes, float d, float m, V& lo, V& hi) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
  const __m256i b0 = _mm256_cvtepu8_epi32(bytes), b1 = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));
  const __m256i low = _mm256_set1_epi32(15);
  const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
  auto w = [&](__m256i c) { return _mm256_fmadd_ps(dv, _mm256_cvtepi32_ps(c), mv); };
  lo = {w(_mm256_and_si256(b0, low)), w(_mm256_and_si256(b1, low))};
  hi = {w(_mm256_srli_epi32(b0, 4)), w(_mm256_srli_epi32(b1, 4))};
}
inline void decode8(const uint8_t* codes, float d, V& lo, V& hi) {
  const __m256 dv = _mm256_set1_ps(d);
  auto w = [&](const uint8_t* p) {
    return _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
  };
  lo = {w(codes), w(codes + 8)};
  hi = {w(codes + 16), w(codes + 24)};
}
inline void half16(const uint16_t* src, float* dst) {
  _mm256_storeu_ps(dst, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
  _mm256_storeu_ps(dst + 8, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 8))));
}
// lane i: value where bit i of bits is set, else 0
inline V vbitmask(uint32_t bits, float value) {
  const __m256i b = _mm256_set1_epi32(static_cast<int>(bits));
  const __m256 v = _mm256_set1_ps(value);
  auto half = [&](__m256i sel) {
    return _mm256_and_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(b, sel), sel)), v);
  };
  return {half(_mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128)),
          half(_mm256_setr_epi32(256, 512, 1024, 2048, 4096, 8192, 16384, 32768))};
}
constexpr const char* kIsa = "avx2";

#else
// Portable: plain loops over 16 lanes that the compiler vectorizes for its target; a * b + c as two roundings
// (built with -ffp-contract=off, and no fused multiply-add instruction is assumed).
struct alignas(64) V { float l[16]; };
#define EAGLE_LANES(expr)                \
  V out;                                 \
  for (int i = 0; i < 16; ++i) out.l[i] = (expr); \
  return out;
inline V vzero() { EAGLE_LANES(0.0f) }
inline V vset1(float a) { EAGLE_LANES(a) }
inline V vload(const float* p) { EAGLE_LANES(p[i]) }
inline V vloadn(const float* p, int64_t n) { EAGLE_LANES(i < n ? p[i] : 0.0f) }
inline void vstore(float* p, V v) { for (int i = 0; i < 16; ++i) p[i] = v.l[i]; }
inline void vstoren(float* p, V v, int64_t n) { for (int i = 0; i < 16 && i < n; ++i) p[i] = v.l[i]; }
inline V vadd(V a, V b) { EAGLE_LANES(a.l[i] + b.l[i]) }
inline V vsub(V a, V b) { EAGLE_LANES(a.l[i] - b.l[i]) }
inline V vmul(V a, V b) { EAGLE_LANES(a.l[i] * b.l[i]) }
inline V vdiv(V a, V b) { EAGLE_LANES(a.l[i] / b.l[i]) }
inline V vmax(V a, V b) { EAGLE_LANES(a.l[i] > b.l[i] ? a.l[i] : b.l[i]) }
inline V vmin(V a, V b) { EAGLE_LANES(a.l[i] < b.l[i] ? a.l[i] : b.l[i]) }
inline V vfma(V a, V b, V c) { EAGLE_LANES(a.l[i] * b.l[i] + c.l[i]) }
inline V vfnma(V a, V b, V c) { EAGLE_LANES(c.l[i] - a.l[i] * b.l[i]) }
inline V vfirst(V v, int64_t n, float fill) { EAGLE_LANES(i < n ? v.l[i] : fill) }
inline V viota() { EAGLE_LANES(static_cast<float>(i)) }
// round to nearest, ties to even, for |x| < 2^22: adding and subtracting 1.5 * 2^23 (exact: no contraction)
inline V vround(V v) { EAGLE_LANES((v.l[i] + 12582912.0f) - 12582912.0f) }
inline V vscale2(V p, V n) {  // p * 2^n, n whole in [-126, 127], 2^n built in the exponent field
  V out;
  for (int i = 0; i < 16; ++i) {
    const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n.l[i]) + 127) << 23;
    float two;
    std::memcpy(&two, &bits, sizeof two);
    out.l[i] = p.l[i] * two;
  }
  return out;
}
inline V vzero_below(V v, V x, float t) { EAGLE_LANES(x.l[i] < t ? 0.0f : v.l[i]) }
#undef EAGLE_LANES
inline float vsum(V v) {
  float h[8], q[4];
  for (int i = 0; i < 8; ++i) h[i] = v.l[i] + v.l[i + 8];
  for (int i = 0; i < 4; ++i) q[i] = h[i] + h[i + 4];
  return (q[0] + q[2]) + (q[1] + q[3]);
}
inline float vmaxall(V v) {
  float m = v.l[0];
  for (int i = 1; i < 16; ++i) m = v.l[i] > m ? v.l[i] : m;
  return m;
}
template <int J>
inline V in_register(V v) { return v; }
// d * c + m equals fma(d, c, m) for these codes (d a float16 value, c < 16: d * c is exact)
inline void decode4(const uint8_t* codes, float d, float m, V& lo, V& hi) {
  for (int i = 0; i < 16; ++i) {
    lo.l[i] = d * static_cast<float>(codes[i] & 15) + m;
    hi.l[i] = d * static_cast<float>(codes[i] >> 4) + m;
  }
}
inline void decode8(const uint8_t* codes, float d, V& lo, V& hi) {
  const int8_t* c = reinterpret_cast<const int8_t*>(codes);
  for (int i = 0; i < 16; ++i) {
    lo.l[i] = d * static_cast<float>(c[i]);
    hi.l[i] = d * static_cast<float>(c[i + 16]);
  }
}
inline void half16(const uint16_t* src, float* dst) {
  for (int i = 0; i < 16; ++i) dst[i] = static_cast<float>(c10::Half(src[i], c10::Half::from_bits()));
}
// lane i: value where bit i of bits is set, else 0
inline V vbitmask(uint32_t bits, float value) {
  V out;
  for (int i = 0; i < 16; ++i) out.l[i] = (bits >> i) & 1 ? value : 0.0f;
  return out;
}
constexpr const char* kIsa = "portable";
#endif

constexpr int64_t kPrefetchRows = 8;  // rows ahead; the best of 4, 8, 16 and 32 (docs/performance.md)

// Prefetch a weight line; `once`: a weight read once per forward (a target's, far larger than the
// caches) is fetched non-temporally, so that streaming it does not push what is read again soon
// (the drafter's weights, the KV cache) out of the last-level cache.
inline void prefetch(const void* p, bool once) {
#if defined(__x86_64__) || defined(_M_X64)
  if (once) _mm_prefetch(static_cast<const char*>(p), _MM_HINT_NTA);
  else _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
#else
  if (once) __builtin_prefetch(p, 0, 0);
  else __builtin_prefetch(p, 0, 3);
#endif
}

// Register budgets: the rows of x one pass over W serves, and the weight rows J met at a time per row count M,
// the fastest timed. AVX-512 has 32 vector registers of 16 lanes; a V takes two of AVX2's 16, so there fewer
// accumulators fit and a product of more rows takes more passes (each row's sums unchanged: the same bits).
#if defined(EAGLE_ISA_AVX512)
constexpr int kPassRows = 16, kPassRowsQ = 8;
template <int M> constexpr int kJ = M <= 2 ? 4 : (M <= 6 ? 3 : (M <= 9 ? 2 : 1));
template <int M> constexpr int kJQ = M <= 1 ? 8 : (M <= 3 ? 4 : (M <= 6 ? 3 : 2));
constexpr int kJQ8One = kJQ<1>;
#elif defined(EAGLE_ISA_AVX2)
constexpr int kPassRows = 4, kPassRowsQ = 4;
template <int M> constexpr int kJ = M <= 1 ? 4 : (M <= 2 ? 2 : 1);
template <int M> constexpr int kJQ = M <= 1 ? 2 : 1;
constexpr int kJQ8One = 1;  // 8-bit codes, one row of x: faster than 2 rows of W at a time (docs/performance.md)
#else
constexpr int kPassRows = 4, kPassRowsQ = 4;
template <int M> constexpr int kJ = M <= 1 ? 4 : (M <= 2 ? 2 : 1);
template <int M> constexpr int kJQ = M <= 1 ? 2 : 1;
constexpr int kJQ8One = kJQ<1>;
#endif

// Outputs j0..j1 (a multiple of J apart) of the M rows of x [M, K]; w [N, K]; out [M, N]. x's rows are K apart
// (ldx) and out's N apart.
template <int M, int J>
void block(const float* x, int64_t K, const float* w, int64_t N, const float* bias, float* out,
           int64_t j0, int64_t j1, bool once) {
  const int64_t whole = K / 16 * 16, tail = K - whole;
  for (int64_t j = j0; j < j1; j += J) {
    V acc[M][J];
    for (int i = 0; i < M; ++i)
      for (int b = 0; b < J; ++b) acc[i][b] = vzero();
    for (int64_t k = 0; k < whole; k += 16) {
      V wv[J];
      for (int b = 0; b < J; ++b) wv[b] = vload(w + (j + b) * K + k);
      for (int b = 0; b < J; ++b)
        prefetch(w + (j + b + kPrefetchRows) * K + k, once);
      for (int i = 0; i < M; ++i) {
        const V xv = in_register<J>(vload(x + i * K + k));
        for (int b = 0; b < J; ++b) acc[i][b] = vfma(xv, wv[b], acc[i][b]);
      }
    }
    if (tail) {
      V wv[J];
      for (int b = 0; b < J; ++b) wv[b] = vloadn(w + (j + b) * K + whole, tail);
      for (int i = 0; i < M; ++i) {
        const V xv = in_register<J>(vloadn(x + i * K + whole, tail));
        for (int b = 0; b < J; ++b) acc[i][b] = vfma(xv, wv[b], acc[i][b]);
      }
    }
    for (int i = 0; i < M; ++i)
      for (int b = 0; b < J; ++b)
        out[i * N + j + b] = vsum(acc[i][b]) + (bias ? bias[j + b] : 0.0f);
  }
}

// J weight rows at a time: as many as the vector registers hold accumulators for; more rows of x than one pass
// serves split in two (each half's sums as before).
template <int M>
void rows(const float* x, int64_t K, const float* w, int64_t N, const float* bias, float* out, bool once) {
  if constexpr (M > kPassRows) {
    constexpr int H = M / 2;
    rows<H>(x, K, w, N, bias, out, once);
    rows<M - H>(x + H * K, K, w, N, bias, out + H * N, once);
    return;
  } else {
    constexpr int J = kJ<M>;
    const int64_t blocks = N / J;
    at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
      block<M, J>(x, K, w, N, bias, out, b0 * J, b1 * J, once);
    });
    if (blocks * J < N) block<M, 1>(x, K, w, N, bias, out, blocks * J, N, once);
  }
}

// The same product with W kept as its exact block encoding (eagle.runtime.block_codes): each block of 32
// weights of a row is w = fma(d, c, m) for 4-bit codes c (0..15, 16 bytes, byte i = c[i] | c[i + 16] << 4)
// and a (d, m) pair of scales, or w = d * c for 8-bit codes (-127..127) and one scale d (kScales).
// A weight vector is decoded to the very fp32 values of W and summed in the same order as block():
// the same bits, from 0.625-0.75 or 1.125 bytes per weight instead of 4.
template <int Bits>
constexpr int64_t kScales = Bits == 4 ? 2 : 1;  // scales per block

template <int Bits>
inline void decode(const uint8_t* codes, const float* scales, V& lo, V& hi) {
  if constexpr (Bits == 4) decode4(codes, scales[0], scales[1], lo, hi);
  else decode8(codes, scales[0], lo, hi);
}

// n float16 values (scales as GGUF stores them: half the bytes of fp32) -> fp32 in dst, exactly.
void half_to_float(const uint16_t* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) half16(src + i, dst + i);
  if (i < n) {
    uint16_t tail[16] = {0};
    float converted[16];
    std::memcpy(tail, src + i, (n - i) * sizeof(uint16_t));
    half16(tail, converted);
    std::memcpy(dst + i, converted, (n - i) * sizeof(float));
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
    V acc[M][J];
    for (int i = 0; i < M; ++i)
      for (int b = 0; b < J; ++b) acc[i][b] = vzero();
    const uint8_t* cp = codes + j * row_bytes;
    const float* xp = x;
    for (int64_t kb = 0; kb < blocks; ++kb, cp += kBlockBytes, sp += kScales<Bits>, xp += 32) {
      V lo[J], hi[J];
      for (int b = 0; b < J; ++b) {
        decode<Bits>(cp + b * row_bytes, sp + b * row_scales, lo[b], hi[b]);
        prefetch(cp + (b + kPrefetchRows) * row_bytes, once);
      }
      for (int i = 0; i < M; ++i) {
        const V xv = in_register<J>(vload(xp + i * K));
        for (int b = 0; b < J; ++b) acc[i][b] = vfma(xv, lo[b], acc[i][b]);
      }
      for (int i = 0; i < M; ++i) {
        const V xv = in_register<J>(vload(xp + i * K + 16));
        for (int b = 0; b < J; ++b) acc[i][b] = vfma(xv, hi[b], acc[i][b]);
      }
    }
    for (int i = 0; i < M; ++i)
      for (int b = 0; b < J; ++b)
        out[i * N + j + b] = vsum(acc[i][b]) + (bias ? bias[j + b] : 0.0f);
  }
}

template <int Bits, int M>
void rows_q(const float* x, int64_t K, const uint8_t* codes, const void* scales, bool half, int64_t N,
            const float* bias, float* out, bool once) {
  if constexpr (M > kPassRowsQ) {
    // several passes over W, each with at most kPassRowsQ rows of x: with more, a block of W met every row of x
    // before the next, and x outgrew the first-level cache (16 rows of 1536: 96 KB): the target's products of 12
    // and 16 rows cost 1.9x and 3.0x those of 8 in one pass, 1.4x and 2.0x in two (AVX-512); each row's outputs
    // are summed as before (the same bits)
    constexpr int H = M / 2;
    rows_q<Bits, H>(x, K, codes, scales, half, N, bias, out, once);
    rows_q<Bits, M - H>(x + H * K, K, codes, scales, half, N, bias, out + H * N, once);
    return;
  } else {
    constexpr int J = Bits == 8 && M == 1 ? kJQ8One : kJQ<M>;
    const int64_t blocks = N / J, row_scales = K / 32 * kScales<Bits>;
    // rows j0..j1 (a multiple of W apart) by block_q; fp16 scales converted W rows at a time, outside it
    // (converted inside its loop, they take registers from the products)
    auto run = [&](auto w, int64_t j0, int64_t j1) {
      constexpr int W = decltype(w)::value;
      if (!half) return block_q<Bits, M, W>(x, K, codes, static_cast<const float*>(scales) + j0 * row_scales, N,
                                            bias, out, j0, j1, once);
      std::vector<float> converted(W * row_scales);
      for (int64_t j = j0; j < j1; j += W) {
        half_to_float(static_cast<const uint16_t*>(scales) + j * row_scales, W * row_scales, converted.data());
        block_q<Bits, M, W>(x, K, codes, converted.data(), N, bias, out, j, j + W, once);
      }
    };
    at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) { run(std::integral_constant<int, J>(), b0 * J, b1 * J); });
    if (blocks * J < N) run(std::integral_constant<int, 1>(), blocks * J, N);
  }
}

#if defined(EAGLE_ISA_AVX2)
// AVX2: products of more rows than one pass of rows_q serves, in one pass over W. A V is two registers here, so a
// pass of block_q holds the sums of 4 rows only, and 16 rows took 4 passes, each decoding W again. Instead kPanel
// rows of W are decoded once into a buffer the first-level cache holds, then met by every row of x, kTile rows at
// a time. The two halves of a V (lanes 0-7 and 8-15 of every 16 weights) never meet until vsum, so they are summed
// in two sweeps along k with one register per output each, and twice as many outputs fit the registers. Every lane
// meets the same products in the same order as in block_q, and vsum adds the halves as there: the same bits.
constexpr int kPanel = 3, kTile = 4;  // the fastest timed of 2x4, 2x6, 3x4 (docs/performance.md)

// out[i * ldo + b] for the m <= kTile rows of x (K apart) and the n <= kPanel decoded rows of w (K apart).
template <int MR, int NR>
void panel_tile(const float* x, int64_t K, const float* w, const float* bias, float* out, int64_t ldo) {
  __m256 sums[2][MR][NR];
  for (int h = 0; h < 2; ++h) {
    __m256 acc[MR][NR];
    for (int i = 0; i < MR; ++i)
      for (int b = 0; b < NR; ++b) acc[i][b] = _mm256_setzero_ps();
    for (int64_t k = 8 * h; k < K; k += 16) {
      __m256 wv[NR];
      for (int b = 0; b < NR; ++b) wv[b] = _mm256_loadu_ps(w + b * K + k);
      for (int i = 0; i < MR; ++i) {
        const __m256 xv = _mm256_loadu_ps(x + i * K + k);
        for (int b = 0; b < NR; ++b) acc[i][b] = _mm256_fmadd_ps(xv, wv[b], acc[i][b]);
      }
    }
    for (int i = 0; i < MR; ++i)
      for (int b = 0; b < NR; ++b) sums[h][i][b] = acc[i][b];
  }
  for (int i = 0; i < MR; ++i)
    for (int b = 0; b < NR; ++b) out[i * ldo + b] = vsum(V{sums[0][i][b], sums[1][i][b]}) + (bias ? bias[b] : 0.0f);
}

template <int NR>
void panel_rows(const float* x, int64_t M, int64_t K, const float* w, const float* bias, float* out, int64_t ldo) {
  int64_t i = 0;
  for (; i + kTile <= M; i += kTile) panel_tile<kTile, NR>(x + i * K, K, w, bias, out + i * ldo, ldo);
  switch (M - i) {
    case 0: break;
    case 1: panel_tile<1, NR>(x + i * K, K, w, bias, out + i * ldo, ldo); break;
    case 2: panel_tile<2, NR>(x + i * K, K, w, bias, out + i * ldo, ldo); break;
    case 3: panel_tile<3, NR>(x + i * K, K, w, bias, out + i * ldo, ldo); break;
    case 4: panel_tile<4, NR>(x + i * K, K, w, bias, out + i * ldo, ldo); break;
    default: panel_tile<5, NR>(x + i * K, K, w, bias, out + i * ldo, ldo); break;
  }
}

constexpr int64_t kRowBlock = 64;

// panel_rows for a panel of n = 1..kPanel decoded rows of W (the last panel of a matrix may be narrower).
inline void panel(int64_t n, const float* x, int64_t M, int64_t K, const float* w, const float* bias, float* out,
                  int64_t ldo) {
  if (n >= 3) panel_rows<3>(x, M, K, w, bias, out, ldo);
  else if (n == 2) panel_rows<2>(x, M, K, w, bias, out, ldo);
  else panel_rows<1>(x, M, K, w, bias, out, ldo);
}

// out [M, N] = x [M, K] W^T (+ bias) for any M, W as in rows_q (codes [N, K * Bits / 8], scales fp32 or fp16).
template <int Bits>
void panels_q(const float* x, int64_t M, int64_t K, const uint8_t* codes, const void* scales, bool half, int64_t N,
              const float* bias, float* out, bool once) {
  constexpr int64_t kBlockBytes = 32 * Bits / 8;
  const int64_t row_bytes = K * Bits / 8, blocks = K / 32, row_scales = blocks * kScales<Bits>;
  if (M > kRowBlock) {  // x's rows in blocks the second-level cache holds, each with its own pass over W
    for (int64_t i = 0; i < M; i += kRowBlock)
      panels_q<Bits>(x + i * K, std::min(kRowBlock, M - i), K, codes, scales, half, N, bias, out + i * N, once);
    return;
  }
  at::parallel_for(0, (N + kPanel - 1) / kPanel, 8, [&](int64_t p0, int64_t p1) {
    std::vector<float> buf(kPanel * K), converted(half ? kPanel * row_scales : 0);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t j = p * kPanel, n = std::min<int64_t>(kPanel, N - j);
      const float* sp = static_cast<const float*>(scales) + j * row_scales;
      if (half) {
        half_to_float(static_cast<const uint16_t*>(scales) + j * row_scales, n * row_scales, converted.data());
        sp = converted.data();
      }
      for (int64_t r = 0; r < n; ++r) {
        const uint8_t* cp = codes + (j + r) * row_bytes;
        const uint8_t* ahead = cp + kPanel * kPrefetchRows * row_bytes;
        float* o = buf.data() + r * K;
        for (int64_t kb = 0; kb < blocks; ++kb, cp += kBlockBytes, o += 32) {
          if (kb * kBlockBytes % 64 == 0 && j + r + kPanel * kPrefetchRows < N) prefetch(ahead + kb * kBlockBytes, once);
          V lo, hi;
          decode<Bits>(cp, sp + (r * blocks + kb) * kScales<Bits>, lo, hi);
          vstore(o, lo);
          vstore(o + 16, hi);
        }
      }
      const float* bp = bias ? bias + j : nullptr;
      panel(n, x, M, K, buf.data(), bp, out + j, N);
    }
  });
}
constexpr bool kPanels = true;
#else
template <int Bits>
void panels_q(const float*, int64_t, int64_t, const uint8_t*, const void*, bool, int64_t, const float*, float*, bool) {}
constexpr bool kPanels = false;
constexpr int kPanel = 3;
inline void panel(int64_t, const float*, int64_t, int64_t, const float*, const float*, float*, int64_t) {}
#endif
static_assert(kPanel == 3, "panel() dispatches 1-3 rows of W");

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

namespace {
void int8_linear_q(const float* x, int64_t M, int64_t K, const uint8_t* codes, const void* scales, bool half, int bits,
                   int64_t N, const float* bias, float* out, bool once);
void check_int8(bool int8, const char* who);
}  // namespace

// stream_linear_q: stream_linear with W given by its exact block encoding (codes uint8 [N, K / 2] and
// scales [N, K / 32, 2] for 4 bits, or int8 [N, K] and [N, K / 32, 1] for 8 bits; scales fp32 or fp16):
// the same outputs, bit for bit. int8: the product with x quantized to int8 instead (any number of rows).
torch::Tensor stream_linear_q(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                              const c10::optional<torch::Tensor>& bias, bool once, bool int8) {
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
  check_int8(int8, "stream_linear_q");
  if (int8) {
    if (M > 0) int8_linear_q(xp, M, K, cp, sp, half, bits, N, b, op, once);
    return out;
  }
  if (kPanels && M > kPassRowsQ) {
    if (bits == 4) panels_q<4>(xp, M, K, cp, sp, half, N, b, op, once);
    else panels_q<8>(xp, M, K, cp, sp, half, N, b, op, once);
    return out;
  }
  for_rows(M, "stream_linear_q", [&](auto m) {
    if (bits == 4) rows_q<4, decltype(m)::value>(xp, K, cp, sp, half, N, b, op, once);
    else rows_q<8, decltype(m)::value>(xp, K, cp, sp, half, N, b, op, once);
  });
  return out;
}

// ---- stream_linear_gguf: the product with W in GGUF's own block layouts --------------------------------------
// Each row of W is its GGUF bytes (ggml's block layouts: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL in blocks of 32
// weights, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS in super-blocks of 256). A few rows at a time are decoded to fp32 into a buffer the
// caches hold, by plain loops the compiler vectorizes, then multiplied by block(): every decoded weight is exact
// (d * c is exact in fp32 for these codes and scales; a minimum is subtracted or added once, as ggml and gguf-py
// decode), so the outputs have the bits of stream_linear on the de-quantized W, from 0.33-1.06 bytes a weight.
namespace {

enum GgmlType : int64_t {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14,
  kIQ4_NL = 20, kIQ4_XS = 23,
  kQ5_0x8 = 1006, kQ4_Kx8 = 1012, kQ6_Kx8 = 1014  // not GGML's: rows interleaved 8 at a time (gguf_interleave)
};

// IQ4_NL and IQ4_XS: a 4-bit code c stands for kIQ4Values[c] (times the block's scale)
alignas(16) constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

struct GgmlLayout {
  int64_t weights, bytes;  // per block
};

GgmlLayout ggml_layout(int64_t type) {
  switch (type) {
    case kQ4_0: return {32, 18};
    case kQ4_1: return {32, 20};
    case kQ5_0: return {32, 22};
    case kQ5_1: return {32, 24};
    case kQ8_0: return {32, 34};
    case kQ2_K: return {256, 84};
    case kQ3_K: return {256, 110};
    case kQ4_K: return {256, 144};
    case kQ4_Kx8: return {256, 144};
    case kQ6_Kx8: return {256, 210};
    case kQ5_0x8: return {32, 22};
    case kQ5_K: return {256, 176};
    case kQ6_K: return {256, 210};
    case kIQ4_NL: return {32, 18};
    case kIQ4_XS: return {256, 136};
    default: TORCH_CHECK(false, "stream_linear_gguf: GGML type ", type, " is not streamed (Q4_0, Q4_1, Q5_0, Q5_1, ",
                         "Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS are)");
  }
  return {0, 0};
}

// weights a block (or super-block) of a streamed type
constexpr int64_t layout_weights(int64_t type) {
  return type == kQ2_K || type == kQ3_K || type == kQ4_K || type == kQ5_K || type == kQ6_K || type == kIQ4_XS ? 256
                                                                                                              : 32;
}

// the K-quants whose int8 products take x per super-block of 256, and whose fp32 scales fused_block hoists
template <int64_t Type>
constexpr bool kSuperInt8 = Type == kQ4_K || Type == kQ5_K || Type == kQ6_K;

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
#if defined(__F16C__)
  return _cvtsh_ss(bits);  // one instruction; c10::Half converts in software here (exact either way)
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// Q4_K and Q5_K: the 6-bit scale and minimum of sub-block j (0..7) from the super-block's 12 scale bytes.
inline void scale_min_k4(int j, const uint8_t* q, int& sc, int& mn) {
  if (j < 4) {
    sc = q[j] & 63;
    mn = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Q3_K: the scale of weights 16 k .. 16 k + 15 (k 0..15) from the super-block's 12 scale bytes: 6 bits, less 32.
inline int scale_q3k(int k, const uint8_t* sc) {
  return (((sc[k % 8] >> (4 * (k / 8))) & 15) | (((sc[8 + k % 4] >> (2 * (k / 4))) & 3) << 4)) - 32;
}

// IQ4_XS: the scale of sub-block ib (0..7, 32 weights) of the super-block at p: 6 bits (scales_l, scales_h), less 32.
inline int scale_iq4xs(int ib, const uint8_t* p) {
  uint16_t high;
  std::memcpy(&high, p + 2, sizeof high);
  return (((p[4 + ib / 2] >> (4 * (ib % 2))) & 15) | (((high >> (2 * ib)) & 3) << 4)) - 32;
}

// One row of K weights from its GGUF bytes into out (fp32), as gguf-py's dequantize computes them.
// (restrict: the stores to out cannot change the codes, so the loops vectorize; uint8_t may alias anything)
template <int64_t Type>
void decode_row(const uint8_t* __restrict p, int64_t K, float* __restrict out) {
  if constexpr (Type == kQ8_0) {
    for (int64_t b = 0; b < K / 32; ++b, p += 34, out += 32) {
      const float d = half_at(p);
      const int8_t* q = reinterpret_cast<const int8_t*>(p + 2);
      for (int l = 0; l < 32; ++l) out[l] = static_cast<float>(q[l]) * d;
    }
  } else if constexpr (Type == kQ4_0 || Type == kQ4_1) {
    // d (c - 8) = fma(d, c, -8 d) and d c + m = fma(d, c, m): d c is exact (d a float16 value, c < 16)
    constexpr int64_t size = Type == kQ4_0 ? 18 : 20;
    for (int64_t b = 0; b < K / 32; ++b, p += size, out += 32) {
      const float d = half_at(p), m = Type == kQ4_0 ? -8.0f * d : half_at(p + 2);
      V lo, hi;
      decode4(p + (Type == kQ4_0 ? 2 : 4), d, m, lo, hi);
      vstore(out, lo);
      vstore(out + 16, hi);
    }
  } else if constexpr (Type == kQ5_0 || Type == kQ5_1) {
    // d c5 (c5 = c4 + 16 h) summed exactly as d c4 + 16 d h, then + m (Q5_1) or - 16 d (Q5_0): one rounding at
    // most, as gguf-py's d c5 + m and d (c5 - 16)
    constexpr int64_t size = Type == kQ5_0 ? 22 : 24, head = Type == kQ5_0 ? 2 : 4;
    for (int64_t b = 0; b < K / 32; ++b, p += size, out += 32) {
      const float d = half_at(p), m = Type == kQ5_0 ? -16.0f * d : half_at(p + 2);
      uint32_t qh;
      std::memcpy(&qh, p + head, sizeof qh);
      V lo, hi;
      decode4(p + head + 4, d, 0.0f, lo, hi);
      const V mv = vset1(m);
      vstore(out, vadd(vadd(lo, vbitmask(qh, 16.0f * d)), mv));
      vstore(out + 16, vadd(vadd(hi, vbitmask(qh >> 16, 16.0f * d)), mv));
    }
  } else if constexpr (Type == kQ4_K || Type == kQ5_K) {
    constexpr int64_t size = Type == kQ4_K ? 144 : 176;
    for (int64_t b = 0; b < K / 256; ++b, p += size, out += 256) {
      const float d = half_at(p), dmin = half_at(p + 2);
      const uint8_t* scales = p + 4;
      const uint8_t* qh = p + 16;  // Q5_K only: bit j of byte l is the fifth bit of weight l of sub-block j
      const uint8_t* qs = p + (Type == kQ4_K ? 16 : 48);
      for (int j = 0; j < 8; ++j) {
        int sc, mn;
        scale_min_k4(j, scales, sc, mn);
        const float dj = d * static_cast<float>(sc), mj = dmin * static_cast<float>(mn);
        const uint8_t* q = qs + 32 * (j / 2);
        const int shift = 4 * (j % 2);
        float* o = out + 32 * j;
        if constexpr (Type == kQ4_K) {  // fma(dj, c, -mj): dj c is exact, one rounding as dj c - mj
          V a0, a1, b0, b1;
          decode4(q, dj, -mj, a0, a1);
          decode4(q + 16, dj, -mj, b0, b1);
          vstore(o, shift ? a1 : a0);
          vstore(o + 16, shift ? b1 : b0);
        } else {
          for (int l = 0; l < 32; ++l)
            o[l] = dj * static_cast<float>(((q[l] >> shift) & 15) | (((qh[l] >> j) & 1) << 4)) - mj;
        }
      }
    }
  } else if constexpr (Type == kQ2_K) {
    // scales [16] (a 4-bit scale and a 4-bit minimum per 16 weights), qs [64] (2-bit codes: weight 128 h + 32 s + l
    // is bits 2 s of byte 32 h + l), d, dmin: dl c - ml with dl c exact, one rounding as gguf-py's
    for (int64_t b = 0; b < K / 256; ++b, p += 84, out += 256) {
      const float d = half_at(p + 80), dmin = half_at(p + 82);
      for (int h = 0; h < 2; ++h)
        for (int sh = 0; sh < 4; ++sh)
          for (int g = 0; g < 2; ++g) {  // 16 weights: scale index 8 h + 2 sh + g
            const uint8_t sc = p[8 * h + 2 * sh + g];
            const float dl = d * static_cast<float>(sc & 15), ml = dmin * static_cast<float>(sc >> 4);
            const uint8_t* q = p + 16 + 32 * h + 16 * g;
            float* o = out + 128 * h + 32 * sh + 16 * g;
            for (int l = 0; l < 16; ++l) o[l] = dl * static_cast<float>((q[l] >> (2 * sh)) & 3) - ml;
          }
    }
  } else if constexpr (Type == kQ3_K) {
    // hmask [32] (bit j of byte l: weight 32 j + l's high bit, set meaning no offset), qs [64] (2-bit codes as Q2_K),
    // scales [12] (sixteen 6-bit scales, offset by 32), d: d s (c - 4 (1 - h)), exact
    for (int64_t b = 0; b < K / 256; ++b, p += 110, out += 256) {
      const uint8_t* hmask = p;
      const uint8_t* sc = p + 96;
      const float d = half_at(p + 108);
      for (int k = 0; k < 16; ++k) {  // weights 16 k .. 16 k + 15
        const float dl = d * static_cast<float>(scale_q3k(k, sc));
        const int h = k / 8, sh = (k % 8) / 2, j = k / 2;
        const uint8_t* q = p + 32 + 32 * h + 16 * (k % 2);
        const uint8_t* m = hmask + 16 * (k % 2);
        float* o = out + 16 * k;
        for (int l = 0; l < 16; ++l)
          o[l] = dl * static_cast<float>(((q[l] >> (2 * sh)) & 3) - (((m[l] >> j) & 1) ? 0 : 4));
      }
    }
  } else if constexpr (Type == kIQ4_NL || Type == kIQ4_XS) {
    // IQ4_NL: d, 16 bytes of codes (weight l: low nibble of byte l, weight 16 + l: its high nibble). IQ4_XS: d,
    // scales_h (2 bits a sub-block), scales_l (4 bits a sub-block), then 8 sub-blocks of 32 weights coded as IQ4_NL's,
    // each with its 6-bit scale less 32. d s v is exact (at most 23 significant bits), as gguf-py's (d s) v
    constexpr int64_t unit = Type == kIQ4_NL ? 32 : 256, size = Type == kIQ4_NL ? 18 : 136;
    for (int64_t b = 0; b < K / unit; ++b, p += size, out += unit) {
      const float d = half_at(p);
      for (int ib = 0; ib < unit / 32; ++ib) {
        float dl = d;
        const uint8_t* q = p + 2 + 16 * ib;
        if constexpr (Type == kIQ4_XS) {
          dl = d * static_cast<float>(scale_iq4xs(ib, p));
          q = p + 8 + 16 * ib;
        }
        float* o = out + 32 * ib;
        for (int l = 0; l < 16; ++l) {
          o[l] = dl * static_cast<float>(kIQ4Values[q[l] & 15]);
          o[16 + l] = dl * static_cast<float>(kIQ4Values[q[l] >> 4]);
        }
      }
    }
  } else {  // Q6_K: ql [128], qh [64], int8 scales [16] (one per 16 weights), d
    for (int64_t b = 0; b < K / 256; ++b, p += 210, out += 256) {
      const uint8_t* ql = p;
      const uint8_t* qh = p + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
      const float d = half_at(p + 208);
      for (int n = 0; n < 2; ++n)
        for (int r = 0; r < 4; ++r) {  // weights 32 r .. 32 r + 31 of half n
          const uint8_t* low = ql + 64 * n + 32 * (r % 2);
          const int lshift = 4 * (r / 2), hshift = 2 * r;
          float* o = out + 128 * n + 32 * r;
          const float s0 = d * static_cast<float>(sc[8 * n + 2 * r]), s1 = d * static_cast<float>(sc[8 * n + 2 * r + 1]);
          for (int l = 0; l < 32; ++l) {
            const int q = (((low[l] >> lshift) & 15) | (((qh[32 * n + l] >> hshift) & 3) << 4)) - 32;
            o[l] = (l < 16 ? s0 : s1) * static_cast<float>(q);
          }
        }
    }
  }
}

// ---- The fused path: a few rows of x meet W's codes decoded in registers -------------------------------------
// For 1-kFusedRows rows of x (decoding a token, drafting) the product is bound by decoding the codes, not by the
// memory: writing decoded rows to a buffer and reading them back doubled the instructions per weight. Here each
// 32 weights of a row are built as 32 bytes of integer codes with byte-wide vector operations (one instruction
// per 32 codes where the buffer path spent one per 8), converted to fp32 and scaled in registers, then met by
// every row of x. Each weight is the value decode_row gives it (d c is exact for every type; where a minimum is
// added, one fused multiply-add rounds the exact d c + m once, as decode_row's sum does), and each output is summed
// in block()'s order: the bits of the buffer path and of stream_linear on the de-quantized W.
#if defined(EAGLE_ISA_AVX512) || defined(EAGLE_ISA_AVX2)
constexpr bool kFusedGguf = true;
constexpr int kFusedRows = 4;  // more rows: the buffer path, whose decoding serves them all, was as fast at 8

// 32 signed bytes -> lo (bytes 0-15) and hi (bytes 16-31) as fp32
#if defined(EAGLE_ISA_AVX512)
inline void bytes_to_floats(__m256i b, V& lo, V& hi) {
  lo = {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)))};
  hi = {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)))};
}
#else
inline void bytes_to_floats(__m256i b, V& lo, V& hi) {
  const __m128i b0 = _mm256_castsi256_si128(b), b1 = _mm256_extracti128_si256(b, 1);
  auto f = [](__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); };
  lo = {f(b0), f(_mm_srli_si128(b0, 8))};
  hi = {f(b1), f(_mm_srli_si128(b1, 8))};
}
#endif

inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
// 16 bytes of two 4-bit codes each (byte i: code i low, code i + 16 high) -> codes 0-31 as bytes
inline __m256i nibbles16(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), low = _mm_set1_epi8(15);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low), _mm_and_si128(v, low));
}
// byte i: 0xFF where bit i of the 32 bits at p is set, else 0
inline __m256i bits32(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, sizeof bits);
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)),
                                             _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                               0x0101010101010101, 0x0000000000000000));
  const __m256i others = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);  // every bit but bit i % 8 of byte i
  return _mm256_cmpeq_epi8(_mm256_or_si256(spread, others), _mm256_set1_epi64x(-1));
}
inline V scaled(float d, V c) { return vmul(vset1(d), c); }
inline V scaled(float d, V c, float m) { return vfma(vset1(d), c, vset1(m)); }

// The codes of W's block s (0-based, 32 weights each) of the unit at p (a block of 32 weights, or a super-block
// of 256 for the K-quants), as 32 bytes c, and their scales: weight l is dl c[l] + ml for l < 16, dh c[l] + mh
// for the others (the minimum added only for the types of kHasMin; dl == dh but for those of kHalfScales). Codes
// are signed bytes, non-negative for the types of kUnsigned.
struct Codes {
  __m256i c;
  float dl, dh, ml, mh;
};
template <int64_t Type>
constexpr bool kHasMin = Type == kQ4_0 || Type == kQ4_1 || Type == kQ5_1 || Type == kQ4_K || Type == kQ5_K ||
                         Type == kQ2_K;
template <int64_t Type>
constexpr bool kHalfScales = Type == kQ2_K || Type == kQ3_K || Type == kQ6_K;
template <int64_t Type>
constexpr bool kUnsigned = kHasMin<Type>;

template <int64_t Type>
inline Codes fused_codes(const uint8_t* p, int s) {
  if constexpr (Type == kQ8_0) {
    const float d = half_at(p);
    return {load32(p + 2), d, d, 0.0f, 0.0f};
  } else if constexpr (Type == kQ4_0 || Type == kQ4_1) {
    const float d = half_at(p), m = Type == kQ4_0 ? -8.0f * d : half_at(p + 2);
    return {nibbles16(p + (Type == kQ4_0 ? 2 : 4)), d, d, m, m};
  } else if constexpr (Type == kQ5_0) {  // d (c5 - 16): exact, the value decode_row's sums reach
    const __m256i high = _mm256_andnot_si256(bits32(p + 2), _mm256_set1_epi8(static_cast<char>(0xF0)));
    const float d = half_at(p);
    return {_mm256_or_si256(nibbles16(p + 6), high), d, d, 0.0f, 0.0f};  // c5 - 16 as a signed byte
  } else if constexpr (Type == kQ5_1) {  // d c5 + m, one rounding
    const __m256i high = _mm256_and_si256(bits32(p + 4), _mm256_set1_epi8(16));
    const float d = half_at(p), m = half_at(p + 2);
    return {_mm256_or_si256(nibbles16(p + 8), high), d, d, m, m};
  } else if constexpr (Type == kQ4_K || Type == kQ5_K) {  // dj c - mj, one rounding
    int sc, mn;
    scale_min_k4(s, p + 4, sc, mn);
    const float dj = half_at(p) * static_cast<float>(sc), mj = half_at(p + 2) * static_cast<float>(mn);
    const __m256i q = load32(p + (Type == kQ4_K ? 16 : 48) + 32 * (s / 2));
    __m256i c = _mm256_and_si256(s % 2 ? _mm256_srli_epi16(q, 4) : q, _mm256_set1_epi8(15));
    if constexpr (Type == kQ5_K) {  // bit s of byte l of qh: the fifth bit of weight l
      const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << s));
      const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(load32(p + 16), bit), bit);
      c = _mm256_or_si256(c, _mm256_and_si256(set, _mm256_set1_epi8(16)));
    }
    return {c, dj, dj, -mj, -mj};
  } else if constexpr (Type == kQ2_K) {  // block s = 4 h + sh: bits 2 sh of bytes 32 h ..; dl c - ml, one rounding
    const __m256i c = _mm256_and_si256(_mm256_srli_epi16(load32(p + 16 + 32 * (s / 4)), 2 * (s % 4)),
                                       _mm256_set1_epi8(3));
    const float d = half_at(p + 80), dmin = half_at(p + 82);
    const uint8_t s0 = p[2 * s], s1 = p[2 * s + 1];
    return {c, d * static_cast<float>(s0 & 15), d * static_cast<float>(s1 & 15),
            -(dmin * static_cast<float>(s0 >> 4)), -(dmin * static_cast<float>(s1 >> 4))};
  } else if constexpr (Type == kQ3_K) {  // block s: 2-bit codes as Q2_K, bit s of hmask byte l; d sc (c - 4 (1 - h))
    const __m256i low = _mm256_and_si256(_mm256_srli_epi16(load32(p + 32 + 32 * (s / 4)), 2 * (s % 4)),
                                         _mm256_set1_epi8(3));
    const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << s));
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(load32(p), bit), bit);
    const __m256i q = _mm256_sub_epi8(_mm256_or_si256(low, _mm256_and_si256(set, _mm256_set1_epi8(4))),
                                      _mm256_set1_epi8(4));
    const float d = half_at(p + 108);
    return {q, d * static_cast<float>(scale_q3k(2 * s, p + 96)), d * static_cast<float>(scale_q3k(2 * s + 1, p + 96)),
            0.0f, 0.0f};
  } else if constexpr (Type == kIQ4_NL || Type == kIQ4_XS) {  // codes looked up in kIQ4Values by a byte shuffle
    const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kIQ4Values)));
    const float dl = Type == kIQ4_XS ? half_at(p) * static_cast<float>(scale_iq4xs(s, p)) : half_at(p);
    return {_mm256_shuffle_epi8(table, nibbles16(p + (Type == kIQ4_NL ? 2 : 8 + 16 * s))), dl, dl, 0.0f, 0.0f};
  } else {  // Q6_K: block s = 4 n + r of the super-block
    const int n = s / 4, r = s % 4;
    const __m256i low = _mm256_and_si256(_mm256_srli_epi16(load32(p + 64 * n + 32 * (r % 2)), 4 * (r / 2)),
                                         _mm256_set1_epi8(15));
    const __m256i high = _mm256_and_si256(_mm256_srli_epi16(load32(p + 128 + 32 * n), 2 * r), _mm256_set1_epi8(3));
    const __m256i q = _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 4)), _mm256_set1_epi8(32));
    const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
    const float d = half_at(p + 208);
    return {q, d * static_cast<float>(sc[8 * n + 2 * r]), d * static_cast<float>(sc[8 * n + 2 * r + 1]), 0.0f, 0.0f};
  }
}

// The 32 weights of W's block s of the unit at p as fp32, lo (weights 0-15) and hi (16-31): d c exactly, or
// d c + m rounded once (one fused multiply-add), the values decode_row gives.
template <int64_t Type>
inline void fused_weights(const uint8_t* p, int s, V& lo, V& hi) {
  const Codes k = fused_codes<Type>(p, s);
  bytes_to_floats(k.c, lo, hi);
  if constexpr (kHasMin<Type>) {
    lo = scaled(k.dl, lo, k.ml);
    hi = scaled(k.dh, hi, k.mh);
  } else {
    lo = scaled(k.dl, lo);
    hi = scaled(k.dh, hi);
  }
}

// The 32 unsigned codes of chunk s (weights 32 s .. 32 s + 31) of the super-block at p, as bytes.
template <int64_t Type>
inline __m256i super_chunk(const uint8_t* p, int s) {
  const __m256i low4 = _mm256_set1_epi8(15);
  if constexpr (Type == kQ6_K) {
    const int n = s / 4, r = s % 4;
    const __m256i low = _mm256_and_si256(_mm256_srli_epi16(load32(p + 64 * n + 32 * (r % 2)), 4 * (r / 2)), low4);
    const __m256i high = _mm256_and_si256(_mm256_srli_epi16(load32(p + 128 + 32 * n), 2 * r), _mm256_set1_epi8(3));
    return _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
  } else {
    const __m256i q = load32(p + (Type == kQ4_K ? 16 : 48) + 32 * (s / 2));
    __m256i c = _mm256_and_si256(s % 2 ? _mm256_srli_epi16(q, 4) : q, low4);
    if constexpr (Type == kQ5_K) {
      const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << s));
      const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(load32(p + 16), bit), bit);
      c = _mm256_or_si256(c, _mm256_and_si256(set, _mm256_set1_epi8(16)));
    }
    return c;
  }
}

// A K-quant super-block's fp32 scales for fused_block, once for its 8 chunks: Q4_K and Q5_K dl[s] = d sc_s and
// ml[s] = -(dmin mn_s) per 32 weights, Q6_K dl[g] = d sc_g per 16 (fused_codes' values: each product exact).
template <int64_t Type>
inline void super_fp32_scales(const uint8_t* p, float* dl, float* ml) {
  if constexpr (Type == kQ6_K) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
    const float d = half_at(p + 208);
    for (int g = 0; g < 16; ++g) dl[g] = d * static_cast<float>(sc[g]);
  } else {
    const float d = half_at(p), dmin = half_at(p + 2);
    for (int j = 0; j < 8; ++j) {
      int sc, mn;
      scale_min_k4(j, p + 4, sc, mn);
      dl[j] = d * static_cast<float>(sc);
      ml[j] = -(dmin * static_cast<float>(mn));
    }
  }
}

// Outputs j0..j1 of the M rows of x [M, K] (rows K apart; out's ldo apart), W's rows raw + j row_bytes in GGUF
// type Type, one row of W at a time (faster than 2 or 4 at a time on AVX2: docs/performance.md), each block of 32
// weights decoded once for the M rows.
template <int64_t Type, int M>
void fused_block(const float* x, int64_t K, const uint8_t* raw, int64_t row_bytes, const float* bias, float* out,
                 int64_t ldo, int64_t j0, int64_t j1) {
  const GgmlLayout layout = ggml_layout(Type);
  const int64_t units = K / layout.weights;
  constexpr int kSub = layout_weights(Type) / 32;
  for (int64_t j = j0; j < j1; ++j) {
    V acc[M];
    for (int i = 0; i < M; ++i) acc[i] = vzero();
    const uint8_t* rp = raw + j * row_bytes;
    for (int64_t u = 0; u < units; ++u, rp += layout.bytes) {
      prefetch(rp + kPrefetchRows * row_bytes, true);
      [[maybe_unused]] float dl[16], ml[8];
      if constexpr (kSuperInt8<Type>) super_fp32_scales<Type>(rp, dl, ml);  // once for the super-block's 8 chunks
      for (int s = 0; s < kSub; ++s) {
        V lo, hi;
        if constexpr (Type == kQ6_K) {
          bytes_to_floats(_mm256_sub_epi8(super_chunk<Type>(rp, s), _mm256_set1_epi8(32)), lo, hi);
          lo = scaled(dl[2 * s], lo);
          hi = scaled(dl[2 * s + 1], hi);
        } else if constexpr (kSuperInt8<Type>) {
          bytes_to_floats(super_chunk<Type>(rp, s), lo, hi);
          lo = scaled(dl[s], lo, ml[s]);
          hi = scaled(dl[s], hi, ml[s]);
        } else {
          fused_weights<Type>(rp, s, lo, hi);
        }
        const float* xp = x + u * layout.weights + 32 * s;
        for (int i = 0; i < M; ++i) acc[i] = vfma(vload(xp + i * K), lo, acc[i]);
        for (int i = 0; i < M; ++i) acc[i] = vfma(vload(xp + i * K + 16), hi, acc[i]);
      }
    }
    for (int i = 0; i < M; ++i) out[i * ldo + j] = vsum(acc[i]) + (bias ? bias[j] : 0.0f);
  }
}

template <int64_t Type, int M>
void fused_rows(const float* x, int64_t K, const uint8_t* raw, int64_t row_bytes, int64_t N, const float* bias,
                float* out, int64_t ldo) {
  at::parallel_for(0, N, 16, [&](int64_t j0, int64_t j1) {
    fused_block<Type, M>(x, K, raw, row_bytes, bias, out, ldo, j0, j1);
  });
}
#else
constexpr bool kFusedGguf = false;
constexpr int kFusedRows = 0;
template <int64_t Type, int M>
void fused_rows(const float*, int64_t, const uint8_t*, int64_t, int64_t, const float*, float*, int64_t) {}
template <int64_t Type>
inline void fused_weights(const uint8_t*, int, V&, V&) {}
#endif

constexpr int64_t kDecodedRows = 12;  // W rows decoded at a time: a multiple of every J and of kPanel

// decode_row for the buffer path: Q2_K, Q3_K, IQ4_NL and IQ4_XS by fused_weights' byte-wide decoding where it is
// compiled (their scalar loops do not vectorize: up to 4x slower), the same values.
template <int64_t Type>
void decode_buffered(const uint8_t* p, int64_t K, float* out) {
  if constexpr (kFusedGguf && (Type == kQ2_K || Type == kQ3_K || Type == kIQ4_NL || Type == kIQ4_XS)) {
    constexpr int64_t unit = layout_weights(Type);
    for (int64_t u = 0; u < K / unit; ++u, p += ggml_layout(Type).bytes)
      for (int s = 0; s < unit / 32; ++s, out += 32) {
        V lo, hi;
        fused_weights<Type>(p, s, lo, hi);
        vstore(out, lo);
        vstore(out + 16, hi);
      }
  } else {
    decode_row<Type>(p, K, out);
  }
}

// Outputs j..j+n of the M rows of x (M <= kPassRows) from W's decoded rows j..j+n (w: row j + b at w + (j + b) K);
// out's rows are ldo apart.
template <int M>
void decoded_pass(const float* x, int64_t K, const float* w, int64_t ldo, const float* bias, float* out, int64_t j,
                  int64_t n) {
  constexpr int J = kJ<M>;
  const int64_t whole = n / J * J;
  if (whole) block<M, J>(x, K, w, ldo, bias, out, j, j + whole, false);
  if (whole < n) block<M, 1>(x, K, w, ldo, bias, out, j + whole, j + n, false);
}

// out [M, N] (rows ldo apart: a part of a wider output) = x [M, K] W^T (+ bias), any M >= 1: each group of
// kDecodedRows rows of W is decoded once into a buffer the caches hold, then met by every row of x, kPassRows at
// a time (each output summed as block() sums it, whatever M: a row's bits do not depend on the others).
template <int64_t Type>
void gguf_rows(const float* x, int64_t M, int64_t K, const uint8_t* raw, int64_t row_bytes, int64_t N,
               const float* bias, float* out, int64_t ldo) {
  if (kFusedGguf && M <= kFusedRows) {
    for_rows(M, "stream_linear_gguf", [&](auto m) {
      if constexpr (decltype(m)::value <= kFusedRows)
        fused_rows<Type, decltype(m)::value>(x, K, raw, row_bytes, N, bias, out, ldo);
    });
    return;
  }
  at::parallel_for(0, (N + kDecodedRows - 1) / kDecodedRows, 1, [&](int64_t g0, int64_t g1) {
    std::vector<float> buf(kDecodedRows * K);
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t j = g * kDecodedRows, n = std::min(kDecodedRows, N - j);
      for (int64_t r = 0; r < n; ++r) {
        for (int64_t b = 0; b < row_bytes; b += 64) prefetch(raw + (j + r + kDecodedRows) * row_bytes + b, true);
        decode_buffered<Type>(raw + (j + r) * row_bytes, K, buf.data() + r * K);
      }
      if (kPanels && M > kPassRows) {  // AVX2: every row of x in one sweep over the buffer (panels_q)
        for (int64_t r = 0; r < n; r += kPanel) {
          panel(std::min<int64_t>(kPanel, n - r), x, M, K, buf.data() + r * K, bias ? bias + j + r : nullptr,
                out + j + r, ldo);
        }
        continue;
      }
      const float* w = buf.data() - j * K;
      for (int64_t p0 = 0; p0 < M; p0 += kPassRows) {
        for_rows(std::min<int64_t>(kPassRows, M - p0), "stream_linear_gguf", [&](auto m) {
          if constexpr (decltype(m)::value <= kPassRows)
            decoded_pass<decltype(m)::value>(x + p0 * K, K, w, ldo, bias, out + p0 * ldo, j, n);
        });
      }
    }
  });
}

// ---- passes of the integer products over W (int8 blocks of 32; K-quant super-blocks on every build) -----------
constexpr int kPassXRows = 8;       // rows of x one pass over W serves
constexpr int64_t kPassWTile = 16;  // rows of W met by every pass before the next ones (the L1 cache holds them)
// Rows of W a pass takes for m rows of x: few rows of x leave the integer units idle while one row of W is
// unpacked, so several rows of W interleave (the 512-bit build holds their sums in its 32 registers; on a 2-core
// Zen 5, one row of x: 8 rows of W took the 1.5B's layers 1.28x less time than 2; docs/performance.md).
#if defined(EAGLE_ISA_AVX512)
constexpr int kPassWRows[kPassXRows + 1] = {0, 8, 4, 2, 2, 1, 1, 1, 1};
#else
constexpr int kPassWRows[kPassXRows + 1] = {0, 2, 2, 1, 1, 1, 1, 1, 1};
#endif

// f(std::integral_constant<int, m>(), r, t, t1) for every pass of a product of x [M, K] by W [N, K]: W's rows split
// among torch's threads, rows t..t1-1 (kPassWTile at a time) met by the passes over x's rows r..r+m-1 before the
// next ones: as few passes as kPassXRows rows of x a pass allow, their rows as even as they go (9 rows as 5 and 4
// took the 1.5B's layers 0.8x the time of 8 and 1, 2-core Zen 5).
template <typename F>
void int8_passes(int64_t M, int64_t N, F&& f) {
  const int64_t passes = (M + kPassXRows - 1) / kPassXRows, base = M / passes, longer = M % passes;
  at::parallel_for(0, N, 16, [&](int64_t j0, int64_t j1) {
    for (int64_t t = j0; t < j1; t += kPassWTile) {
      const int64_t t1 = std::min(j1, t + kPassWTile);
      for (int64_t p = 0, r = 0; p < passes; ++p) {
        const int64_t m = base + (p < longer ? 1 : 0);
        switch (m) {
#define EAGLE_PASS(n)                              \
  case n:                                          \
    f(std::integral_constant<int, n>(), r, t, t1); \
    break;
          EAGLE_PASS(1) EAGLE_PASS(2) EAGLE_PASS(3) EAGLE_PASS(4) EAGLE_PASS(5) EAGLE_PASS(6) EAGLE_PASS(7)
          EAGLE_PASS(8)
#undef EAGLE_PASS
        }
        r += m;
      }
    }
  });
}

// ---- int8 activations: the products in the integer domain (an option: it changes the numerics) --------------
// Each row of x is quantized per block of 32 as ggml quantizes activations for its dot products (d = max |x| / 127,
// codes x / d rounded to the nearest, -127..127). A block's 32 codes meet W's codes in 16- and 32-bit integers
// (exact), and one fused multiply-add per 8 lanes applies both scales; a minimum's term is its scale times the
// block half's sum of x's codes (times d). Each output sums its blocks in order with the same operations whatever
// rows come with it, so a tree row gets a single row's bits. Only in the AVX2 and AVX-512 builds.
#if defined(EAGLE_ISA_AVX512) || defined(EAGLE_ISA_AVX2)
constexpr bool kInt8 = true;

// x [M, K] quantized: codes q [M, K]; d [M, K / 32], each block's scale; s [M, K / 16], d times the sum of each
// half block's codes; sb [M, K / 32], d times the sum of each block's.
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> d, s, sb;
  std::vector<int32_t> sums;  // each block's sum of codes
};

QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K) {
  const int64_t blocks = M * K / 32;
  QuantizedRows r{std::vector<int8_t>(M * K), std::vector<float>(blocks), std::vector<float>(2 * blocks),
                  std::vector<float>(blocks), std::vector<int32_t>(blocks)};
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  auto isum = [](__m256i v) {
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1)));
  };
  for (int64_t i = 0; i < blocks; ++i) {
    const float* p = x + 32 * i;
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int t = 0; t < 4; ++t) {
      v[t] = _mm256_loadu_ps(p + 8 * t);
      amax = _mm256_max_ps(amax, _mm256_and_ps(v[t], magnitude));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float a = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const float d = a / 127.0f, inv = a > 0.0f ? 127.0f / a : 0.0f;
    __m256i q[4];
    for (int t = 0; t < 4; ++t) q[t] = _mm256_cvtps_epi32(_mm256_mul_ps(v[t], _mm256_set1_ps(inv)));  // ties to even
    r.d[i] = d;
    const int lo = isum(_mm256_add_epi32(q[0], q[1])), hi = isum(_mm256_add_epi32(q[2], q[3]));
    r.s[2 * i] = d * static_cast<float>(lo);
    r.s[2 * i + 1] = d * static_cast<float>(hi);
    r.sb[i] = d * static_cast<float>(lo + hi);
    r.sums[i] = lo + hi;
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.q.data() + 32 * i),
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  }
  return r;
}

// lanes 0-7 summed in one order: (i + (i + 4)), then (0 + 2) + (1 + 3)
inline float hsum8(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

// W's rows as GGUF rows of one type: the codes of row j's block b.
template <int64_t Type>
struct GgufCodes {
  static constexpr bool kMin = kHasMin<Type>, kHalf = kHalfScales<Type>, kPlus = kUnsigned<Type>;
  static constexpr int kSub = layout_weights(Type) / 32;
  static constexpr int kEvery = 1;  // blocks per prefetch
  const uint8_t* raw;
  int64_t row_bytes, unit_bytes;
  Codes at(int64_t j, int64_t b) const {
    return fused_codes<Type>(raw + j * row_bytes + b / kSub * unit_bytes, b % kSub);
  }
  const uint8_t* line(int64_t j, int64_t b) const { return raw + j * row_bytes + b * unit_bytes / kSub; }
};

// W's rows as block codes (eagle.runtime.block_codes): 4 bits, Q4_1's nibbles with (d, m); 8 bits, int8 codes
// with d; scales fp32 or (Half) fp16.
template <int Bits, bool Half>
struct BlockCodesRows {
  static constexpr bool kMin = Bits == 4, kHalf = false, kPlus = Bits == 4;
  static constexpr int kEvery = 64 / (32 * Bits / 8);  // blocks per prefetch: a cache line's
  const uint8_t* codes;
  const void* scales;
  int64_t row_bytes, row_scales;
  float scale(int64_t i) const {
    if constexpr (Half) return half_at(static_cast<const uint8_t*>(scales) + 2 * i);
    else return static_cast<const float*>(scales)[i];
  }
  Codes at(int64_t j, int64_t b) const {
    const uint8_t* p = line(j, b);
    const int64_t i = j * row_scales + b * kScales<Bits>;
    if constexpr (Bits == 4 && Half) {  // (d, m) converted together
      int32_t pair;
      std::memcpy(&pair, static_cast<const uint16_t*>(scales) + i, sizeof pair);
      const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(pair));
      const float d = _mm_cvtss_f32(dm), m = _mm_cvtss_f32(_mm_movehdup_ps(dm));
      return {nibbles16(p), d, d, m, m};
    } else {
      const float d = scale(i), m = Bits == 4 ? scale(i + 1) : 0.0f;
      return {Bits == 4 ? nibbles16(p) : load32(p), d, d, m, m};
    }
  }
  const uint8_t* line(int64_t j, int64_t b) const { return codes + j * row_bytes + b * 32 * Bits / 8; }
};

// Lane l: the sum of the products of bytes 4l..4l+3 of a (unsigned) and x (signed), exact in int32: one vpdpbusd
// with VNNI; else vpmaddubsw's pairs (they never saturate: |a| <= 128 and |x| <= 127 in every use) summed by
// vpmaddwd. The same integers either way, so the same bits.
inline __m256i dot_fours(__m256i a, __m256i x) {
#if defined(EAGLE_VNNI)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, x);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(a, x), _mm256_set1_epi16(1));
#endif
}

// out[i * ldo + j] for rows row0..row0+M-1 of x (quantized: xq) and rows j0..j1 of W (src), R rows of W at a
// time (as super_block's); once: as for prefetch.
template <class Src, int M, int R = 1>
void int8_block(const Src& src, const QuantizedRows& xq, int64_t K, int64_t row0, const float* bias, float* out,
                int64_t ldo, int64_t j0, int64_t j1, bool once) {
  const int64_t blocks = K / 32;
  int64_t j = j0;
  for (; j + R <= j1; j += R) {
    __m256 acc[R][M];
    float mins[R][M];
    for (int w = 0; w < R; ++w)
      for (int i = 0; i < M; ++i) {
        acc[w][i] = _mm256_setzero_ps();
        mins[w][i] = 0.0f;
      }
    for (int64_t b = 0; b < blocks; ++b) {
      Codes k[R];
      __m256i a[R];
      for (int w = 0; w < R; ++w) {
        if (b % Src::kEvery == 0) prefetch(src.line(j + w + kPrefetchRows, b), once);
        k[w] = src.at(j + w, b);
        a[w] = Src::kPlus ? k[w].c : _mm256_abs_epi8(k[w].c);
      }
      for (int i = 0; i < M; ++i) {
        const int64_t xb = (row0 + i) * blocks + b;
        const __m256i x0 = load32(reinterpret_cast<const uint8_t*>(xq.q.data()) + 32 * xb);
        const float dx = xq.d[xb];
        for (int w = 0; w < R; ++w) {
          const __m256i xv = Src::kPlus ? x0 : _mm256_sign_epi8(x0, k[w].c);
          const __m256 sums = _mm256_cvtepi32_ps(dot_fours(a[w], xv));
          const __m256 scale = Src::kHalf ? _mm256_set_m128(_mm_set1_ps(k[w].dh * dx), _mm_set1_ps(k[w].dl * dx))
                                          : _mm256_set1_ps(k[w].dl * dx);
          acc[w][i] = _mm256_fmadd_ps(sums, scale, acc[w][i]);
          if constexpr (Src::kMin && Src::kHalf)
            mins[w][i] = mins[w][i] + (k[w].ml * xq.s[2 * xb] + k[w].mh * xq.s[2 * xb + 1]);
          else if constexpr (Src::kMin) mins[w][i] = mins[w][i] + k[w].ml * xq.sb[xb];
        }
      }
    }
    for (int w = 0; w < R; ++w)
      for (int i = 0; i < M; ++i) out[i * ldo + j + w] = hsum8(acc[w][i]) + mins[w][i] + (bias ? bias[j + w] : 0.0f);
  }
  if constexpr (R > 1) {
    if (j < j1) int8_block<Src, M, 1>(src, xq, K, row0, bias, out, ldo, j, j1, once);
  }
}

// out [M, N] (rows ldo apart) = x W^T (+ bias) for any M >= 1, x given quantized, in int8_passes.
template <class Src>
void int8_rows(const Src& src, const QuantizedRows& xq, int64_t M, int64_t K, int64_t N, const float* bias,
               float* out, int64_t ldo, bool once) {
  int8_passes(M, N, [&](auto m, int64_t r, int64_t t, int64_t t1) {
    constexpr int rows = decltype(m)::value;
    int8_block<Src, rows, kPassWRows[rows]>(src, xq, K, r, bias, out + r * ldo, ldo, t, t1, once);
  });
}

// The int8 product of x [M, K] and block codes (stream_linear_q's arguments) into out [M, N].
void int8_linear_q(const float* x, int64_t M, int64_t K, const uint8_t* codes, const void* scales, bool half, int bits,
                   int64_t N, const float* bias, float* out, bool once) {
  const QuantizedRows xq = quantize_rows(x, M, K);
  const int64_t row_bytes = K * bits / 8, row_scales = K / 32 * (bits == 4 ? kScales<4> : kScales<8>);
  auto run = [&](const auto& src) { int8_rows(src, xq, M, K, N, bias, out, N, once); };
  if (bits == 4 && half) run(BlockCodesRows<4, true>{codes, scales, row_bytes, row_scales});
  else if (bits == 4) run(BlockCodesRows<4, false>{codes, scales, row_bytes, row_scales});
  else if (half) run(BlockCodesRows<8, true>{codes, scales, row_bytes, row_scales});
  else run(BlockCodesRows<8, false>{codes, scales, row_bytes, row_scales});
}

#if defined(EAGLE_ISA_AVX512)
// Q5_0 with int8 activations, two blocks a step in 512-bit registers: block b's codes in bytes 0-31 (in the order
// int8_block gives them its 8 lanes), block b + 1's in bytes 32-63, their fifth bits set from one 64-bit mask, the
// codes kept unsigned (c5 = (c5 - 16) + 16) with -16 times each lane's sum of x's codes as the integer sums' start
// (`offsets`: the same integers as int8_block's signed products); then each block's 8 lanes are scaled and summed
// into its row's sums in block order, as int8_block does: the same bits, with half the vector operations.
struct Q5Offsets {
  std::vector<int32_t> lanes;  // [M, K / 4]: -16 times the sum of x's codes 4l..4l+3
};

Q5Offsets q5_offsets(const QuantizedRows& xq, int64_t M, int64_t K) {
  Q5Offsets r{std::vector<int32_t>(M * K / 4)};
  for (int64_t l = 0; l < M * K / 4; ++l) {
    const int8_t* q = xq.q.data() + 4 * l;
    r.lanes[l] = -16 * (static_cast<int32_t>(q[0]) + q[1] + q[2] + q[3]);
  }
  return r;
}

template <int M, int R>
void q5_0_pairs(const uint8_t* raw, int64_t row_bytes, const QuantizedRows& xq, const Q5Offsets& xo, int64_t K,
                int64_t row0, const float* bias, float* out, int64_t ldo, int64_t j0, int64_t j1) {
  constexpr int64_t unit = 22;
  const int64_t blocks = K / 32;
  const GgufCodes<kQ5_0> src{raw, row_bytes, unit};
  const __m512i pick = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);  // [b lo, b hi, b+1 lo, b+1 hi] (16 bytes each)
  const __m256i low4 = _mm256_set1_epi8(15);
  const __m512i fifth = _mm512_set1_epi8(16);
  int64_t j = j0;
  for (; j + R <= j1; j += R) {
    __m256 acc[R][M];
    for (int w = 0; w < R; ++w)
      for (int i = 0; i < M; ++i) acc[w][i] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= blocks; b += 2) {
      __m512i c[R];
      float d0[R], d1[R];
      for (int w = 0; w < R; ++w) {
        prefetch(src.line(j + w + kPrefetchRows, b), true);  // non-temporal, as int8_block's
        prefetch(src.line(j + w + kPrefetchRows, b + 1), true);
        const uint8_t* p = src.line(j + w, b);
        const __m256i q = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 6))),
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + unit + 6)), 1);
        const __m512i nib = _mm512_permutex2var_epi64(
            _mm512_castsi256_si512(_mm256_and_si256(q, low4)), pick,
            _mm512_castsi256_si512(_mm256_and_si256(_mm256_srli_epi16(q, 4), low4)));
        uint32_t h0, h1;
        std::memcpy(&h0, p + 2, 4);
        std::memcpy(&h1, p + unit + 2, 4);
        c[w] = _mm512_mask_add_epi8(nib, static_cast<__mmask64>(h0 | (static_cast<uint64_t>(h1) << 32)), nib, fifth);
        d0[w] = half_at(p);
        d1[w] = half_at(p + unit);
      }
      for (int i = 0; i < M; ++i) {
        const int64_t xb = (row0 + i) * blocks + b;
        const __m512i xv = _mm512_loadu_si512(xq.q.data() + 32 * xb);
        const __m512i start = _mm512_loadu_si512(xo.lanes.data() + 8 * xb);
        const float dx0 = xq.d[xb], dx1 = xq.d[xb + 1];
        for (int w = 0; w < R; ++w) {
#if defined(EAGLE_VNNI)
          const __m512i sums = _mm512_dpbusd_epi32(start, c[w], xv);
#else
          const __m512i sums = _mm512_add_epi32(start, _mm512_madd_epi16(_mm512_maddubs_epi16(c[w], xv),
                                                                          _mm512_set1_epi16(1)));
#endif
          const __m512 f = _mm512_cvtepi32_ps(sums);
          acc[w][i] = _mm256_fmadd_ps(_mm512_castps512_ps256(f), _mm256_set1_ps(d0[w] * dx0), acc[w][i]);
          acc[w][i] = _mm256_fmadd_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f), 1)), _mm256_set1_ps(d1[w] * dx1), acc[w][i]);
        }
      }
    }
    for (; b < blocks; ++b) {  // an odd last block: int8_block's operations
      for (int w = 0; w < R; ++w) {
        const Codes k = src.at(j + w, b);
        const __m256i a = _mm256_abs_epi8(k.c);
        for (int i = 0; i < M; ++i) {
          const int64_t xb = (row0 + i) * blocks + b;
          const __m256i xv = _mm256_sign_epi8(load32(reinterpret_cast<const uint8_t*>(xq.q.data()) + 32 * xb), k.c);
          acc[w][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_fours(a, xv)), _mm256_set1_ps(k.dl * xq.d[xb]),
                                      acc[w][i]);
        }
      }
    }
    for (int w = 0; w < R; ++w)
      for (int i = 0; i < M; ++i) out[i * ldo + j + w] = hsum8(acc[w][i]) + 0.0f + (bias ? bias[j + w] : 0.0f);
  }
  if constexpr (R > 1) {
    if (j < j1) q5_0_pairs<M, 1>(raw, row_bytes, xq, xo, K, row0, bias, out, ldo, j, j1);
  }
}
#endif

template <int64_t Type>
void int8_gguf(const QuantizedRows& xq, int64_t M, int64_t K, const uint8_t* raw, int64_t row_bytes, int64_t N,
               const float* bias, float* out, int64_t ldo) {
#if defined(EAGLE_ISA_AVX512)
  if constexpr (Type == kQ5_0) {
    const Q5Offsets xo = q5_offsets(xq, M, K);
    int8_passes(M, N, [&](auto m, int64_t r, int64_t t, int64_t t1) {
      constexpr int rows = decltype(m)::value;
      q5_0_pairs<rows, kPassWRows[rows]>(raw, row_bytes, xq, xo, K, r, bias, out + r * ldo, ldo, t, t1);
    });
    return;
  }
#endif
  int8_rows(GgufCodes<Type>{raw, row_bytes, ggml_layout(Type).bytes}, xq, M, K, N, bias, out, ldo, true);
}
#else
constexpr bool kInt8 = false;
struct QuantizedRows {};
QuantizedRows quantize_rows(const float*, int64_t, int64_t) { return {}; }
void int8_linear_q(const float*, int64_t, int64_t, const uint8_t*, const void*, bool, int, int64_t, const float*,
                   float*, bool) {}
template <int64_t Type>
void int8_gguf(const QuantizedRows&, int64_t, int64_t, const uint8_t*, int64_t, int64_t, const float*, float*,
               int64_t) {}
#endif

void check_int8(bool int8, const char* who) {
  TORCH_CHECK(!int8 || kInt8, who, ": int8 activations need the AVX2 or AVX-512 kernels (these are ", kIsa, ")");
}

// ---- int8 activations for the K-quants: x quantized per super-block of 256 (ggml's Q8_K) ----------------------
// Q4_K, Q5_K and Q6_K rows meet x quantized per super-block of 256 (d = max |x| / 127, codes x / d rounded to the
// nearest, ties to even; every 16 codes' sum kept), as llama.cpp's dot products of these types do. Each super-block
// of a weight row is an unsigned code c (Q4_K 0..15, Q5_K 0..31, Q6_K 0..63) and an integer scale per 16 or 32
// weights, w = d (sc c) - dm mn: Q4_K and Q5_K dm = dmin and mn their 6-bit minimum; Q6_K (w = d sc (c - 32))
// dm = d and mn = 32 sc. So a row's super-block product is d dx sum(sc c q) - dm dx sum(mn q), two exact integer
// sums (the second from the 16-code sums) in 8 lanes (lane l: bytes 4l..4l+3 of every 32 codes; minimums 2l and
// 2l + 1), each lane scaled in fp32 by one multiply-add a part (Q6_K: one, the parts subtracted in integers as their
// scales are equal) into 8 fp32 lanes, summed at the end. A row's operations do not depend on the other rows in the
// call: the same bits alone or in a tree.
// The AVX2/AVX-512 builds sum the bytes with vpmaddubsw/vpmaddwd; the portable one with plain loops (the same
// integers; its fp32 roundings may differ, as its other products' do).
constexpr int64_t kSuper = 256;


// x [M, K] quantized per super-block: codes q [M, K]; d [M, K / 256]; sums [M, K / 16] of every 16 codes.
struct SuperRows {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int16_t> sums;
};

// Plain loops on every build (the same codes everywhere): max and the product x (127 / max) are exact operations
// of IEEE fp32, rounded to the nearest (ties to even) by nearbyint in the default rounding mode.
SuperRows quantize_super(const float* x, int64_t M, int64_t K) {
  const int64_t blocks = M * K / kSuper;
  SuperRows r{std::vector<int8_t>(M * K), std::vector<float>(blocks), std::vector<int16_t>(M * K / 16)};
  for (int64_t b = 0; b < blocks; ++b) {
    const float* p = x + kSuper * b;
    float amax = 0.0f;
    for (int64_t k = 0; k < kSuper; ++k) amax = std::max(amax, std::fabs(p[k]));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    r.d[b] = amax / 127.0f;
    int8_t* q = r.q.data() + kSuper * b;
    for (int64_t k = 0; k < kSuper; ++k) q[k] = static_cast<int8_t>(std::nearbyint(p[k] * inv));
    for (int64_t g = 0; g < kSuper / 16; ++g) {
      int sum = 0;
      for (int k = 0; k < 16; ++k) sum += q[16 * g + k];
      r.sums[b * (kSuper / 16) + g] = static_cast<int16_t>(sum);
    }
  }
  return r;
}

// A K-quant super-block's integer scales: sc[g] and mn[g] for each 16 weights g (0..15), d and dm.
struct SuperScales {
  int16_t sc[16], mn[16];
  float d, dm;
};

template <int64_t Type>
inline SuperScales super_scales(const uint8_t* p) {
  SuperScales s;
  if constexpr (Type == kQ6_K) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
    for (int g = 0; g < 16; ++g) {
      s.sc[g] = sc[g];
      s.mn[g] = static_cast<int16_t>(32 * sc[g]);
    }
    s.d = s.dm = half_at(p + 208);
  } else {
    for (int j = 0; j < 8; ++j) {
      int sc, mn;
      scale_min_k4(j, p + 4, sc, mn);
      s.sc[2 * j] = s.sc[2 * j + 1] = static_cast<int16_t>(sc);
      s.mn[2 * j] = s.mn[2 * j + 1] = static_cast<int16_t>(mn);
    }
    s.d = half_at(p);
    s.dm = half_at(p + 2);
  }
  return s;
}

// The unsigned code of weight 32 s + l (l 0..31) of the super-block at p.
template <int64_t Type>
inline int super_code(const uint8_t* p, int s, int l) {
  if constexpr (Type == kQ6_K) {
    const int n = s / 4, r = s % 4;
    return ((p[64 * n + 32 * (r % 2) + l] >> (4 * (r / 2))) & 15) | (((p[128 + 32 * n + l] >> (2 * r)) & 3) << 4);
  } else {
    const int low = (p[(Type == kQ4_K ? 16 : 48) + 32 * (s / 2) + l] >> (4 * (s % 2))) & 15;
    return Type == kQ5_K ? low | (((p[16 + l] >> s) & 1) << 4) : low;
  }
}

#if defined(EAGLE_ISA_AVX512) || defined(EAGLE_ISA_AVX2)
inline int32_t hsum_epi32(__m256i v) {
  __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1)));
}

// A super-block's integer scales as vectors: sc8[s], the scale of chunk s (Q4_K, Q5_K) or of its two halves
// (Q6_K: sc16 per 16 weights); mn, the minimums' multipliers per 16 weights (16 int16); d and dm.
struct SuperVectors {
  __m256i mn;
  alignas(16) uint8_t sc8[8];
  alignas(32) int16_t sc16[16];
  float d, dm;
};

template <int64_t Type>
inline SuperVectors super_vectors(const uint8_t* p) {
  SuperVectors v;
  if constexpr (Type == kQ6_K) {
    const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(v.sc16), sc);
    v.mn = _mm256_slli_epi16(sc, 5);  // 32 sc
    v.d = v.dm = half_at(p + 208);
  } else {  // the 12 bytes s of 6-bit scales and minimums unpacked to 8 + 8 bytes in one vector (ggml's
    // get_scale_min_k4): scale j < 4 is s[j] & 63, j >= 4 (s[j + 4] & 15) | (s[j - 4] >> 6) << 4; minimum j < 4
    // s[j + 4] & 63, j >= 4 (s[j + 4] >> 4) | (s[j] >> 6) << 4. The load's last 4 bytes are codes, unused.
    const __m128i s = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 4));
    const __m128i lo = _mm_shuffle_epi8(s, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
    const __m128i hi = _mm_shuffle_epi8(s, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
    const __m128i low_bits = _mm_or_si128(
        _mm_and_si128(lo, _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0)),
        _mm_and_si128(_mm_srli_epi16(lo, 4), _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15)));
    const __m128i both = _mm_or_si128(low_bits, _mm_and_si128(_mm_srli_epi16(hi, 2), _mm_set1_epi8(0x30)));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(v.sc8), both);
    v.mn = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(
        both, _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15)));
    v.d = half_at(p);
    v.dm = half_at(p + 2);
  }
  return v;
}

#if defined(EAGLE_ISA_AVX512)
// Chunks s and s + 1 (s even) of the super-block at p: the codes of chunk s in the low 256 bits, of s + 1 in the
// high ones (super_chunk's bytes, two at a time).
template <int64_t Type>
inline __m512i super_pair(const uint8_t* p, int s) {
  const __m512i low4 = _mm512_set1_epi8(15);
  if constexpr (Type == kQ6_K) {  // chunks r, r + 1 (r = s % 4: 0 or 2): the 64 bytes at p + 64 n, one shift
    const int n = s / 4, r = s % 4;
    const __m512i low = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512(p + 64 * n), 4 * (r / 2)), low4);
    const __m512i shifts = _mm512_inserti64x4(_mm512_set1_epi16(static_cast<int16_t>(2 * r)),
                                              _mm256_set1_epi16(static_cast<int16_t>(2 * r + 2)), 1);
    const __m512i high = _mm512_and_si512(_mm512_srlv_epi16(_mm512_broadcast_i64x4(load32(p + 128 + 32 * n)), shifts),
                                          _mm512_set1_epi8(3));
    return _mm512_or_si512(low, _mm512_slli_epi16(high, 4));
  } else {  // the low and the high nibbles of the same 32 bytes
    const __m256i q = load32(p + (Type == kQ4_K ? 16 : 48) + 32 * (s / 2));
    __m512i c = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(q), _mm256_srli_epi16(q, 4), 1), low4);
    if constexpr (Type == kQ5_K) {
      const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8(static_cast<char>(1 << s)),
                                             _mm256_set1_epi8(static_cast<char>(1 << (s + 1))), 1);
      const __mmask64 set = _mm512_test_epi8_mask(_mm512_broadcast_i64x4(load32(p + 16)), bit);
      c = _mm512_or_si512(c, _mm512_maskz_mov_epi8(set, _mm512_set1_epi8(16)));
    }
    return c;
  }
}

// wide[w][i] = the integer sums of super_block's chunk loop for the super-block at rp (row w of W: rp + w row_bytes)
// and x's codes xq8 + i K, two chunks a 512-bit operation: lanes l and l + 8 added give the 256-bit loop's lane l
// (the same integers, so the same bits).
template <int64_t Type, int M, int R>
inline void super_wide(const uint8_t* rp, int64_t row_bytes, const SuperVectors* sv, const uint8_t* xq8, int64_t K,
                       __m512i (*wide)[M]) {
  __m512i table[R];
  for (int w = 0; w < R; ++w) {
    table[w] = Type == kQ6_K ? _mm512_castsi256_si512(_mm256_load_si256(reinterpret_cast<const __m256i*>(sv[w].sc16)))
                             : _mm512_cvtepu8_epi16(_mm256_zextsi128_si256(_mm_loadl_epi64(
                                   reinterpret_cast<const __m128i*>(sv[w].sc8))));
    for (int i = 0; i < M; ++i) wide[w][i] = _mm512_setzero_si512();
  }
  for (int s = 0; s < 8; s += 2) {
    // 16-bit lane l of the pair's products meets the scale of its 16 (Q6_K) or 32 codes
    const __m512i pick = Type == kQ6_K
        ? _mm512_add_epi16(_mm512_set1_epi16(static_cast<int16_t>(2 * s)),
                           _mm512_srli_epi16(_mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18,
                                                              17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2,
                                                              1, 0), 3))
        : _mm512_inserti64x4(_mm512_set1_epi16(static_cast<int16_t>(s)), _mm256_set1_epi16(static_cast<int16_t>(s + 1)),
                             1);
    __m512i c[R], scale[R];
    for (int w = 0; w < R; ++w) {
      c[w] = super_pair<Type>(rp + w * row_bytes, s);
      scale[w] = _mm512_permutexvar_epi16(pick, table[w]);
    }
    for (int i = 0; i < M; ++i) {
      const __m512i xv = _mm512_loadu_si512(xq8 + i * K + 32 * s);
      for (int w = 0; w < R; ++w) {
#if defined(EAGLE_VNNI)
        wide[w][i] = _mm512_dpwssd_epi32(wide[w][i], _mm512_maddubs_epi16(c[w], xv), scale[w]);
#else
        wide[w][i] = _mm512_add_epi32(wide[w][i], _mm512_madd_epi16(_mm512_maddubs_epi16(c[w], xv), scale[w]));
#endif
      }
    }
  }
}

// out[i * ldo + j] for rows row0..row0+M-1 of x (quantized: xq) and W's rows j0..j1 (GGUF rows of Type), R rows
// of W at a time: they share each load of x and interleave their chains of dependent operations, while each row's
// sums stay its own. Two rows of x share each floating-point operation (row i in lanes 0-7, i + 1 in 8-15): the
// 256-bit loop's operations lane for lane, so the same bits (an odd last row fills both halves, the low one kept).
template <int64_t Type, int M, int R = 1>
void super_block(const uint8_t* raw, int64_t row_bytes, const SuperRows& xq, int64_t K, int64_t row0,
                 const float* bias, float* out, int64_t ldo, int64_t j0, int64_t j1) {
  constexpr int64_t unit = Type == kQ6_K ? 210 : (Type == kQ5_K ? 176 : 144);
  constexpr int P = (M + 1) / 2;  // pairs of rows of x
  const int64_t supers = K / kSuper;
  const uint8_t* xq8 = reinterpret_cast<const uint8_t*>(xq.q.data()) + row0 * K;
  int64_t j = j0;
  for (; j + R <= j1; j += R) {
    __m512 acc[R][P];
    for (int w = 0; w < R; ++w)
      for (int p = 0; p < P; ++p) acc[w][p] = _mm512_setzero_ps();
    const uint8_t* rp = raw + j * row_bytes;
    for (int64_t u = 0; u < supers; ++u, rp += unit) {
      SuperVectors sv[R];
      for (int w = 0; w < R; ++w) {
        const uint8_t* wp = rp + w * row_bytes;
        for (int64_t b = 0; b < unit; b += 64) prefetch(wp + kPrefetchRows * row_bytes + b, false);  // as below
        sv[w] = super_vectors<Type>(wp);
      }
      __m512i wide[R][M];
      super_wide<Type, M, R>(rp, row_bytes, sv, xq8 + u * kSuper, K, wide);
      for (int p = 0; p < P; ++p) {
        const int i = 2 * p;
        const bool two = i + 1 < M;
        const int64_t xb = (row0 + i) * supers + u, xb1 = two ? xb + supers : xb;
        const __m512 dx = _mm512_mask_broadcastss_ps(_mm512_set1_ps(xq.d[xb]), 0xff00, _mm_set_ss(xq.d[xb1]));
        const __m512i sums = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.sums.data() + 16 * xb))),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.sums.data() + 16 * xb1)), 1);
        for (int w = 0; w < R; ++w) {
          const __m512i other = two ? wide[w][i + 1] : wide[w][i];
          const __m512i isum = _mm512_add_epi32(_mm512_shuffle_i64x2(wide[w][i], other, 0x44),
                                                _mm512_shuffle_i64x2(wide[w][i], other, 0xee));
          const __m512i msum = _mm512_madd_epi16(_mm512_broadcast_i64x4(sv[w].mn), sums);  // as below
          const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(sv[w].d), dx);
          if constexpr (Type == kQ6_K) {
            acc[w][p] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(_mm512_sub_epi32(isum, msum)), acc[w][p]);
          } else {
            acc[w][p] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(isum), acc[w][p]);
            acc[w][p] = _mm512_fnmadd_ps(_mm512_mul_ps(_mm512_set1_ps(sv[w].dm), dx), _mm512_cvtepi32_ps(msum),
                                         acc[w][p]);
          }
        }
      }
    }
    for (int w = 0; w < R; ++w) {
      const float b = bias ? bias[j + w] : 0.0f;
      for (int i = 0; i < M; ++i) {
        const __m512i pair = _mm512_castps_si512(acc[w][i / 2]);
        out[i * ldo + j + w] = hsum8(_mm256_castsi256_ps(i % 2 ? _mm512_extracti64x4_epi64(pair, 1)
                                                               : _mm512_castsi512_si256(pair))) + b;
      }
    }
  }
  if constexpr (R > 1) {
    if (j < j1) super_block<Type, M, 1>(raw, row_bytes, xq, K, row0, bias, out, ldo, j, j1);
  }
}
#elif defined(EAGLE_ISA_AVX2)

// out[i * ldo + j] for rows row0..row0+M-1 of x (quantized: xq) and W's rows j0..j1 (GGUF rows of Type), R rows
// of W at a time: they share each load of x and interleave their chains of dependent operations (an R of 2 computes
// about 1.5 times the codes per cycle of an R of 1 on these CPUs), while each row's sums stay its own.
template <int64_t Type, int M, int R = 1>
void super_block(const uint8_t* raw, int64_t row_bytes, const SuperRows& xq, int64_t K, int64_t row0,
                 const float* bias, float* out, int64_t ldo, int64_t j0, int64_t j1) {
  constexpr int64_t unit = Type == kQ6_K ? 210 : (Type == kQ5_K ? 176 : 144);
  const int64_t supers = K / kSuper;
  const uint8_t* xq8 = reinterpret_cast<const uint8_t*>(xq.q.data()) + row0 * K;
  int64_t j = j0;
  for (; j + R <= j1; j += R) {
    __m256 acc[R][M];
    for (int w = 0; w < R; ++w)
      for (int i = 0; i < M; ++i) acc[w][i] = _mm256_setzero_ps();
    const uint8_t* rp = raw + j * row_bytes;
    for (int64_t u = 0; u < supers; ++u, rp += unit) {
      SuperVectors sv[R];
      __m256i isum[R][M];
      for (int w = 0; w < R; ++w) {
        const uint8_t* wp = rp + w * row_bytes;
        // into all cache levels (T0), not non-temporally: streamed super-blocks ran 1.6x faster so (1.5B Q4_K_M
        // body and head, 2 threads, Xeon AVX-512; docs/performance.md)
        for (int64_t b = 0; b < unit; b += 64) prefetch(wp + kPrefetchRows * row_bytes + b, false);
        sv[w] = super_vectors<Type>(wp);
        for (int i = 0; i < M; ++i) isum[w][i] = _mm256_setzero_si256();
      }
      for (int s = 0; s < 8; ++s) {
        __m256i c[R], scale[R];
        for (int w = 0; w < R; ++w) {
          c[w] = super_chunk<Type>(rp + w * row_bytes, s);
          scale[w] = Type == kQ6_K
              ? _mm256_set_m128i(_mm_set1_epi16(sv[w].sc16[2 * s + 1]), _mm_set1_epi16(sv[w].sc16[2 * s]))
              : _mm256_set1_epi16(sv[w].sc8[s]);
        }
        for (int i = 0; i < M; ++i) {
          const __m256i xv = load32(xq8 + i * K + u * kSuper + 32 * s);
          for (int w = 0; w < R; ++w)
            isum[w][i] = _mm256_add_epi32(isum[w][i], _mm256_madd_epi16(_mm256_maddubs_epi16(c[w], xv), scale[w]));
        }
      }
      for (int i = 0; i < M; ++i) {
        const int64_t xb = (row0 + i) * supers + u;
        const float dx = xq.d[xb];
        const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.sums.data() + 16 * xb));
        for (int w = 0; w < R; ++w) {
          const __m256i msum = _mm256_madd_epi16(sv[w].mn, sums);  // lane l: minimums 2l and 2l + 1
          if constexpr (Type == kQ6_K) {  // the same scale d: subtracted in integers
            acc[w][i] = _mm256_fmadd_ps(_mm256_set1_ps(sv[w].d * dx),
                                        _mm256_cvtepi32_ps(_mm256_sub_epi32(isum[w][i], msum)), acc[w][i]);
          } else {
            acc[w][i] = _mm256_fmadd_ps(_mm256_set1_ps(sv[w].d * dx), _mm256_cvtepi32_ps(isum[w][i]), acc[w][i]);
            acc[w][i] = _mm256_fnmadd_ps(_mm256_set1_ps(sv[w].dm * dx), _mm256_cvtepi32_ps(msum), acc[w][i]);
          }
        }
      }
    }
    for (int w = 0; w < R; ++w)
      for (int i = 0; i < M; ++i) out[i * ldo + j + w] = hsum8(acc[w][i]) + (bias ? bias[j + w] : 0.0f);
  }
  if constexpr (R > 1) {
    if (j < j1) super_block<Type, M, 1>(raw, row_bytes, xq, K, row0, bias, out, ldo, j, j1);
  }
}
#endif
#else
// Portable: the same integers by plain loops, in the vector builds' lanes (multiply and add rounded apart).
template <int64_t Type, int M, int R = 1>
void super_block(const uint8_t* raw, int64_t row_bytes, const SuperRows& xq, int64_t K, int64_t row0,
                 const float* bias, float* out, int64_t ldo, int64_t j0, int64_t j1) {
  constexpr int64_t unit = Type == kQ6_K ? 210 : (Type == kQ5_K ? 176 : 144);
  const int64_t supers = K / kSuper;
  for (int64_t j = j0; j < j1; ++j) {
    for (int i = 0; i < M; ++i) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      const uint8_t* rp = raw + j * row_bytes;
      for (int64_t u = 0; u < supers; ++u, rp += unit) {
        const SuperScales sc = super_scales<Type>(rp);
        const int64_t xb = (row0 + i) * supers + u;
        const int8_t* q = xq.q.data() + (row0 + i) * K + u * kSuper;
        const int16_t* sums = xq.sums.data() + 16 * xb;
        int32_t lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0}, mins[8];
        for (int s = 0; s < 8; ++s)
          for (int l = 0; l < 32; ++l) lanes[l / 4] += sc.sc[2 * s + l / 16] * super_code<Type>(rp, s, l) * q[32 * s + l];
        for (int l = 0; l < 8; ++l) mins[l] = sc.mn[2 * l] * sums[2 * l] + sc.mn[2 * l + 1] * sums[2 * l + 1];
        const float dx = xq.d[xb], scale = sc.d * dx, mscale = sc.dm * dx;
        for (int l = 0; l < 8; ++l) {
          if constexpr (Type == kQ6_K) {
            acc[l] = acc[l] + scale * static_cast<float>(lanes[l] - mins[l]);
          } else {
            acc[l] = acc[l] + scale * static_cast<float>(lanes[l]);
            acc[l] = acc[l] - mscale * static_cast<float>(mins[l]);
          }
        }
      }
      // hsum8's order: (l + (l + 4)), then (0 + 2) + (1 + 3)
      float h[4];
      for (int l = 0; l < 4; ++l) h[l] = acc[l] + acc[l + 4];
      out[i * ldo + j] = ((h[0] + h[2]) + (h[1] + h[3])) + (bias ? bias[j] : 0.0f);
    }
  }
}
#endif

// Rows of W a super-block pass takes for m rows of x: the 512-bit build's pair epilogue leaves registers for 2 rows
// of W up to 8 rows of x (1.5B Q4_K_M layers, 2-core Zen 5: 5-8 rows 0.85-0.90x the time of 1 row of W;
// docs/performance.md).
#if defined(EAGLE_ISA_AVX512)
constexpr int kSuperWRows[kPassXRows + 1] = {0, 8, 4, 2, 2, 2, 2, 2, 2};
#else
constexpr auto& kSuperWRows = kPassWRows;  // no pair epilogue: the block products' table
#endif

// out [M, N] (rows ldo apart) = x W^T (+ bias), W GGUF rows of K-quant Type, x quantized per super-block, in
// int8_passes.
template <int64_t Type>
void super_rows(const SuperRows& xq, int64_t M, int64_t K, const uint8_t* raw, int64_t row_bytes, int64_t N,
                const float* bias, float* out, int64_t ldo) {
  int8_passes(M, N, [&](auto m, int64_t r, int64_t t, int64_t t1) {
    constexpr int rows = decltype(m)::value;
    super_block<Type, rows, kSuperWRows[rows]>(raw, row_bytes, xq, K, r, bias, out + r * ldo, ldo, t, t1);
  });
}


// ---- Q4_K interleaved 8 rows at a time (int8 activations) ------------------------------------------------------
// gguf_interleave rewrites a Q4_K matrix in place, 8 rows (a group) at a time, as llama.cpp repacks Q4_K for its
// AVX2 products: super-block u of a group (its 8 rows' 144 bytes, 1152) becomes d[8] and dmin[8] (fp16), the 6-bit
// scale and minimum of each chunk c of 32 weights and row r as low nibbles (byte 32 + 8 c + r: scale & 15 | (min &
// 15) << 4) and high bits (byte 96 + k, k < 32: H[k] | H[k + 32] << 4 with H[8 c + r] = scale >> 4 | (min >> 4) << 2),
// then the codes: for chunk pair p (0..3) and quad q (0..7) the bytes qs[32 p + 4 q .. + 3] of rows 0..7 side by side
// (32 bytes at 128 + 256 p + 32 q; low nibbles chunk 2 p, high nibbles 2 p + 1). One load then holds 4 codes of each
// of 8 rows, which meet the same 4 codes of x: every sum lands in the lane of its row (no horizontal sums), and a
// super-block's scales are unpacked once for 8 rows. The integers are those of super_block's (a row's chunk sums
// times its scales, its minimums times x's chunk sums); per super-block the fp32 steps are acc = fma(d dx, isum,
// acc), acc = fma(-(dmin dx), msum, acc), on every build (the portable one by plain loops): the same bits.
constexpr int64_t kGroupBytes = 8 * 144;  // a group's super-block

void interleave_q4k_group(const uint8_t* src, int64_t row_bytes, int64_t supers, uint8_t* dst) {
  for (int64_t u = 0; u < supers; ++u) {
    uint8_t* o = dst + u * kGroupBytes;
    uint8_t high[64];
    for (int r = 0; r < 8; ++r) {
      const uint8_t* p = src + r * row_bytes + u * 144;
      std::memcpy(o + 2 * r, p, 2);
      std::memcpy(o + 16 + 2 * r, p + 2, 2);
      for (int c = 0; c < 8; ++c) {
        int sc, mn;
        scale_min_k4(c, p + 4, sc, mn);
        o[32 + 8 * c + r] = static_cast<uint8_t>((sc & 15) | ((mn & 15) << 4));
        high[8 * c + r] = static_cast<uint8_t>((sc >> 4) | ((mn >> 4) << 2));
      }
      for (int pair = 0; pair < 4; ++pair)
        for (int q = 0; q < 8; ++q) std::memcpy(o + 128 + 256 * pair + 32 * q + 4 * r, p + 16 + 32 * pair + 4 * q, 4);
    }
    for (int k = 0; k < 32; ++k) o[96 + k] = static_cast<uint8_t>(high[k] | (high[k + 32] << 4));
  }
}

// chunk c's scale and minimum of row r in an interleaved super-block o
inline void interleaved_scale(const uint8_t* o, int c, int r, int& sc, int& mn) {
  const int k = 8 * c + r, lo = o[32 + k], hi = k < 32 ? o[96 + k] & 15 : o[96 + k - 32] >> 4;
  sc = (lo & 15) | ((hi & 3) << 4);
  mn = (lo >> 4) | ((hi >> 2) << 4);
}

void deinterleave_q4k_group(const uint8_t* src, int64_t supers, int64_t row_bytes, uint8_t* dst) {
  for (int64_t u = 0; u < supers; ++u) {
    const uint8_t* o = src + u * kGroupBytes;
    for (int r = 0; r < 8; ++r) {
      uint8_t* p = dst + r * row_bytes + u * 144;
      std::memcpy(p, o + 2 * r, 2);
      std::memcpy(p + 2, o + 16 + 2 * r, 2);
      int sc[8], mn[8];
      for (int c = 0; c < 8; ++c) interleaved_scale(o, c, r, sc[c], mn[c]);
      uint8_t* q = p + 4;  // the inverse of scale_min_k4
      for (int j = 0; j < 4; ++j) {
        q[j] = static_cast<uint8_t>(sc[j] | ((sc[j + 4] >> 4) << 6));
        q[j + 4] = static_cast<uint8_t>(mn[j] | ((mn[j + 4] >> 4) << 6));
        q[j + 8] = static_cast<uint8_t>((sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4));
      }
      for (int pair = 0; pair < 4; ++pair)
        for (int qd = 0; qd < 8; ++qd) std::memcpy(p + 16 + 32 * pair + 4 * qd, o + 128 + 256 * pair + 32 * qd + 4 * r, 4);
    }
  }
}

#if defined(EAGLE_ISA_AVX512) || defined(EAGLE_ISA_AVX2)
// An interleaved super-block's scales for its 8 rows: sc[c] int16, row r's scale of chunk c in lanes 2r and 2r + 1;
// mn[h] int16, row r's minimums of chunks 2h and 2h + 1 in lanes 2r, 2r + 1; d and dmin of each row.
struct GroupScales {
  __m256i sc[8], mn[4];
  __m256 d, dm;
};

inline void group_scales(const uint8_t* o, GroupScales& s) {
  const __m256i low4 = _mm256_set1_epi8(15), lo03 = load32(o + 32), lo47 = load32(o + 64), hi = load32(o + 96);
  const __m256i sc03 = _mm256_or_si256(_mm256_and_si256(lo03, low4),
                                       _mm256_slli_epi16(_mm256_and_si256(hi, _mm256_set1_epi8(3)), 4));
  const __m256i mn03 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo03, 4), low4),
                                       _mm256_slli_epi16(_mm256_and_si256(hi, _mm256_set1_epi8(12)), 2));
  const __m256i sc47 = _mm256_or_si256(_mm256_and_si256(lo47, low4), _mm256_and_si256(hi, _mm256_set1_epi8(0x30)));
  const __m256i mn47 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo47, 4), low4),
                                       _mm256_srli_epi16(_mm256_and_si256(hi, _mm256_set1_epi8(-64)), 2));
  const __m256i scs[2] = {sc03, sc47}, mns[2] = {mn03, mn47};
  for (int h = 0; h < 2; ++h) {  // bytes 8 c + r of chunks 4 h .. 4 h + 3; a 128-bit lane holds two chunks
    const __m256i even = _mm256_unpacklo_epi8(scs[h], scs[h]), odd = _mm256_unpackhi_epi8(scs[h], scs[h]);
    s.sc[4 * h] = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(even));
    s.sc[4 * h + 1] = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(odd));
    s.sc[4 * h + 2] = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(even, 1));
    s.sc[4 * h + 3] = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(odd, 1));
    const __m256i pairs = _mm256_unpacklo_epi8(mns[h], _mm256_bsrli_epi128(mns[h], 8));
    s.mn[2 * h] = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(pairs));
    s.mn[2 * h + 1] = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(pairs, 1));
  }
  s.d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o)));
  s.dm = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o + 16)));
}

inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// out[i * ldo + 8 g + r] for rows row0..row0+M-1 of x (quantized: xq) and groups g0..g1 of interleaved rows
template <int M>
void group_block(const uint8_t* raw, int64_t supers, const SuperRows& xq, int64_t K, int64_t row0, const float* bias,
                 float* out, int64_t ldo, int64_t g0, int64_t g1) {
  const __m256i low4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  const int8_t* x0 = xq.q.data() + row0 * K;
  for (int64_t g = g0; g < g1; ++g) {
    __m256 acc[M];
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) acc[i] = _mm256_setzero_ps();
    const uint8_t* gp = raw + g * supers * kGroupBytes;
    for (int64_t u = 0; u < supers; ++u) {
      const uint8_t* o = gp + u * kGroupBytes;
      GroupScales s;
      group_scales(o, s);
      __m256i isum[M];
#pragma GCC unroll 8
      for (int i = 0; i < M; ++i) isum[i] = _mm256_setzero_si256();
      // chunk c = 2 p + h, h a constant (the low or the high nibbles)
      const auto chunk = [&](int p, auto constant) {
        constexpr int h = decltype(constant)::value;
        const int c = 2 * p + h;
        const uint8_t* codes = o + 128 + 256 * p;
        __m256i w[8];
#pragma GCC unroll 8
        for (int q = 0; q < 8; ++q) {
          const __m256i b = load32(codes + 32 * q);
          if constexpr (h) w[q] = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
          else w[q] = _mm256_and_si256(b, low4);
        }
#pragma GCC unroll 8
        for (int i = 0; i < M; ++i) {
          const int8_t* xc = x0 + i * K + u * kSuper + 32 * c;
          __m256i a = _mm256_maddubs_epi16(w[0], broadcast4(xc));  // codes 0..15, x -127..127: no saturation
#pragma GCC unroll 8
          for (int q = 1; q < 8; ++q) a = _mm256_add_epi16(a, _mm256_maddubs_epi16(w[q], broadcast4(xc + 4 * q)));
          isum[i] = _mm256_add_epi32(isum[i], _mm256_madd_epi16(a, s.sc[c]));  // 16 products <= 30480 a lane
        }
      };
      for (int p = 0; p < 4; ++p) {
        chunk(p, std::integral_constant<int, 0>());
        chunk(p, std::integral_constant<int, 1>());
      }
#pragma GCC unroll 8
      for (int i = 0; i < M; ++i) {
        const int64_t xb = (row0 + i) * supers + u;
        // x's chunk sums [c0..c7] as int16 pairs (c0 c1 | c2 c3 in 32-bit lanes 0, 1; c4 c5 | c6 c7 in 4, 5)
        const __m256i cs = _mm256_madd_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.sums.data() + 16 * xb)), ones);
        const __m256i pk = _mm256_packs_epi32(cs, cs);
        __m256i msum = _mm256_madd_epi16(s.mn[0], _mm256_permutevar8x32_epi32(pk, _mm256_set1_epi32(0)));
        msum = _mm256_add_epi32(msum, _mm256_madd_epi16(s.mn[1], _mm256_permutevar8x32_epi32(pk, _mm256_set1_epi32(1))));
        msum = _mm256_add_epi32(msum, _mm256_madd_epi16(s.mn[2], _mm256_permutevar8x32_epi32(pk, _mm256_set1_epi32(4))));
        msum = _mm256_add_epi32(msum, _mm256_madd_epi16(s.mn[3], _mm256_permutevar8x32_epi32(pk, _mm256_set1_epi32(5))));
        const __m256 dx = _mm256_set1_ps(xq.d[xb]);
        acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(s.d, dx), _mm256_cvtepi32_ps(isum[i]), acc[i]);
        acc[i] = _mm256_fnmadd_ps(_mm256_mul_ps(s.dm, dx), _mm256_cvtepi32_ps(msum), acc[i]);
      }
    }
    const __m256 b = bias ? _mm256_loadu_ps(bias + 8 * g) : _mm256_setzero_ps();
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) _mm256_storeu_ps(out + i * ldo + 8 * g, _mm256_add_ps(acc[i], b));
  }
}
#else
template <int M>
void group_block(const uint8_t* raw, int64_t supers, const SuperRows& xq, int64_t K, int64_t row0, const float* bias,
                 float* out, int64_t ldo, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) {
    for (int i = 0; i < M; ++i) {
      const int8_t* x = xq.q.data() + (row0 + i) * K;
      for (int r = 0; r < 8; ++r) {
        float acc = 0.0f;
        for (int64_t u = 0; u < supers; ++u) {
          const uint8_t* o = raw + (g * supers + u) * kGroupBytes;
          const int64_t xb = (row0 + i) * supers + u;
          int32_t isum = 0, msum = 0;
          for (int c = 0; c < 8; ++c) {
            int sc, mn, sum = 0;
            interleaved_scale(o, c, r, sc, mn);
            for (int l = 0; l < 32; ++l)
              sum += ((o[128 + 256 * (c / 2) + 32 * (l / 4) + 4 * r + l % 4] >> (4 * (c % 2))) & 15) *
                     x[u * kSuper + 32 * c + l];
            isum += sc * sum;
            msum += mn * (xq.sums[16 * xb + 2 * c] + xq.sums[16 * xb + 2 * c + 1]);
          }
          const float dx = xq.d[xb];
          acc = std::fma(half_at(o + 2 * r) * dx, static_cast<float>(isum), acc);
          acc = std::fma(-(half_at(o + 16 + 2 * r) * dx), static_cast<float>(msum), acc);
        }
        out[i * ldo + 8 * g + r] = acc + (bias ? bias[8 * g + r] : 0.0f);
      }
    }
  }
}
#endif


// ---- Q6_K interleaved 8 rows at a time (int8 activations) ------------------------------------------------------
// gguf_interleave rewrites a Q6_K matrix alike, each block of 4 groups (32 rows, 6720 bytes a super-block column) as
// four planes so that every 32-byte load of codes is aligned (a super-block of 8 rows is 1680 bytes, which would leave
// half of them across cache lines: 2.7x the time a product on a Zen 4): for super-block u of the block's group j
// (index i = j supers + u of n = its groups x supers), from the block's start the low code bits at 1024 i: for half h (0, 1), part p (0: ql[64 h + l], 1: ql[64 h + 32 + l]) and quad q (0..7) the bytes
// ql[64 h + 32 p + 4 q .. + 3] of rows 0..7 side by side (at 512 h + 256 p + 32 q); the high bits at 1024 n + 512 i:
// qh[32 h + 4 q .. + 3] of rows 0..7 (at 256 h + 32 q); the int8 scale of each 16 weights b and row r at 1536 n +
// 128 i + 8 b + r; d of row r (fp16) at 1664 n + 16 i + 2 r. Chunk 4 h + k of 32 weights takes the low (k < 2) or
// high (k >= 2) nibbles of part k % 2 and bits 2 k, 2 k + 1 of qh. A row's integers are super_block's: sum(sc c x)
// and 32 sum(sc xsum16), subtracted, then acc = fma(d dx, isum - msum, acc) per super-block.
struct Q6Planes {
  const uint8_t *ql, *qh, *sc, *d;
};

constexpr int64_t kPlaneGroups = 4;  // groups a block of Q6_K planes holds

// super-block u of group g of a Q6_K matrix interleaved at base (groups in all, supers a row)
inline Q6Planes q6_planes(const uint8_t* base, int64_t groups, int64_t supers, int64_t g, int64_t u) {
  const int64_t first = g / kPlaneGroups * kPlaneGroups, n = std::min(kPlaneGroups, groups - first) * supers;
  const int64_t i = (g - first) * supers + u;
  const uint8_t* block = base + first * 8 * 210 * supers;
  return {block + 1024 * i, block + 1024 * n + 512 * i, block + 1536 * n + 128 * i, block + 1664 * n + 16 * i};
}

// rows src (8 rows, row_bytes apart) as group g of the planes at base (groups x supers super-blocks in all)
void interleave_q6k_group(const uint8_t* src, int64_t row_bytes, int64_t supers, uint8_t* base, int64_t groups,
                          int64_t g) {
  for (int64_t u = 0; u < supers; ++u) {
    const Q6Planes o = q6_planes(base, groups, supers, g, u);
    for (int r = 0; r < 8; ++r) {
      const uint8_t* p = src + r * row_bytes + u * 210;
      std::memcpy(const_cast<uint8_t*>(o.d) + 2 * r, p + 208, 2);
      for (int b = 0; b < 16; ++b) const_cast<uint8_t*>(o.sc)[8 * b + r] = p[192 + b];
      for (int h = 0; h < 2; ++h)
        for (int q = 0; q < 8; ++q) {
          for (int part = 0; part < 2; ++part)
            std::memcpy(const_cast<uint8_t*>(o.ql) + 512 * h + 256 * part + 32 * q + 4 * r, p + 64 * h + 32 * part + 4 * q, 4);
          std::memcpy(const_cast<uint8_t*>(o.qh) + 256 * h + 32 * q + 4 * r, p + 128 + 32 * h + 4 * q, 4);
        }
    }
  }
}

void deinterleave_q6k_group(const uint8_t* base, int64_t groups, int64_t g, int64_t supers, int64_t row_bytes,
                            uint8_t* dst) {
  for (int64_t u = 0; u < supers; ++u) {
    const Q6Planes o = q6_planes(base, groups, supers, g, u);
    for (int r = 0; r < 8; ++r) {
      uint8_t* p = dst + r * row_bytes + u * 210;
      std::memcpy(p + 208, o.d + 2 * r, 2);
      for (int b = 0; b < 16; ++b) p[192 + b] = o.sc[8 * b + r];
      for (int h = 0; h < 2; ++h)
        for (int q = 0; q < 8; ++q) {
          for (int part = 0; part < 2; ++part)
            std::memcpy(p + 64 * h + 32 * part + 4 * q, o.ql + 512 * h + 256 * part + 32 * q + 4 * r, 4);
          std::memcpy(p + 128 + 32 * h + 4 * q, o.qh + 256 * h + 32 * q + 4 * r, 4);
        }
    }
  }
}

#if defined(EAGLE_ISA_AVX512) || defined(EAGLE_ISA_AVX2)
// out[i * ldo + 8 g + r] for rows row0..row0+M-1 of x (quantized: xq) and groups g0..g1 of interleaved Q6_K rows
template <int M>
void group6_block(const uint8_t* raw, int64_t supers, int64_t groups, const SuperRows& xq, int64_t K, int64_t row0,
                  const float* bias, float* out, int64_t ldo, int64_t g0, int64_t g1) {
  const __m256i low4 = _mm256_set1_epi8(15), high2 = _mm256_set1_epi8(48);
  const int8_t* x0 = xq.q.data() + row0 * K;
  for (int64_t g = g0; g < g1; ++g) {
    __m256 acc[M];
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t u = 0; u < supers; ++u) {
      const Q6Planes o = q6_planes(raw, groups, supers, g, u);
      __m256i isum[M], msum[M];
#pragma GCC unroll 8
      for (int i = 0; i < M; ++i) isum[i] = msum[i] = _mm256_setzero_si256();
      // chunk c = 4 n + k, k a constant (what a quad's code takes from its bytes)
      const auto chunk = [&](int n, auto constant) {
        constexpr int k = decltype(constant)::value;
        const int c = 4 * n + k;
        // the scales of sub-blocks 2c and 2c + 1: bytes 0-7 and 8-15 of one 128-bit lane
        const __m256i bytes = load32(o.sc + 32 * (c / 2));
        __m128i lane;
        if constexpr (k % 2) lane = _mm256_extracti128_si256(bytes, 1);
        else lane = _mm256_castsi256_si128(bytes);
        const __m256i sc0 = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(lane, lane));
        const __m256i sc1 = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(lane, lane));
        const __m256i pairs = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(lane, _mm_srli_si128(lane, 8)));
        __m256i w[8];
#pragma GCC unroll 8
        for (int q = 0; q < 8; ++q) {
          const __m256i lo = load32(o.ql + 512 * n + 256 * (k % 2) + 32 * q), hi = load32(o.qh + 256 * n + 32 * q);
          __m256i low = lo, top = hi;
          if constexpr (k >= 2) low = _mm256_srli_epi16(lo, 4);
          if constexpr (k == 0) top = _mm256_slli_epi16(hi, 4);
          if constexpr (k == 1) top = _mm256_slli_epi16(hi, 2);
          if constexpr (k == 3) top = _mm256_srli_epi16(hi, 2);
          w[q] = _mm256_or_si256(_mm256_and_si256(low, low4), _mm256_and_si256(top, high2));
        }
#pragma GCC unroll 8
        for (int i = 0; i < M; ++i) {
          const int8_t* xc = x0 + i * K + u * kSuper + 32 * c;
          // two products a 16-bit sum: codes 0..63, x -127..127, at most 32004
          const __m256i a0 = _mm256_add_epi16(_mm256_maddubs_epi16(w[0], broadcast4(xc)), _mm256_maddubs_epi16(w[1], broadcast4(xc + 4)));
          const __m256i a1 = _mm256_add_epi16(_mm256_maddubs_epi16(w[2], broadcast4(xc + 8)), _mm256_maddubs_epi16(w[3], broadcast4(xc + 12)));
          const __m256i a2 = _mm256_add_epi16(_mm256_maddubs_epi16(w[4], broadcast4(xc + 16)), _mm256_maddubs_epi16(w[5], broadcast4(xc + 20)));
          const __m256i a3 = _mm256_add_epi16(_mm256_maddubs_epi16(w[6], broadcast4(xc + 24)), _mm256_maddubs_epi16(w[7], broadcast4(xc + 28)));
          const __m256i s0 = _mm256_add_epi32(_mm256_madd_epi16(a0, sc0), _mm256_madd_epi16(a1, sc0));
          const __m256i s1 = _mm256_add_epi32(_mm256_madd_epi16(a2, sc1), _mm256_madd_epi16(a3, sc1));
          isum[i] = _mm256_add_epi32(isum[i], _mm256_add_epi32(s0, s1));
          const int64_t xb = (row0 + i) * supers + u;
          int32_t sums;  // x's sums of sub-blocks 2c and 2c + 1
          std::memcpy(&sums, xq.sums.data() + 16 * xb + 2 * c, 4);
          msum[i] = _mm256_add_epi32(msum[i], _mm256_madd_epi16(pairs, _mm256_set1_epi32(sums)));
        }
      };
      for (int n = 0; n < 2; ++n) {
        chunk(n, std::integral_constant<int, 0>());
        chunk(n, std::integral_constant<int, 1>());
        chunk(n, std::integral_constant<int, 2>());
        chunk(n, std::integral_constant<int, 3>());
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o.d)));
#pragma GCC unroll 8
      for (int i = 0; i < M; ++i) {
        const __m256 dx = _mm256_set1_ps(xq.d[(row0 + i) * supers + u]);
        acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(d, dx),
                                 _mm256_cvtepi32_ps(_mm256_sub_epi32(isum[i], _mm256_slli_epi32(msum[i], 5))), acc[i]);
      }
    }
    const __m256 b = bias ? _mm256_loadu_ps(bias + 8 * g) : _mm256_setzero_ps();
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) _mm256_storeu_ps(out + i * ldo + 8 * g, _mm256_add_ps(acc[i], b));
  }
}
#else
template <int M>
void group6_block(const uint8_t* raw, int64_t supers, int64_t groups, const SuperRows& xq, int64_t K, int64_t row0,
                  const float* bias, float* out, int64_t ldo, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) {
    for (int i = 0; i < M; ++i) {
      const int8_t* x = xq.q.data() + (row0 + i) * K;
      for (int r = 0; r < 8; ++r) {
        float acc = 0.0f;
        for (int64_t u = 0; u < supers; ++u) {
          const Q6Planes o = q6_planes(raw, groups, supers, g, u);
          const int64_t xb = (row0 + i) * supers + u;
          int32_t isum = 0, msum = 0;
          for (int c = 0; c < 8; ++c) {
            const int n = c / 4, k = c % 4;
            for (int half = 0; half < 2; ++half) {
              const int sc = static_cast<int8_t>(o.sc[8 * (2 * c + half) + r]);
              int sum = 0;
              for (int l = 16 * half; l < 16 * half + 16; ++l) {
                const int lo = (o.ql[512 * n + 256 * (k % 2) + 32 * (l / 4) + 4 * r + l % 4] >> (k < 2 ? 0 : 4)) & 15;
                const int hi = (o.qh[256 * n + 32 * (l / 4) + 4 * r + l % 4] >> (2 * k)) & 3;
                sum += (lo | (hi << 4)) * x[u * kSuper + 32 * c + l];
              }
              isum += sc * sum;
              msum += sc * xq.sums[16 * xb + 2 * c + half];
            }
          }
          acc = std::fma(half_at(o.d + 2 * r) * xq.d[xb], static_cast<float>(isum - 32 * msum), acc);
        }
        out[i * ldo + 8 * g + r] = acc + (bias ? bias[8 * g + r] : 0.0f);
      }
    }
  }
}
#endif

constexpr int kGroupRows = 4;    // rows of x a pass over a group takes
constexpr int64_t kGroupTile = 2;  // groups every pass meets before the next ones (the L1 cache holds them)

// out [M, N] (rows ldo apart) = x W^T (+ bias), W interleaved rows of Type (kQ4_Kx8 or kQ6_Kx8; N a multiple of
// 8), x quantized per super-block
template <int64_t Type>
void group_rows(const SuperRows& xq, int64_t M, int64_t K, const uint8_t* raw, int64_t N, const float* bias,
                float* out, int64_t ldo) {
  const int64_t supers = K / kSuper;
  at::parallel_for(0, N / 8, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t t = g0; t < g1; t += kGroupTile) {
      const int64_t t1 = std::min(g1, t + kGroupTile);
      for (int64_t r = 0; r < M; r += kGroupRows) {
        const auto pass = [&](auto m) {
          constexpr int rows = decltype(m)::value;
          if constexpr (Type == kQ4_Kx8) group_block<rows>(raw, supers, xq, K, r, bias, out + r * ldo, ldo, t, t1);
          else group6_block<rows>(raw, supers, N / 8, xq, K, r, bias, out + r * ldo, ldo, t, t1);
        };
        switch (std::min<int64_t>(kGroupRows, M - r)) {
          case 1: pass(std::integral_constant<int, 1>()); break;
          case 2: pass(std::integral_constant<int, 2>()); break;
          case 3: pass(std::integral_constant<int, 3>()); break;
          default: pass(std::integral_constant<int, 4>()); break;
        }
      }
    }
  });
}


// ---- Q5_0 interleaved 8 rows at a time (int8 activations, x per block of 32) ----------------------------------
// gguf_interleave rewrites a Q5_0 matrix as planes per block of 4 groups (as Q6_K; 176 bytes a block of 8 rows would
// leave loads across cache lines): for block b of 32 weights of the block's group j (index i = j blocks + b of n),
// from the block's start: the low code bits at 128 i, quad q (0..3) the bytes qs[4 q .. + 3] of rows 0..7 side by
// side (low nibbles weights 4 q + k, high nibbles 16 + 4 q + k); each row's 32 fifth bits as one word at 128 n + 32 i
// + 4 r, bit 8 k + 4 h + q that of weight 16 h + 4 q + k (so one shift and mask put a quad's four at bit 4 of its
// bytes); d of row r (fp16) at 160 n + 16 i + 2 r. A row's block product is (dw dx) (sum(c x) - 16 sum(x)) with c the
// unsigned 5-bit codes: acc = fma(dw dx, isum, acc) per block, in its own lane.
inline int64_t q50_block_start(int64_t groups, int64_t blocks, int64_t g, int64_t& n, int64_t& i, int64_t b) {
  const int64_t first = g / kPlaneGroups * kPlaneGroups;
  n = std::min(kPlaneGroups, groups - first) * blocks;
  i = (g - first) * blocks + b;
  return first * 8 * 22 * blocks;
}

void interleave_q50_group(const uint8_t* src, int64_t row_bytes, int64_t blocks, uint8_t* base, int64_t groups,
                          int64_t g) {
  for (int64_t b = 0; b < blocks; ++b) {
    int64_t n, i;
    uint8_t* o = base + q50_block_start(groups, blocks, g, n, i, b);
    for (int r = 0; r < 8; ++r) {
      const uint8_t* p = src + r * row_bytes + b * 22;
      std::memcpy(o + 160 * n + 16 * i + 2 * r, p, 2);
      uint32_t qh, word = 0;
      std::memcpy(&qh, p + 2, 4);
      for (int h = 0; h < 2; ++h)
        for (int q = 0; q < 4; ++q)
          for (int k = 0; k < 4; ++k) word |= ((qh >> (16 * h + 4 * q + k)) & 1u) << (8 * k + 4 * h + q);
      std::memcpy(o + 128 * n + 32 * i + 4 * r, &word, 4);
      for (int q = 0; q < 4; ++q) std::memcpy(o + 128 * i + 32 * q + 4 * r, p + 6 + 4 * q, 4);
    }
  }
}

void deinterleave_q50_group(const uint8_t* base, int64_t groups, int64_t g, int64_t blocks, int64_t row_bytes,
                            uint8_t* dst) {
  for (int64_t b = 0; b < blocks; ++b) {
    int64_t n, i;
    const uint8_t* o = base + q50_block_start(groups, blocks, g, n, i, b);
    for (int r = 0; r < 8; ++r) {
      uint8_t* p = dst + r * row_bytes + b * 22;
      std::memcpy(p, o + 160 * n + 16 * i + 2 * r, 2);
      uint32_t word, qh = 0;
      std::memcpy(&word, o + 128 * n + 32 * i + 4 * r, 4);
      for (int h = 0; h < 2; ++h)
        for (int q = 0; q < 4; ++q)
          for (int k = 0; k < 4; ++k) qh |= ((word >> (8 * k + 4 * h + q)) & 1u) << (16 * h + 4 * q + k);
      std::memcpy(p + 2, &qh, 4);
      for (int q = 0; q < 4; ++q) std::memcpy(p + 6 + 4 * q, o + 128 * i + 32 * q + 4 * r, 4);
    }
  }
}

#if defined(EAGLE_ISA_AVX512) || defined(EAGLE_ISA_AVX2)
// out[i * ldo + 8 g + r] for rows row0..row0+M-1 of x (quantized per block of 32: xq) and groups g0..g1 of
// interleaved Q5_0 rows
template <int M>
void group5_block(const uint8_t* raw, int64_t blocks, int64_t groups, const QuantizedRows& xq, int64_t K,
                  int64_t row0, const float* bias, float* out, int64_t ldo, int64_t g0, int64_t g1) {
  const __m256i low4 = _mm256_set1_epi8(15), fifth = _mm256_set1_epi8(16), ones = _mm256_set1_epi16(1);
  const int8_t* x0 = xq.q.data() + row0 * K;
  for (int64_t g = g0; g < g1; ++g) {
    __m256 acc[M];
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      int64_t n, ix;
      const uint8_t* o = raw + q50_block_start(groups, blocks, g, n, ix, b);
      const __m256i word = load32(o + 128 * n + 32 * ix);
      __m256i w[8];  // quads 0..7 of the block's 32 codes, 8 rows each
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) {
        const __m256i bytes = load32(o + 128 * ix + 32 * q);
        w[q] = _mm256_or_si256(_mm256_and_si256(bytes, low4),
                               _mm256_and_si256(_mm256_sll_epi32(word, _mm_cvtsi32_si128(4 - q)), fifth));
        w[4 + q] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4),
                                   _mm256_and_si256(_mm256_srl_epi32(word, _mm_cvtsi32_si128(q)), fifth));
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o + 160 * n + 16 * ix)));
#pragma GCC unroll 8
      for (int i = 0; i < M; ++i) {
        const int8_t* xc = x0 + i * K + 32 * b;
        // four products a 16-bit sum: codes 0..31, x -127..127, at most 31496
        __m256i a0 = _mm256_maddubs_epi16(w[0], broadcast4(xc)), a1 = _mm256_maddubs_epi16(w[4], broadcast4(xc + 16));
#pragma GCC unroll 4
        for (int q = 1; q < 4; ++q) {
          a0 = _mm256_add_epi16(a0, _mm256_maddubs_epi16(w[q], broadcast4(xc + 4 * q)));
          a1 = _mm256_add_epi16(a1, _mm256_maddubs_epi16(w[4 + q], broadcast4(xc + 16 + 4 * q)));
        }
        const int64_t xb = (row0 + i) * (K / 32) + b;
        const __m256i isum = _mm256_sub_epi32(_mm256_add_epi32(_mm256_madd_epi16(a0, ones), _mm256_madd_epi16(a1, ones)),
                                              _mm256_set1_epi32(16 * xq.sums[xb]));
        acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(xq.d[xb])), _mm256_cvtepi32_ps(isum), acc[i]);
      }
    }
    const __m256 bv = bias ? _mm256_loadu_ps(bias + 8 * g) : _mm256_setzero_ps();
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) _mm256_storeu_ps(out + i * ldo + 8 * g, _mm256_add_ps(acc[i], bv));
  }
}

// out [M, N] (rows ldo apart) = x W^T (+ bias), W interleaved Q5_0 rows (N a multiple of 8), x quantized per block
void group5_rows(const QuantizedRows& xq, int64_t M, int64_t K, const uint8_t* raw, int64_t N, const float* bias,
                 float* out, int64_t ldo) {
  at::parallel_for(0, N / 8, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t t = g0; t < g1; t += kGroupTile) {
      const int64_t t1 = std::min(g1, t + kGroupTile);
      for (int64_t r = 0; r < M; r += kGroupRows) {
        const auto pass = [&](auto m) {
          constexpr int rows = decltype(m)::value;
          group5_block<rows>(raw, K / 32, N / 8, xq, K, r, bias, out + r * ldo, ldo, t, t1);
        };
        switch (std::min<int64_t>(kGroupRows, M - r)) {
          case 1: pass(std::integral_constant<int, 1>()); break;
          case 2: pass(std::integral_constant<int, 2>()); break;
          case 3: pass(std::integral_constant<int, 3>()); break;
          default: pass(std::integral_constant<int, 4>()); break;
        }
      }
    }
  });
}
#else
void group5_rows(const QuantizedRows&, int64_t, int64_t, const uint8_t*, int64_t, const float*, float*, int64_t) {}
#endif

// A GGUF type's interleaved type (kQ4_Kx8, kQ6_Kx8, kQ5_0x8), or 0 where it has none
constexpr int64_t interleaved_type(int64_t type) {
  return type == kQ4_K ? kQ4_Kx8 : type == kQ6_K ? kQ6_Kx8 : type == kQ5_0 ? kQ5_0x8 : 0;
}
constexpr int64_t plain_type(int64_t type) {
  return type == kQ4_Kx8 ? kQ4_K : type == kQ6_Kx8 ? kQ6_K : type == kQ5_0x8 ? kQ5_0 : type;
}

// group g's rows src (8 rows in GGUF's layout, row_bytes apart) into the interleaved matrix at base (groups in all)
void interleave_group(int64_t type, const uint8_t* src, int64_t row_bytes, uint8_t* base, int64_t groups, int64_t g) {
  if (type == kQ4_K) interleave_q4k_group(src, row_bytes, row_bytes / 144, base + g * 8 * row_bytes);
  else if (type == kQ6_K) interleave_q6k_group(src, row_bytes, row_bytes / 210, base, groups, g);
  else interleave_q50_group(src, row_bytes, row_bytes / 22, base, groups, g);
}

// group g of the interleaved matrix at base as 8 rows in GGUF's layout at dst
void deinterleave_group(int64_t type, const uint8_t* base, int64_t groups, int64_t g, int64_t row_bytes, uint8_t* dst) {
  if (type == kQ4_Kx8) deinterleave_q4k_group(base + g * 8 * row_bytes, row_bytes / 144, row_bytes, dst);
  else if (type == kQ6_Kx8) deinterleave_q6k_group(base, groups, g, row_bytes / 210, row_bytes, dst);
  else deinterleave_q50_group(base, groups, g, row_bytes / 22, row_bytes, dst);
}

}  // namespace

// stream_linear_gguf: y = x W^T (+ b) for the rows of x [M, K] with W given as GGUF rows of one or more parts
// (raws[i] uint8 [N_i, row bytes] of GGML type types[i]), their outputs side by side [M, sum N_i] (a fused q/k/v or
// gate/up whose parts have different types): the bits of stream_linear on the parts de-quantized as gguf-py does
// and concatenated. bias: [sum N_i] or none.
torch::Tensor stream_linear_gguf_parts(const torch::Tensor& x, const std::vector<torch::Tensor>& raws,
                                       const std::vector<int64_t>& types, const c10::optional<torch::Tensor>& bias,
                                       bool int8) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2 && x.device().is_cpu(),
              "stream_linear_gguf: contiguous fp32 CPU x [M, K]");
  TORCH_CHECK(!raws.empty() && raws.size() == types.size(), "stream_linear_gguf: a GGML type per part");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(M >= 1, "stream_linear_gguf: at least one row");
  int64_t total = 0;
  for (size_t i = 0; i < raws.size(); ++i) {
    const torch::Tensor& raw = raws[i];
    TORCH_CHECK(raw.dtype() == torch::kUInt8 && raw.is_contiguous() && raw.dim() == 2 && raw.device().is_cpu(),
                "stream_linear_gguf: contiguous uint8 CPU rows [N, row bytes]");
    const GgmlLayout layout = ggml_layout(types[i]);
    TORCH_CHECK(K % layout.weights == 0 && raw.size(1) == K / layout.weights * layout.bytes,
                "stream_linear_gguf: shapes do not match x [M, K] (K a multiple of ", layout.weights, ")");
    total += raw.size(0);
  }
  const float* b = bias_data(bias, total, "stream_linear_gguf");
  auto out = torch::empty({M, total}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // x quantized once for every part: per block of 32, and per super-block of 256 for the K-quants that take it
  // (those on every build: the portable one sums their integers by plain loops)
  bool blocks32 = false, supers = false;
  for (const int64_t t : types) (t == kQ4_K || t == kQ5_K || t == kQ6_K || t == kQ4_Kx8 || t == kQ6_Kx8 ? supers : blocks32) = true;
  check_int8(int8 && blocks32, "stream_linear_gguf");
  const QuantizedRows xq = int8 && blocks32 ? quantize_rows(xp, M, K) : QuantizedRows{};
  const SuperRows xs = int8 && supers ? quantize_super(xp, M, K) : SuperRows{};
  int64_t col = 0;
  for (size_t i = 0; i < raws.size(); ++i) {
    const uint8_t* rp = raws[i].data_ptr<uint8_t>();
    const int64_t N = raws[i].size(0), rb = raws[i].size(1);
    const float* bp = b ? b + col : nullptr;
    if (plain_type(types[i]) != types[i]) {
      TORCH_CHECK(int8, "stream_linear_gguf: interleaved rows take int8 activations only");
      TORCH_CHECK(N % 8 == 0, "stream_linear_gguf: interleaved rows come in groups of 8");
      if (types[i] == kQ4_Kx8) group_rows<kQ4_Kx8>(xs, M, K, rp, N, bp, op + col, total);
      else if (types[i] == kQ6_Kx8) group_rows<kQ6_Kx8>(xs, M, K, rp, N, bp, op + col, total);
      else group5_rows(xq, M, K, rp, N, bp, op + col, total);
      col += N;
      continue;
    }
    switch (types[i]) {
#define EAGLE_GGML(t) \
  case t:             \
    if constexpr (kSuperInt8<t>) {                                      \
      if (int8) {                                                        \
        super_rows<t>(xs, M, K, rp, rb, N, bp, op + col, total);         \
        break;                                                           \
      }                                                                  \
    }                                                                    \
    if (int8) int8_gguf<t>(xq, M, K, rp, rb, N, bp, op + col, total); \
    else gguf_rows<t>(xp, M, K, rp, rb, N, bp, op + col, total); \
    break;
      EAGLE_GGML(kQ4_0) EAGLE_GGML(kQ4_1) EAGLE_GGML(kQ5_0) EAGLE_GGML(kQ5_1) EAGLE_GGML(kQ8_0) EAGLE_GGML(kQ2_K)
      EAGLE_GGML(kQ3_K) EAGLE_GGML(kQ4_K) EAGLE_GGML(kQ5_K) EAGLE_GGML(kQ6_K) EAGLE_GGML(kIQ4_NL) EAGLE_GGML(kIQ4_XS)
#undef EAGLE_GGML
    }
    col += N;
  }
  return out;
}

// stream_linear_gguf: one part (W as its GGUF rows raw uint8 [N, row bytes] of GGML type `type`).
torch::Tensor stream_linear_gguf(const torch::Tensor& x, const torch::Tensor& raw, int64_t type,
                                 const c10::optional<torch::Tensor>& bias, bool int8) {
  return stream_linear_gguf_parts(x, {raw}, {type}, bias, int8);
}

// gguf_dequantize_rows: rows `index` (int64 [n]) of W given as its GGUF rows raw uint8 [N, row bytes] of GGML type
// `type`, de-quantized to fp32 [n, K] as gguf-py does (an embedding lookup from the codes).
torch::Tensor gguf_dequantize_rows(const torch::Tensor& raw, int64_t type, const torch::Tensor& index) {
  TORCH_CHECK(raw.dtype() == torch::kUInt8 && raw.is_contiguous() && raw.dim() == 2 && raw.device().is_cpu(),
              "gguf_dequantize_rows: contiguous uint8 CPU rows [N, row bytes]");
  TORCH_CHECK(index.dtype() == torch::kInt64 && index.dim() == 1 && index.device().is_cpu(),
              "gguf_dequantize_rows: int64 CPU index [n]");
  const GgmlLayout layout = ggml_layout(type);
  const int64_t rb = raw.size(1), N = raw.size(0), K = rb / layout.bytes * layout.weights, n = index.size(0);
  TORCH_CHECK(rb % layout.bytes == 0, "gguf_dequantize_rows: row bytes not a whole number of blocks");
  auto out = torch::empty({n, K}, torch::kFloat32);
  const torch::Tensor idx = index.contiguous();
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) TORCH_CHECK(ip[r] >= 0 && ip[r] < N, "gguf_dequantize_rows: index out of range");
  const uint8_t* rp = raw.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  if (plain_type(type) != type) {  // each row from its group put back in GGUF's layout
    TORCH_CHECK(N % 8 == 0, "gguf_dequantize_rows: interleaved rows come in groups of 8");
    std::vector<uint8_t> group(8 * rb);
    for (int64_t r = 0; r < n; ++r) {
      deinterleave_group(type, rp, N / 8, ip[r] / 8, rb, group.data());
      if (type == kQ4_Kx8) decode_row<kQ4_K>(group.data() + ip[r] % 8 * rb, K, op + r * K);
      else if (type == kQ6_Kx8) decode_row<kQ6_K>(group.data() + ip[r] % 8 * rb, K, op + r * K);
      else decode_row<kQ5_0>(group.data() + ip[r] % 8 * rb, K, op + r * K);
    }
    return out;
  }
  for (int64_t r = 0; r < n; ++r) {
    switch (type) {
#define EAGLE_GGML(t) \
  case t:             \
    decode_row<t>(rp + ip[r] * rb, K, op + r * K); \
    break;
      EAGLE_GGML(kQ4_0) EAGLE_GGML(kQ4_1) EAGLE_GGML(kQ5_0) EAGLE_GGML(kQ5_1) EAGLE_GGML(kQ8_0) EAGLE_GGML(kQ2_K)
      EAGLE_GGML(kQ3_K) EAGLE_GGML(kQ4_K) EAGLE_GGML(kQ5_K) EAGLE_GGML(kQ6_K) EAGLE_GGML(kIQ4_NL) EAGLE_GGML(kIQ4_XS)
#undef EAGLE_GGML
    }
  }
  return out;
}

// gguf_interleave: a Q4_K or Q6_K matrix's rows raw uint8 [N, row bytes] (N a multiple of 8) rewritten in place as
// interleaved groups of 8; returns their type for the products (kQ4_Kx8, kQ6_Kx8). gguf_deinterleave: interleaved
// rows of such a type as a copy in GGUF's layout again.
int64_t gguf_interleave(torch::Tensor raw, int64_t type) {
  const int64_t to = interleaved_type(type);
  TORCH_CHECK(to != 0, "gguf_interleave: GGML type ", type, " has no interleaved layout (Q4_K, Q6_K and Q5_0 have)");
  TORCH_CHECK(raw.dtype() == torch::kUInt8 && raw.is_contiguous() && raw.dim() == 2 && raw.device().is_cpu() &&
              raw.size(0) % 8 == 0 && raw.size(1) % ggml_layout(type).bytes == 0,
              "gguf_interleave: contiguous uint8 CPU rows [N, row bytes], N a multiple of 8");
  const int64_t rb = raw.size(1), groups = raw.size(0) / 8, blocks = (groups + kPlaneGroups - 1) / kPlaneGroups;
  uint8_t* p = raw.data_ptr<uint8_t>();
  at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {  // a block of groups is rewritten within its bytes
    std::vector<uint8_t> rows(kPlaneGroups * 8 * rb);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t g0 = b * kPlaneGroups, g1 = std::min(groups, g0 + kPlaneGroups);
      std::memcpy(rows.data(), p + g0 * 8 * rb, (g1 - g0) * 8 * rb);
      for (int64_t g = g0; g < g1; ++g) interleave_group(type, rows.data() + (g - g0) * 8 * rb, rb, p, groups, g);
    }
  });
  return to;
}

torch::Tensor gguf_deinterleave(const torch::Tensor& raw, int64_t type) {
  TORCH_CHECK(plain_type(type) != type, "gguf_deinterleave: type ", type, " is not an interleaved one");
  TORCH_CHECK(raw.dtype() == torch::kUInt8 && raw.is_contiguous() && raw.dim() == 2 && raw.device().is_cpu() &&
              raw.size(0) % 8 == 0 && raw.size(1) % ggml_layout(type).bytes == 0,
              "gguf_deinterleave: contiguous uint8 CPU rows [N, row bytes], N a multiple of 8");
  const int64_t rb = raw.size(1);
  auto out = torch::empty_like(raw);
  const uint8_t* p = raw.data_ptr<uint8_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  at::parallel_for(0, raw.size(0) / 8, 16, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) deinterleave_group(type, p, raw.size(0) / 8, g, rb, o + g * 8 * rb);
  });
  return out;
}

// gguf_interleaved_rows: rows `index` (int64 [n]) of interleaved rows raw of such a type, in GGUF's layout [n, row bytes]
torch::Tensor gguf_interleaved_rows(const torch::Tensor& raw, int64_t type, const torch::Tensor& index) {
  TORCH_CHECK(plain_type(type) != type, "gguf_interleaved_rows: type ", type, " is not an interleaved one");
  TORCH_CHECK(raw.dtype() == torch::kUInt8 && raw.is_contiguous() && raw.dim() == 2 && raw.device().is_cpu() &&
              raw.size(0) % 8 == 0, "gguf_interleaved_rows: contiguous uint8 CPU rows [N, row bytes], N a multiple of 8");
  TORCH_CHECK(index.dtype() == torch::kInt64 && index.dim() == 1 && index.device().is_cpu(),
              "gguf_interleaved_rows: int64 CPU index [n]");
  const int64_t N = raw.size(0), rb = raw.size(1), n = index.size(0);
  const torch::Tensor idx = index.contiguous();
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) TORCH_CHECK(ip[r] >= 0 && ip[r] < N, "gguf_interleaved_rows: index out of range");
  auto out = torch::empty({n, rb}, raw.options());
  const uint8_t* p = raw.data_ptr<uint8_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  at::parallel_for(0, n, 64, [&](int64_t r0, int64_t r1) {
    std::vector<uint8_t> group(8 * rb);
    int64_t held = -1;
    for (int64_t r = r0; r < r1; ++r) {
      if (ip[r] / 8 != held) deinterleave_group(type, p, N / 8, held = ip[r] / 8, rb, group.data());
      std::memcpy(o + r * rb, group.data() + ip[r] % 8 * rb, rb);
    }
  });
  return out;
}

// A product for decoder_layer: W fp32 [N, K], or codes with their scales (stream_linear_q), or GGUF rows of one or
// more parts (raws and their GGML types, stream_linear_gguf_parts: w unused); its bias; and whether codes meet x
// quantized to int8 (int8 activations).
struct Product {
  c10::optional<torch::Tensor> w, s;
  std::vector<torch::Tensor> raws;
  std::vector<int64_t> types;
  c10::optional<torch::Tensor> b;
  bool int8 = false;
};
using ProductArgs = std::tuple<c10::optional<torch::Tensor>, c10::optional<torch::Tensor>, std::vector<torch::Tensor>,
                               std::vector<int64_t>, c10::optional<torch::Tensor>, bool>;

torch::Tensor linear(const torch::Tensor& x, const Product& p, bool once) {
  if (!p.raws.empty()) return stream_linear_gguf_parts(x, p.raws, p.types, p.b, p.int8);
  return p.s.has_value() ? stream_linear_q(x, *p.w, *p.s, p.b, once, p.int8) : stream_linear(x, *p.w, p.b, once);
}

// linear_rows: linear for any number of rows, a kernel that takes 1-16 rows a call given them 16 at a time (a
// row's result does not depend on the rows computed with it).
torch::Tensor linear_rows(const torch::Tensor& x, const Product& p, bool once = true) {
  const int64_t M = x.size(0);
  if (M <= kMaxRows || !p.raws.empty() || p.int8 || (kPanels && p.s.has_value())) return linear(x, p, once);
  std::vector<torch::Tensor> parts;
  for (int64_t r = 0; r < M; r += kMaxRows) parts.push_back(linear(x.narrow(0, r, std::min(kMaxRows, M - r)), p, once));
  return torch::cat(parts);
}

// rms_norm: Llama's RMSNorm in fp32, w * (x * 1 / sqrt(mean(x^2) + eps)) per row of x [..., H], in one
// pass over each row (torch's CPU rms_norm runs five operations).
namespace {
// One row of H values: w * (x * 1 / sqrt(mean(x^2) + eps)) into out (which may be x itself).
void rms_row(const float* xp, const float* wp, int64_t H, float eps, float* op) {
  const int64_t whole = H / 16 * 16, tail = H - whole;
  V acc = vzero();
  for (int64_t k = 0; k < whole; k += 16) {
    const V v = vload(xp + k);
    acc = vfma(v, v, acc);
  }
  if (tail) {
    const V v = vloadn(xp + whole, tail);
    acc = vfma(v, v, acc);
  }
  const float mean = vsum(acc) / static_cast<float>(H);
  const V scale = vset1(1.0f / std::sqrt(mean + eps));
  for (int64_t k = 0; k < whole; k += 16) vstore(op + k, vmul(vload(wp + k), vmul(vload(xp + k), scale)));
  if (tail) vstoren(op + whole, vmul(vloadn(wp + whole, tail), vmul(vloadn(xp + whole, tail), scale)), tail);
}
}  // namespace

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && w.dtype() == torch::kFloat32, "rms_norm: fp32 only");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "rms_norm: CPU tensors only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && w.dim() == 1 && x.size(-1) == w.size(0),
              "rms_norm: contiguous x [..., H] and w [H]");
  const int64_t H = w.size(0), rows = x.numel() / H;
  auto out = torch::empty_like(x);
  const float* wp = w.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r)
    rms_row(x.data_ptr<float>() + r * H, wp, H, static_cast<float>(eps), out.data_ptr<float>() + r * H);
  return out;
}

namespace {

// exp for 16 floats: 2^n * p(r), r = x - n ln 2 (Cephes' expf polynomial, ~1 ulp); 0 below -87 (where
// expf is 0 or subnormal: a softmax term that small cannot change a sum of terms up to 1).
inline V exp16(V x) {
  const V clamped = vmax(vmin(x, vset1(88.0f)), vset1(-88.0f));
  const V n = vround(vmul(clamped, vset1(1.44269504088896341f)));
  V r = vfnma(n, vset1(0.693359375f), clamped);
  r = vfnma(n, vset1(-2.12194440e-4f), r);
  V p = vset1(1.9875691500e-4f);
  p = vfma(p, r, vset1(1.3981999507e-3f));
  p = vfma(p, r, vset1(8.3334519073e-3f));
  p = vfma(p, r, vset1(4.1665795894e-2f));
  p = vfma(p, r, vset1(1.6666665459e-1f));
  p = vfma(p, r, vset1(5.0000001201e-1f));
  p = vfma(p, vmul(r, r), vadd(r, vset1(1.0f)));
  return vzero_below(vscale2(p, n), x, -87.0f);
}

// reduce_add16: lane c of the result is the sum of the 16 lanes of the vector in slot c of v
// (kSlotKey[s]: the lane whose vector goes in slot s; it is its own inverse), each summed by vsum's tree
// (halves, quarters, pairs, then the last two): the bits that reduction gives each vector alone; with
// AVX-512 for 16 vectors in 45 operations instead of about 130.
constexpr int kSlotKey[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};

#if defined(EAGLE_ISA_AVX512)
inline V reduce_add16(const V* vv) {
  const __m512* v = reinterpret_cast<const __m512*>(vv);
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
  return {_mm512_add_ps(_mm512_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(2, 0, 2, 0)),
                        _mm512_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(3, 1, 3, 1)))};
}
#else
inline V reduce_add16(const V* v) {
  alignas(64) float sums[16];
  for (int c = 0; c < 16; ++c) sums[c] = vsum(v[kSlotKey[c]]);
  return vload(sums);
}
#endif

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
  TORCH_CHECK(d % 16 == 0 && qkv.size(1) == (nh + 2 * nkv) * d, "rope_cache: head_dim a multiple of 16, qkv width");
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
      for (int64_t t = 0; t + 16 <= half; t += 16) {
        const V x1 = vload(x + t), x2 = vload(x + half + t);
        vstore(dst + t, vsub(vmul(x1, vload(c + t)), vmul(x2, vload(s + t))));
        vstore(dst + half + t, vadd(vmul(x2, vload(c + half + t)), vmul(x1, vload(s + half + t))));
      }
      if (const int64_t t = half / 16 * 16, n = half - t; n) {  // head dims that are odd multiples of 16
        const V x1 = vloadn(x + t, n), x2 = vloadn(x + half + t, n);
        vstoren(dst + t, vsub(vmul(x1, vloadn(c + t, n)), vmul(x2, vloadn(s + t, n))), n);
        vstoren(dst + half + t, vadd(vmul(x2, vloadn(c + half + t, n)), vmul(x1, vloadn(s + half + t, n))), n);
      }
    }
    for (int64_t h = 0; h < nkv; ++h)
      std::memcpy(vp + (h * cap + start + i) * d, row + (nh + nkv + h) * d, d * sizeof(float));
  }
  return out;
}

// One query row of one head (attention, below): softmax(q k^T * sc + add) v over its n keys, listed
// in idx (cache rows) with their biases in add; V vectors of 16 per head; score: room for n + 16.
template <int NV>
void attend_row(const float* qv, const float* kh, const float* vh, const int32_t* idx, const float* add,
                int64_t n, float sc, float* score, float* dst) {
  constexpr int64_t d = 16 * NV;
  V qreg[NV];
  for (int64_t v = 0; v < NV; ++v) qreg[v] = vload(qv + 16 * v);
  V most = vset1(-INFINITY);
  for (int64_t c0 = 0; c0 < n; c0 += 16) {  // the scores of 16 keys at a time
    const int64_t count = std::min<int64_t>(16, n - c0);
    V dots[16];
    for (int s = 0; s < 16; ++s) {
      const int64_t c = kSlotKey[s];
      if (c >= count) {
        dots[s] = vzero();
        continue;
      }
      const float* k = kh + static_cast<int64_t>(idx[c0 + c]) * d;
      V acc = vmul(qreg[0], vload(k));
      for (int64_t v = 1; v < NV; ++v) acc = vfma(qreg[v], vload(k + 16 * v), acc);
      dots[s] = acc;
    }
    const V scores = vadd(vmul(reduce_add16(dots), vset1(sc)), vloadn(add + c0, count));
    vstoren(score + c0, scores, count);
    most = vmax(most, vfirst(scores, count, -INFINITY));
  }
  const float best = vmaxall(most);
  const V top = vset1(best);
  V total = vzero();
  for (int64_t c = 0; c < n; c += 16) {
    const int64_t live = std::min<int64_t>(16, n - c);
    const V kept = vfirst(exp16(vsub(vloadn(score + c, live), top)), live, 0.0f);
    vstore(score + c, kept);
    total = vadd(total, kept);
  }
  const float inv = 1.0f / vsum(total);
  V acc[NV];
  for (int64_t v = 0; v < NV; ++v) acc[v] = vzero();
  for (int64_t c = 0; c < n; ++c) {
    const V w = vset1(score[c]);
    const float* val = vh + static_cast<int64_t>(idx[c]) * d;
    for (int64_t v = 0; v < NV; ++v) acc[v] = vfma(w, vload(val + 16 * v), acc[v]);
  }
  const V scale_out = vset1(inv);
  for (int64_t v = 0; v < NV; ++v) vstore(dst + 16 * v, vmul(acc[v], scale_out));
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
  TORCH_CHECK(d % 16 == 0 && d <= 256 && key_buf.size(2) == d && nh % nkv == 0,
              "attention: head_dim a multiple of 16 up to 256, heads");
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
        EAGLE_VECS(12) EAGLE_VECS(16)  // head dims 192 and 256 (Gemma-3)
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
  const V one = vset1(1.0f);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t t = 0; t < inter; t += 16) {
      const V g = vload(src + i * 2 * inter + t);
      const V u = vload(src + i * 2 * inter + inter + t);
      const V silu = vdiv(g, vadd(one, exp16(vsub(vzero(), g))));
      vstore(op + i * inter + t, vmul(silu, u));
    }
  return out;
}

// A decoder layer's weights (each product a Product). Without input_norm, qkv reads x itself (an EAGLE drafter's
// first layer: its input is fc's output).
struct LayerWeights {
  c10::optional<torch::Tensor> input_norm;
  double input_eps;
  Product qkv, o;
  torch::Tensor post_norm;
  double post_eps;
  Product gate_up, down;
  c10::optional<torch::Tensor> q_norm, k_norm;  // Qwen3: an RMSNorm on each query and key head (eps: input_eps)
};

// head_norms: each query head of qkv [q, (nh + 2 nkv) d] normed by q_norm [d] and each key head by k_norm [d],
// in place (RMSNorm over the head's d values, rms_row's sums).
void head_norms(torch::Tensor qkv, const torch::Tensor& q_norm, const torch::Tensor& k_norm, int64_t nh,
                int64_t nkv, double eps) {
  const int64_t d = q_norm.numel(), heads = qkv.size(1) / d;
  TORCH_CHECK(qkv.is_contiguous() && heads == nh + 2 * nkv && k_norm.numel() == d && q_norm.is_contiguous() &&
              k_norm.is_contiguous(), "head_norms: head widths");
  float* rows = qkv.data_ptr<float>();
  for (int64_t i = 0; i < qkv.size(0); ++i)
    for (int64_t h = 0; h < nh + nkv; ++h) {
      float* head = rows + (i * heads + h) * d;
      rms_row(head, (h < nh ? q_norm : k_norm).data_ptr<float>(), d, static_cast<float>(eps), head);
    }
}

// decoder_layer: one Llama decoder layer for one sequence of any number of rows, in place on x [q, H]:
// x += o(attention(rope(qkv(rms(x))))), then x += down(silu_mul(gate_up(rms(x)))), the same kernels
// and sums as the separate calls (x += y gives x + y's bits). Keys and values go to rows start..start+q-1
// of the buffers; bias and scale as for attention; once: the weights are read once per forward (a
// target's: prefetch).
void decoder_layer(torch::Tensor x, const LayerWeights& l, const torch::Tensor& cos, const torch::Tensor& sin,
                   torch::Tensor key_buf, torch::Tensor value_buf, int64_t nh, int64_t start,
                   const c10::optional<torch::Tensor>& bias, double scale, bool once) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2, "decoder_layer: x fp32 [q, H]");
  const torch::Tensor h = l.input_norm.has_value() ? rms_norm(x, *l.input_norm, l.input_eps) : x;
  const torch::Tensor qkv = linear_rows(h, l.qkv, once);
  if (l.q_norm.has_value()) head_norms(qkv, *l.q_norm, *l.k_norm, nh, key_buf.size(0), l.input_eps);
  const torch::Tensor q = rope_cache(qkv, cos, sin, key_buf, value_buf, nh, start);
  x.add_(linear_rows(attention(q, key_buf, value_buf, start + x.size(0), bias, scale), l.o, once));
  x.add_(linear_rows(silu_mul(linear_rows(rms_norm(x, l.post_norm, l.post_eps), l.gate_up, once)), l.down, once));
}

// A layer's four products (qkv, o, gate_up, down) from their Python tuples, checked.
std::array<Product, 4> four_products(const std::vector<ProductArgs>& products, const char* who) {
  TORCH_CHECK(products.size() == 4, who, ": four products (qkv, o, gate_up, down)");
  std::array<Product, 4> p;
  for (int i = 0; i < 4; ++i) {
    const auto& [w, s, raws, types, b, int8] = products[i];
    TORCH_CHECK(raws.size() == types.size() && (w.has_value() != !raws.empty()),
                who, ": a product is a weight or GGUF parts with their types");
    TORCH_CHECK(!int8 || s.has_value() || !raws.empty(), who, ": int8 activations for codes only");
    check_int8(int8, who);
    p[i] = {w, s, raws, types, b, int8};
  }
  return p;
}

// DecoderStack: decoder layers whose weights are handed over once (add), run by one call a forward
// (forward), instead of a call per layer from Python that converts some 25 arguments each time.
class DecoderStack {
 public:
  DecoderStack(int64_t nh, double scale) : nh_(nh), scale_(scale) {}

  // One more layer: its norms and its products qkv, o, gate_up, down, each (w, scales, GGUF raws, GGML types,
  // bias) as Product holds them.
  void add(const c10::optional<torch::Tensor>& input_norm, double input_eps, const torch::Tensor& post_norm,
           double post_eps, const std::vector<ProductArgs>& products, const c10::optional<torch::Tensor>& q_norm,
           const c10::optional<torch::Tensor>& k_norm) {
    const std::array<Product, 4> p = four_products(products, "DecoderStack.add");
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "DecoderStack.add: q_norm and k_norm together");
    for (const auto* n : {&q_norm, &k_norm})
      TORCH_CHECK(!n->has_value() || ((*n)->dtype() == torch::kFloat32 && (*n)->is_contiguous() && (*n)->dim() == 1),
                  "DecoderStack.add: fp32 head norms");
    layers_.push_back({input_norm, input_eps, p[0], p[1], post_norm, post_eps, p[2], p[3], q_norm, k_norm});
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

// argmax_rows: the index of each row's largest value for x fp32 [N, V], the first of equal ones, a NaN counting
// as the largest (torch's argmax): a vectorized maximum, then the first index holding it (torch's CPU argmax
// walks the values one at a time).
torch::Tensor argmax_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2 && x.device().is_cpu() &&
              x.size(1) > 0, "argmax_rows: contiguous fp32 CPU x [N, V], V > 0");
  const int64_t N = x.size(0), W = x.size(1), whole = W / 16 * 16;
  auto out = torch::empty({N}, torch::kInt64);
  int64_t* op = out.data_ptr<int64_t>();
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, N, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = xp + r * W;
      V acc = vset1(-INFINITY), odd = vzero();  // odd: 0 while every value is finite
      for (int64_t k = 0; k < whole; k += 16) {
        const V v = vload(row + k);
        acc = vmax(acc, v);
        odd = vadd(odd, vmul(v, vzero()));
      }
      float best = vmaxall(acc);
      bool finite = std::isfinite(vsum(odd));
      for (int64_t k = whole; k < W; ++k) {
        finite = finite && std::isfinite(row[k]);
        best = row[k] > best ? row[k] : best;
      }
      int64_t found = -1;
      if (finite) {
        for (int64_t k = 0; k < W && found < 0; ++k)
          if (row[k] == best) found = k;
      } else {  // a NaN or an infinity: one value at a time, as torch does (the first NaN, else the first largest)
        found = 0;
        for (int64_t k = 1; k < W && !std::isnan(row[found]); ++k)
          if (std::isnan(row[k]) || row[k] > row[found]) found = k;
      }
      op[r] = found;
    }
  });
  return out;
}

// int8_radius: for fp32 rows x [N, K], the two terms of how far each logit of the int8 products can be from the fp32
// one (CodesGreedyHead): x quantized as those products quantize it (per block of `block`: 32, or 256 as the K-quants'
// super-blocks), x' its codes times their scales, c [N, 2] = (|x - x'|, gamma (|x'| + |x|)), each summed in double,
// times 1.001 plus 1e-12 for the roundings of these sums: logit j is within c0 |w_j| + c1 (|a_j| + |b_j|) of the
// fp32 one, where the int8 product sums w_j = a_j - b_j as two parts (b_j: the minimums; 0 for codes without). NaN
// where x is not finite. Float64 [N, 2].
torch::Tensor int8_radius(const torch::Tensor& x, double gamma, int64_t block) {
  TORCH_CHECK(block == 32 || block == kSuper, "int8_radius: blocks of 32 or 256");
  if (block == 32) check_int8(true, "int8_radius");
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2 && x.device().is_cpu() &&
              x.size(1) % block == 0, "int8_radius: contiguous fp32 CPU x [N, K], K a multiple of the block");
  const int64_t N = x.size(0), K = x.size(1);
  auto out = torch::empty({N, 2}, torch::kFloat64);
  double* op = out.data_ptr<double>();
  const float* xp = x.data_ptr<float>();
  std::vector<int8_t> codes;
  std::vector<float> scales;
  if (block == kSuper) {
    SuperRows xs = quantize_super(xp, N, K);
    codes.swap(xs.q);
    scales.swap(xs.d);
  } else {
#if defined(EAGLE_ISA_AVX512) || defined(EAGLE_ISA_AVX2)  // the builds with int8 products (check_int8 above)
    QuantizedRows xq = quantize_rows(xp, N, K);
    codes.swap(xq.q);
    scales.swap(xq.d);
#endif
  }
  for (int64_t i = 0; i < N; ++i) {
    double err = 0.0, seen = 0.0, own = 0.0;
    for (int64_t k = 0; k < K; ++k) {
      const double v = xp[i * K + k], q = static_cast<double>(codes[i * K + k]) * scales[(i * K + k) / block];
      err += (v - q) * (v - q);
      seen += q * q;
      own += v * v;
    }
    op[2 * i] = std::sqrt(err) * 1.001 + 1e-12;
    op[2 * i + 1] = gamma * (std::sqrt(seen) + std::sqrt(own)) * 1.001 + 1e-12;
  }
  return out;
}

// screen_candidates: the tokens whose fp32 logit may be a row's largest, from approximate logits approx fp32 [N, V]
// each within c_j of the fp32 one (CodesGreedyHead's bound): c_j = radius[i] * norms[j] for radius [N] and norms [V],
// or radius[i, 0] * norms[0, j] + radius[i, 1] * norms[1, j] for radius [N, 2] and norms [2, V]. Per row:
// lowest = max_j (A_j - c_j) (no row's best is below it), and token j is a candidate where A_j + c_j >= lowest -
// slack * max(max_j |A_j + c_j|, |lowest|) (the fp32 roundings of those sums), the arithmetic of the torch expressions
// it replaces, in two passes over the row. Returns (the union of the rows' candidates in increasing order, int64 [T];
// which of them each row keeps, bool [N, T]), or two empty tensors where the whole head must decide: a row with a
// value that is not finite or with no candidate, or more than `most` candidates in a row or in all.
std::tuple<torch::Tensor, torch::Tensor> screen_candidates(const torch::Tensor& approx, const torch::Tensor& radius,
                                                           const torch::Tensor& norms, double slack, int64_t most) {
  TORCH_CHECK(approx.dtype() == torch::kFloat32 && approx.is_contiguous() && approx.dim() == 2 && approx.device().is_cpu(),
              "screen_candidates: contiguous fp32 CPU approx [N, V]");
  const int64_t N = approx.size(0), W = approx.size(1), whole = W / 16 * 16;
  const int64_t terms = radius.dim() == 2 ? 2 : 1;
  TORCH_CHECK(radius.dtype() == torch::kFloat32 && radius.is_contiguous() && radius.numel() == N * terms &&
              norms.dtype() == torch::kFloat32 && norms.is_contiguous() && norms.numel() == W * terms &&
              norms.dim() == radius.dim() && (terms == 1 || (radius.size(1) == 2 && norms.size(0) == 2)),
              "screen_candidates: fp32 radius [N] and norms [V], or radius [N, 2] and norms [2, V]");
  const float* ap = approx.data_ptr<float>();
  const float* rp = radius.data_ptr<float>();
  const float* np = norms.data_ptr<float>();
  const float* np1 = terms == 2 ? np + W : nullptr;
  std::vector<std::vector<int64_t>> rows(N);
  std::vector<char> usable(N, 1);
  at::parallel_for(0, N, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float* a = ap + i * W;
      const float r = rp[terms * i], r1 = terms == 2 ? rp[2 * i + 1] : 0.0f;
      const V vr = vset1(r), vr1 = vset1(r1);
      // c_j as the torch expressions compute it: one product, or two products and their sum
      auto reach = [&](int64_t k) {
        return np1 ? vadd(vmul(vr, vload(np + k)), vmul(vr1, vload(np1 + k))) : vmul(vr, vload(np + k));
      };
      auto reach1 = [&](int64_t k) { return np1 ? r * np[k] + r1 * np1[k] : r * np[k]; };
      V lo = vset1(-INFINITY), top = vzero(), odd = vzero();  // odd: 0 while every value is finite
      for (int64_t k = 0; k < whole; k += 16) {
        const V v = vload(a + k), c = reach(k), s = vadd(v, c);
        lo = vmax(lo, vsub(v, c));
        top = vmax(top, vmax(s, vsub(vzero(), s)));
        odd = vadd(odd, vmul(s, vzero()));
      }
      float lowest = vmaxall(lo), high = vmaxall(top);
      bool finite = std::isfinite(vsum(odd)) && std::isfinite(r) && std::isfinite(r1);
      for (int64_t k = whole; k < W; ++k) {
        const float c = reach1(k), s = a[k] + c;
        finite = finite && std::isfinite(s);
        lowest = std::max(lowest, a[k] - c);
        high = std::max(high, std::fabs(s));
      }
      if (!finite || !std::isfinite(lowest)) {
        usable[i] = 0;
        continue;
      }
      const float t = lowest - static_cast<float>(slack) * std::max(high, std::fabs(lowest));
      std::vector<int64_t>& kept = rows[i];
      for (int64_t k = 0; k < W; k += 16) {
        const int64_t n = std::min<int64_t>(16, W - k);
        if (n == 16 && vmaxall(vadd(vload(a + k), reach(k))) < t) continue;  // none of the 16
        for (int64_t j = k; j < k + n; ++j)
          if (a[j] + reach1(j) >= t) kept.push_back(j);
        if (static_cast<int64_t>(kept.size()) > most) break;
      }
      if (kept.empty() || static_cast<int64_t>(kept.size()) > most) usable[i] = 0;
    }
  });
  const auto none = std::make_tuple(torch::empty({0}, torch::kInt64), torch::empty({N, 0}, torch::kBool));
  for (int64_t i = 0; i < N; ++i)
    if (!usable[i]) return none;
  std::vector<int64_t> all;
  for (const auto& kept : rows) all.insert(all.end(), kept.begin(), kept.end());
  std::sort(all.begin(), all.end());
  all.erase(std::unique(all.begin(), all.end()), all.end());
  if (static_cast<int64_t>(all.size()) > most) return none;
  const int64_t T = static_cast<int64_t>(all.size());
  auto tokens = torch::empty({T}, torch::kInt64);
  std::copy(all.begin(), all.end(), tokens.data_ptr<int64_t>());
  auto keep = torch::zeros({N, T}, torch::kBool);
  bool* kp = keep.data_ptr<bool>();
  for (int64_t i = 0; i < N; ++i)
    for (const int64_t j : rows[i]) kp[i * T + (std::lower_bound(all.begin(), all.end(), j) - all.begin())] = true;
  return std::make_tuple(tokens, keep);
}

// A Gemma-3 decoder layer's weights: the (1 + w) scales of its six RMSNorms, its four products, and its kind (which
// of the forward's rotary tables and attention biases it reads: sliding-window and full-attention layers differ).
struct GemmaLayerWeights {
  torch::Tensor input_norm, q_norm, k_norm, post_attention_norm, pre_feedforward_norm, post_feedforward_norm;
  Product qkv, o, gate_up, down;
  int64_t kind;
};

// One sequence's rows in a Gemma-3 forward over several (GemmaStack.forward_segments): how many, the cache
// row its first new key goes to, its cache buffers per layer ([1, kv, capacity, d]) and its attention bias per
// layer kind (none: causal).
struct GemmaSegment {
  int64_t rows, start;
  const std::vector<torch::Tensor>* keys;
  const std::vector<torch::Tensor>* values;
  const std::vector<c10::optional<torch::Tensor>>* biases;
};

// gemma_layer: Gemma-3 decoder layer i over the rows of segs (one after another in x [R, H]), in place:
// qkv(rms(x)), RMSNorms on each query and key head, rotary, attention; x += rms(o(.)); then
// x += rms(down(gelu_tanh(gate) * up)) with gate, up = gate_up(rms(x)). The products and norms run over all rows
// (each row's result its own); rotary, cache writes, attention and the activation per sequence, each on its rows
// alone. The kernels and sums of the separate calls eagle.runtime.gemma makes (the activation is torch's), so a
// row gets the bits of its sequence's forward alone.
void gemma_layer(torch::Tensor x, const GemmaLayerWeights& l, size_t i, const torch::Tensor& cos,
                 const torch::Tensor& sin, const std::vector<GemmaSegment>& segs, int64_t nh, double scale, double eps) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2, "gemma_layer: x fp32 [R, H]");
  const torch::Tensor qkv = linear_rows(rms_norm(x, l.input_norm, eps), l.qkv);
  const torch::Tensor& first = (*segs[0].keys)[i];
  const int64_t nkv = first.size(1), d = first.size(3), heads = qkv.size(1) / d;
  TORCH_CHECK(heads == nh + 2 * nkv && l.q_norm.numel() == d && l.k_norm.numel() == d, "gemma_layer: head widths");
  head_norms(qkv, l.q_norm, l.k_norm, nh, nkv, eps);
  std::vector<torch::Tensor> outs;
  int64_t row = 0;
  for (const GemmaSegment& s : segs) {
    const torch::Tensor key_buf = (*s.keys)[i][0], value_buf = (*s.values)[i][0];
    const torch::Tensor qr = rope_cache(qkv.narrow(0, row, s.rows), cos.narrow(0, row, s.rows),
                                        sin.narrow(0, row, s.rows), key_buf, value_buf, nh, s.start);
    outs.push_back(attention(qr, key_buf, value_buf, s.start + s.rows, (*s.biases)[l.kind], scale));
    row += s.rows;
  }
  x.add_(rms_norm(linear_rows(outs.size() == 1 ? outs[0] : torch::cat(outs), l.o), l.post_attention_norm, eps));
  const torch::Tensor gate_up = linear_rows(rms_norm(x, l.pre_feedforward_norm, eps), l.gate_up);
  const int64_t inter = gate_up.size(1) / 2;
  std::vector<torch::Tensor> acts;
  row = 0;
  for (const GemmaSegment& s : segs) {  // torch's activation on each sequence's rows: the shape it has alone
    const torch::Tensor g = gate_up.narrow(0, row, s.rows);
    acts.push_back((at::gelu(g.narrow(1, 0, inter), "tanh") * g.narrow(1, inter, inter)).contiguous());
    row += s.rows;
  }
  x.add_(rms_norm(linear_rows(acts.size() == 1 ? acts[0] : torch::cat(acts), l.down), l.post_feedforward_norm, eps));
}

// GemmaStack: a Gemma-3 target's decoder layers, handed over once (add) and run by one call a forward.
class GemmaStack {
 public:
  GemmaStack(int64_t nh, double scale, double eps) : nh_(nh), scale_(scale), eps_(eps) {}

  // One more layer: its six norm scales (input, q, k, post-attention, pre-feedforward, post-feedforward), its
  // products qkv, o, gate_up, down (as Product holds them), and its kind.
  void add(const std::vector<torch::Tensor>& norms, const std::vector<ProductArgs>& products, int64_t kind) {
    TORCH_CHECK(norms.size() == 6, "GemmaStack.add: six norms");
    for (const auto& n : norms)
      TORCH_CHECK(n.dtype() == torch::kFloat32 && n.is_contiguous() && n.dim() == 1, "GemmaStack.add: fp32 norms");
    const std::array<Product, 4> p = four_products(products, "GemmaStack.add");
    layers_.push_back({norms[0], norms[1], norms[2], norms[3], norms[4], norms[5], p[0], p[1], p[2], p[3], kind});
  }

  // Every layer in order on x [R, H], in place, for S sequences at once (one alone: S = 1): x holds their rows one
  // after another, sizes[s] each; sequence s writes its keys and values from row starts[s] of keys[s][i][0],
  // values[s][i][0] (buffers [1, kv, capacity, d]) and attends under biases[s][t] (as for attention; none: causal)
  // in a layer of kind t; cos[t], sin[t] [R, d]. The weights are read once for all R rows. Returns copies of x
  // after each layer listed in aux, in aux's order.
  std::vector<torch::Tensor> forward_segments(torch::Tensor x, const std::vector<torch::Tensor>& cos,
                                              const std::vector<torch::Tensor>& sin, const std::vector<int64_t>& sizes,
                                              const std::vector<int64_t>& starts,
                                              const std::vector<std::vector<torch::Tensor>>& keys,
                                              const std::vector<std::vector<torch::Tensor>>& values,
                                              const std::vector<std::vector<c10::optional<torch::Tensor>>>& biases,
                                              const std::vector<int64_t>& aux) {
    const size_t n = sizes.size();
    TORCH_CHECK(n > 0 && starts.size() == n && keys.size() == n && values.size() == n && biases.size() == n,
                "GemmaStack.forward_segments: sizes, starts, keys, values and biases per sequence");
    std::vector<GemmaSegment> segs;
    int64_t rows = 0;
    for (size_t s = 0; s < n; ++s) {
      TORCH_CHECK(sizes[s] >= 1, "GemmaStack.forward_segments: rows in every sequence");
      TORCH_CHECK(keys[s].size() == layers_.size() && values[s].size() == layers_.size() &&
                  biases[s].size() == cos.size(), "GemmaStack: a buffer per layer, a bias per layer kind");
      segs.push_back({sizes[s], starts[s], &keys[s], &values[s], &biases[s]});
      rows += sizes[s];
    }
    TORCH_CHECK(rows == x.size(0), "GemmaStack.forward_segments: the sizes add up to x's rows");
    std::vector<torch::Tensor> outputs(aux.size());
    for (size_t i = 0; i < layers_.size(); ++i) {
      const GemmaLayerWeights& l = layers_[i];
      TORCH_CHECK(l.kind >= 0 && l.kind < static_cast<int64_t>(cos.size()) && cos.size() == sin.size(),
                  "GemmaStack: cos and sin per layer kind");
      gemma_layer(x, l, i, cos[l.kind], sin[l.kind], segs, nh_, scale_, eps_);
      for (size_t j = 0; j < aux.size(); ++j)
        if (aux[j] == static_cast<int64_t>(i)) outputs[j] = x.clone();
    }
    return outputs;
  }

 private:
  int64_t nh_;
  double scale_, eps_;
  std::vector<GemmaLayerWeights> layers_;
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

}  // namespace EAGLE_ISA_NS

using namespace EAGLE_ISA_NS;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.attr("isa") = kIsa;
  m.def("stream_linear", &stream_linear, "y = x W^T (+ b), fp32, 1-16 rows, W streamed once", py::arg("x"),
        py::arg("w"), py::arg("bias"), py::arg("once") = false);
  m.attr("stream_rows_q") = kPanels ? int64_t(1) << 40 : kMaxRows;
  m.def("stream_linear_q", &stream_linear_q, "stream_linear with W as exact block codes and scales: the same bits",
        py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("bias"), py::arg("once") = false,
        py::arg("int8") = false);
  m.attr("int8_activations") = kInt8;
  m.def("stream_linear_gguf", &stream_linear_gguf, "stream_linear with W as its GGUF rows (GGML type): the bits of "
        "the de-quantized W", py::arg("x"), py::arg("raw"), py::arg("type"), py::arg("bias"), py::arg("int8") = false);
  m.def("stream_linear_gguf_parts", &stream_linear_gguf_parts, "stream_linear_gguf of several GGUF parts, their "
        "outputs side by side", py::arg("x"), py::arg("raws"), py::arg("types"), py::arg("bias"),
        py::arg("int8") = false);
  m.def("gguf_interleave", &gguf_interleave, "a Q4_K or Q6_K matrix's rows interleaved 8 at a time, in place; "
        "returns the products' type for them", py::arg("raw"), py::arg("type"));
  m.def("gguf_deinterleave", &gguf_deinterleave, "interleaved rows in GGUF's layout (a copy)", py::arg("raw"),
        py::arg("type"));
  m.def("gguf_interleaved_rows", &gguf_interleaved_rows, "rows of interleaved rows in GGUF's layout",
        py::arg("raw"), py::arg("type"), py::arg("index"));
  m.def("gguf_dequantize_rows", &gguf_dequantize_rows, "rows of a GGUF matrix de-quantized to fp32 (as gguf-py)",
        py::arg("raw"), py::arg("type"), py::arg("index"));
  m.def("rms_norm", &rms_norm, "Llama's RMSNorm, fp32, one pass per row");
  m.def("rope_cache", &rope_cache, "rotary queries and keys, keys and values into the cache buffers, fp32");
  m.def("attention", &attention, "grouped-query attention of a few rows over the cache, fp32, row-independent");
  m.def("silu_mul", &silu_mul, "silu(gate) * up, fp32");
  m.def("int8_radius", &int8_radius, "how far each int8-product logit of rows x can be from the fp32 one, per unit "
        "of the weight row's norms (float64 [N, 2])", py::arg("x"), py::arg("gamma"), py::arg("block") = 32);
  m.def("screen_candidates", &screen_candidates, "the tokens an approximate head's bound leaves within reach of each "
        "row's best: (their union, which each row keeps), or empty ones where the whole head must decide",
        py::arg("approx"), py::arg("radius"), py::arg("norms"), py::arg("slack"), py::arg("most"));
  m.def("argmax_rows", &argmax_rows, "each row's first largest value's index (torch's argmax), fp32 [N, V]");
  m.def("compact_rows", &compact_rows, "copy rows keep[j] of each cache buffer to start + j, for all layers at once");
  py::class_<DecoderStack>(m, "DecoderStack", py::module_local(), "decoder layers run by one call a forward (decoder_layer each)")
      .def(py::init<int64_t, double>(), py::arg("nh"), py::arg("scale"))
      .def("add", &DecoderStack::add, "append a layer: its norms and four products (w, scales, raws, types, bias, int8)",
           py::arg("input_norm"), py::arg("input_eps"), py::arg("post_norm"), py::arg("post_eps"), py::arg("products"),
           py::arg("q_norm") = py::none(), py::arg("k_norm") = py::none())
      .def("forward", &DecoderStack::forward, "every layer in place on x [q, H]; copies of x after the aux layers",
           py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("keys"), py::arg("values"), py::arg("start"),
           py::arg("bias"), py::arg("once"), py::arg("aux"));
  py::class_<GemmaStack>(m, "GemmaStack", py::module_local(), "a Gemma-3 target's decoder layers run by one call")
      .def(py::init<int64_t, double, double>(), py::arg("nh"), py::arg("scale"), py::arg("eps"))
      .def("add", &GemmaStack::add, "append a layer: six norm scales, four products, its kind",
           py::arg("norms"), py::arg("products"), py::arg("kind"))
      .def("forward_segments", &GemmaStack::forward_segments,
           "every layer in place on the rows of one or more sequences, each with its own cache and biases; the "
           "weights read once; copies of x after the aux layers",
           py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("sizes"), py::arg("starts"), py::arg("keys"),
           py::arg("values"), py::arg("biases"), py::arg("aux"));
}
