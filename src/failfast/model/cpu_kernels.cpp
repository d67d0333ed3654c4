// Float32 CPU kernels for inference on AVX-512 CPUs (docs/design.md, "Float32 CPU kernels";
// built and loaded by model/cpu_kernels.py). Each computes a row's result in one fixed order,
// whatever else shares the call, so a k-token verification rounds like k one-token forwards.
//
// tiled_linear: y = x W^T + b for a few rows of x (model/tiled.py). The weight comes in tiles
// of 64 output columns, each stored k-major ([tile][k][64]) so a tile streams from memory in
// order, as float16 when every weight is a float16 value (exact: half the bytes, widened in
// registers) or float32. Each output is one accumulator summed over k = 0..K-1 in order, then
// the bias is added, whatever the row count or thread count.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kTile = 64;  // output columns per tile: four vectors of 16 floats
constexpr int64_t kRows = 6;   // rows per register block: 24 accumulators, 4 weight vectors
// How far ahead of its reads a product asks for its weights (`_mm_prefetch`, a hint that never
// faults): the hardware prefetcher alone streamed 11-12 GB/s on our 2-core VM, this 15-17.
constexpr int64_t kPrefetchBytes = 4096;

inline __mmask16 first_lanes(int64_t count) {
  return count >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1);
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// R rows of x (row stride K) times one tile, into `cols` (<= 64) columns of y (row stride N).
template <int R, typename W>
void rows_by_tile(const float* x, int64_t K, const W* tile, float* y, int64_t N, int64_t cols, const float* bias) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const W* w = tile + k * kTile;
    const uintptr_t ahead = reinterpret_cast<uintptr_t>(w) + kPrefetchBytes;  // may pass the end: only a hint
    for (size_t line = 0; line < kTile * sizeof(W); line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T0);
    const __m512 w0 = load16(w), w1 = load16(w + 16), w2 = load16(w + 32), w3 = load16(w + 48);
    for (int r = 0; r < R; ++r) {
      const __m512 xr = _mm512_set1_ps(x[r * K + k]);
      acc[r][0] = _mm512_fmadd_ps(xr, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xr, w1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(xr, w2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(xr, w3, acc[r][3]);
    }
  }
  for (int64_t j = 0; j < 4 && j * 16 < cols; ++j) {
    const __mmask16 mask = first_lanes(cols - j * 16);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + j * 16) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * N + j * 16, mask, _mm512_add_ps(acc[r][j], b));
  }
}

template <typename W>
using RowsByTile = void (*)(const float*, int64_t, const W*, float*, int64_t, int64_t, const float*);
template <typename W>
constexpr RowsByTile<W> kRowsByTile[kRows] = {rows_by_tile<1, W>, rows_by_tile<2, W>, rows_by_tile<3, W>,
                                               rows_by_tile<4, W>, rows_by_tile<5, W>, rows_by_tile<6, W>};

template <typename W>
void product(const float* x, int64_t M, int64_t K, const W* tiles, int64_t N, float* y, const float* bias) {
  const int64_t count = (N + kTile - 1) / kTile;
  at::parallel_for(0, count, 1, [&](int64_t first, int64_t end) {
    for (int64_t t = first; t < end; ++t) {
      const W* tile = tiles + t * K * kTile;
      const int64_t col = t * kTile, cols = std::min(kTile, N - col);
      const float* b = bias ? bias + col : nullptr;
      for (int64_t m = 0; m < M; m += kRows) {  // later row blocks read the tile from cache
        const float* xm = x + m * K;
        float* ym = y + m * N + col;
        kRowsByTile<W>[std::min(kRows, M - m) - 1](xm, K, tile, ym, N, cols, b);
      }
    }
  });
}

// rms_norm: y = w * (x / sqrt(mean(x^2) + eps)) over the last dimension of x; the sum of
// squares in 16 lanes, then the lanes in a fixed order. One call instead of PyTorch's eight
// dispatched ops (about 1.5 us against 15-45 us for a 384-wide row).
// One row: y = w * (x * (1 / sqrt(mean(x^2) + eps))); y may be x.
inline void rms_norm_row(const float* xr, const float* w, float* yr, int64_t n, float eps) {
  __m512 squares = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 xi = _mm512_maskz_loadu_ps(first_lanes(n - i), xr + i);
    squares = _mm512_fmadd_ps(xi, xi, squares);
  }
  const float scale = 1.0f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(n) + eps);
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 lanes = first_lanes(n - i);
    const __m512 h = _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, xr + i), s);
    _mm512_mask_storeu_ps(yr + i, lanes, _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, w + i), h));
  }
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == torch::kFloat && x.device().is_cpu(),
              "x must be contiguous float32 on the CPU");
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == torch::kFloat && weight.numel() == n,
              "weight must be a contiguous float32 vector of x's last dimension");
  auto y = torch::empty_like(x);
  for (int64_t r = 0; r < rows; ++r)
    rms_norm_row(x.data_ptr<float>() + r * n, weight.data_ptr<float>(), y.data_ptr<float>() + r * n, n,
                 static_cast<float>(eps));
  return y;
}

void check_tiles(const torch::Tensor& tiles, int64_t K, int64_t N, const char* name) {
  TORCH_CHECK(tiles.dim() == 3 && tiles.is_contiguous() && tiles.size(0) == (N + kTile - 1) / kTile &&
                  tiles.size(1) == K && tiles.size(2) == kTile &&
                  (tiles.scalar_type() == torch::kHalf || tiles.scalar_type() == torch::kFloat) && tiles.device().is_cpu(),
              name, " must be float16 or float32 CPU tiles [ceil(out / 64), in, 64], contiguous");
}

// y [M, N] = x [M, K] times tiles (checked by check_tiles), plus bias (or null).
void tiled_product(const float* x, int64_t M, int64_t K, const torch::Tensor& tiles, int64_t N, float* y,
                   const float* bias) {
  if (tiles.scalar_type() == torch::kHalf)
    product(x, M, K, tiles.data_ptr<at::Half>(), N, y, bias);
  else
    product(x, M, K, tiles.data_ptr<float>(), N, y, bias);
}

const float* optional_floats(const c10::optional<torch::Tensor>& t, int64_t n, const char* name) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->is_contiguous() && t->scalar_type() == torch::kFloat && t->numel() == n && t->device().is_cpu(),
              name, " must be a contiguous float32 CPU vector of ", n);
  return t->data_ptr<float>();
}

torch::Tensor tiled_linear(const torch::Tensor& x, const torch::Tensor& tiles, int64_t out_features,
                           const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat && x.device().is_cpu(),
              "x must be a contiguous float32 CPU matrix");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  check_tiles(tiles, K, N, "tiles");
  auto y = torch::empty({M, N}, x.options());
  tiled_product(x.data_ptr<float>(), M, K, tiles, N, y.data_ptr<float>(), optional_floats(bias, N, "bias"));
  return y;
}

// e^x, lane by lane: 2^n * e^r with r = x - n ln2 in [-ln2/2, ln2/2] and a degree-6 Taylor
// polynomial for e^r (relative error ~1e-7); x is clamped to [-87, 88] (e^-87 ~ 1.6e-38, so
// callers that need exact zeros, as for masked keys, set them themselves).
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 poly = _mm512_set1_ps(1.0f / 720);
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.0f / 120));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.0f / 24));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.0f / 6));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(0.5f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.0f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(poly, n);
}

