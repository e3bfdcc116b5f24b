// One Llama-family decoder layer in bf16 for batch-1 decoding and tree verification on x86 CPUs.
//
// Why C++: a 135M model's decoding step is ~120 small GEMVs plus ~20 elementwise ops per layer. Through PyTorch
// each op pays dispatch and thread wake-up costs and the bf16 GEMVs reach ~2/3 of the memory bandwidth; here one
// call runs a whole layer and the GEMV streams the weights once, accumulating bf16 products in fp32.
//
// One source, two builds (kernels/cpu_layer.py passes the macro): DRAFTSMITH_ISA_AVX512_BF16 for AVX512-BF16 CPUs
// and DRAFTSMITH_ISA_AVX2 for AVX2+FMA ones without AVX-512 (e.g. AMD Zen 3). Only the small vector layer below
// differs between them; the GEMM, norms, RoPE, attention and SiLU are written once over its "16 fp32 lanes" type.
//
// The plain-PyTorch reference is LeanDecoder's torch path (draftsmith/runtime/target/model.py); rounding to bf16 happens
// where transformers rounds (after each projection, norm, activation and residual add), accumulation is fp32.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

namespace {

using bf16 = uint16_t;

inline float to_f(bf16 v) {
  uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// ---- vector layer: vf = 16 fp32 lanes ----------------------------------------------------------------------------
// Loads and stores of bf16 take n, the number of valid lanes (1..16): lanes past n read as zero and are not written,
// which covers the tails of rows that are not a multiple of 16 long.
#if defined(DRAFTSMITH_ISA_AVX512_BF16)

using vf = __m512;

inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset1(float a) { return _mm512_set1_ps(a); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vfmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline __mmask16 lanes(int64_t n) { return (__mmask16)((1u << n) - 1); }

// bf16 -> fp32 is the 16-bit pattern moved to the top half of the 32-bit lane.
inline vf load_bf(const bf16* p, int64_t n = 16) {
  const __m256i raw = _mm256_maskz_loadu_epi16(lanes(n), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline void store_bf(bf16* p, vf v, int64_t n = 16) {  // round to nearest even, as torch does
  _mm256_mask_storeu_epi16(p, lanes(n), (__m256i)_mm512_cvtneps_pbh(v));
}
inline vf round_bf(vf v) {  // to bf16 precision (nearest even) and back
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline float hsum(vf v) { return _mm512_reduce_add_ps(v); }
inline vf vround_int(vf v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT); }
inline vf vtimes_pow2(vf p, vf n) { return _mm512_scalef_ps(p, n); }  // p * 2^n, n integral in [-126, 127]
inline bool any_gt(vf v, vf t) { return _mm512_cmp_ps_mask(v, t, _CMP_GT_OQ) != 0; }
inline vf zero_where_neg_inf(vf score, vf v) {
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(score, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ), v);
}
// Running argmax per lane: y (at column indices idx) replaces best where it wins: greater, or NaN over a number
// (torch.argmax ranks NaN highest). Only a strict win replaces, so the earlier column keeps a tie.
inline void argmax_step(vf y, vf idx, vf& best, vf& best_idx) {
  const __mmask16 win = _mm512_cmp_ps_mask(y, best, _CMP_GT_OQ) |
                        (_mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q) & _mm512_cmp_ps_mask(best, best, _CMP_ORD_Q));
  best = _mm512_mask_mov_ps(best, win, y);
  best_idx = _mm512_mask_mov_ps(best_idx, win, idx);
}

// GEMM operands (see "Packed weights" below): one packed 64-byte weight vector (16 rows x one column pair, lane r =
// W[r,2p+1] << 16 | W[r,2p]) and one token's input pair (x[2p+1] << 16 | x[2p]) broadcast to every lane, both fed to
// vdpbf16ps as they are: the input stays bf16 (xelem), nothing is widened.
using xelem = bf16;
using wpair = __m512bh;
inline wpair load_w(const bf16* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline __m512bh load_x(const bf16* x) {
  int32_t pair;
  std::memcpy(&pair, x, 4);
  return (__m512bh)_mm512_set1_epi32(pair);
}
// acc + W[r,2p+1] x[2p+1] + W[r,2p] x[2p] per lane r: vdpbf16ps adds the odd product first, then the even one, each
// an fp32 FMA rounded to nearest even (the products of two bf16 are exact), with subnormal inputs read as zero and
// subnormal results flushed to zero. Checked bit for bit against that FMA sequence on Zen 4, subnormals included.
inline vf madd_pair(vf acc, wpair w, __m512bh x) { return _mm512_dpbf16_ps(acc, w, x); }
// Nothing to set: vdpbf16ps flushes subnormals by itself, whatever MXCSR says, and so does vcvtneps2bf16 (store_bf,
// round_bf) with a subnormal sum in the epilogue (checked on Zen 4).
struct FlushSubnormals {
  FlushSubnormals() {}
};

// q.k over d (a multiple of 16) bf16 values: vdpbf16ps multiplies bf16 pairs exactly and accumulates in fp32.
inline float dot_bf16(const bf16* a, const bf16* b, int64_t d) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t k = 0; k < d; k += 32) {
    const __mmask32 m = d - k >= 32 ? ~__mmask32(0) : (__mmask32)((1ull << (d - k)) - 1);
    const __m512bh x = (__m512bh)_mm512_maskz_loadu_epi16(m, a + k), y = (__m512bh)_mm512_maskz_loadu_epi16(m, b + k);
    acc = _mm512_dpbf16_ps(acc, x, y);
  }
  return _mm512_reduce_add_ps(acc);
}

// out[j] = dot_bf16(q, k + j * d, d) for 16 consecutive K rows, bit for bit: the same vdpbf16ps chain per row, then
// the 16 sums reduced together in GCC's _mm512_reduce_add_ps pairing (lane i+8 onto i, then i+4, i+2, i+1) by
// transposing shuffles, where 16 separate horizontal sums cost ~4 dependent shuffle-adds each.
inline void dot16_bf16(const bf16* q, const bf16* k, int64_t d, float* out) {
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; c += 32) {
    const __mmask32 m = d - c >= 32 ? ~__mmask32(0) : (__mmask32)((1ull << (d - c)) - 1);
    const __m512bh x = (__m512bh)_mm512_maskz_loadu_epi16(m, q + c);
    for (int j = 0; j < 16; ++j)
      acc[j] = _mm512_dpbf16_ps(acc[j], x, (__m512bh)_mm512_maskz_loadu_epi16(m, k + j * d + c));
  }
  __m512 r1[8], r2[4], r3[2];
  for (int p = 0; p < 8; ++p)  // [row 2p's lane i + lane i+8 (i < 8) | row 2p+1's]
    r1[p] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * p], acc[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_f32x4(acc[2 * p], acc[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int u = 0; u < 4; ++u)  // 128-bit block b: row 4u+b's lane j + lane j+4 (j < 4)
    r2[u] = _mm512_add_ps(_mm512_shuffle_f32x4(r1[2 * u], r1[2 * u + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_f32x4(r1[2 * u], r1[2 * u + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int w = 0; w < 2; ++w) {  // block b: [lane 0+2, 1+3 of row 8w+b, the same of row 8w+4+b]
    const __m512d a = _mm512_castps_pd(r2[2 * w]), b = _mm512_castps_pd(r2[2 * w + 1]);
    r3[w] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // block b: the sums of rows b, 4+b, 8+b, 12+b; a 4 x 4 transpose puts row j at lane j
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(r3[0], r3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_ps(r3[0], r3[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  _mm512_storeu_ps(out, _mm512_permutexvar_ps(order, sums));
}

// GEMM tiles (blocks of 16 rows x tokens, one fp32 accumulator each): a task takes kGroupBlocks blocks, as one tile
// per kTileTokens tokens. 4 x 6 accumulators + 4 weight vectors + broadcast inputs fit the 32 zmm registers
// without spills (4 x 7 spills). Against 4 x 4 on Zen 4, one thread, the 135M model's linears: T = 5 0.85x the time
// (one pass over the weights instead of a 4-token tile and a latency-bound 1-token one), T = 8 0.86x, T = 16 0.93x.
constexpr int kGroupBlocks = 4, kTileBlocks = 4, kTileTokens = 6;
// Attention's V pass holds rows x (head_dim / 16) accumulators: 16 zmm, beside head_dim / 16 V vectors.
constexpr int kAccRegs = 16;

#elif defined(DRAFTSMITH_ISA_AVX2)

struct vf {
  __m256 lo, hi;  // lanes 0-7, 8-15
};

inline vf vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline vf vset1(float a) { const __m256 s = _mm256_set1_ps(a); return {s, s}; }
inline vf vadd(vf a, vf b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline vf vsub(vf a, vf b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline vf vmul(vf a, vf b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline vf vdiv(vf a, vf b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline vf vfmadd(vf a, vf b, vf c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline vf vmax(vf a, vf b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline vf vmin(vf a, vf b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline vf vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v.lo); _mm256_storeu_ps(p + 8, v.hi); }

// AVX2 has no 16-bit masked loads/stores: tails go through a zeroed stack buffer (rare: only rows not a multiple
// of 16 long reach them).
inline vf load_bf(const bf16* p, int64_t n = 16) {
  __m256i raw;
  if (n >= 16) {
    raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  } else {
    alignas(32) bf16 buf[16] = {};
    std::memcpy(buf, p, n * sizeof(bf16));
    raw = _mm256_load_si256(reinterpret_cast<const __m256i*>(buf));
  }
  const __m256i lo = _mm256_cvtepu16_epi32(_mm256_castsi256_si128(raw));       // [8] u32
  const __m256i hi = _mm256_cvtepu16_epi32(_mm256_extracti128_si256(raw, 1));  // [8] u32
  return {_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16))};
}

// fp32 bits rounded to nearest even at bit 16 (the bf16 pattern is the top half); NaN becomes the quiet NaN
// 0x7FC0, as c10::BFloat16 does, instead of being rounded into an infinity or a different payload.
inline __m256i rne_bits(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC00000), nan);
}
inline void store_bf(bf16* p, vf v, int64_t n = 16) {
  const __m256i lo = _mm256_srli_epi32(rne_bits(v.lo), 16), hi = _mm256_srli_epi32(rne_bits(v.hi), 16);
  // packus interleaves 128-bit halves (lo0-3 hi0-3 lo4-7 hi4-7); the permute puts lanes back in order.
  const __m256i h = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8);  // [16] u16
  if (n >= 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
  } else {
    alignas(32) bf16 buf[16];
    _mm256_store_si256(reinterpret_cast<__m256i*>(buf), h);
    std::memcpy(p, buf, n * sizeof(bf16));
  }
}
inline vf round_bf(vf v) {
  const __m256i top = _mm256_set1_epi32(int(0xFFFF0000u));
  return {_mm256_castsi256_ps(_mm256_and_si256(rne_bits(v.lo), top)),
          _mm256_castsi256_ps(_mm256_and_si256(rne_bits(v.hi), top))};
}
inline float hsum(vf v) {
  const __m256 s8 = _mm256_add_ps(v.lo, v.hi);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline vf vround_int(vf v) {
  constexpr int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(v.lo, mode), _mm256_round_ps(v.hi, mode)};
}
// p * 2^n for integral n in [-126, 127]: 2^n is built directly as the fp32 pattern (n + 127) << 23 (no scalef).
inline __m256 times_pow2(__m256 p, __m256 n) {
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
inline vf vtimes_pow2(vf p, vf n) { return {times_pow2(p.lo, n.lo), times_pow2(p.hi, n.hi)}; }
inline bool any_gt(vf v, vf t) {
  return _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(v.lo, t.lo, _CMP_GT_OQ), _mm256_cmp_ps(v.hi, t.hi, _CMP_GT_OQ)));
}
inline vf zero_where_neg_inf(vf score, vf v) {
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  return {_mm256_and_ps(_mm256_cmp_ps(score.lo, ninf, _CMP_NEQ_OQ), v.lo),
          _mm256_and_ps(_mm256_cmp_ps(score.hi, ninf, _CMP_NEQ_OQ), v.hi)};
}
// The argmax step of the AVX-512 layer, on two halves (a win: greater, or NaN over a number).
inline __m256 wins(__m256 y, __m256 best) {
  const __m256 nan_over_number =
      _mm256_and_ps(_mm256_cmp_ps(y, y, _CMP_UNORD_Q), _mm256_cmp_ps(best, best, _CMP_ORD_Q));
  return _mm256_or_ps(_mm256_cmp_ps(y, best, _CMP_GT_OQ), nan_over_number);
}
inline void argmax_step(vf y, vf idx, vf& best, vf& best_idx) {
  const __m256 lo = wins(y.lo, best.lo), hi = wins(y.hi, best.hi);
  best = {_mm256_blendv_ps(best.lo, y.lo, lo), _mm256_blendv_ps(best.hi, y.hi, hi)};
  best_idx = {_mm256_blendv_ps(best_idx.lo, idx.lo, lo), _mm256_blendv_ps(best_idx.hi, idx.hi, hi)};
}

// GEMM operands without a bf16 dot product: the input is widened to fp32 once (xelem), and the 64-byte packed
// weight vector is split as two 32-byte halves (rows 0-7, then rows 8-15) into its two columns in fp32.
using xelem = float;
struct wpair {
  vf even, odd;  // columns 2p and 2p+1 of the 16 rows
};
inline wpair load_w(const bf16* p) {
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
  const __m256i top = _mm256_set1_epi32(int(0xFFFF0000u));
  return {{_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16))},
          {_mm256_castsi256_ps(_mm256_and_si256(lo, top)), _mm256_castsi256_ps(_mm256_and_si256(hi, top))}};
}
inline const float* load_x(const float* x) { return x; }  // broadcast at each use: 16 ymm leave no room to hold them
// vdpbf16ps's arithmetic, so that both builds give the same bits: the odd product first, then the even one, each an
// fp32 FMA (exact products of bf16), under FlushSubnormals.
inline vf madd_pair(vf acc, const wpair& w, const float* x) {
  return vfmadd(w.even, vset1(x[0]), vfmadd(w.odd, vset1(x[1]), acc));
}
// MXCSR DAZ | FTZ for the duration of one GEMM task (a thread's share of the blocks): subnormal inputs read as
// zero and subnormal results flush to zero, as in vdpbf16ps, so subnormal weights, inputs or partial sums give the
// AVX-512 build's bits too; and a subnormal bias + sum flushes as vcvtneps2bf16 flushes it there. The one case left
// apart: a bias or residual that is itself a subnormal bf16 (AVX-512 adds it, here it reads as zero), which changes
// an output only when that output is below ~2^-117. Per task, not per tile: MXCSR writes drain the FP pipeline, and
// around every tile they made a 16-token verify 1.5x slower.
struct FlushSubnormals {
  const unsigned saved = _mm_getcsr();
  FlushSubnormals() { _mm_setcsr(saved | 0x8040u); }  // FTZ (bit 15) | DAZ (bit 6)
  ~FlushSubnormals() { _mm_setcsr(saved); }
  FlushSubnormals(const FlushSubnormals&) = delete;
  FlushSubnormals& operator=(const FlushSubnormals&) = delete;
};

// q.k in fp32 FMAs on widened bf16 (products of two bf16 are exact in fp32, as with vdpbf16ps).
inline float dot_bf16(const bf16* a, const bf16* b, int64_t d) {
  vf acc = vzero();
  for (int64_t k = 0; k < d; k += 16) acc = vfmadd(load_bf(a + k), load_bf(b + k), acc);
  return hsum(acc);
}

// out[j] = dot_bf16(q, k + j * d, d) for 16 consecutive K rows (the AVX-512 build batches the horizontal sums).
inline void dot16_bf16(const bf16* q, const bf16* k, int64_t d, float* out) {
  for (int j = 0; j < 16; ++j) out[j] = dot_bf16(q, k + j * d, d);
}

// GEMM tiles with 16 ymm registers, each vf taking two: a single token runs the task's 4 blocks at once (8 ymm of
// accumulators, 4 weight streams in flight); several tokens run 1 block x 4 tokens (8 ymm of accumulators + 8
// broadcast inputs), which reuses each unpacked weight vector 4 times without spilling. On Zen 4, 8 tokens: 1 x 4
// took 3.3 ms per 28 MB of weights, 4 x 2 (spills) 3.5, 2 x 2 5.1, the single-token 4 x 1 tile 5.7.
constexpr int kGroupBlocks = 4, kTileBlocks = 1, kTileTokens = 4;
constexpr int kAccRegs = 4;  // attention's V accumulators (8 ymm), as kAccRegs above

#else
#error "define DRAFTSMITH_ISA_AVX512_BF16 or DRAFTSMITH_ISA_AVX2 (kernels/cpu_layer.py does)"
#endif

// exp of 16 lanes: x = n ln2 + r, |r| <= ln2/2, degree-6 Taylor polynomial (relative error < 2e-7), times 2^n.
inline vf vexp(vf x) {
  x = vmax(vmin(x, vset1(88.f)), vset1(-87.f));
  const vf n = vround_int(vmul(x, vset1(1.44269504f)));
  vf r = vfmadd(n, vset1(-0.693145751953125f), x);  // ln2 split in two for an exact n * ln2_hi
  r = vfmadd(n, vset1(-1.428606765330187e-06f), r);
  vf p = vset1(1.f / 720);
  for (float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = vfmadd(p, r, vset1(c));
  return vtimes_pow2(p, n);
}

const bf16* ptr(const torch::Tensor& t) { return reinterpret_cast<const bf16*>(t.data_ptr()); }
const bf16* opt_ptr(const std::optional<torch::Tensor>& t) { return t ? ptr(*t) : nullptr; }

// Packed weights: W [N, K] is stored as [ceil(N/16), K/2, 16, 2], zero-padded to whole blocks of 16 rows, so one
// 64-byte load holds 16 rows x 2 columns. As 16 x 32-bit lanes, lane r = W[r, 2p+1] << 16 | W[r, 2p]: the operand
// vdpbf16ps takes, against one token's pair of x broadcast to every lane, one instruction per 16 rows x 2 columns x
// token. (On Zen 4 a zmm vdpbf16ps issues at one per cycle, as a zmm FMA does, and does the work of the 2 FMAs the
// fp32 form needed per pair, with no unpacking. A 135M target's whole forward, one thread, against that fp32 form:
// T = 1 0.94x the time, T = 2-4 about the same (bandwidth-bound), T = 5 0.85x, T = 8 0.74x, T = 16 0.66x.)
// The AVX2 build, with no bf16 dot product, splits the vector into its two columns in fp32 and runs vdpbf16ps's
// arithmetic as 2 FMAs (madd_pair), so both builds produce the same bits.
// Each weight byte is read once per forward, whatever T is, and every output is one chain of madd_pair over the
// pairs in order, whatever the tile: a token's row does not depend on T, the tiling or the thread split.

#ifndef PREFETCH
#define PREFETCH 16  // in 64-byte vectors
#endif

// Where a GEMM writes: Y [T, ld] holds output columns [col0, col0 + ld) (the whole [T, N] for a plain GEMM; a
// small per-task window when the LM head is reduced to an argmax without materialising [T, V]).
struct Out {
  bf16* y;
  int64_t ld, col0;
};

// Blocks [b0, b0+G) of 16 rows against tokens [t0, t0+NT): Y = bf16(bf16(X W^T + bias) + res), rows < N only.
// X is the input [T, K] as the GEMM reads it (xelem: bf16, or its fp32 copy in the AVX2 build); res is [T, N].
template <int G, int NT>
inline void tile(const xelem* X, int64_t K, const bf16* P, int64_t N, int64_t b0, int64_t t0, const bf16* bias,
                 const bf16* res, Out Y) {
  const int64_t pairs = K / 2;
  vf acc[G][NT];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NT; ++j) acc[g][j] = vzero();
  const bf16* base = P + b0 * pairs * 32;
  for (int64_t p = 0; p < pairs; ++p) {
    for (int g = 0; g < G; ++g) {
      // Software prefetch 1 KiB ahead: the hardware streamer stops at each 4 KiB page, and a 576-wide layer's
      // stream per block is only 18 KiB long.
      _mm_prefetch(reinterpret_cast<const char*>(base + (g * pairs + p + PREFETCH) * 32), _MM_HINT_T0);
      const wpair w = load_w(base + (g * pairs + p) * 32);  // columns 2p and 2p+1 of the 16 rows
      for (int j = 0; j < NT; ++j) acc[g][j] = madd_pair(acc[g][j], w, load_x(X + (t0 + j) * K + 2 * p));
    }
  }
  for (int g = 0; g < G; ++g) {
    const int64_t r0 = (b0 + g) * 16, valid = std::min<int64_t>(16, N - r0);
    const vf b = bias ? load_bf(bias + r0, valid) : vzero();
    for (int j = 0; j < NT; ++j) {
      vf y = round_bf(vadd(acc[g][j], b));
      if (res) y = vadd(y, load_bf(res + (t0 + j) * N + r0, valid));
      store_bf(Y.y + (t0 + j) * Y.ld + r0 - Y.col0, y, valid);
    }
  }
}

// Tokens [t0, T) in tiles of NT, the remainder (< NT tokens) as one smaller tile.
template <int G, int NT>
inline void token_tiles(const xelem* X, int64_t T, int64_t K, const bf16* P, int64_t N, int64_t b0, int64_t t0,
                        const bf16* bias, const bf16* res, Out Y) {
  for (; t0 + NT <= T; t0 += NT) tile<G, NT>(X, K, P, N, b0, t0, bias, res, Y);
  if constexpr (NT > 1)
    if (t0 < T) token_tiles<G, NT - 1>(X, T, K, P, N, b0, t0, bias, res, Y);
}

// Blocks [b0, b0+G) against all T tokens: one token as a G-block tile (G weight streams at once, bandwidth-bound);
// several in tiles of kTileBlocks x kTileTokens (each weight vector reused across tokens, compute-bound).
template <int G>
inline void block_group(const xelem* X, int64_t T, int64_t K, const bf16* P, int64_t N, int64_t b0, const bf16* bias,
                        const bf16* res, Out Y) {
  constexpr int TB = std::min(G, kTileBlocks);
  static_assert(G % TB == 0, "a group is a whole number of tiles");
  if (T == 1) return tile<G, 1>(X, K, P, N, b0, 0, bias, res, Y);
  for (int g = 0; g < G; g += TB) token_tiles<TB, kTileTokens>(X, T, K, P, N, b0 + g, 0, bias, res, Y);
}

// The input X [T, K] as the tiles read it: as it is for vdpbf16ps; in fp32 once for the AVX2 build's FMAs.
class GemmInput {
 public:
  GemmInput(const bf16* X, int64_t n) {
#if defined(DRAFTSMITH_ISA_AVX512_BF16)
    (void)n;
    data_ = X;
#else
    widened_.resize(n);  // [T * K]
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) vstore(widened_.data() + i, load_bf(X + i));
    for (; i < n; ++i) widened_[i] = to_f(X[i]);
    data_ = widened_.data();
#endif
  }
  const xelem* data() const { return data_; }

 private:
  std::vector<float> widened_;
  const xelem* data_;
};

// A task should stream >= ~64 KiB of weights, or waking the second thread costs more than it saves: the grain in
// blocks of 16 rows (whole groups of kGroupBlocks).
int64_t group_grain(int64_t K) { return std::max<int64_t>(1, (64 * 1024) / (kGroupBlocks * 16 * K * 2)); }

// Blocks [b0, b1) in groups of kGroupBlocks, the 1-3 left over as one narrower group (still several weight streams).
// One GEMM task: subnormals flush as vdpbf16ps flushes them, in both builds.
void block_range(const xelem* X, int64_t T, int64_t K, const bf16* P, int64_t N, int64_t b0, int64_t b1,
                 const bf16* bias, const bf16* res, Out Y) {
  const FlushSubnormals flush;
  constexpr int G = kGroupBlocks;
  static_assert(G == 4, "the remainder switch below covers 1-3 blocks");
  for (; b0 + G <= b1; b0 += G) block_group<G>(X, T, K, P, N, b0, bias, res, Y);
  switch (b1 - b0) {
    case 3: return block_group<3>(X, T, K, P, N, b0, bias, res, Y);
    case 2: return block_group<2>(X, T, K, P, N, b0, bias, res, Y);
    case 1: return block_group<1>(X, T, K, P, N, b0, bias, res, Y);
    default: return;
  }
}

// Threads split whole blocks, not groups of 4: a 576-row output (36 blocks, 9 groups) split 5/4 groups (20/16
// blocks, the slower thread 11% over an even split) and now splits 18/18; the leftover blocks after the last whole
// group, which ran on one thread after the parallel region, are shared too. Per output the accumulation order is
// the same whatever the split, so results do not depend on the thread count.
// Y [T, N] = X [T, K] @ W^T (+ bias [N]) (+ res [T, N]) with W packed as above; K even.
void gemm(const bf16* X, int64_t T, int64_t K, const bf16* P, int64_t N, const bf16* bias, const bf16* res, bf16* Y) {
  const GemmInput xf(X, T * K);  // [T, K]
  const int64_t blocks = (N + 15) / 16;
  const Out out{Y, N, 0};
  at::parallel_for(0, blocks, kGroupBlocks * group_grain(K), [&](int64_t a, int64_t b) {
    block_range(xf.data(), T, K, P, N, a, b, bias, res, out);
  });
}

// One token's argmax so far over the columns a task ran (i < 0: none yet).
struct Winner {
  float v;
  int64_t i;
};

// (v, i) beats w in torch.argmax's order: the larger value, NaN above every number, the lower column among equals.
inline bool beats(float v, int64_t i, const Winner& w) {
  if (w.i < 0) return true;
  const bool vn = std::isnan(v), wn = std::isnan(w.v);
  if (vn != wn) return vn;
  if (!vn && v != w.v) return v > w.v;
  return i < w.i;
}

// Per-lane running maxima of each token over the output windows one task produced: lane r of chunk c holds column
// col0 + 16c + r. Column indices ride in fp32 lanes (exact below 2^24, checked by the caller).
struct LaneMax {
  std::vector<vf> v, i;  // [T] x 16 lanes
  bool started = false;
  explicit LaneMax(int64_t T) : v(T), i(T) {}

  // Fold a bf16 window [T, ld] of n (a multiple of 16) columns starting at col0; the first one initialises.
  void fold(const bf16* win, int64_t T, int64_t ld, int64_t col0, int64_t n) {
    alignas(64) static const float iota[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    for (int64_t c = 0; c < n; c += 16) {
      const vf at = vadd(vload(iota), vset1(float(col0 + c)));
      for (int64_t t = 0; t < T; ++t) {
        const vf y = load_bf(win + t * ld + c);
        if (started) {
          argmax_step(y, at, v[t], i[t]);
        } else {
          v[t] = y;
          i[t] = at;
        }
      }
      started = true;
    }
  }

  void merge_into(std::vector<Winner>& out) const {
    if (!started) return;
    alignas(64) float lv[16], li[16];
    for (size_t t = 0; t < out.size(); ++t) {
      vstore(lv, v[t]);
      vstore(li, i[t]);
      for (int r = 0; r < 16; ++r)
        if (beats(lv[r], int64_t(li[r]), out[t])) out[t] = {lv[r], int64_t(li[r])};
    }
  }
};

// idx [T] = the argmax over the N outputs of X [T, K] @ W^T (+ bias) for each token, every output rounded to bf16
// exactly as gemm stores it, without writing the [T, N] matrix: the LM head of a greedy step. Each task runs its
// groups into a [T, 16G] window that stays in L1 and folds it into per-lane maxima; the tasks' winners merge last.
void gemm_argmax(const bf16* X, int64_t T, int64_t K, const bf16* P, int64_t N, const bf16* bias, int64_t* idx) {
  constexpr int G = kGroupBlocks, W = 16 * G;
  const GemmInput xf(X, T * K);  // [T, K]
  const int64_t blocks = (N + 15) / 16, groups = (N / 16) / G;  // whole groups of whole blocks run in parallel
  std::vector<Winner> best(T, Winner{0.f, -1});
  std::mutex merging;
  at::parallel_for(0, groups, group_grain(K), [&](int64_t a, int64_t b) {
    const FlushSubnormals flush;  // as block_range (fold only compares outputs, which FTZ leaves never subnormal)
    std::vector<bf16> win(T * W);  // [T, W]
    LaneMax lanes(T);
    for (int64_t q = a; q < b; ++q) {
      block_group<G>(xf.data(), T, K, P, N, G * q, bias, nullptr, Out{win.data(), W, W * q});
      lanes.fold(win.data(), T, W, W * q, W);
    }
    std::lock_guard<std::mutex> lock(merging);
    lanes.merge_into(best);
  });
  std::vector<bf16> win(T * 16);  // [T, 16]: the blocks after the last whole group, the partial one included
  LaneMax lanes(T);
  const FlushSubnormals flush;
  for (int64_t b = G * groups; b < blocks; ++b) {
    block_group<1>(xf.data(), T, K, P, N, b, bias, nullptr, Out{win.data(), 16, 16 * b});
    const int64_t valid = std::min<int64_t>(16, N - 16 * b);
    if (valid == 16) {
      lanes.fold(win.data(), T, 16, 16 * b, 16);
      continue;
    }
    for (int64_t t = 0; t < T; ++t)
      for (int64_t r = 0; r < valid; ++r) {
        const float v = to_f(win[t * 16 + r]);
        if (beats(v, 16 * b + r, best[t])) best[t] = {v, 16 * b + r};
      }
  }
  lanes.merge_into(best);
  for (int64_t t = 0; t < T; ++t) idx[t] = best[t].i;
}

// out = bf16(w * bf16(x * rsqrt(mean(x^2) + eps))) per row of n values (transformers' LlamaRMSNorm in bf16).
// In place (out == x) is safe: each 16-lane chunk is read before it is written.
void rms_norm(const bf16* x, int64_t rows, int64_t n, const bf16* w, float eps, bf16* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const bf16* xr = x + r * n;
    vf ss = vzero();
    for (int64_t k = 0; k < n; k += 16) {
      const vf v = load_bf(xr + k, std::min<int64_t>(16, n - k));
      ss = vfmadd(v, v, ss);
    }
    const vf inv = vset1(1.f / std::sqrt(hsum(ss) / float(n) + eps));
    for (int64_t k = 0; k < n; k += 16) {
      const int64_t m = std::min<int64_t>(16, n - k);
      store_bf(out + r * n + k, vmul(load_bf(w + k, m), round_bf(vmul(load_bf(xr + k, m), inv))), m);
    }
  }
}

// In-place RoPE on one head vector (d a multiple of 16): x*cos + roll(x, d/2)*sin_signed (the sign of rotate_half is
// in the table), each product rounded to bf16 as torch's bf16 ops do.
void rope(bf16* x, int64_t d, const bf16* cos, const bf16* sin) {
  float tmp[256];  // [2d]: x twice, so roll(x, d/2)[j] = tmp[j + d/2] without a wrap
  for (int64_t j = 0; j < d; j += 16) {
    const vf v = load_bf(x + j);
    vstore(tmp + j, v);
    vstore(tmp + d + j, v);
  }
  for (int64_t j = 0; j < d; j += 16) {
    const vf a = round_bf(vmul(vload(tmp + j), load_bf(cos + j)));
    const vf b = round_bf(vmul(vload(tmp + j + d / 2), load_bf(sin + j)));
    store_bf(x + j, vadd(a, b));
  }
}

// Whether new token i sees slot s of n = start + T: every prefix slot and the new slots start+j with mask[i, j]
// (causal without a mask); or, with full [T, n] (a drafter's tree step, whose earlier speculative entries are not all
// visible), the slots s with full[i, s].
inline bool visible(int64_t s, int64_t i, int64_t start, int64_t T, const bool* mask, const bool* full) {
  const int64_t n = start + T;
  return full ? full[i * n + s] : s < start || (mask ? mask[i * T + (s - start)] : (s - start) <= i);
}

// V [S, C*16] weighted by each row's softmax numerators, slots in order: acc[row] += p[row, s] * V[s], M rows at a
// time with their M x C accumulators in registers (each V row loaded once for the M rows). A zero weight (a masked
// slot, or an exp that underflowed) adds exactly nothing, fma(0, v, a) == a for finite v, so every row's sums are
// those of a loop that skips such slots. store(r, m, acc [m, C]) takes the finished rows r..r+m-1.
template <int C, int M, typename Store>
inline void attend_value_rows(const bf16* vc, const float* scores, int64_t npad, int64_t n, int64_t r, Store& store) {
  vf acc[M * C];
  for (auto& a : acc) a = vzero();
  for (int64_t s = 0; s < n; ++s) {
    vf v[C];
    for (int c = 0; c < C; ++c) v[c] = load_bf(vc + s * C * 16 + 16 * c);
    for (int i = 0; i < M; ++i) {
      const vf p = vset1(scores[(r + i) * npad + s]);
      for (int c = 0; c < C; ++c) acc[i * C + c] = vfmadd(p, v[c], acc[i * C + c]);
    }
  }
  store(r, M, acc);
}

template <int C, typename Store>
void attend_values(const bf16* vc, const float* scores, int64_t npad, int64_t n, int64_t rows, Store& store) {
  constexpr int M = std::max(1, kAccRegs / C);
  int64_t r = 0;
  for (; r + M <= rows; r += M) attend_value_rows<C, M>(vc, scores, npad, n, r, store);
  for (; r < rows; ++r) attend_value_rows<C, 1>(vc, scores, npad, n, r, store);
}

// Attention of query rows [r0, r1) of kv head g, where row r is head g*group + r % group of new token r / group, over
// its cache. Per row the arithmetic is the single-row softmax attention's, whatever rows share the call: the same
// dot_bf16 per slot, the softmax numerators 16 slots at a time, the V rows accumulated in slot order. Slots run
// outermost so each K and V row is read once for all the call's rows (GQA group x tokens) instead of once per row.
// q: qkv rows [T, nqkv]; out: attn rows [T, nq]; kc/vc: this kv head's [S, d] cache.
void attend_kv_head(const bf16* qkv, int64_t nqkv, const bf16* kc, const bf16* vc, int64_t g, int64_t group,
                    int64_t r0, int64_t r1, int64_t start, int64_t T, const bool* mask, const bool* full, int64_t d,
                    float scale, bf16* out, int64_t nq) {
  const int64_t n = start + T, npad = (n + 15) / 16 * 16, rows = r1 - r0, chunks = d / 16;
  // Reused by this thread across layers and steps: a scratch of rows x (npad scores + best + 16 lanes of maxima).
  thread_local std::vector<float> buf;
  buf.resize(rows * (npad + 17));
  float* scores = buf.data();              // [rows, npad]
  float* best = scores + rows * npad;      // [rows]
  float* lane_best = best + rows;          // [rows, 16]: whole blocks' maxima per lane, folded into best below
  auto token_of = [&](int64_t r) { return (r0 + r) / group; };
  auto q_of = [&](int64_t r) { return qkv + token_of(r) * nqkv + (g * group + (r0 + r) % group) * d; };
  auto score = [&](int64_t r, int64_t s) {  // one slot of one row
    float& sc = scores[r * npad + s];
    if (!visible(s, token_of(r), start, T, mask, full)) {
      sc = -INFINITY;
      return;
    }
    sc = dot_bf16(q_of(r), kc + s * d, d) * scale;
    best[r] = std::max(best[r], sc);
  };
  for (int64_t r = 0; r < rows; ++r) {
    best[r] = -INFINITY;
    vstore(lane_best + 16 * r, vset1(-INFINITY));
  }
  int64_t s = 0;
  for (; s + 16 <= n; s += 16) {  // K rows s..s+15 stay in L1 for all the rows
    for (int64_t r = 0; r < rows; ++r) {
      bool all = full == nullptr && s + 16 <= start;  // the prefix is visible to every row without a full mask
      if (!all) {
        all = true;
        for (int64_t j = 0; j < 16 && all; ++j) all = visible(s + j, token_of(r), start, T, mask, full);
      }
      if (!all) {
        for (int64_t j = 0; j < 16; ++j) score(r, s + j);
        continue;
      }
      float* sc = scores + r * npad + s;
      dot16_bf16(q_of(r), kc + s * d, d, sc);  // the same values as score()'s dot_bf16
      const vf scaled = vmul(vload(sc), vset1(scale));
      vstore(sc, scaled);
      // a vector max, not a scalar chain of 16 dependent max per block; a NaN score is skipped, as std::max skips it
      vstore(lane_best + 16 * r, vmax(scaled, vload(lane_best + 16 * r)));
    }
  }
  for (int64_t r = 0; r < rows; ++r)  // max is exact: the same best whatever order the slots are compared in
    for (int64_t j = 0; j < 16; ++j) best[r] = std::max(best[r], lane_best[16 * r + j]);
  for (; s < n; ++s)
    for (int64_t r = 0; r < rows; ++r) score(r, s);
  // Slots [0, open) are visible to every row; past it a tree node skips its siblings' slots (or, with a full mask,
  // any slot may be hidden).
  const int64_t open = full ? 0 : start, whole = open / 16 * 16;
  const bool packs = mask != nullptr || full != nullptr;  // causal rows see contiguous slots: no packing needed
  for (int64_t r = 0; r < rows; ++r) {  // softmax numerators 16 at a time; masked slots (-inf) become exactly 0
    float* row = scores + r * npad;
    for (int64_t s = n; s < npad; ++s) row[s] = -INFINITY;
    vf sum = vzero();
    for (int64_t s = 0; s < n; s += 16) {
      const vf v = vload(row + s);
      const vf e = zero_where_neg_inf(v, vexp(vsub(v, vset1(best[r]))));
      vstore(row + s, e);
      if (!packs || s + 16 <= whole) sum = vadd(sum, e);
    }
    if (packs) {
      // The rest of the denominator over the visible slots packed in slot order: lane k of the sum then holds the
      // same terms as the one-token step of this row's path (where those tokens sit at consecutive slots), so a
      // tree node off its plain-decoding slot gets that step's denominator bit for bit. Lanes keyed by slot would
      // group the terms differently, and bf16 speculative decoding would drift from bf16 plain decoding.
      float* packed = lane_best + 16 * r;  // free now: the maxima were folded into best above
      int64_t m = 0;
      auto flush = [&]() {
        for (int64_t j = m; j < 16; ++j) packed[j] = 0.f;
        sum = vadd(sum, vload(packed));
        m = 0;
      };
      for (int64_t s = whole; s < n; ++s) {
        if (!visible(s, token_of(r), start, T, mask, full)) continue;
        packed[m++] = row[s];
        if (m == 16) flush();
      }
      if (m > 0) flush();
    }
    best[r] = hsum(sum);  // now the row's softmax denominator
  }
  auto store_rows = [&](int64_t r, int64_t m, const vf* acc) {  // acc [m, chunks]
    for (int64_t i = 0; i < m; ++i) {
      bf16* o = out + token_of(r + i) * nq + (g * group + (r0 + r + i) % group) * d;
      const vf total = vset1(best[r + i]);
      for (int64_t c = 0; c < chunks; ++c) store_bf(o + 16 * c, vdiv(acc[i * chunks + c], total));
    }
  };
  switch (chunks) {  // one pass over V per kAccRegs / chunks rows, their accumulators held in registers
    case 1: return attend_values<1>(vc, scores, npad, n, rows, store_rows);
    case 2: return attend_values<2>(vc, scores, npad, n, rows, store_rows);
    case 3: return attend_values<3>(vc, scores, npad, n, rows, store_rows);
    case 4: return attend_values<4>(vc, scores, npad, n, rows, store_rows);
    case 5: return attend_values<5>(vc, scores, npad, n, rows, store_rows);
    case 6: return attend_values<6>(vc, scores, npad, n, rows, store_rows);
    case 7: return attend_values<7>(vc, scores, npad, n, rows, store_rows);
    default: return attend_values<8>(vc, scores, npad, n, rows, store_rows);
  }
}

// A layer's scratch, reused across the layers of one TargetStack step (sized by the first layer, which all match).
struct LayerScratch {
  std::vector<bf16> qkv, attn, mid, xn, gu, act;
};

// The layer after its input norm: xin [T, kin] (normed) feeds q/k/v, res [T, H] is the residual stream; writes the
// K/V of the T new tokens to slots start..start+T-1 and the layer's output [T, H] to out, which may be res itself
// (res is last read by the o_proj GEMM, which writes sc.mid). sc's vectors grow to this layer's sizes.
void layer_body(const bf16* xin, int64_t kin, const torch::Tensor& res, const torch::Tensor& wqkv,
                         const std::optional<torch::Tensor>& bqkv, const std::optional<torch::Tensor>& qn,
                         const std::optional<torch::Tensor>& kn, const torch::Tensor& wo,
                         const std::optional<torch::Tensor>& bo, const torch::Tensor& ln2, const torch::Tensor& wgu,
                         const std::optional<torch::Tensor>& bgu, const torch::Tensor& wdown,
                         const std::optional<torch::Tensor>& bdown, const torch::Tensor& kc, const torch::Tensor& vc,
                         int64_t start, const torch::Tensor& cos, const torch::Tensor& sin, const bool* mask,
                         const bool* full, int64_t hq, int64_t hkv, double eps, double scale, LayerScratch& sc,
                         bf16* out, const int64_t* row_pos = nullptr) {
  // row_pos [T] (batched decoding, TargetStack.forward_rows): token t is the next token of its own sequence, kc/vc
  // are [T, Hkv, S, d] (one cache per token), its K/V go to slot row_pos[t] and it attends over slots 0..row_pos[t].
  const int64_t T = res.size(0), H = res.size(1), d = kc.size(-1), S = kc.size(-2), inter = 2 * wdown.size(1);
  const int64_t row_stride = row_pos ? hkv * S * d : 0;  // elements between two tokens' caches
  const int64_t nq = hq * d, nqkv = (hq + 2 * hkv) * d, group = hq / hkv;
  for (const torch::Tensor* t : {&res, &kc, &vc, &cos, &sin, &wqkv, &wo, &wgu, &wdown})
    TORCH_CHECK(t->scalar_type() == torch::kBFloat16 && t->is_contiguous() && t->device().is_cpu(),
                "the fused CPU layer takes contiguous bf16 CPU tensors");
  TORCH_CHECK(d % 16 == 0 && d <= 128, "head_dim must be a multiple of 16 and <= 128");
  TORCH_CHECK(row_pos ? kc.dim() == 4 && kc.size(0) == T && kc.size(1) == hkv : start + T <= S,
              row_pos ? "forward_rows needs one [Hkv, S, d] cache per row" : "the new tokens do not fit in the cache");
  for (int64_t t = 0; row_pos && t < T; ++t)
    TORCH_CHECK(row_pos[t] >= 0 && row_pos[t] < S, "row ", t, "'s position ", row_pos[t], " is outside its cache");
  TORCH_CHECK(cos.numel() >= T * d && sin.numel() >= T * d, "cos/sin need a row of head_dim values per new token");
  TORCH_CHECK(2 * wqkv.size(1) == kin && 2 * wo.size(1) == hq * d && 2 * wgu.size(1) == H &&
                  wgu.size(0) * 16 >= 2 * inter,
              "packed weights do not match the hidden size / heads");
  // resize keeps the capacity: after the first layer of a step these allocate nothing
  sc.xn.resize(T * H);
  sc.qkv.resize(T * nqkv);
  sc.attn.resize(T * nq);
  sc.mid.resize(T * H);
  sc.gu.resize(T * 2 * inter);
  sc.act.resize(T * inter);
  bf16 *xn = sc.xn.data(), *qkv = sc.qkv.data(), *attn = sc.attn.data(), *gu = sc.gu.data(), *act = sc.act.data();
  const float feps = float(eps);

  gemm(xin, T, kin, ptr(wqkv), nqkv, opt_ptr(bqkv), nullptr, qkv);  // [T, (Hq+2Hkv)d]
  bf16* kcache = reinterpret_cast<bf16*>(kc.data_ptr());
  bf16* vcache = reinterpret_cast<bf16*>(vc.data_ptr());
  for (int64_t t = 0; t < T; ++t) {
    bf16* row = qkv + t * nqkv;
    for (int64_t h = 0; h < hq + hkv; ++h) {
      bf16* head = row + h * d;
      if (qn) rms_norm(head, 1, d, ptr(h < hq ? *qn : *kn), feps, head);  // Qwen3 q/k norm (in place is safe)
      rope(head, d, ptr(cos) + t * d, ptr(sin) + t * d);
    }
    const int64_t slot = row_pos ? row_pos[t] : start + t;
    for (int64_t g = 0; g < hkv; ++g) {
      std::memcpy(kcache + t * row_stride + (g * S + slot) * d, row + (hq + g) * d, d * sizeof(bf16));
      std::memcpy(vcache + t * row_stride + (g * S + slot) * d, row + (hq + hkv + g) * d, d * sizeof(bf16));
    }
  }
  if (row_pos) {  // jobs (row, kv head): each row is one causal token over its own cache
    int64_t visible = 0;  // cache slots read, summed over the rows (rows sit at different positions)
    for (int64_t t = 0; t < T; ++t) visible += row_pos[t] + 1;
    const int64_t work = hq * visible * d;
    at::parallel_for(0, T * hkv, work > (1 << 15) ? 1 : T * hkv, [&](int64_t a, int64_t b) {
      for (int64_t job = a; job < b; ++job) {
        const int64_t t = job / hkv, g = job % hkv, off = t * row_stride + g * S * d;
        attend_kv_head(qkv + t * nqkv, nqkv, kcache + off, vcache + off, g, group, 0, group, row_pos[t], 1, nullptr,
                       nullptr, d, float(scale), attn + t * nq, nq);
      }
    });
  } else {
    // Each thread takes an equal share of the hkv x T x group query rows, in runs of whole kv heads where it can
    // (a run reads its head's K and V once). By kv head and token block, 3 kv heads split 2:1 over 2 threads.
    const int64_t per_kv = T * group, total = hkv * per_kv, work = T * hq * (start + T) * d;
    const int64_t parts = work > (1 << 15) ? std::min<int64_t>(at::get_num_threads(), total) : 1;
    at::parallel_for(0, parts, 1, [&](int64_t a, int64_t b) {
      for (int64_t part = a; part < b; ++part) {
        const int64_t hi = total * (part + 1) / parts;  // this share: flattened rows [total * part / parts, hi)
        for (int64_t x = total * part / parts; x < hi;) {
          const int64_t g = x / per_kv, r0 = x % per_kv, r1 = std::min(per_kv, r0 + hi - x);
          attend_kv_head(qkv, nqkv, kcache + g * S * d, vcache + g * S * d, g, group, r0, r1, start, T, mask, full,
                         d, float(scale), attn, nq);
          x += r1 - r0;
        }
      }
    });
  }
  bf16* m = sc.mid.data();
  gemm(attn, T, nq, ptr(wo), H, opt_ptr(bo), ptr(res), m);  // res + o_proj(attn)
  rms_norm(m, T, H, ptr(ln2), feps, xn);
  gemm(xn, T, H, ptr(wgu), 2 * inter, opt_ptr(bgu), nullptr, gu);  // [T, 2I]: gate | up
  for (int64_t t = 0; t < T; ++t) {  // act [T, I] = bf16(bf16(silu(gate)) * up), 16 at a time
    const bf16* gate = gu + t * 2 * inter;
    const bf16* up = gate + inter;
    for (int64_t j = 0; j < inter; j += 16) {
      const int64_t m = std::min<int64_t>(16, inter - j);
      const vf g = load_bf(gate + j, m);
      const vf silu = vdiv(g, vadd(vset1(1.f), vexp(vsub(vzero(), g))));
      store_bf(act + t * inter + j, vmul(round_bf(silu), load_bf(up + j, m)), m);
    }
  }
  gemm(act, T, inter, ptr(wdown), H, opt_ptr(bdown), m, out);
}

// x [rows, n] RMS-normed by w into scratch, or x itself when w is None (EAGLE-1's layer, a head without a norm).
const bf16* normed_or_same(const torch::Tensor& x, int64_t rows, int64_t n, const std::optional<torch::Tensor>& w,
                           double eps, std::vector<bf16>& scratch, const char* what) {
  if (!w) return ptr(x);
  TORCH_CHECK(w->scalar_type() == torch::kBFloat16 && w->is_contiguous() && w->numel() == n, what,
              " must be a contiguous bf16 [", n, "] weight or None");
  scratch.resize(rows * n);
  rms_norm(ptr(x), rows, n, ptr(*w), float(eps), scratch.data());
  return scratch.data();
}

const bool* mask_ptr(const std::optional<torch::Tensor>& mask, int64_t rows, int64_t cols, const char* what) {
  if (!mask) return nullptr;
  TORCH_CHECK(mask->scalar_type() == torch::kBool && mask->is_contiguous() && mask->numel() == rows * cols, what,
              " must be a contiguous bool tensor [", rows, ", ", cols, "]");
  return mask->data_ptr<bool>();
}

}  // namespace

// x [T, H] -> x after one decoder layer; writes this layer's K/V for the T new tokens to slots start..start+T-1.
// ln1 None: no input norm (EAGLE-1's draft layer, fed by fc(concat(emb, hidden)), has none).
// full_mask [T, start+T] (EAGLE-1's tree step: its earlier speculative slots are not all visible) overrides tree_mask
// [T, T]; trailing and defaulting to None so that positional callers without it keep working.
torch::Tensor decoder_layer(const torch::Tensor& x, const std::optional<torch::Tensor>& ln1,
                            const torch::Tensor& wqkv, const std::optional<torch::Tensor>& bqkv, const std::optional<torch::Tensor>& qn,
                            const std::optional<torch::Tensor>& kn, const torch::Tensor& wo,
                            const std::optional<torch::Tensor>& bo, const torch::Tensor& ln2, const torch::Tensor& wgu,
                            const std::optional<torch::Tensor>& bgu, const torch::Tensor& wdown,
                            const std::optional<torch::Tensor>& bdown, const torch::Tensor& kc, const torch::Tensor& vc,
                            int64_t start, const torch::Tensor& cos, const torch::Tensor& sin,
                            const std::optional<torch::Tensor>& tree_mask, int64_t hq, int64_t hkv, double eps,
                            double scale, const std::optional<torch::Tensor>& full_mask) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.is_contiguous() && x.device().is_cpu() && x.dim() == 2,
              "the fused CPU layer takes contiguous bf16 CPU tensors");
  const int64_t T = x.size(0), H = x.size(1);
  const bool* mask = mask_ptr(tree_mask, T, T, "tree_mask");
  const bool* full = mask_ptr(full_mask, T, start + T, "full_mask");
  std::vector<bf16> xn;
  LayerScratch sc;
  auto out = torch::empty_like(x);  // [T, H]
  layer_body(normed_or_same(x, T, H, ln1, eps, xn, "ln1"), H, x, wqkv, bqkv, qn, kn, wo, bo, ln2, wgu, bgu, wdown,
             bdown, kc, vc, start, cos, sin, mask, full, hq, hkv, eps, scale, sc,
             reinterpret_cast<bf16*>(out.data_ptr()));
  return out;
}

// EAGLE-3's draft layer (drafters/eagle3.py, Eagle3Layer): q/k/v read concat(norm(emb), hidden_norm(hidden)) [T, 2H],
// the residual is hidden [T, H]; the rest is the Llama layer above. full_mask [T, start+T] (a tree step) or
// tree_mask [T, T] (the new tokens among themselves, every earlier slot visible) or neither (causal).
torch::Tensor eagle3_layer(const torch::Tensor& emb, const torch::Tensor& hidden, const torch::Tensor& ln_emb,
                           const torch::Tensor& ln_hidden, const torch::Tensor& wqkv, const torch::Tensor& wo,
                           const torch::Tensor& ln2, const torch::Tensor& wgu, const torch::Tensor& wdown,
                           const torch::Tensor& kc, const torch::Tensor& vc, int64_t start, const torch::Tensor& cos,
                           const torch::Tensor& sin, const std::optional<torch::Tensor>& tree_mask,
                           const std::optional<torch::Tensor>& full_mask, int64_t hq, int64_t hkv, double eps,
                           double scale) {
  for (const torch::Tensor* t : {&emb, &hidden, &ln_emb, &ln_hidden})
    TORCH_CHECK(t->scalar_type() == torch::kBFloat16 && t->is_contiguous() && t->device().is_cpu(),
                "the fused CPU layer takes contiguous bf16 CPU tensors");
  TORCH_CHECK(emb.dim() == 2 && emb.sizes() == hidden.sizes(), "emb and hidden must both be [T, H]");
  const int64_t T = hidden.size(0), H = hidden.size(1);
  const bool* mask = mask_ptr(tree_mask, T, T, "tree_mask");
  const bool* full = mask_ptr(full_mask, T, start + T, "full_mask");
  std::vector<bf16> xin(T * 2 * H);  // [T, 2H]: norm(emb) | hidden_norm(hidden)
  for (int64_t t = 0; t < T; ++t) {
    rms_norm(ptr(emb) + t * H, 1, H, ptr(ln_emb), float(eps), xin.data() + t * 2 * H);
    rms_norm(ptr(hidden) + t * H, 1, H, ptr(ln_hidden), float(eps), xin.data() + t * 2 * H + H);
  }
  LayerScratch sc;
  auto out = torch::empty_like(hidden);  // [T, H]
  layer_body(xin.data(), 2 * H, hidden, wqkv, std::nullopt, std::nullopt, std::nullopt, wo, std::nullopt, ln2, wgu,
             std::nullopt, wdown, std::nullopt, kc, vc, start, cos, sin, mask, full, hq, hkv, eps, scale, sc,
             reinterpret_cast<bf16*>(out.data_ptr()));
  return out;
}

// y [T, N] = x [T, K] @ w^T (+ bias) with w packed ([ceil(N/16), K/2, 32]): the LM head and any other bf16 linear.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, const std::optional<torch::Tensor>& bias,
                     int64_t n) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && w.scalar_type() == torch::kBFloat16 && x.is_contiguous() &&
                  w.is_contiguous() && x.dim() == 2 && w.dim() == 3,
              "linear takes a contiguous bf16 x [T, K] and a packed bf16 weight [ceil(N/16), K/2, 32]");
  TORCH_CHECK(x.size(1) == 2 * w.size(1) && (n + 15) / 16 == w.size(0), "x / packed weight / n do not match");
  auto y = torch::empty({x.size(0), n}, x.options());
  gemm(ptr(x), x.size(0), x.size(1), ptr(w), n, opt_ptr(bias), nullptr, reinterpret_cast<bf16*>(y.data_ptr()));
  return y;
}

