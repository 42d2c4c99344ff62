// Paged decode attention on CPU, reading K/V in place from the pool's per-layer page views.
//
// For request b and q head h (kv head kh = h / G, G = q heads per kv head):
//   out[b, h] = softmax(scale * q[b, h] . K[b, 0:len_b, kh]) . V[b, 0:len_b, kh]
// where token t of row b is offset t % page_size of page page_table[b, t / page_size].
//
// Design (the flash-decoding scheme, as vLLM CPU's and SGLang's CPU decode kernels use it; this
// code is our own): one work item is (request, split of its row) with every head of the request:
// a page holds page_size * kv_heads * head_dim contiguous values per layer and K/V, so an item
// streams each page once and all q heads (the G of each kv head, GQA) then read it from L1. Items
// per (request, kv head), tried first, each read a third of every token record (the other heads'
// lines in between) and were no faster than torch_paged's gather + SDPA on the 2-core test box.
// Each item walks its tokens page by page with an online softmax (running max m, sum l,
// accumulator acc, all fp32). When B is below the thread count, rows are cut into page-aligned
// splits whose partial (m, l, acc) are merged afterwards. Nothing is gathered or padded: a row
// costs its own length.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// exp for x <= 0 (softmax arguments), vectorizable (no libm call): 2^n * p(r), x = n ln2 + r,
// |r| <= ln2 / 2 (ln2 split in two, Cody-Waite), degree-6 Taylor/Horner for e^r (relative
// error ~1e-7). x below -87 gives ~1e-38, not 0: callers never rely on an exact 0.
inline float exp_neg(float x) {
  x = std::max(x, -87.0f);
  // round to nearest by the 1.5 * 2^23 trick (vectorizes; nearbyint may not)
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// 16 floats as one value (GCC/Clang vector extension: one zmm with AVX-512, two ymm with AVX2).
typedef float v16f __attribute__((vector_size(64)));
typedef int v16i __attribute__((vector_size(64)));

inline v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store16(float* p, v16f v) { std::memcpy(p, &v, sizeof(v)); }

// Lane j of the result = the sum of the 16 lanes of v[j]: 16 dot products' partial sums reduced
// with 15 pairwise shuffle-adds instead of a scalar horizontal sum per dot (what g++ 12 emits for a
// `simd reduction`: 15 dependent scalar adds after 4 vector FMAs; replacing it, with the PV
// accumulators kept in registers, halved the kernel's time).
inline v16f transpose_sum16(const v16f* v) {
  const v16i a_lo = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const v16i b_lo = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const v16i c_lo = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const v16i d_lo = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  v16f a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // lanes 8k..8k+7: 8 partials of token 2i+k
    a[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], a_lo) + __builtin_shuffle(v[2 * i], v[2 * i + 1], a_lo + 8);
  for (int i = 0; i < 4; ++i)  // lanes 4k..4k+3: 4 partials of token 4i+k
    b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], b_lo) + __builtin_shuffle(a[2 * i], a[2 * i + 1], b_lo + 4);
  for (int i = 0; i < 2; ++i)  // lanes 2k, 2k+1: 2 partials of token 8i+k
    c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1], c_lo) + __builtin_shuffle(b[2 * i], b[2 * i + 1], c_lo + 2);
  return __builtin_shuffle(c[0], c[1], d_lo) + __builtin_shuffle(c[0], c[1], d_lo + 1);
}