// swiglu: silu(gate) * up = gate / (1 + e^-gate) * up, element by element, for gate and up
// [rows, n] (last dimension contiguous, any row stride: the halves of the fused gate/up
// product); out [rows, n] contiguous. PyTorch's SiLU takes a vectorised exp for most elements
// and a scalar one for a chunk's leftovers, and where chunks end depends on the row count and
// the thread split; here every element takes the same path.
inline void swiglu_row(const float* g, const float* u, float* o, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 lanes = first_lanes(n - i);
    const __m512 gi = _mm512_maskz_loadu_ps(lanes, g + i);
    const __m512 silu = _mm512_div_ps(gi, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), gi))));
    _mm512_mask_storeu_ps(o + i, lanes, _mm512_mul_ps(silu, _mm512_maskz_loadu_ps(lanes, u + i)));
  }
}

torch::Tensor swiglu(const torch::Tensor& gate, const torch::Tensor& up) {
  TORCH_CHECK(gate.dim() == 2 && up.sizes() == gate.sizes() && gate.stride(1) == 1 && up.stride(1) == 1 &&
                  gate.scalar_type() == torch::kFloat && up.scalar_type() == torch::kFloat && gate.device().is_cpu() &&
                  up.device().is_cpu(),
              "gate and up must be float32 CPU matrices of one shape with contiguous rows");
  const int64_t rows = gate.size(0), n = gate.size(1);
  auto out = torch::empty({rows, n}, gate.options());
  for (int64_t r = 0; r < rows; ++r)
    swiglu_row(gate.data_ptr<float>() + r * gate.stride(0), up.data_ptr<float>() + r * up.stride(0),
               out.data_ptr<float>() + r * n, n);
  return out;
}

// The horizontal sums of 16 vectors, as one vector (lane i: the sum of acc[i]'s lanes): a
// fixed tree of in-lane and cross-lane shuffles, about 3 ops per vector against ~8 for
// reducing each alone. Each lane sums only its own vector, always in the same order.
inline __m512 sums_of_16(const __m512 acc[16]) {
  __m512 quads[4];
  for (int g = 0; g < 4; ++g) {  // per 128-bit block: the block's sums of acc[4g .. 4g+3]
    const __m512 *a = acc + 4 * g;
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
    quads[g] = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  // block g of the result: the four blocks of quads[g] added
  const __m512 q01 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 q23 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(q01, q23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(q01, q23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Which of keys j0 .. j0+15 (fewer at the end) a query may attend to.
inline __mmask16 live_keys(const bool* allowed, int64_t allowed_stride, int64_t j0, int64_t S) {
  __mmask16 live = first_lanes(S - j0);
  if (!allowed) return live;
  unsigned bits = 0;
  for (int i = 0; i < 16 && j0 + i < S; ++i) bits |= static_cast<unsigned>(allowed[(j0 + i) * allowed_stride]) << i;
  return live & static_cast<__mmask16>(bits);
}

// One query against its keys: softmax(q k^T * scale) v over the keys `allowed` lets through
// (all when null), into out [D]. C vectors of 16 hold a head (D <= 16 C). Scores are made 16
// keys at a time; a key's score, its softmax weight and its term of the weighted sum do not
// depend on which other keys are there, and masked keys weigh exactly 0.
template <int C>
void attend_query(const float* q, const float* keys, int64_t key_stride, const float* values, int64_t value_stride,
                  int64_t S, int64_t D, const bool* allowed, int64_t allowed_stride, float scale, float* scores,
                  float* out) {
  __m512 qv[C];
  for (int c = 0; c < C; ++c) qv[c] = _mm512_maskz_loadu_ps(first_lanes(D - 16 * c), q + 16 * c);
  const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 top = lowest;
  for (int64_t j0 = 0; j0 < S; j0 += 16) {
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) {
      acc[i] = _mm512_setzero_ps();
      if (j0 + i >= S) continue;
      const float* k = keys + (j0 + i) * key_stride;
      for (int c = 0; c < C; ++c) acc[i] = _mm512_fmadd_ps(qv[c], _mm512_maskz_loadu_ps(first_lanes(D - 16 * c), k + 16 * c), acc[i]);
    }
    const __m512 s = _mm512_mask_blend_ps(live_keys(allowed, allowed_stride, j0, S), lowest,
                                          _mm512_mul_ps(sums_of_16(acc), _mm512_set1_ps(scale)));
    top = _mm512_max_ps(top, s);
    _mm512_storeu_ps(scores + j0, s);  // scores holds S rounded up to 16
  }
  const float best = _mm512_reduce_max_ps(top);
  __m512 o[C];
  for (int c = 0; c < C; ++c) o[c] = _mm512_setzero_ps();
  __m512 total = _mm512_setzero_ps();
  if (best != -std::numeric_limits<float>::infinity()) {  // else no key to attend to: zeros
    const __m512 best_v = _mm512_set1_ps(best);
    for (int64_t j0 = 0; j0 < S; j0 += 16) {
      const __m512 s = _mm512_loadu_ps(scores + j0);
      const __mmask16 live = _mm512_cmp_ps_mask(s, lowest, _CMP_NEQ_OQ);
      const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(s, best_v)));
      total = _mm512_add_ps(total, e);
      alignas(64) float weights[16];
      _mm512_store_ps(weights, e);
      for (unsigned rest = live; rest; rest &= rest - 1) {  // the live keys, in order
        const int i = __builtin_ctz(rest);
        const float* v = values + (j0 + i) * value_stride;
        const __m512 w = _mm512_set1_ps(weights[i]);
        for (int c = 0; c < C; ++c) o[c] = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(first_lanes(D - 16 * c), v + 16 * c), o[c]);
      }
    }
    const __m512 inverse = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
    for (int c = 0; c < C; ++c) o[c] = _mm512_mul_ps(o[c], inverse);
  }
  for (int c = 0; c < C; ++c) _mm512_mask_storeu_ps(out + 16 * c, first_lanes(D - 16 * c), o[c]);
}

using AttendQuery = void (*)(const float*, const float*, int64_t, const float*, int64_t, int64_t, int64_t, const bool*,
                             int64_t, float, float*, float*);
constexpr AttendQuery kAttendQuery[8] = {attend_query<1>, attend_query<2>, attend_query<3>, attend_query<4>,
                                         attend_query<5>, attend_query<6>, attend_query<7>, attend_query<8>};