// idx [T] long = argmax over n of bf16(x [T, K] @ w^T (+ bias)), the first maximum on ties, NaN ranked highest
// (torch.argmax of what `linear` returns), without materialising the [T, n] logits.
torch::Tensor linear_argmax(const torch::Tensor& x, const torch::Tensor& w, const std::optional<torch::Tensor>& bias,
                            int64_t n) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && w.scalar_type() == torch::kBFloat16 && x.is_contiguous() &&
                  w.is_contiguous() && x.dim() == 2 && w.dim() == 3,
              "linear_argmax takes a contiguous bf16 x [T, K] and a packed bf16 weight [ceil(N/16), K/2, 32]");
  TORCH_CHECK(x.size(1) == 2 * w.size(1) && (n + 15) / 16 == w.size(0), "x / packed weight / n do not match");
  TORCH_CHECK(n > 0 && n < (int64_t(1) << 24), "linear_argmax needs 0 < n < 2^24 (column indices ride in fp32)");
  auto idx = torch::empty({x.size(0)}, x.options().dtype(torch::kLong));
  gemm_argmax(ptr(x), x.size(0), x.size(1), ptr(w), n, opt_ptr(bias), idx.data_ptr<int64_t>());
  return idx;
}

// One row's softmax statistics and top k over the columns [j0, j1) one task ran: the largest logit mx, the sum of
// exp(l - mx) over those columns, and up to k (logit, id) pairs, descending, the lower id first among equal logits.
struct RowPart {
  int64_t j0 = 0;
  float mx = -INFINITY, sum = 0.f;
  std::vector<float> v;
  std::vector<int64_t> id;
};