// One row's tokens [t0, t1) for all its heads: updates m [H], l [H], acc [H, D] (H = KVH * G, q head
// h reads kv head h / G). Page by page, so each page's K and V (page_size * KVH * D contiguous
// values in both layouts) are streamed from memory once and then reused from L1 by every q head.
// DT: head_dim fixed at compile time (0 = runtime D), so the D loops unroll into registers.
// s: scratch [H, page_size]; kbuf/vbuf: [page_size * KVH * D] floats for a non-fp32 page.
template <typename T, int DT>
void attend_range(const float* q, const T* k_base, const T* v_base, int64_t page_stride,
                  int64_t tok_stride, int64_t head_stride, const int32_t* pages, int64_t t0,
                  int64_t t1, int64_t ps, int64_t KVH, int64_t G, int64_t D_rt, float scale,
                  float* m, float* l, float* acc, float* s, float* kbuf, float* vbuf) {
  const int64_t D = DT ? DT : D_rt;
  const int64_t H = KVH * G;
  const bool contiguous_page = head_stride == D && tok_stride == KVH * D;
  for (int64_t t = t0; t < t1;) {
    const int64_t off = t % ps;
    const int64_t n = std::min(ps - off, t1 - t);
    const int64_t page = pages[t / ps];
    const T* kp = k_base + page * page_stride + off * tok_stride;
    const T* vp = v_base + page * page_stride + off * tok_stride;
    // the next page lies elsewhere in the pool and the hardware prefetcher does not cross pages:
    // its K and V (page_size * KVH * D contiguous values each) are prefetched while this page is
    // computed, a slice per q head. On one thread this was 1.5-2x faster at B=1 ctx 2000 and B=8
    // ctx 640 than one burst at the page's start (one or two pages ahead: 5-15 % over no prefetch)
    // and than the same slices into L2 only.
    const int64_t ahead = (t / ps + 1) * ps;  // first token of the next page
    const char* nk = nullptr;
    const char* nv = nullptr;
    int64_t pf_slice = 0;
    if (ahead < t1 && contiguous_page) {
      const int64_t next = pages[ahead / ps];
      nk = reinterpret_cast<const char*>(k_base + next * page_stride);
      nv = reinterpret_cast<const char*>(v_base + next * page_stride);
      const int64_t lines = (ps * tok_stride * static_cast<int64_t>(sizeof(T)) + 63) / 64;
      pf_slice = (lines + H - 1) / H;
    }
    // row (j, kv head kh) of K is kr + j * ktok + kh * khead
    const float* kr;
    const float* vr;
    int64_t ktok, khead;
    if constexpr (std::is_same_v<T, float>) {
      kr = kp;
      vr = vp;
      ktok = tok_stride;
      khead = head_stride;
    } else {
      for (int64_t j = 0; j < n; ++j) {
        for (int64_t kh = 0; kh < KVH; ++kh) {
          const T* ks = kp + j * tok_stride + kh * head_stride;
          const T* vs = vp + j * tok_stride + kh * head_stride;
          float* kd = kbuf + (j * KVH + kh) * D;
          float* vd = vbuf + (j * KVH + kh) * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) {
            kd[d] = to_float(ks[d]);
            vd[d] = to_float(vs[d]);
          }
        }
      }
      kr = kbuf;
      vr = vbuf;
      ktok = KVH * D;
      khead = D;
    }
    for (int64_t h = 0; h < H; ++h) {
      if (nk != nullptr) {
        for (int64_t i = h * pf_slice; i < (h + 1) * pf_slice; ++i) {
          __builtin_prefetch(nk + 64 * i);
          __builtin_prefetch(nv + 64 * i);
        }
      }
      const float* qh = q + h * D;
      const float* kh_rows = kr + (h / G) * khead;
      const float* vh_rows = vr + (h / G) * khead;
      float* sh = s + h * ps;
      float* ah = acc + h * D;
      if constexpr (DT % 16 == 0 && DT > 0) {
        constexpr int C = DT / 16;
        v16f qv[C];
        for (int c = 0; c < C; ++c) qv[c] = load16(qh + 16 * c);
        for (int64_t j0 = 0; j0 < n; j0 += 16) {
          v16f part[16];
          for (int64_t j = 0; j < 16; ++j) {
            v16f sum = {};
            if (j0 + j < n) {
              const float* krow = kh_rows + (j0 + j) * ktok;
              for (int c = 0; c < C; ++c) sum += qv[c] * load16(krow + 16 * c);
            }
            part[j] = sum;
          }
          float tmp[16];
          store16(tmp, transpose_sum16(part) * scale);
          for (int64_t j = j0; j < std::min(n, j0 + 16); ++j) sh[j] = tmp[j - j0];
        }
      } else {
        for (int64_t j = 0; j < n; ++j) {
          const float* krow = kh_rows + j * ktok;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qh[d] * krow[d];
          sh[j] = dot * scale;
        }
      }
      float mx = m[h];
      for (int64_t j = 0; j < n; ++j) mx = std::max(mx, sh[j]);
      const float alpha = exp_neg(m[h] - mx);  // m = -inf at the start: alpha ~ 0, acc and l are 0
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < n; ++j) {
        sh[j] = exp_neg(sh[j] - mx);
        sum += sh[j];
      }
      l[h] = l[h] * alpha + sum;
      m[h] = mx;
      if constexpr (DT % 16 == 0 && DT > 0) {
        // the accumulator stays in registers across the page's tokens
        constexpr int C = DT / 16;
        v16f av[C];
        for (int c = 0; c < C; ++c) av[c] = load16(ah + 16 * c) * alpha;
        for (int64_t j = 0; j < n; ++j) {
          const float p = sh[j];
          const float* vrow = vh_rows + j * ktok;
          for (int c = 0; c < C; ++c) av[c] += p * load16(vrow + 16 * c);
        }
        for (int c = 0; c < C; ++c) store16(ah + 16 * c, av[c]);
      } else {
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ah[d] *= alpha;
        for (int64_t j = 0; j < n; ++j) {
          const float p = sh[j];
          const float* vrow = vh_rows + j * ktok;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ah[d] += p * vrow[d];
        }
      }
    }
    t += n;
  }
}