// attend: attention of queries q [B, H, T, D] to keys and values [B, G, S, D] (G groups of
// H / G query heads; the last dimension contiguous), scaled by `scale`, where a boolean mask
// (broadcast to [B, T, S]) lets a key through; out [B, T, H, D]. Each query's scores, softmax
// and weighted sum run in one fixed order over its keys, and masked keys are skipped, so a
// query's result is the same whatever other queries share the call and however many masked
// keys follow its last one: a k-token forward computes what k one-token forwards do.
torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                     const c10::optional<torch::Tensor>& mask, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v must be [B, heads, tokens, head_dim]");
  for (const auto* t : {&q, &k, &v})
    TORCH_CHECK(t->scalar_type() == torch::kFloat && t->device().is_cpu() && t->stride(3) == 1,
                "q, k, v must be float32 on the CPU with a contiguous last dimension");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), G = k.size(1), S = k.size(2);
  TORCH_CHECK(D > 0 && D <= 128 && k.size(3) == D && v.size(3) == D && G > 0 && H % G == 0 && k.size(0) == B &&
                  v.size(0) == B && v.size(1) == G && v.size(2) == S,
              "attend: shapes do not fit (head_dim 1 to 128)");
  if (mask.has_value())
    TORCH_CHECK(mask->scalar_type() == torch::kBool && mask->dim() == 3 && mask->size(0) == B && mask->size(1) == T &&
                    mask->size(2) == S,
                "mask must be boolean [B, T, S]");
  auto out = torch::empty({B, T, H, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const bool* mp = mask.has_value() ? mask->data_ptr<bool>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t per_group = H / G;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(S * D, 1));
  at::parallel_for(0, B * H * T, grain, [&](int64_t first, int64_t end) {
    std::vector<float> scores(S + 16);
    for (int64_t item = first; item < end; ++item) {
      const int64_t b = item / (H * T), h = item / T % H, t = item % T, g = h / per_group;
      const float* query = qp + b * q.stride(0) + h * q.stride(1) + t * q.stride(2);
      const float* keys = kp + b * k.stride(0) + g * k.stride(1);
      const float* values = vp + b * v.stride(0) + g * v.stride(1);
      const bool* allowed = mp ? mp + b * mask->stride(0) + t * mask->stride(1) : nullptr;
      const int64_t allowed_stride = mp ? mask->stride(2) : 0;
      float* o = op + ((b * T + t) * H + h) * D;
      kAttendQuery[(D + 15) / 16 - 1](query, keys, k.stride(2), values, v.stride(2), S, D, allowed, allowed_stride,
                                      static_cast<float>(scale), scores.data(), o);
    }
  });
  return out;
}

// out[i] = x[i] * cos[i] + partner[i] * signed_sin[i] for i < n: one half of a rotated head.
inline void rotate_half(const float* x, const float* partner, const float* cos, const float* signed_sin, float* out,
                        int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 lanes = first_lanes(n - i);
    const __m512 straight = _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, x + i), _mm512_maskz_loadu_ps(lanes, cos + i));
    const __m512 swapped =
        _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, partner + i), _mm512_maskz_loadu_ps(lanes, signed_sin + i));
    _mm512_mask_storeu_ps(out + i, lanes, _mm512_add_ps(straight, swapped));
  }
}

// rotary: RoPE in the rotate-half layout, x * cos + roll(x, D/2) * signed_sin (model/transformer.py's
// `apply_rotary`: the same two multiplies and one add per element, never fused, so the same
// bits) for x [B, H, T, D] with a contiguous last dimension and tables [T, D]; out contiguous.
// One call instead of five ops.
torch::Tensor rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& signed_sin) {
  TORCH_CHECK(x.dim() == 4 && x.scalar_type() == torch::kFloat && x.device().is_cpu() && x.stride(3) == 1,
              "x must be float32 [B, heads, T, D] on the CPU with a contiguous last dimension");
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3), half = D / 2;
  TORCH_CHECK(D % 2 == 0, "head_dim must be even");
  for (const auto* table : {&cos, &signed_sin})
    TORCH_CHECK(table->is_contiguous() && table->scalar_type() == torch::kFloat && table->dim() == 2 &&
                    table->size(0) == T && table->size(1) == D,
                "cos and signed_sin must be contiguous float32 [T, D]");
  auto out = torch::empty({B, H, T, D}, x.options());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t) {
        const float* row = x.data_ptr<float>() + b * x.stride(0) + h * x.stride(1) + t * x.stride(2);
        const float* c = cos.data_ptr<float>() + t * D;
        const float* s = signed_sin.data_ptr<float>() + t * D;
        float* o = out.data_ptr<float>() + ((b * H + h) * T + t) * D;
        rotate_half(row, row + half, c, s, o, half);
        rotate_half(row + half, row, c + half, s + half, o + half, half);
      }
  return out;
}

void check_vector(const torch::Tensor& t, int64_t n, const char* name) {
  TORCH_CHECK(t.is_contiguous() && t.scalar_type() == torch::kFloat && t.numel() == n && t.device().is_cpu(), name,
              " must be a contiguous float32 CPU vector of ", n);
}

// Where each token of a decoder_layer call sits: its cache row, its position, the end of the
// keys it attends to (keys 0 .. end-1 of its cache row) and its row of the RoPE tables.
struct Places {
  std::vector<int64_t> row, pos, keys, rope;
};

// One head of a q/k/v row: normed in place (Qwen3's per-head norm; none where null), then
// rotated (RoPE rows c and sn) into dst.
inline void rotate_head(float* head, const float* norm, const float* c, const float* sn, float* dst, int64_t D,
                        float eps) {
  if (norm) rms_norm_row(head, norm, head, D, eps);
  const int64_t half = D / 2;
  rotate_half(head, head + half, c, sn, dst, half);
  rotate_half(head + half, head, c + half, sn + half, dst + half, half);
}