// NaN logits are not ranked (the drafter's head has none).
static RowPart row_part(const bf16* logits, int64_t j0, int64_t j1, int64_t k) {
  RowPart part;
  part.j0 = j0;
  const int64_t n = j1 - j0;
  std::vector<float> row((n + 15) / 16 * 16, -INFINITY);  // [n rounded up to 16]: -inf pads the tail
  for (int64_t j = 0; j < n; j += 16) {
    const int64_t m = std::min<int64_t>(16, n - j);
    if (m == 16) {
      vstore(row.data() + j, load_bf(logits + j0 + j));
    } else {
      for (int64_t r = 0; r < m; ++r) row[j + r] = to_f(logits[j0 + j + r]);
    }
  }
  vf mx = vset1(-INFINITY);
  for (size_t j = 0; j < row.size(); j += 16) mx = vmax(mx, vload(row.data() + j));
  alignas(64) float lanes_max[16];
  vstore(lanes_max, mx);
  part.mx = *std::max_element(lanes_max, lanes_max + 16);
  vf sum = vzero();  // exp(l - mx) over these columns (the -inf pads add exactly 0)
  for (size_t j = 0; j < row.size(); j += 16) {
    const vf x = vload(row.data() + j);
    sum = vadd(sum, zero_where_neg_inf(x, vexp(vsub(x, vset1(part.mx)))));
  }
  part.sum = hsum(sum);
  // Insertion into a sorted list of k: a column enters only by beating the k-th strictly, and goes after the
  // equal values already there, so among equals the lower column stays first. Once k are held, a chunk of 16 with
  // nothing above the k-th is skipped in one compare (almost all of them).
  std::vector<float>& v = part.v;
  std::vector<int64_t>& id = part.id;
  v.assign(k, 0.f);
  id.assign(k, 0);
  int64_t count = 0;
  for (int64_t c0 = 0; c0 < n; c0 += 16) {
    if (count == k && !any_gt(vload(row.data() + c0), vset1(v[k - 1]))) continue;
    for (int64_t j = c0; j < std::min(n, c0 + 16); ++j) {
      const float x = row[j];
      if (count == k && !(x > v[k - 1])) continue;
      int64_t pos = count < k ? count++ : k - 1;
      for (; pos > 0 && v[pos - 1] < x; --pos) {
        v[pos] = v[pos - 1];
        id[pos] = id[pos - 1];
      }
      v[pos] = x;
      id[pos] = j0 + j;
    }
  }
  v.resize(count);
  id.resize(count);
  return part;
}