template <typename T, int DT>
void run(const at::Tensor& q, const at::Tensor& k_pages, const at::Tensor& v_pages,
         const at::Tensor& page_table, const at::Tensor& seq_lens, double scale_d, at::Tensor& out,
         int64_t splits) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t ps = k_pages.size(1), KVH = k_pages.size(2), G = H / KVH;
  const int64_t page_stride = k_pages.stride(0), tok_stride = k_pages.stride(1);
  const int64_t head_stride = k_pages.stride(2);
  const int64_t max_pages = page_table.size(1);
  const float scale = static_cast<float>(scale_d);
  const float* qp = q.data_ptr<float>();
  const T* kb = k_pages.data_ptr<T>();
  const T* vb = v_pages.data_ptr<T>();
  const int32_t* pt = page_table.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const int64_t S = splits;
  const int64_t state = H * (D + 2);  // m [H], l [H], acc [H, D] of one (request, split)
  std::vector<float> part(S > 1 ? B * S * state : 0);
  at::parallel_for(0, B * S, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(H * ps + 2 * ps * KVH * D + (S > 1 ? 0 : state));
    float* s = scratch.data();
    float* kbuf = s + H * ps;
    float* vbuf = kbuf + ps * KVH * D;
    for (int64_t it = begin; it < end; ++it) {
      const int64_t b = it / S, sp = it % S;
      const int64_t len = lens[b];
      // split boundaries on page edges
      const int64_t pages_b = (len + ps - 1) / ps;
      const int64_t per = (pages_b + S - 1) / S;
      const int64_t t0 = std::min(len, sp * per * ps), t1 = std::min(len, (sp + 1) * per * ps);
      float* m = S > 1 ? part.data() + it * state : vbuf + ps * KVH * D;
      float* l = m + H;
      float* acc = l + H;
      std::fill(m, m + H, -std::numeric_limits<float>::infinity());
      std::fill(l, l + H, 0.f);
      std::fill(acc, acc + H * D, 0.f);
      attend_range<T, DT>(qp + b * H * D, kb, vb, page_stride, tok_stride, head_stride,
                          pt + b * max_pages, t0, t1, ps, KVH, G, D, scale, m, l, acc, s, kbuf,
                          vbuf);
      if (S == 1) {
        for (int64_t h = 0; h < H; ++h) {
          float* o = op + (b * H + h) * D;
          const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
          for (int64_t d = 0; d < D; ++d) o[d] = acc[h * D + d] * inv;
        }
      }
    }
  });
  if (S == 1) return;
  // merge the splits: out = sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M), M = max_s m_s
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t h = 0; h < H; ++h) {
        float M = -std::numeric_limits<float>::infinity();
        for (int64_t sp = 0; sp < S; ++sp) M = std::max(M, part[(b * S + sp) * state + h]);
        float* o = op + (b * H + h) * D;
        std::fill(o, o + D, 0.f);
        float L = 0.f;
        for (int64_t sp = 0; sp < S; ++sp) {
          const float* base = part.data() + (b * S + sp) * state;
          if (base[H + h] == 0.f) continue;  // an empty split (row shorter than its share)
          const float w = exp_neg(base[h] - M);
          L += base[H + h] * w;
          const float* acc = base + 2 * H + h * D;
          for (int64_t d = 0; d < D; ++d) o[d] += acc[d] * w;
        }
        const float inv = L > 0.f ? 1.f / L : 0.f;
        for (int64_t d = 0; d < D; ++d) o[d] *= inv;
      }
    }
  });
}