// One Qwen2/Qwen3 decoder layer of float32 inference over a KV cache in one call: what
// model/transformer.py's `DecoderLayer.forward` computes with the kernels above, the same
// kernels in the same order (so the same bits), without its ~25 dispatched ops. x holds M
// tokens (rows of E); each token's key (normed for Qwen3, rotated) and value are written into
// the layer's cache [rows, G, capacity, D] at its row and position, and its query attends to
// its row's keys 0 .. keys-1, which the attention kernel reads as a key range instead of a mask:
// masked keys were skipped anyway, so the bits are the same.
torch::Tensor layer(const torch::Tensor& x, const Places& at, const torch::Tensor& input_norm,
                    const torch::Tensor& qkv_tiles, const c10::optional<torch::Tensor>& qkv_bias,
                    const c10::optional<torch::Tensor>& q_norm, const c10::optional<torch::Tensor>& k_norm,
                    const torch::Tensor& o_tiles, const torch::Tensor& post_norm, const torch::Tensor& gate_up_tiles,
                    const torch::Tensor& down_tiles, double eps, const torch::Tensor& cos,
                    const torch::Tensor& signed_sin, const torch::Tensor& cache_k, const torch::Tensor& cache_v,
                    int64_t heads, double scale, const c10::optional<torch::Tensor>& embedded,
                    const c10::optional<torch::Tensor>& embedded_norm, const std::vector<int64_t>* outputs = nullptr) {
  const int64_t E = x.size(-1), M = static_cast<int64_t>(at.row.size());
  const int64_t IN = embedded.has_value() ? 2 * E : E;  // what q/k/v read: [normed embedded, normed x] or normed x
  TORCH_CHECK(embedded.has_value() == embedded_norm.has_value(), "embedded and embedded_norm come together");
  if (embedded.has_value())
    TORCH_CHECK(embedded->sizes() == x.sizes() && embedded->is_contiguous() && embedded->scalar_type() == torch::kFloat &&
                    embedded->device().is_cpu(),
                "embedded must be contiguous float32 of x's shape on the CPU");
  for (const auto* c : {&cache_k, &cache_v})
    TORCH_CHECK(c->dim() == 4 && c->scalar_type() == torch::kFloat && c->device().is_cpu() && c->stride(3) == 1 &&
                    c->sizes() == cache_k.sizes(),
                "caches must be float32 [rows, kv_heads, capacity, head_dim] with a contiguous last dimension");
  const int64_t G = cache_k.size(1), D = cache_k.size(3), H = heads;
  TORCH_CHECK(G > 0 && H > 0 && H % G == 0 && D > 0 && D <= 128 && D % 2 == 0,
              "decoder_layer: heads must be a multiple of the cache's kv heads, head_dim even and at most 128");
  for (int64_t r = 0; r < M; ++r)
    TORCH_CHECK(at.row[r] >= 0 && at.row[r] < cache_k.size(0) && at.pos[r] >= 0 && at.pos[r] < at.keys[r] &&
                    at.keys[r] <= cache_k.size(2) && at.rope[r] >= 0 && at.rope[r] < cos.size(0),
                "decoder_layer: a token's cache row, position, keys or RoPE row is out of range");
  const int64_t QKV = (H + 2 * G) * D, I = down_tiles.size(1);
  check_tiles(qkv_tiles, IN, QKV, "qkv_tiles");
  check_tiles(o_tiles, H * D, E, "o_tiles");
  check_tiles(gate_up_tiles, E, 2 * I, "gate_up_tiles");
  check_tiles(down_tiles, I, E, "down_tiles");
  check_vector(input_norm, E, "input_norm");
  check_vector(post_norm, E, "post_norm");
  const float* bias = optional_floats(qkv_bias, QKV, "qkv_bias");
  const float* qn = optional_floats(q_norm, D, "q_norm");
  const float* kn = optional_floats(k_norm, D, "k_norm");
  const float* en = optional_floats(embedded_norm, E, "embedded_norm");
  for (const auto* table : {&cos, &signed_sin})
    TORCH_CHECK(table->is_contiguous() && table->scalar_type() == torch::kFloat && table->dim() == 2 &&
                    table->size(1) == D && table->size(0) == cos.size(0) && table->device().is_cpu(),
                "cos and signed_sin must be contiguous float32 [positions, head_dim]");
  const float e = static_cast<float>(eps);
  const float* xp = x.data_ptr<float>();
  // the rows whose outputs are made: `outputs` (rows of x, ascending), or all; the others only
  // write their keys and values
  std::vector<int64_t> chosen;
  if (outputs) {
    for (size_t i = 0; i < outputs->size(); ++i)
      TORCH_CHECK((*outputs)[i] >= 0 && (*outputs)[i] < M && (i == 0 || (*outputs)[i] > (*outputs)[i - 1]),
                  "decoder_layer: output rows must be ascending rows of x");
    chosen = *outputs;
  } else {
    for (int64_t r = 0; r < M; ++r) chosen.push_back(r);
  }
  const int64_t Y = static_cast<int64_t>(chosen.size());
  auto out = outputs ? torch::empty({1, Y, E}, x.options()) : torch::empty_like(x);
  float* yp = out.data_ptr<float>();
  std::vector<float> h(M * IN), qkv(M * QKV), q(Y * H * D), attn(Y * H * D), gate_up(Y * 2 * I), act(Y * I),
      down(Y * E);

  for (int64_t r = 0; r < M; ++r) {
    float* hr = h.data() + r * IN;
    if (en) rms_norm_row(embedded->data_ptr<float>() + r * E, en, hr, E, e);
    rms_norm_row(xp + r * E, input_norm.data_ptr<float>(), hr + IN - E, E, e);
  }
  tiled_product(h.data(), M, IN, qkv_tiles, QKV, qkv.data(), bias);
  float* kp = cache_k.data_ptr<float>();
  float* vp = cache_v.data_ptr<float>();
  const int64_t k0 = cache_k.stride(0), k1 = cache_k.stride(1), k2 = cache_k.stride(2);
  const int64_t v0 = cache_v.stride(0), v1 = cache_v.stride(1), v2 = cache_v.stride(2);
  for (int64_t r = 0, y = 0; r < M; ++r) {  // keys and values into the cache; normed (Qwen3), rotated queries
    const float* c = cos.data_ptr<float>() + at.rope[r] * D;
    const float* sn = signed_sin.data_ptr<float>() + at.rope[r] * D;
    float* row = qkv.data() + r * QKV;
    const bool makes_output = y < Y && chosen[y] == r;
    for (int64_t i = makes_output ? 0 : H; i < H + G; ++i) {
      const bool is_query = i < H;
      rotate_head(row + i * D, is_query ? qn : kn, c, sn,
                  is_query ? q.data() + (y * H + i) * D : kp + at.row[r] * k0 + (i - H) * k1 + at.pos[r] * k2, D, e);
    }
    for (int64_t g = 0; g < G; ++g)
      std::copy_n(row + (H + G + g) * D, D, vp + at.row[r] * v0 + g * v1 + at.pos[r] * v2);
    y += makes_output;
  }
  int64_t widest = 0;
  for (int64_t r : chosen) widest = std::max(widest, at.keys[r]);
  const int64_t per_group = H / G;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(widest * D, 1));
  at::parallel_for(0, Y * H, grain, [&](int64_t first, int64_t end) {
    std::vector<float> scores(widest + 16);
    for (int64_t item = first; item < end; ++item) {
      const int64_t r = chosen[item / H], hh = item % H, g = hh / per_group;
      kAttendQuery[(D + 15) / 16 - 1](q.data() + item * D, kp + at.row[r] * k0 + g * k1, k2,
                                      vp + at.row[r] * v0 + g * v1, v2, at.keys[r], D, nullptr, 0,
                                      static_cast<float>(scale), scores.data(), attn.data() + item * D);
    }
  });
  tiled_product(attn.data(), Y, H * D, o_tiles, E, yp, nullptr);
  for (int64_t y = 0; y < Y; ++y)  // the residual: y holds x after attention
    for (int64_t i = 0; i < E; ++i) yp[y * E + i] = xp[chosen[y] * E + i] + yp[y * E + i];
  for (int64_t y = 0; y < Y; ++y) rms_norm_row(yp + y * E, post_norm.data_ptr<float>(), h.data() + y * E, E, e);
  tiled_product(h.data(), Y, E, gate_up_tiles, 2 * I, gate_up.data(), nullptr);
  for (int64_t y = 0; y < Y; ++y)
    swiglu_row(gate_up.data() + y * 2 * I, gate_up.data() + y * 2 * I + I, act.data() + y * I, I);
  tiled_product(act.data(), Y, I, down_tiles, E, down.data(), nullptr);
  for (int64_t i = 0; i < Y * E; ++i) yp[i] += down[i];
  return out;
}

// The places of T tokens at positions start .. start+T-1 of each of B cache rows, in row
// order: a query at position p reads keys 0 .. p (causal: block_size 0) or up to the end of its
// block, at most read_end (block diffusion). RoPE rows: the token's index in its row (tables
// of the forward's T positions), or its position (`by_position`: tables from position 0).
Places grid_places(int64_t B, int64_t T, int64_t start, int64_t read_end, int64_t block_size, bool by_position) {
  Places at;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t p = start + t;
      at.row.push_back(b);
      at.pos.push_back(p);
      at.keys.push_back(block_size ? std::min(read_end, (p / block_size + 1) * block_size) : p + 1);
      at.rope.push_back(by_position ? p : t);
    }
  return at;
}

void check_input(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 3 && x.is_contiguous() && x.scalar_type() == torch::kFloat && x.device().is_cpu(),
              "x must be contiguous float32 [rows, tokens, hidden] on the CPU");
}

