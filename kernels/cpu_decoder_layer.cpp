// One Llama-family decoder layer in bf16 for batch-1 decoding and tree verification on AVX512-BF16 CPUs.
//
// Why C++: a 135M model's decoding step is ~120 small GEMVs plus ~20 elementwise ops per layer. Through PyTorch
// each op pays dispatch and thread wake-up costs and the bf16 GEMVs reach ~2/3 of the memory bandwidth; here one
// call runs a whole layer and the GEMV streams the weights once with AVX512-BF16 dot products.
//
// The plain-PyTorch reference is LeanDecoder's torch path (draftsmith/runtime/model.py); rounding to bf16 happens
// where transformers rounds (after each projection, norm, activation and residual add), accumulation is fp32.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

namespace {

using bf16 = uint16_t;

inline float to_f(bf16 v) {
  uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline bf16 to_bf(float f) { return c10::BFloat16(f).x; }  // round to nearest even, as torch does
inline float round_bf(float f) { return to_f(to_bf(f)); }

// Up to 32 bf16 values from p; lanes past n are zero (K tails).
inline __m512bh load32(const bf16* p, int64_t n) {
  if (n >= 32) return (__m512bh)_mm512_loadu_si512(p);
  const __mmask32 m = (__mmask32)((1ull << n) - 1);
  return (__m512bh)_mm512_maskz_loadu_epi16(m, p);
}

// 16 bf16 -> 16 fp32 (lanes outside the mask are zero).
inline __m512 load16_f(const bf16* p, __mmask16 m = 0xFFFF) {
  const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// Round 16 fp32 lanes to bf16 precision (nearest even) and back.
inline __m512 round16(__m512 v) {
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// exp of 16 lanes: x = n ln2 + r, |r| <= ln2/2, degree-6 Taylor polynomial (relative error < 2e-7), times 2^n.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.f)), _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  for (float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

const bf16* ptr(const torch::Tensor& t) { return reinterpret_cast<const bf16*>(t.data_ptr()); }
const bf16* opt_ptr(const std::optional<torch::Tensor>& t) { return t ? ptr(*t) : nullptr; }

// Packed weights: W [N, K] is stored as [ceil(N/16), K/2, 16, 2], zero-padded to whole blocks of 16 rows, so one
// 64-byte load holds 16 rows x 2 columns. As 16 x 32-bit lanes, lane r = W[r, 2p+1] << 16 | W[r, 2p]: a shift and a
// mask turn it into the two columns in fp32, each multiplied by one broadcast x value with fp32 FMAs. (On the
// AVX512-BF16 CPU this was tuned on, vdpbf16ps retires ~1 per 2-4 cycles against 2 FMAs per cycle, so the FMA form
// is ~2x faster once a multi-token verify makes the GEMM compute-bound; a single token is bandwidth-bound either way.)
// Each weight byte is read once per forward, whatever T is.

#ifndef PREFETCH
#define PREFETCH 16  // in 64-byte vectors
#endif

// Blocks [b0, b0+G) of 16 rows against tokens [t0, t0+NT): Y = bf16(bf16(X W^T + bias) + res), rows < N only.
// X is the fp32 copy of the input [T, K].
template <int G, int NT>
inline void tile(const float* X, int64_t K, const bf16* P, int64_t N, int64_t b0, int64_t t0, const bf16* bias,
                 const bf16* res, bf16* Y) {
  const int64_t pairs = K / 2;
  __m512 acc[G][NT];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NT; ++j) acc[g][j] = _mm512_setzero_ps();
  const bf16* base = P + b0 * pairs * 32;
  const __m512i high = _mm512_set1_epi32(int(0xFFFF0000u));
  for (int64_t p = 0; p < pairs; ++p) {
    for (int g = 0; g < G; ++g) {
      // Software prefetch 1 KiB ahead: the hardware streamer stops at each 4 KiB page, and a 576-wide layer's
      // stream per block is only 18 KiB long.
      _mm_prefetch(reinterpret_cast<const char*>(base + (g * pairs + p + PREFETCH) * 32), _MM_HINT_T0);
      const __m512i raw = _mm512_loadu_si512(base + (g * pairs + p) * 32);
      const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));  // column 2p of the 16 rows
      const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(raw, high));   // column 2p+1
      for (int j = 0; j < NT; ++j) {
        const float* x = X + (t0 + j) * K + 2 * p;
        acc[g][j] = _mm512_fmadd_ps(even, _mm512_set1_ps(x[0]), acc[g][j]);
        acc[g][j] = _mm512_fmadd_ps(odd, _mm512_set1_ps(x[1]), acc[g][j]);
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    const int64_t r0 = (b0 + g) * 16, valid = std::min<int64_t>(16, N - r0);
    const __mmask16 m = (__mmask16)((1u << valid) - 1);
    const __m512 b = bias ? load16_f(bias + r0, m) : _mm512_setzero_ps();
    for (int j = 0; j < NT; ++j) {
      __m512 y = round16(_mm512_add_ps(acc[g][j], b));
      const int64_t at = (t0 + j) * N + r0;
      if (res) y = _mm512_add_ps(y, load16_f(res + at, m));
      _mm256_mask_storeu_epi16(Y + at, m, (__m256i)_mm512_cvtneps_pbh(y));
    }
  }
}

template <int G>
inline void block_group(const float* X, int64_t T, int64_t K, const bf16* P, int64_t N, int64_t b0, const bf16* bias,
                        const bf16* res, bf16* Y) {
  int64_t t0 = 0;
  for (; t0 + 4 <= T; t0 += 4) tile<G, 4>(X, K, P, N, b0, t0, bias, res, Y);
  switch (T - t0) {
    case 3: tile<G, 3>(X, K, P, N, b0, t0, bias, res, Y); break;
    case 2: tile<G, 2>(X, K, P, N, b0, t0, bias, res, Y); break;
    case 1: tile<G, 1>(X, K, P, N, b0, t0, bias, res, Y); break;
    default: break;
  }
}

// Y [T, N] = X [T, K] @ W^T (+ bias [N]) (+ res [T, N]) with W packed as above; K even.
void gemm(const bf16* X, int64_t T, int64_t K, const bf16* P, int64_t N, const bf16* bias, const bf16* res, bf16* Y) {
  std::vector<float> xf(T * K);  // the input in fp32 once, broadcast from here
  for (int64_t i = 0; i < T * K; ++i) xf[i] = to_f(X[i]);
  const int64_t blocks = (N + 15) / 16, groups = blocks / 4;
  // A task should stream >= ~64 KiB of weights, or waking the second thread costs more than it saves.
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (4 * 16 * K * 2));
  at::parallel_for(0, groups, grain, [&](int64_t a, int64_t b) {
    for (int64_t q = a; q < b; ++q) block_group<4>(xf.data(), T, K, P, N, 4 * q, bias, res, Y);
  });
  for (int64_t b = 4 * groups; b < blocks; ++b) block_group<1>(xf.data(), T, K, P, N, b, bias, res, Y);
}

// out = bf16(w * bf16(x * rsqrt(mean(x^2) + eps))) per row of n values (transformers' LlamaRMSNorm in bf16).
void rms_norm(const bf16* x, int64_t rows, int64_t n, const bf16* w, float eps, bf16* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const bf16* xr = x + r * n;
    float ss = 0.f;
    for (int64_t k = 0; k < n; ++k) ss += to_f(xr[k]) * to_f(xr[k]);
    const float inv = 1.f / std::sqrt(ss / float(n) + eps);
    for (int64_t k = 0; k < n; ++k) out[r * n + k] = to_bf(to_f(w[k]) * round_bf(to_f(xr[k]) * inv));
  }
}