template <typename T>
void run_dtype(const at::Tensor& q, const at::Tensor& k_pages, const at::Tensor& v_pages,
               const at::Tensor& page_table, const at::Tensor& seq_lens, double scale,
               at::Tensor& out, int64_t splits) {
  switch (q.size(2)) {
    case 64: return run<T, 64>(q, k_pages, v_pages, page_table, seq_lens, scale, out, splits);
    case 128: return run<T, 128>(q, k_pages, v_pages, page_table, seq_lens, scale, out, splits);
    default: return run<T, 0>(q, k_pages, v_pages, page_table, seq_lens, scale, out, splits);
  }
}

// q [B, H, D] float32 contiguous; k_pages / v_pages [P, page_size, KVH, D] float32 or bfloat16,
// any page and token strides, head_dim contiguous; page_table int32 [B, max_pages]; seq_lens int32
// [B]; out [B, H, D] float32 contiguous. splits >= 1: pieces each row is cut into.
void paged_decode(const at::Tensor& q, const at::Tensor& k_pages, const at::Tensor& v_pages,
                  const at::Tensor& page_table, const at::Tensor& seq_lens, double scale,
                  at::Tensor out, int64_t splits) {
  TORCH_CHECK(q.device().is_cpu() && k_pages.device().is_cpu(), "paged_decode: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "paged_decode: q must be contiguous float32 [B, H, D]");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == at::kFloat && out.is_contiguous(),
              "paged_decode: out must be contiguous float32 shaped like q");
  TORCH_CHECK(k_pages.dim() == 4 && k_pages.sizes() == v_pages.sizes() &&
                  k_pages.strides() == v_pages.strides() &&
                  k_pages.scalar_type() == v_pages.scalar_type(),
              "paged_decode: k_pages and v_pages must share shape, strides and dtype");
  TORCH_CHECK(k_pages.stride(3) == 1 && k_pages.size(3) == q.size(2),
              "paged_decode: head_dim must match q and be contiguous in the pool");
  TORCH_CHECK(q.size(1) % k_pages.size(2) == 0, "paged_decode: q heads not a multiple of kv heads");
  TORCH_CHECK(page_table.dim() == 2 && page_table.size(0) == q.size(0) &&
                  page_table.scalar_type() == at::kInt && page_table.is_contiguous(),
              "paged_decode: page_table must be contiguous int32 [B, max_pages]");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == q.size(0) &&
                  seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(),
              "paged_decode: seq_lens must be contiguous int32 [B]");
  TORCH_CHECK(splits >= 1, "paged_decode: splits < 1");
  if (k_pages.scalar_type() == at::kFloat) {
    run_dtype<float>(q, k_pages, v_pages, page_table, seq_lens, scale, out, splits);
  } else if (k_pages.scalar_type() == at::kBFloat16) {
    run_dtype<c10::BFloat16>(q, k_pages, v_pages, page_table, seq_lens, scale, out, splits);
  } else {
    TORCH_CHECK(false, "paged_decode: pool dtype must be float32 or bfloat16");
  }
}