// decoder_layer: x [B, T, E], the tokens at positions start .. start+T-1 of cache rows 0 .. B-1
// (every row of the cache); a query at position p attends to keys 0 .. p (causal: block_size
// 0) or up to the end of its block, at most read_end (block diffusion, reading scratch K/V an
// earlier pass wrote past its tokens). RoPE tables [T, D].
torch::Tensor decoder_layer(const torch::Tensor& x, const torch::Tensor& input_norm, const torch::Tensor& qkv_tiles,
                            const c10::optional<torch::Tensor>& qkv_bias, const c10::optional<torch::Tensor>& q_norm,
                            const c10::optional<torch::Tensor>& k_norm, const torch::Tensor& o_tiles,
                            const torch::Tensor& post_norm, const torch::Tensor& gate_up_tiles,
                            const torch::Tensor& down_tiles, double eps, const torch::Tensor& cos,
                            const torch::Tensor& signed_sin, const torch::Tensor& cache_k, const torch::Tensor& cache_v,
                            int64_t start, int64_t read_end, int64_t block_size, int64_t heads, double scale) {
  check_input(x);
  const int64_t B = x.size(0), T = x.size(1);
  TORCH_CHECK(cache_k.dim() == 4 && cache_k.size(0) == B && block_size >= 0 && start + T <= read_end,
              "decoder_layer: the cache must have x's rows, and read_end cover the tokens");
  const Places at = grid_places(B, T, start, read_end, block_size, false);
  return layer(x, at, input_norm, qkv_tiles, qkv_bias, q_norm, k_norm, o_tiles, post_norm, gate_up_tiles, down_tiles,
               eps, cos, signed_sin, cache_k, cache_v, heads, scale, c10::nullopt, c10::nullopt);
}

// packed_decoder_layer: x [1, N, E], tokens of several cache rows packed one row after another
// (model/ragged.py); places [3, N] int64: each token's cache row, position and key end. RoPE
// tables [N, D], one row per token. With `embedded` (x's shape) and its norm, q/k/v read
// [normed embedded, normed x] (an EAGLE-3 layer, model/eagle3.py); x stays the residual.
torch::Tensor packed_decoder_layer(const torch::Tensor& x, const torch::Tensor& input_norm, const torch::Tensor& qkv_tiles,
                                   const c10::optional<torch::Tensor>& qkv_bias,
                                   const c10::optional<torch::Tensor>& q_norm, const c10::optional<torch::Tensor>& k_norm,
                                   const torch::Tensor& o_tiles, const torch::Tensor& post_norm,
                                   const torch::Tensor& gate_up_tiles, const torch::Tensor& down_tiles, double eps,
                                   const torch::Tensor& cos, const torch::Tensor& signed_sin,
                                   const torch::Tensor& cache_k, const torch::Tensor& cache_v,
                                   const torch::Tensor& places, int64_t heads, double scale,
                                   const c10::optional<torch::Tensor>& embedded,
                                   const c10::optional<torch::Tensor>& embedded_norm) {
  check_input(x);
  const int64_t N = x.size(1);
  TORCH_CHECK(x.size(0) == 1 && places.dim() == 2 && places.size(0) == 3 && places.size(1) == N &&
                  places.scalar_type() == torch::kLong && places.is_contiguous() && places.device().is_cpu(),
              "packed_decoder_layer: x must be [1, N, hidden] and places contiguous int64 [3, N]");
  const int64_t* p = places.data_ptr<int64_t>();
  Places at{{p, p + N}, {p + N, p + 2 * N}, {p + 2 * N, p + 3 * N}, {}};
  for (int64_t r = 0; r < N; ++r) at.rope.push_back(r);
  return layer(x, at, input_norm, qkv_tiles, qkv_bias, q_norm, k_norm, o_tiles, post_norm, gate_up_tiles, down_tiles,
               eps, cos, signed_sin, cache_k, cache_v, heads, scale, embedded, embedded_norm);
}

// A decoder layer's weights as `layer` takes them (model/transformer.py's LayerKernelWeights
// without the EAGLE-3 embedding norm).
using LayerWeights = std::tuple<torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>,
                                c10::optional<torch::Tensor>, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                                double>;

// A model's decoder layers for `stack_forward`, built once per set of kept kernel weights so
// that a forward hands over one object instead of ten tensors a layer.
struct LayerStack {
  std::vector<LayerWeights> layers;
  int64_t heads;
  double scale;
};