// The top k of one row over all its columns from the tasks' parts (sorted by j0, so the sum's order does not depend
// on which task finished first): the global max, each part's sum rescaled to it, and the k best of the union in the
// same order (descending logit, the lower id first on ties) as softmax probabilities.
static void merge_parts(const std::vector<RowPart>& parts, int64_t k, float* probs, int64_t* ids) {
  float best = -INFINITY;
  for (const RowPart& p : parts) best = std::max(best, p.mx);
  float total = 0.f;
  std::vector<std::pair<float, int64_t>> cand;
  for (const RowPart& p : parts) {
    if (p.mx != -INFINITY) total += p.sum * std::exp(p.mx - best);
    for (size_t i = 0; i < p.v.size(); ++i) cand.emplace_back(p.v[i], p.id[i]);
  }
  std::partial_sort(cand.begin(), cand.begin() + k, cand.end(), [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  });
  for (int64_t i = 0; i < k; ++i) {
    probs[i] = std::exp(cand[i].first - best) / total;
    ids[i] = cand[i].second;
  }
}

// (probs [T, k] fp32, ids [T, k] long) = the top k of softmax(bf16(norm(x) @ w^T)) over all n columns, x [T, K],
// norm_w [K] (None: no norm), w packed: a draft head's norm, GEMM, softmax and top-k in one call. The [T, n] logits
// stay in an internal buffer.
std::tuple<torch::Tensor, torch::Tensor> norm_linear_topk(const torch::Tensor& x,
                                                          const std::optional<torch::Tensor>& norm_w, double eps,
                                                          const torch::Tensor& w, int64_t n, int64_t k) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && w.scalar_type() == torch::kBFloat16 && x.is_contiguous() &&
                  w.is_contiguous() && x.dim() == 2 && w.dim() == 3,
              "norm_linear_topk takes a contiguous bf16 x [T, K] and a packed bf16 weight [ceil(N/16), K/2, 32]");
  const int64_t T = x.size(0), K = x.size(1);
  TORCH_CHECK(K == 2 * w.size(1) && (n + 15) / 16 == w.size(0), "x / packed weight / n do not match");
  TORCH_CHECK(k >= 1 && k <= n, "norm_linear_topk needs 1 <= k <= n, got k=", k, " for n=", n);
  std::vector<bf16> xn;
  const GemmInput xf(normed_or_same(x, T, K, norm_w, eps, xn, "norm_w"), T * K);  // [T, K]
  std::vector<bf16> logits(T * n);  // [T, n]
  const int64_t blocks = (n + 15) / 16;
  std::vector<std::vector<RowPart>> parts(T);  // [T][task]
  std::mutex merging;
  // The columns split over threads as gemm splits them (whole 16-row blocks), each task ranking the columns it ran
  // while they are in cache: one thread left half the bandwidth of 2 cores unused on a T=1 draft head.
  at::parallel_for(0, blocks, kGroupBlocks * group_grain(K), [&](int64_t a, int64_t b) {
    block_range(xf.data(), T, K, ptr(w), n, a, b, nullptr, nullptr, Out{logits.data(), n, 0});
    std::vector<RowPart> mine(T);
    for (int64_t t = 0; t < T; ++t) mine[t] = row_part(logits.data() + t * n, 16 * a, std::min(n, 16 * b), k);
    std::lock_guard<std::mutex> lock(merging);
    for (int64_t t = 0; t < T; ++t) parts[t].push_back(std::move(mine[t]));
  });
  auto probs = torch::empty({T, k}, x.options().dtype(torch::kFloat));
  auto ids = torch::empty({T, k}, x.options().dtype(torch::kLong));
  float* p = probs.data_ptr<float>();
  int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    std::sort(parts[t].begin(), parts[t].end(), [](const RowPart& l, const RowPart& r) { return l.j0 < r.j0; });
    merge_parts(parts[t], k, p + t * k, id + t * k);
  }
  return {probs, ids};
}