template <typename P, typename S>
void store_rows(const at::Tensor& src, const at::Tensor& pages, const int64_t* slots) {
  const int64_t B = src.size(0), KVH = src.size(1), D = src.size(2), ps = pages.size(1);
  const S* sp = src.data_ptr<S>();
  P* dp = pages.data_ptr<P>();
  for (int64_t b = 0; b < B; ++b) {
    P* row = dp + (slots[b] / ps) * pages.stride(0) + (slots[b] % ps) * pages.stride(1);
    for (int64_t h = 0; h < KVH; ++h) {
      const S* s = sp + b * src.stride(0) + h * src.stride(1);
      P* d = row + h * pages.stride(2);
      for (int64_t i = 0; i < D; ++i) d[i] = static_cast<P>(static_cast<float>(s[i]));  // torch's casts
    }
  }
}

template <typename P>
void store_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_pages, const at::Tensor& v_pages,
              const int64_t* slots) {
  if (k.scalar_type() == at::kFloat) {
    store_rows<P, float>(k, k_pages, slots);
    store_rows<P, float>(v, v_pages, slots);
  } else {
    store_rows<P, c10::BFloat16>(k, k_pages, slots);
    store_rows<P, c10::BFloat16>(v, v_pages, slots);
  }
}

// One decode step's attention for one layer in one call: store the new tokens' k / v [B, KVH, D]
// at `slots` (int64 [B]) of the pool's pages (cast to the pool dtype, as KVPool.write), then
// paged_decode of q [B, H, D] over them. q, k, v may be strided views (of a fused q/k/v projection)
// with a unit head_dim stride, float32 or bfloat16. Returns [B, H * D] in q's dtype. One call
// instead of ~12 torch ops: with a few rows per step each op's dispatch cost more than its work.
// Raises before writing anything on a slot outside the pool or on q / k / v / pool shapes that do
// not fit; paged_decode's own checks (page table, lengths) run after the store.
at::Tensor store_and_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& k_pages, const at::Tensor& v_pages, const at::Tensor& slots,
                            const at::Tensor& page_table, const at::Tensor& seq_lens, double scale,
                            int64_t splits) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && k.sizes() == v.sizes() &&
                  k.size(0) == q.size(0) && k.size(2) == q.size(2) && k.scalar_type() == v.scalar_type(),
              "store_and_decode: q [B, H, D], k and v [B, KVH, D] expected");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1,
              "store_and_decode: q, k and v need a unit head_dim stride");
  for (const at::Tensor* t : {&q, &k}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16,
                "store_and_decode: q, k and v must be float32 or bfloat16");
  }
  TORCH_CHECK(k_pages.dim() == 4 && k_pages.sizes() == v_pages.sizes() && k_pages.strides() == v_pages.strides() &&
                  k_pages.scalar_type() == v_pages.scalar_type() && k_pages.size(2) == k.size(1) &&
                  k_pages.size(3) == k.size(2) && k_pages.stride(3) == 1,
              "store_and_decode: k_pages and v_pages must be [P, page_size, KVH, D] alike, head_dim contiguous");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == k.size(0) && slots.scalar_type() == at::kLong &&
                  slots.is_contiguous() && slots.device().is_cpu(),
              "store_and_decode: slots must be contiguous int64 [B]");
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t n_slots = k_pages.size(0) * k_pages.size(1);
  for (int64_t b = 0; b < slots.size(0); ++b) {
    TORCH_CHECK(sl[b] >= 0 && sl[b] < n_slots, "store_and_decode: slot ", sl[b], " outside the pool");
  }
  at::Tensor qf = q.to(at::kFloat).contiguous();
  at::Tensor out = at::empty_like(qf);
  if (k_pages.scalar_type() == at::kFloat) {
    store_kv<float>(k, v, k_pages, v_pages, sl);
  } else if (k_pages.scalar_type() == at::kBFloat16) {
    store_kv<c10::BFloat16>(k, v, k_pages, v_pages, sl);
  } else {
    TORCH_CHECK(false, "store_and_decode: pool dtype must be float32 or bfloat16");
  }
  paged_decode(qf, k_pages, v_pages, page_table, seq_lens, scale, out, splits);
  return out.to(q.scalar_type()).view({q.size(0), q.size(1) * q.size(2)});
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention over a KV pool (CPU)");
  m.def("store_and_decode", &store_and_decode, "store the step's k/v in the pool, then paged_decode (CPU)");
}