// stack_forward: a whole float32 forward over a KV cache in one call: the embedding rows of
// `tokens` (N ids), every layer of `stack` (`layer`, as decoder_layer and
// packed_decoder_layer run it), the final norm of the rows `logits_at` (R indices into the N
// tokens) and their logits through the head's tiles ([R, vocab]): what
// `Transformer.forward` computes with one kernel call per layer, with the same kernels in the
// same order, so the same bits, without the Python between them. Tokens sit at `places` [3, N]
// (cache row, position, key end; a packed forward) or, without it, at positions start ..
// start+T-1 of every cache row (N = B x T, row-major; `grid_places`). RoPE tables cover
// positions 0.. (a token's row is its position). With `taps` (layer indices, ascending) the
// result also holds the outputs of those layers at every token, side by side ([N, taps x E]:
// what a target-conditioned drafter reads). With `hidden` [N, E] (an EAGLE-3 step; a one-layer
// stack) the residual stream starts from it and the embedding rows go beside it into the
// layer's attention input, normed by `embedded_norm`, as packed_decoder_layer's `embedded`.
std::vector<torch::Tensor> stack_forward(const LayerStack& stack, const std::vector<int64_t>& tokens, int64_t batch,
                            const c10::optional<torch::Tensor>& places, int64_t start, int64_t read_end,
                            int64_t block_size, const torch::Tensor& embedding, const torch::Tensor& cos,
                            const torch::Tensor& signed_sin, const std::vector<torch::Tensor>& keys,
                            const std::vector<torch::Tensor>& values, const torch::Tensor& norm, double eps,
                            const torch::Tensor& head_tiles, int64_t vocab, const std::vector<int64_t>& logits_at,
                            const std::vector<int64_t>& taps, const c10::optional<torch::Tensor>& hidden,
                            const c10::optional<torch::Tensor>& embedded_norm) {
  const int64_t N = static_cast<int64_t>(tokens.size()), L = static_cast<int64_t>(stack.layers.size());
  TORCH_CHECK(hidden.has_value() == embedded_norm.has_value() && (!hidden.has_value() || L == 1),
              "stack_forward: hidden and embedded_norm come together, for a one-layer stack");
  for (size_t i = 0; i < taps.size(); ++i)
    TORCH_CHECK(taps[i] >= 0 && taps[i] < L && (i == 0 || taps[i] > taps[i - 1]),
                "stack_forward: taps must be ascending layer indices");
  TORCH_CHECK(embedding.dim() == 2 && embedding.is_contiguous() && embedding.scalar_type() == torch::kFloat &&
                  embedding.device().is_cpu(),
              "stack_forward: the embedding must be a contiguous float32 CPU matrix");
  TORCH_CHECK(static_cast<int64_t>(keys.size()) == L && static_cast<int64_t>(values.size()) == L,
              "stack_forward: one key and one value cache per layer");
  const int64_t E = embedding.size(1), V = embedding.size(0), R = static_cast<int64_t>(logits_at.size());
  check_vector(norm, E, "norm");
  check_tiles(head_tiles, E, vocab, "head_tiles");
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(logits_at[r] >= 0 && logits_at[r] < N, "stack_forward: logits_at indexes past the tokens");
  for (int64_t n = 0; n < N; ++n)
    TORCH_CHECK(tokens[n] >= 0 && tokens[n] < V, "stack_forward: a token id is outside the embedding");
  Places at;
  if (places.has_value()) {
    TORCH_CHECK(places->dim() == 2 && places->size(0) == 3 && places->size(1) == N &&
                    places->scalar_type() == torch::kLong && places->is_contiguous() && places->device().is_cpu(),
                "stack_forward: places must be contiguous int64 [3, N]");
    const int64_t* p = places->data_ptr<int64_t>();
    at = Places{{p, p + N}, {p + N, p + 2 * N}, {p + 2 * N, p + 3 * N}, {p + N, p + 2 * N}};
  } else {
    TORCH_CHECK(batch > 0 && N % batch == 0 && block_size >= 0 && start + N / batch <= read_end,
                "stack_forward: tokens must fill the batch's rows, and read_end cover them");
    for (int64_t i = 0; i < L; ++i)
      TORCH_CHECK(keys[i].dim() == 4 && keys[i].size(0) == batch && values[i].dim() == 4 && values[i].size(0) == batch,
                  "stack_forward: the caches must have the batch's rows");
    at = grid_places(batch, N / batch, start, read_end, block_size, true);
  }
  const int64_t rows = places.has_value() ? 1 : batch;
  auto embedded = torch::empty({rows, N / rows, E}, embedding.options());
  for (int64_t n = 0; n < N; ++n)
    std::copy_n(embedding.data_ptr<float>() + tokens[n] * E, E, embedded.data_ptr<float>() + n * E);
  torch::Tensor x = embedded;
  c10::optional<torch::Tensor> beside;  // the embedding beside the hidden states (an EAGLE-3 step)
  if (hidden.has_value()) {
    TORCH_CHECK(hidden->dim() == 2 && hidden->size(0) == N && hidden->size(1) == E && hidden->is_contiguous() &&
                    hidden->scalar_type() == torch::kFloat && hidden->device().is_cpu(),
                "stack_forward: hidden must be contiguous float32 [N, hidden size] on the CPU");
    check_vector(*embedded_norm, E, "embedded_norm");
    x = hidden->view({rows, N / rows, E});
    beside = embedded;
  }
  const int64_t F = static_cast<int64_t>(taps.size()) * E;
  auto features = torch::empty({N, F}, embedding.options());
  // Unless tapped, the last layer makes outputs only for the rows the head reads (the others
  // write their keys and values): the same bits for those rows, as a row's output does not
  // depend on the others'. `read[r]`: where row logits_at[r] is in x after the layers.
  std::vector<int64_t> wanted(logits_at), read(logits_at);
  std::sort(wanted.begin(), wanted.end());
  wanted.erase(std::unique(wanted.begin(), wanted.end()), wanted.end());
  const bool trim = L > 0 && (taps.empty() || taps.back() != L - 1);
  if (trim)
    for (auto& r : read) r = std::lower_bound(wanted.begin(), wanted.end(), r) - wanted.begin();
  for (int64_t i = 0, tapped = 0; i < L; ++i) {
    const auto& [input_norm, qkv, qkv_bias, q_norm, k_norm, o, post_norm, gate_up, down, layer_eps] = stack.layers[i];
    x = layer(x, at, input_norm, qkv, qkv_bias, q_norm, k_norm, o, post_norm, gate_up, down, layer_eps, cos, signed_sin,
              keys[i], values[i], stack.heads, stack.scale, beside, embedded_norm,
              trim && i == L - 1 ? &wanted : nullptr);
    if (tapped < static_cast<int64_t>(taps.size()) && taps[tapped] == i) {
      for (int64_t n = 0; n < N; ++n)
        std::copy_n(x.data_ptr<float>() + n * E, E, features.data_ptr<float>() + n * F + tapped * E);
      ++tapped;
    }
  }
  std::vector<float> normed(R * E);
  for (int64_t r = 0; r < R; ++r) {
    rms_norm_row(x.data_ptr<float>() + read[r] * E, norm.data_ptr<float>(), normed.data() + r * E, E,
                 static_cast<float>(eps));
  }
  auto logits = torch::empty({R, vocab}, embedding.options());
  tiled_product(normed.data(), R, E, head_tiles, vocab, logits.data_ptr<float>(), nullptr);
  return {logits, features};
}

// The keys (normed for Qwen3, rotated) and values of T attention input rows h [T, IN] (normed
// already) through a layer's fused q/k/v tiles, written at positions start .. start+T-1 of
// cache row 0; the queries are dropped.
void write_keys_values(const LayerWeights& w, const float* h, int64_t T, int64_t IN, int64_t heads,
                       const torch::Tensor& cos, const torch::Tensor& signed_sin, const torch::Tensor& cache_k,
                       const torch::Tensor& cache_v, int64_t start, const char* caller) {
  const auto& [input_norm, qkv_tiles, qkv_bias, q_norm, k_norm, o, post_norm, gate_up, down, layer_eps] = w;
  for (const auto* c : {&cache_k, &cache_v})
    TORCH_CHECK(c->dim() == 4 && c->scalar_type() == torch::kFloat && c->device().is_cpu() && c->stride(3) == 1 &&
                    c->sizes() == cache_k.sizes() && start >= 0 && start + T <= c->size(2),
                caller, ": caches must be float32 [rows, kv_heads, capacity, head_dim] with room for the positions");
  for (const auto* table : {&cos, &signed_sin})
    TORCH_CHECK(table->is_contiguous() && table->scalar_type() == torch::kFloat && table->dim() == 2 &&
                    table->size(0) >= start + T && table->device().is_cpu(),
                caller, ": RoPE tables must be contiguous float32 [positions, head_dim] covering the positions");
  const int64_t G = cache_k.size(1), D = cache_k.size(3), H = heads, QKV = (H + 2 * G) * D;
  TORCH_CHECK(cos.size(1) == D && signed_sin.size(1) == D && D % 2 == 0, caller, ": RoPE tables of head_dim");
  check_tiles(qkv_tiles, IN, QKV, "qkv_tiles");
  const float* bias = optional_floats(qkv_bias, QKV, "qkv_bias");
  const float* kn = optional_floats(k_norm, D, "k_norm");
  std::vector<float> qkv(T * QKV);
  tiled_product(h, T, IN, qkv_tiles, QKV, qkv.data(), bias);
  float* kp = cache_k.data_ptr<float>();
  float* vp = cache_v.data_ptr<float>();
  for (int64_t r = 0; r < T; ++r) {
    const int64_t p = start + r;
    float* row = qkv.data() + r * QKV;
    for (int64_t g = 0; g < G; ++g) {
      rotate_head(row + (H + g) * D, kn, cos.data_ptr<float>() + p * D, signed_sin.data_ptr<float>() + p * D,
                  kp + g * cache_k.stride(1) + p * cache_k.stride(2), D, static_cast<float>(layer_eps));
      std::copy_n(row + (H + G + g) * D, D, vp + g * cache_v.stride(1) + p * cache_v.stride(2));
    }
  }
}

void check_rows(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous() && t.scalar_type() == torch::kFloat && t.device().is_cpu(), what,
              " must be a contiguous float32 CPU matrix");
}