// ---- one target forward in one call ----------------------------------------------------------------------------
// LeanDecoder's forward as one native call: every layer, the final norm and the LM head (logits or argmax), instead
// of a Python loop of decoder_layer calls (30 calls of 24 pybind arguments a step for a 135M model). The weights are
// held from construction (when the decoder builds its exec plan), the KV cache from bind_cache (once per cache).
// Each step runs the same kernels as the per-layer path, in the same order, so the results are bit-identical.
class TargetStack {
 public:
  // layers: per layer (ln1, wqkv, bqkv, qn, kn, wo, bo, ln2, wgu, bgu, wdown, bdown), decoder_layer's order; None
  // where the model has no such tensor (ln1, wqkv, wo, ln2, wgu and wdown are required).
  TargetStack(const std::vector<std::vector<std::optional<torch::Tensor>>>& layers, torch::Tensor norm_w,
              torch::Tensor head, int64_t vocab, int64_t hq, int64_t hkv, double eps, double scale)
      : layers_(layers), norm_w_(std::move(norm_w)), head_(std::move(head)), vocab_(vocab), hq_(hq), hkv_(hkv),
        eps_(eps), scale_(scale) {
    for (const auto& l : layers_) {
      TORCH_CHECK(l.size() == 12, "TargetStack: each layer is decoder_layer's 12 weights, got ", l.size());
      for (int j : {0, 1, 5, 7, 8, 10}) TORCH_CHECK(l[j].has_value(), "TargetStack: layer weight ", j, " is None");
    }
    TORCH_CHECK(head_.dim() == 3 && (vocab_ + 15) / 16 == head_.size(0) && norm_w_.numel() == 2 * head_.size(1),
                "TargetStack: the packed head / final norm do not match the vocabulary and hidden size");
  }