// In-place RoPE on one head vector: x*cos + roll(x, d/2)*sin_signed (the sign of rotate_half is in the table).
void rope(bf16* x, int64_t d, const bf16* cos, const bf16* sin) {
  float tmp[1024];
  for (int64_t j = 0; j < d; ++j) tmp[j] = to_f(x[j]);
  const int64_t half = d / 2;
  for (int64_t j = 0; j < d; ++j)
    x[j] = to_bf(round_bf(tmp[j] * to_f(cos[j])) + round_bf(tmp[(j + half) % d] * to_f(sin[j])));
}

// Attention of new token i, query head h, over prefix slots [0, start) and new slots start+j with mask[i, j].
void attend_one(const bf16* q, const bf16* kc, const bf16* vc, int64_t start, int64_t i, int64_t T, const bool* mask,
                int64_t d, float scale, std::vector<float>& scores, bf16* out) {
  const int64_t n = start + T;
  scores.resize(n);
  float best = -INFINITY;
  for (int64_t s = 0; s < n; ++s) {
    const bool visible = s < start || (mask ? mask[i * T + (s - start)] : (s - start) <= i);
    if (!visible) {
      scores[s] = -INFINITY;
      continue;
    }
    __m512 acc = _mm512_setzero_ps();
    for (int64_t k = 0; k < d; k += 32) acc = _mm512_dpbf16_ps(acc, load32(q + k, d - k), load32(kc + s * d + k, d - k));
    scores[s] = _mm512_reduce_add_ps(acc) * scale;
    best = std::max(best, scores[s]);
  }
  // Softmax numerators 16 at a time; masked slots (-inf) become exactly 0 and are skipped below.
  scores.resize((n + 15) / 16 * 16, -INFINITY);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t s = 0; s < n; s += 16) {
    const __m512 v = _mm512_loadu_ps(scores.data() + s);
    const __mmask16 live = _mm512_cmp_ps_mask(v, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(v, _mm512_set1_ps(best))));
    _mm512_storeu_ps(scores.data() + s, e);
    sum = _mm512_add_ps(sum, e);
  }
  const float total = _mm512_reduce_add_ps(sum);
  __m512 acc[8];  // d <= 128, d % 16 == 0
  const int64_t chunks = d / 16;
  for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t s = 0; s < n; ++s) {
    if (scores[s] == 0.f) continue;
    const __m512 p = _mm512_set1_ps(scores[s]);
    for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_fmadd_ps(p, load16_f(vc + s * d + 16 * c), acc[c]);
  }
  float buf[16];
  for (int64_t c = 0; c < chunks; ++c) {
    _mm512_storeu_ps(buf, acc[c]);
    for (int j = 0; j < 16; ++j) out[16 * c + j] = to_bf(buf[j] / total);
  }
}

}  // namespace