// context_kv: a target-conditioned drafter's context (model/dflash.py, `write_context`) in one
// call: target features [T, F] fused (their product with fc's tiles, then the RMSNorm
// `hidden_norm`), and each layer's keys (normed for Qwen3, rotated) and values of the fused
// rows written into its cache at positions start .. start+T-1 of cache row 0. A layer's keys
// and values come from its fused q/k/v product, its queries dropped: one product of tiles.
void context_kv(const LayerStack& stack, const torch::Tensor& features, const torch::Tensor& fc_tiles,
                const torch::Tensor& hidden_norm, double eps, const torch::Tensor& cos, const torch::Tensor& signed_sin,
                const std::vector<torch::Tensor>& keys, const std::vector<torch::Tensor>& values, int64_t start) {
  check_rows(features, "context_kv: features");
  const int64_t T = features.size(0), F = features.size(1), E = hidden_norm.numel(),
                L = static_cast<int64_t>(stack.layers.size());
  check_vector(hidden_norm, E, "hidden_norm");
  check_tiles(fc_tiles, F, E, "fc_tiles");
  TORCH_CHECK(static_cast<int64_t>(keys.size()) == L && static_cast<int64_t>(values.size()) == L,
              "context_kv: one key and one value cache per layer");
  std::vector<float> fused(T * E);
  tiled_product(features.data_ptr<float>(), T, F, fc_tiles, E, fused.data(), nullptr);
  for (int64_t r = 0; r < T; ++r)
    rms_norm_row(fused.data() + r * E, hidden_norm.data_ptr<float>(), fused.data() + r * E, E, static_cast<float>(eps));
  for (int64_t i = 0; i < L; ++i)
    write_keys_values(stack.layers[i], fused.data(), T, E, stack.heads, cos, signed_sin, keys[i], values[i], start,
                      "context_kv");
}

// slot_kv: an EAGLE-3 drafter's committed slots (model/eagle3.py, `write_context`) in one call:
// slot r's attention input is [embedded_norm(embedding row of tokens[r]), input_norm(hidden[r])],
// as in `layer`, and its key and value go to position start + r of cache row 0 (a one-layer
// stack's cache). Only the fused q/k/v product runs, its queries dropped.
void slot_kv(const LayerStack& stack, const std::vector<int64_t>& tokens, const torch::Tensor& hidden,
             const torch::Tensor& embedding, const torch::Tensor& embedded_norm, const torch::Tensor& cos,
             const torch::Tensor& signed_sin, const torch::Tensor& cache_k, const torch::Tensor& cache_v, int64_t start) {
  check_rows(hidden, "slot_kv: hidden");
  check_rows(embedding, "slot_kv: the embedding");
  const int64_t T = hidden.size(0), E = hidden.size(1);
  TORCH_CHECK(stack.layers.size() == 1 && static_cast<int64_t>(tokens.size()) == T && embedding.size(1) == E,
              "slot_kv: a one-layer stack, a token per hidden row, an embedding of the hidden size");
  const torch::Tensor& input_norm = std::get<0>(stack.layers[0]);
  check_vector(embedded_norm, E, "embedded_norm");
  check_vector(input_norm, E, "input_norm");
  const float e = static_cast<float>(std::get<9>(stack.layers[0]));
  std::vector<float> h(T * 2 * E);
  for (int64_t r = 0; r < T; ++r) {
    TORCH_CHECK(tokens[r] >= 0 && tokens[r] < embedding.size(0), "slot_kv: a token id is outside the embedding");
    rms_norm_row(embedding.data_ptr<float>() + tokens[r] * E, embedded_norm.data_ptr<float>(), h.data() + r * 2 * E, E, e);
    rms_norm_row(hidden.data_ptr<float>() + r * E, input_norm.data_ptr<float>(), h.data() + r * 2 * E + E, E, e);
  }
  write_keys_values(stack.layers[0], h.data(), T, 2 * E, stack.heads, cos, signed_sin, cache_k, cache_v, start,
                    "slot_kv");
}

// A row's argmax among its first `limit` columns (the first on ties; a NaN counts as the
// largest, the first NaN wins) and, with `confidence`, its softmax probability among them (NaN
// where the row has a NaN or no finite maximum, as PyTorch's softmax gives).
std::pair<int64_t, double> pick_row(const float* row, int64_t limit, bool confidence) {
  __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 nan = 0;
  int64_t i = 0;
  for (; i < limit && !nan; i += 16) {
    const __mmask16 lanes = first_lanes(limit - i);
    const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), lanes, row + i);
    nan = _mm512_mask_cmp_ps_mask(lanes, v, v, _CMP_UNORD_Q);
    top = _mm512_max_ps(top, v);
  }
  const double no_probability = std::numeric_limits<double>::quiet_NaN();
  if (nan) return {i - 16 + __builtin_ctz(nan), no_probability};  // the block that had one is the last read
  const float best = _mm512_reduce_max_ps(top);
  int64_t at = 0;
  while (row[at] != best) ++at;
  if (!confidence) return {at, 0.0};
  if (!std::isfinite(best)) return {at, no_probability};  // e^(inf - inf)
  const __m512 shift = _mm512_set1_ps(best);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < limit; j += 16) {
    const __mmask16 lanes = first_lanes(limit - j);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, row + j), shift));
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(lanes, e));
  }
  return {at, 1.0 / static_cast<double>(_mm512_reduce_add_ps(sum))};
}

// row_picks: pick_row for each row of float32 logits [R, V] (all columns without a limit), as
// host lists. A greedy verification or drafting step reads these from the logits
// the forward just wrote, instead of several PyTorch ops on cold caches (~60 us each). None
// where the logits are not a contiguous float32 CPU matrix with a column: PyTorch picks then
// (the checks are here because reading a tensor's dtype and device from Python cost ~40 us).
py::object row_picks(const torch::Tensor& logits, c10::optional<int64_t> limit_or_all, bool confidence) {
  if (!(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == torch::kFloat &&
        logits.device().is_cpu() && logits.size(1) > 0))
    return py::none();
  const int64_t R = logits.size(0), V = logits.size(1), limit = limit_or_all.value_or(V);
  TORCH_CHECK(limit >= 1 && limit <= V, "limit must be in [1, ", V, "]");
  std::vector<int64_t> ids(R);
  std::vector<double> confs(confidence ? R : 0);
  for (int64_t r = 0; r < R; ++r) {
    const auto [id, conf] = pick_row(logits.data_ptr<float>() + r * V, limit, confidence);
    ids[r] = id;
    if (confidence) confs[r] = conf;
  }
  return py::make_tuple(ids, confs);
}