  // The per-layer K and V caches [Hkv, S, d] (a KVCache's views); held until the next bind.
  void bind_cache(std::vector<torch::Tensor> k, std::vector<torch::Tensor> v) {
    TORCH_CHECK(k.size() == layers_.size() && v.size() == layers_.size(), "bind_cache needs one K and V per layer");
    k_ = std::move(k);
    v_ = std::move(v);
  }

  // x [T, H] (embeddings) -> (logits [T', V] or argmax [T'] long, post-norm hidden [T, H], the inputs of the layers
  // in taps, num_layers meaning the last output). Rows: `rows` [T'] if given, else the last row if `last`, else all.
  std::tuple<torch::Tensor, torch::Tensor, std::vector<torch::Tensor>> forward(
      const torch::Tensor& x, int64_t start, const torch::Tensor& cos, const torch::Tensor& sin,
      const std::optional<torch::Tensor>& tree_mask, const std::vector<int64_t>& taps, bool argmax,
      const std::optional<torch::Tensor>& rows, bool last) const {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.is_contiguous() && x.dim() == 2 &&
                    x.size(1) == norm_w_.numel(),
                "TargetStack.forward takes contiguous bf16 embeddings [T, H]");
    TORCH_CHECK(k_.size() == layers_.size(), "TargetStack.forward before bind_cache");
    const int64_t T = x.size(0), H = x.size(1), L = int64_t(layers_.size());
    const bool* mask = mask_ptr(tree_mask, T, T, "tree_mask");
    std::vector<torch::Tensor> found(taps.size());
    std::vector<bf16> xn(T * H);
    LayerScratch sc;
    // One residual stream [T, H] for every layer, each writing its output over its input (layer_body allows it);
    // a tapped layer input is copied out before the next layer overwrites it, x itself (layer 0's) is never written.
    const auto stream = torch::empty_like(x);
    bf16* out = reinterpret_cast<bf16*>(stream.data_ptr());
    torch::Tensor h = x;
    for (int64_t i = 0; i <= L; ++i) {
      for (size_t j = 0; j < taps.size(); ++j)
        if (taps[j] == i) found[j] = i == 0 || i == L ? h : h.clone();
      if (i == L) break;
      const auto& w = layers_[i];
      rms_norm(ptr(h), T, H, ptr(*w[0]), float(eps_), xn.data());
      layer_body(xn.data(), H, h, *w[1], w[2], w[3], w[4], *w[5], w[6], *w[7], *w[8], w[9], *w[10], w[11], k_[i],
                 v_[i], start, cos, sin, mask, nullptr, hq_, hkv_, eps_, scale_, sc, out);  // [T, H]
      h = stream;
    }
    auto hidden = torch::empty_like(h);  // [T, H]
    rms_norm(ptr(h), T, H, ptr(norm_w_), float(eps_), reinterpret_cast<bf16*>(hidden.data_ptr()));
    torch::Tensor sel = hidden;  // [T', H]
    if (rows) {
      sel = hidden.index_select(0, *rows);
    } else if (last) {
      sel = hidden.slice(0, T - 1, T);  // the last row of a contiguous [T, H] is contiguous
    }
    return {argmax ? linear_argmax(sel, head_, std::nullopt, vocab_) : linear(sel, head_, std::nullopt, vocab_),
            hidden, found};
  }

  // Batched greedy decoding (datagen/batched_generation.py): x [b, H] holds the next token of b independent
  // sequences, rows row0..row0+b-1 of the batch's caches k/v [L, B, Hkv, S, d] theirs, pos [b] each row's slot (its
  // position), cos/sin [b, d] at those positions. Writes each row's K/V at its slot and returns the argmax [b] of the
  // head after the final norm: the per-layer kernels of forward, with one causal token per cache.
  torch::Tensor forward_rows(const torch::Tensor& x, const torch::Tensor& k, const torch::Tensor& v,
                             int64_t row0, const torch::Tensor& pos, const torch::Tensor& cos,
                             const torch::Tensor& sin) const {
    const int64_t b = x.size(0), H = x.size(1), L = int64_t(layers_.size());
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.is_contiguous() && x.dim() == 2 && H == norm_w_.numel(),
                "TargetStack.forward_rows takes contiguous bf16 embeddings [b, H]");
    TORCH_CHECK(k.dim() == 5 && k.size(0) == L && row0 >= 0 && row0 + b <= k.size(1) && k.sizes() == v.sizes() &&
                    k.is_contiguous() &&
                    v.is_contiguous() && k.scalar_type() == torch::kBFloat16 && v.scalar_type() == torch::kBFloat16,
                "forward_rows needs contiguous bf16 caches k, v [L, B, Hkv, S, d] holding rows row0..row0+b-1");
    TORCH_CHECK(pos.scalar_type() == torch::kLong && pos.is_contiguous() && pos.numel() == b,
                "forward_rows needs pos [b] int64");
    std::vector<bf16> xn(b * H);
    LayerScratch sc;
    const auto stream = x.clone();  // [b, H], each layer writing over its input
    bf16* out = reinterpret_cast<bf16*>(stream.data_ptr());
    for (int64_t i = 0; i < L; ++i) {
      const auto& w = layers_[i];
      rms_norm(out, b, H, ptr(*w[0]), float(eps_), xn.data());
      layer_body(xn.data(), H, stream, *w[1], w[2], w[3], w[4], *w[5], w[6], *w[7], *w[8], w[9], *w[10], w[11],
                 k[i].narrow(0, row0, b), v[i].narrow(0, row0, b), 0, cos, sin, nullptr, nullptr, hq_, hkv_, eps_,
                 scale_, sc, out, pos.data_ptr<int64_t>());  // [b, H]
    }
    auto hidden = torch::empty_like(stream);  // [b, H]
    rms_norm(out, b, H, ptr(norm_w_), float(eps_), reinterpret_cast<bf16*>(hidden.data_ptr()));
    return linear_argmax(hidden, head_, std::nullopt, vocab_);
  }

 private:
  std::vector<std::vector<std::optional<torch::Tensor>>> layers_;
  torch::Tensor norm_w_, head_;
  int64_t vocab_, hq_, hkv_;
  double eps_, scale_;
  std::vector<torch::Tensor> k_, v_;
};

