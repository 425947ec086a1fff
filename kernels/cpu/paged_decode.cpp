// Decode attention (one new query per sequence) straight over the paged KV pool: no gather of a
// sequence's pages into a contiguous copy, and one call per layer for the whole batch instead of a
// handful of torch ops per sequence. One (sequence, KV head) pair is one task, its sums always run
// in the same order: a row's result never depends on the batch it is in or on the thread count.
// Built at install (or first use) by crescent.kernels.cpu.cpu_ext with -march=native.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <vector>

namespace {

// exp for the softmax: a fixed polynomial, so the loop vectorizes and every row gets the same bits.
inline float fast_exp(float x) {
  x = x < -87.3f ? -87.3f : x;
  const float n = std::nearbyint(x * 1.44269504f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// One sequence's query heads that share KV head ``k_base``/``v_base`` (already offset to it).
template <int D>
void one_task(const float* __restrict q, const float* __restrict k_base, const float* __restrict v_base,
              const int64_t* __restrict table, int64_t L, int64_t block_size, int64_t kps, int64_t kts,
              int64_t vps, int64_t vts, int64_t group, float scale, float* __restrict scores,
              float* __restrict out, int64_t q_head_stride) {
  // q: the group's query heads (q + g * q_head_stride); scores: (group, L) scratch.
  for (int64_t t = 0; t < L; ++t) {
    const float* __restrict kt = k_base + table[t / block_size] * kps + (t % block_size) * kts;
    for (int64_t g = 0; g < group; ++g) {
      const float* __restrict qg = q + g * q_head_stride;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int d = 0; d < D; ++d) s += qg[d] * kt[d];
      scores[g * L + t] = s * scale;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* __restrict sg = scores + g * L;
    float mx = -INFINITY;
    for (int64_t t = 0; t < L; ++t) mx = sg[t] > mx ? sg[t] : mx;
#pragma omp simd
    for (int64_t t = 0; t < L; ++t) sg[t] = fast_exp(sg[t] - mx);
    float denom = 0.f;
#pragma omp simd reduction(+ : denom)
    for (int64_t t = 0; t < L; ++t) denom += sg[t];
    const float inv = 1.f / denom;
    for (int64_t t = 0; t < L; ++t) sg[t] *= inv;
  }
  float acc[16][D];
  for (int64_t g = 0; g < group; ++g)
    for (int d = 0; d < D; ++d) acc[g][d] = 0.f;
  for (int64_t t = 0; t < L; ++t) {
    const float* __restrict vt = v_base + table[t / block_size] * vps + (t % block_size) * vts;
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * L + t];
#pragma omp simd
      for (int d = 0; d < D; ++d) acc[g][d] += p * vt[d];
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int d = 0; d < D; ++d) out[g * q_head_stride + d] = acc[g][d];
}

}  // namespace

// q: (B, H, 64) float32 contiguous; k_pool, v_pool: (pages, block_size, KV, 64) float32 with the last
// dim contiguous (a layer's slice of the pool); page_tables: (B, max_pages) int64; context_lens: (B,)
// int64, each >= 1 and covered by its table. Returns (B, H, 64).
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                                     torch::Tensor page_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == torch::kFloat, "q: (B, H, D) float32 contiguous");
  TORCH_CHECK(k_pool.dim() == 4 && v_pool.dim() == 4 && k_pool.scalar_type() == torch::kFloat &&
              v_pool.scalar_type() == torch::kFloat && k_pool.stride(3) == 1 && v_pool.stride(3) == 1,
              "k_pool, v_pool: (pages, block_size, KV, D) float32, last dim contiguous");
  TORCH_CHECK(k_pool.sizes() == v_pool.sizes(), "k_pool and v_pool differ in shape");
  TORCH_CHECK(page_tables.dim() == 2 && page_tables.size(0) == q.size(0) && page_tables.is_contiguous() &&
              page_tables.scalar_type() == torch::kLong, "page_tables: (B, max_pages) int64 contiguous");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == q.size(0) && context_lens.is_contiguous() &&
              context_lens.scalar_type() == torch::kLong, "context_lens: (B,) int64 contiguous");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t block_size = k_pool.size(1), KV = k_pool.size(2), group = H / KV;
  TORCH_CHECK(D == 64 && k_pool.size(3) == 64 && H % KV == 0, "paged_decode_attention: head_dim 64, H a multiple of KV");
  TORCH_CHECK(group <= 16, "paged_decode_attention: at most 16 query heads per KV head");
  const int64_t max_pages = page_tables.size(1);
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_pool.data_ptr<float>();
  const float* vp = v_pool.data_ptr<float>();
  const int64_t* tp = page_tables.data_ptr<int64_t>();
  const int64_t* lp = context_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t num_pages = k_pool.size(0);
  for (int64_t b = 0; b < B; ++b) {  // a bad table would read outside the pool: refuse it
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= max_pages * block_size, "context length ", lp[b], " not covered by its page table");
    for (int64_t p = 0; p < (lp[b] + block_size - 1) / block_size; ++p)
      TORCH_CHECK(tp[b * max_pages + p] >= 0 && tp[b * max_pages + p] < num_pages, "page ", tp[b * max_pages + p],
                  " outside the pool of ", num_pages);
  }
  const int64_t kps = k_pool.stride(0), kts = k_pool.stride(1), khs = k_pool.stride(2);
  const int64_t vps = v_pool.stride(0), vts = v_pool.stride(1), vhs = v_pool.stride(2);
  at::parallel_for(0, B * KV, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KV, kh = task % KV, L = lp[b];
      scores.resize(static_cast<size_t>(group * L));
      one_task<64>(qp + (b * H + kh * group) * D, kp + kh * khs, vp + kh * vhs, tp + b * max_pages, L, block_size,
                   kps, kts, vps, vts, group, static_cast<float>(scale), scores.data(),
                   op + (b * H + kh * group) * D, D);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_decode_attention", &paged_decode_attention); }