// chain_steps: `steps` greedy steps of a chain drafter in one call, each the stack_forward call
// its step makes and the pick its drafter makes, so the same bits as the steps one by one. Step
// s feeds its tokens at positions `position`.. of cache row 0 (the first step `tokens`, each
// later one the token just drafted) and picks the argmax of its last row's logits among their
// first `limit` columns with its probability (pick_row), mapped through `vocab` (a draft
// vocabulary's token ids; none: the column is the id). With `hidden` [1, E] (EAGLE-3,
// model/eagle3.py's step_logits) a step's hidden state goes through the one-layer stack beside
// the token's embedding and the layer's output (tapped) is the next step's hidden state;
// without it (an AR drafter) a step is a causal forward. Returns (tokens, confidences, the
// last step's output [1, E] or None).
py::tuple chain_steps(const LayerStack& stack, std::vector<int64_t> tokens, const c10::optional<torch::Tensor>& hidden,
                      int64_t position, int64_t steps, const torch::Tensor& embedding, const torch::Tensor& cos,
                      const torch::Tensor& signed_sin, const std::vector<torch::Tensor>& keys,
                      const std::vector<torch::Tensor>& values, const torch::Tensor& norm, double eps,
                      const torch::Tensor& head_tiles, int64_t head_rows,
                      const c10::optional<torch::Tensor>& embedded_norm, int64_t limit,
                      const std::vector<int64_t>& vocab) {
  TORCH_CHECK(steps >= 1 && !tokens.empty() && (!hidden.has_value() || tokens.size() == 1) && limit >= 1 &&
                  limit <= head_rows && (vocab.empty() || static_cast<int64_t>(vocab.size()) >= limit),
              "chain_steps: steps >= 1, tokens (one with hidden), a limit within the head's rows and the vocabulary");
  // what the last step reaches, checked before the first writes its keys and values
  const int64_t end = position + static_cast<int64_t>(tokens.size()) + steps - 1;
  TORCH_CHECK(!keys.empty() && keys[0].dim() == 4 && end <= keys[0].size(2) && end <= cos.size(0),
              "chain_steps: the steps pass the cache's end or the RoPE tables");
  for (int64_t i = 0; i < limit && !vocab.empty(); ++i)
    TORCH_CHECK(vocab[i] >= 0 && vocab[i] < embedding.size(0), "chain_steps: a vocabulary id is outside the embedding");
  std::vector<int64_t> drafted;
  std::vector<double> confs;
  c10::optional<torch::Tensor> h = hidden;
  for (int64_t s = 0; s < steps; ++s) {
    const int64_t n = static_cast<int64_t>(tokens.size());
    std::vector<torch::Tensor> out;
    if (h.has_value()) {
      const auto places = torch::tensor({int64_t{0}, position, position + 1}, torch::kLong).view({3, 1});
      out = stack_forward(stack, tokens, 1, places, 0, 0, 0, embedding, cos, signed_sin, keys, values, norm, eps,
                          head_tiles, head_rows, {0}, {0}, h, embedded_norm);
      h = out[1];
    } else {
      out = stack_forward(stack, tokens, 1, c10::nullopt, position, position + n, 0, embedding, cos, signed_sin, keys,
                          values, norm, eps, head_tiles, head_rows, {n - 1}, {}, c10::nullopt, c10::nullopt);
    }
    const auto [column, conf] = pick_row(out[0].data_ptr<float>(), limit, true);
    const int64_t token = vocab.empty() ? column : vocab[column];
    drafted.push_back(token);
    confs.push_back(conf);
    position += n;
    tokens = {token};
  }
  return py::make_tuple(drafted, confs, h.has_value() ? py::cast(*h) : py::none());
}

// A model's parameters, to tell cheaply whether any changed in place or changed whether it
// trains since its kernel weights were read (model/transformer.py, `KernelPlan`): the summed
// version counters and the indices of those that take gradients, or None where a tensor keeps
// no version counter (an inference tensor). Summing ~70 counters in Python took ~100 us a
// forward on the caches the forward had flushed.
struct ParameterWatch {
  std::vector<torch::Tensor> tensors;
};

py::object parameter_state(const ParameterWatch& watch) {
  int64_t versions = 0;
  std::vector<int64_t> training;
  for (size_t i = 0; i < watch.tensors.size(); ++i) {
    const torch::Tensor& t = watch.tensors[i];
    if (t.is_inference()) return py::none();
    versions += static_cast<int64_t>(t._version());
    if (t.requires_grad()) training.push_back(static_cast<int64_t>(i));
  }
  return py::make_tuple(versions, training);
}

}  // namespace

// The kernels touch no Python object: other Python threads (a server's) run meanwhile.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("tiled_linear", &tiled_linear, release(), "x [M, K] float32 times tiled weights [ceil(N/64), K, 64], plus bias");
  m.def("rms_norm", &rms_norm, release(), "RMSNorm of contiguous float32 x over its last dimension");
  m.def("rotary", &rotary, release(), "RoPE of float32 x [B, H, T, D] with tables [T, D] (rotate-half layout)");
  m.def("swiglu", &swiglu, release(), "silu(gate) * up of float32 [rows, n] matrices");
  m.def("decoder_layer", &decoder_layer, release(),
        "a float32 Qwen2/Qwen3 decoder layer over a KV cache (DecoderLayer.forward in one call)");
  m.def("packed_decoder_layer", &packed_decoder_layer, release(),
        "decoder_layer for the packed tokens of several cache rows (a ragged forward; an EAGLE-3 step)",
        py::arg("x"), py::arg("input_norm"), py::arg("qkv_tiles"), py::arg("qkv_bias"), py::arg("q_norm"),
        py::arg("k_norm"), py::arg("o_tiles"), py::arg("post_norm"), py::arg("gate_up_tiles"), py::arg("down_tiles"),
        py::arg("eps"), py::arg("cos"), py::arg("signed_sin"), py::arg("cache_k"), py::arg("cache_v"),
        py::arg("places"), py::arg("heads"), py::arg("scale"), py::arg("embedded") = py::none(),
        py::arg("embedded_norm") = py::none());
  py::class_<LayerStack>(m, "LayerStack", "a model's decoder layers' kernel weights, for stack_forward")
      .def(py::init([](std::vector<LayerWeights> layers, int64_t heads, double scale) {
        return LayerStack{std::move(layers), heads, scale};
      }));
  m.def("stack_forward", &stack_forward, release(),
        "a whole float32 forward over a KV cache: embedding, every layer, final norm and head of chosen rows, and tapped layers' outputs",
        py::arg("stack"), py::arg("tokens"), py::arg("batch"), py::arg("places"), py::arg("start"), py::arg("read_end"),
        py::arg("block_size"), py::arg("embedding"), py::arg("cos"), py::arg("signed_sin"), py::arg("keys"),
        py::arg("values"), py::arg("norm"), py::arg("eps"), py::arg("head_tiles"), py::arg("vocab"),
        py::arg("logits_at"), py::arg("taps"), py::arg("hidden") = py::none(), py::arg("embedded_norm") = py::none());
  m.def("slot_kv", &slot_kv, release(),
        "an EAGLE-3 drafter's committed slots: their keys and values into its cache, from [normed embedding, normed hidden]");
  m.def("context_kv", &context_kv, release(),
        "a target-conditioned drafter's context: fused features, then every layer's keys and values into its cache");
  py::class_<ParameterWatch>(m, "ParameterWatch", "a model's parameters, whose state parameter_state reads")
      .def(py::init([](std::vector<torch::Tensor> tensors) { return ParameterWatch{std::move(tensors)}; }));
  m.def("parameter_state", &parameter_state,
        "(summed version counters, indices of the parameters that take gradients), or None if one keeps no counter");
  m.def("chain_steps", &chain_steps, "greedy chain-drafter steps in one call");
  m.def("row_picks", &row_picks,
        "each float32 logits row's argmax among its first `limit` columns and, with `confidence`, its softmax probability",
        py::arg("logits"), py::arg("limit"), py::arg("confidence"));
  m.def("attend", &attend, release(), "attention of float32 q [B, H, T, D] to k, v [B, G, S, D] under a boolean mask [B, T, S]");
}