// out [T, H] = bf16(w * bf16(x * rsqrt(mean(x^2) + eps))): the final norm of the per-layer path, the stack's twin.
torch::Tensor rms_norm_op(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && w.scalar_type() == torch::kBFloat16 && x.is_contiguous() &&
                  w.is_contiguous() && x.dim() == 2 && w.numel() == x.size(1),
              "rms_norm takes a contiguous bf16 x [T, H] and weight [H]");
  auto out = torch::empty_like(x);
  rms_norm(ptr(x), x.size(0), x.size(1), ptr(w), float(eps), reinterpret_cast<bf16*>(out.data_ptr()));
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // module_local: both ISA builds define TargetStack, and a process (the tests) may load both.
  pybind11::class_<TargetStack>(m, "TargetStack", pybind11::module_local(),
                                "a whole target forward (all layers, final norm, head) in one call")
      .def(pybind11::init<const std::vector<std::vector<std::optional<torch::Tensor>>>&, torch::Tensor,
                          torch::Tensor, int64_t, int64_t, int64_t, double, double>())
      .def("bind_cache", &TargetStack::bind_cache)
      // Without the GIL: a prefill runs for seconds, and other Python threads may run meanwhile.
      .def("forward", &TargetStack::forward, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("forward_rows", &TargetStack::forward_rows, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("rms_norm", &rms_norm_op, "bf16 RMSNorm over the last dimension (transformers' LlamaRMSNorm rounding)");
  m.def("norm_linear_topk", &norm_linear_topk, "a draft head: RMSNorm, packed bf16 GEMM, softmax and top-k");
  m.def("linear_argmax", &linear_argmax, "argmax per row of a bf16 linear over a packed weight, without the logits");
  using pybind11::arg;
  m.def("decoder_layer", &decoder_layer, "one bf16 Llama-family decoder layer over a static KV cache", arg("x"),
        arg("ln1"), arg("wqkv"), arg("bqkv"), arg("qn"), arg("kn"), arg("wo"), arg("bo"), arg("ln2"), arg("wgu"),
        arg("bgu"), arg("wdown"), arg("bdown"), arg("kc"), arg("vc"), arg("start"), arg("cos"), arg("sin"),
        arg("tree_mask"), arg("hq"), arg("hkv"), arg("eps"), arg("scale"), arg("full_mask") = pybind11::none());
  m.def("eagle3_layer", &eagle3_layer, "EAGLE-3's bf16 draft layer over a static draft KV cache");
  m.def("linear", &linear, "bf16 linear y = x @ w.T (+ bias) over a packed weight, fp32 accumulation");
}