// x [T, H] -> x after one decoder layer; writes this layer's K/V for the T new tokens to slots start..start+T-1.
torch::Tensor decoder_layer(const torch::Tensor& x, const torch::Tensor& ln1, const torch::Tensor& wqkv,
                            const std::optional<torch::Tensor>& bqkv, const std::optional<torch::Tensor>& qn,
                            const std::optional<torch::Tensor>& kn, const torch::Tensor& wo,
                            const std::optional<torch::Tensor>& bo, const torch::Tensor& ln2, const torch::Tensor& wgu,
                            const std::optional<torch::Tensor>& bgu, const torch::Tensor& wdown,
                            const std::optional<torch::Tensor>& bdown, const torch::Tensor& kc, const torch::Tensor& vc,
                            int64_t start, const torch::Tensor& cos, const torch::Tensor& sin,
                            const std::optional<torch::Tensor>& tree_mask, int64_t hq, int64_t hkv, double eps,
                            double scale) {
  const int64_t T = x.size(0), H = x.size(1), d = kc.size(2), S = kc.size(1), inter = 2 * wdown.size(1);
  const int64_t nq = hq * d, nqkv = (hq + 2 * hkv) * d, group = hq / hkv;
  for (const torch::Tensor* t : {&x, &kc, &vc, &cos, &sin, &wqkv, &wo, &wgu, &wdown})
    TORCH_CHECK(t->scalar_type() == torch::kBFloat16 && t->is_contiguous() && t->device().is_cpu(),
                "the fused CPU layer takes contiguous bf16 CPU tensors");
  TORCH_CHECK(!tree_mask || (tree_mask->scalar_type() == torch::kBool && tree_mask->is_contiguous()),
              "tree_mask must be a contiguous bool tensor");
  TORCH_CHECK(d % 16 == 0 && d <= 128, "head_dim must be a multiple of 16 and <= 128");
  TORCH_CHECK(start + T <= S, "the new tokens do not fit in the cache");
  TORCH_CHECK(2 * wqkv.size(1) == H && 2 * wo.size(1) == hq * d && 2 * wgu.size(1) == H && wgu.size(0) * 16 >= 2 * inter,
              "packed weights do not match the hidden size / heads");
  std::vector<bf16> xn(T * H), qkv(T * nqkv), attn(T * nq), gu(T * 2 * inter), act(T * inter);
  auto mid = torch::empty_like(x), out = torch::empty_like(x);
  const float feps = float(eps);

  rms_norm(ptr(x), T, H, ptr(ln1), feps, xn.data());
  gemm(xn.data(), T, H, ptr(wqkv), nqkv, opt_ptr(bqkv), nullptr, qkv.data());  // [T, (Hq+2Hkv)d]
  bf16* kcache = reinterpret_cast<bf16*>(kc.data_ptr());
  bf16* vcache = reinterpret_cast<bf16*>(vc.data_ptr());
  for (int64_t t = 0; t < T; ++t) {
    bf16* row = qkv.data() + t * nqkv;
    for (int64_t h = 0; h < hq + hkv; ++h) {
      bf16* head = row + h * d;
      if (qn) rms_norm(head, 1, d, ptr(h < hq ? *qn : *kn), feps, head);  // Qwen3 q/k norm (in place is safe)
      rope(head, d, ptr(cos) + t * d, ptr(sin) + t * d);
    }
    for (int64_t g = 0; g < hkv; ++g) {
      std::memcpy(kcache + (g * S + start + t) * d, row + (hq + g) * d, d * sizeof(bf16));
      std::memcpy(vcache + (g * S + start + t) * d, row + (hq + hkv + g) * d, d * sizeof(bf16));
    }
  }
  const bool* mask = tree_mask ? tree_mask->data_ptr<bool>() : nullptr;
  const int64_t work = T * hq * (start + T) * d;
  at::parallel_for(0, T * hq, work > (1 << 15) ? 1 : T * hq, [&](int64_t a, int64_t b) {
    std::vector<float> scores;
    for (int64_t job = a; job < b; ++job) {
      const int64_t i = job / hq, h = job % hq, g = h / group;
      attend_one(qkv.data() + i * nqkv + h * d, kcache + g * S * d, vcache + g * S * d, start, i, T, mask, d,
                 float(scale), scores, attn.data() + i * nq + h * d);
    }
  });
  bf16* m = reinterpret_cast<bf16*>(mid.data_ptr());
  gemm(attn.data(), T, nq, ptr(wo), H, opt_ptr(bo), ptr(x), m);  // x + o_proj(attn)
  rms_norm(m, T, H, ptr(ln2), feps, xn.data());
  gemm(xn.data(), T, H, ptr(wgu), 2 * inter, opt_ptr(bgu), nullptr, gu.data());  // [T, 2I]: gate | up
  for (int64_t t = 0; t < T; ++t) {  // act = bf16(bf16(silu(gate)) * up), 16 at a time
    const bf16* gate = gu.data() + t * 2 * inter;
    const bf16* up = gate + inter;
    for (int64_t j = 0; j < inter; j += 16) {
      const __mmask16 m = (__mmask16)((1u << std::min<int64_t>(16, inter - j)) - 1);
      const __m512 g = load16_f(gate + j, m);
      const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
      const __m512 y = _mm512_mul_ps(round16(silu), load16_f(up + j, m));
      _mm256_mask_storeu_epi16(act.data() + t * inter + j, m, (__m256i)_mm512_cvtneps_pbh(y));
    }
  }
  gemm(act.data(), T, inter, ptr(wdown), H, opt_ptr(bdown), m, reinterpret_cast<bf16*>(out.data_ptr()));
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decoder_layer", &decoder_layer, "one bf16 Llama-family decoder layer over a static KV cache");
  m.def("linear", &linear, "bf16 linear y = x @ w.T (+ bias) over a packed weight, fp32 accumulation");
}
