// Float32 products y = x W^T + b for a few rows of x on AVX-512 CPUs (docs/design.md,
// "Tiled float32 products"; loaded by model/tiled.py).
//
// The weight comes in tiles of 64 output columns, each stored k-major ([tile][k][64]) so a
// tile streams from memory in order, as float16 when every weight is a float16 value (exact:
// half the bytes, widened in registers) or float32. Each output is one accumulator summed
// over k = 0..K-1 in order, then the bias is added, whatever the row count or thread count:
// a row's result does not depend on the other rows of the call.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kTile = 64;  // output columns per tile: four vectors of 16 floats
constexpr int64_t kRows = 6;   // rows per register block: 24 accumulators, 4 weight vectors

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
    const int64_t left = cols - j * 16;
    const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + j * 16) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * N + j * 16, mask, _mm512_add_ps(acc[r][j], b));
  }
}

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
        switch (std::min(kRows, M - m)) {
          case 6: rows_by_tile<6>(xm, K, tile, ym, N, cols, b); break;
          case 5: rows_by_tile<5>(xm, K, tile, ym, N, cols, b); break;
          case 4: rows_by_tile<4>(xm, K, tile, ym, N, cols, b); break;
          case 3: rows_by_tile<3>(xm, K, tile, ym, N, cols, b); break;
          case 2: rows_by_tile<2>(xm, K, tile, ym, N, cols, b); break;
          default: rows_by_tile<1>(xm, K, tile, ym, N, cols, b); break;
        }
      }
    }
  });
}

torch::Tensor tiled_linear(const torch::Tensor& x, const torch::Tensor& tiles, int64_t out_features,
                           const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat && x.device().is_cpu(),
              "x must be a contiguous float32 CPU matrix");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(tiles.dim() == 3 && tiles.is_contiguous() && tiles.size(0) == (N + kTile - 1) / kTile &&
                  tiles.size(1) == K && tiles.size(2) == kTile,
              "tiles must be [ceil(out / 64), in, 64] and contiguous");
  TORCH_CHECK(!bias.has_value() || (bias->is_contiguous() && bias->scalar_type() == torch::kFloat && bias->numel() == N),
              "bias must be a contiguous float32 vector of out_features");
  auto y = torch::empty({M, N}, x.options());
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  if (tiles.scalar_type() == torch::kHalf) {
    product(x.data_ptr<float>(), M, K, tiles.data_ptr<at::Half>(), N, y.data_ptr<float>(), b);
  } else {
    TORCH_CHECK(tiles.scalar_type() == torch::kFloat, "tiles must be float16 or float32");
    product(x.data_ptr<float>(), M, K, tiles.data_ptr<float>(), N, y.data_ptr<float>(), b);
  }
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("tiled_linear", &tiled_linear, "x [M, K] float32 times tiled weights [ceil(N/64), K, 64], plus bias");
}
