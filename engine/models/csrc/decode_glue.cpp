// The element-wise "glue" between a decode step's GEMMs on CPU, one call each instead of 5-8 torch
// ops: residual add + RMSNorm, RoPE on the fused q/k/v rows in place, SiLU(gate) * up.
//
// With one to a few rows per step every torch op costs its dispatch (a few microseconds) and a new
// tensor, and a decoder layer ran ~40 of them around its 4 GEMMs: on SmolLM2-135M (30 layers) that
// was ~1/4 of a batch-1 step. These kernels compute what the torch path computes, in the same
// order and dtype roundings (HF's LlamaRMSNorm, rotate-half RoPE, F.silu then *), so the results
// equal the torch path's bit for bit. The two steps whose rounding depends on torch's own kernels
// stay torch's, called from here (one dispatch each instead of a Python op each): the mean of
// squares (torch sums float lanes in its own order) and SiLU (torch's exp is SLEEF's).
// Rows run in parallel only when there are enough of them (prefill-sized inputs).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <c10/util/BFloat16.h>
#include <cmath>
#include <cstdint>
#include <optional>

namespace {

inline float f32(float x) { return x; }
inline float f32(c10::BFloat16 x) { return static_cast<float>(x); }
// round to the storage type (round-to-nearest-even for bf16, as torch's casts)
template <typename T> inline T store(float x) { return static_cast<T>(x); }

int64_t grain_rows(int64_t width) { return std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(width, 1)); }

// x += h (in place; h may be null), rows in parallel
template <typename T>
void add_impl(T* x, const T* h, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0 * n; i < r1 * n; ++i) x[i] = store<T>(f32(x[i]) + f32(h[i]));
  });
}

// out = weight * to_T(x_f32 * rsqrt(var + eps)), var [rows] = mean(x_f32^2) from torch
template <typename T>
void rms_norm_impl(const T* x, const float* var, const T* w, T* out, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * n;
      const float inv = 1.0f / std::sqrt(var[r] + eps);  // torch.rsqrt's 1 / sqrt, both rounded
      T* o = out + r * n;
      for (int64_t i = 0; i < n; ++i) o[i] = store<T>(f32(w[i]) * f32(store<T>(f32(xr[i]) * inv)));
    }
  });
}

// In place on the first `heads` heads of each row (q then k in a fused q/k/v row):
//   x[i] = x[i] * cos[i] - x[i + D/2] * sin[i],  x[i + D/2] = x[i + D/2] * cos[i + D/2] + x[i] * sin[i + D/2]
// each product and the sum rounded to T as torch's `x * cos + rotate_half(x) * sin` does; this file
// is built with -ffp-contract=off (engine/cpu_kernels.py), so no FMA merges a product into the sum
// and float32 results equal torch's bit for bit.
template <typename T>
void rope_impl(T* qkv, int64_t row_stride, const T* cos, const T* sin, int64_t rows, int64_t heads, int64_t d) {
  const int64_t half = d / 2;
  at::parallel_for(0, rows, grain_rows(heads * d), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* c = cos + r * d;
      const T* s = sin + r * d;
      for (int64_t hd = 0; hd < heads; ++hd) {
        T* x = qkv + r * row_stride + hd * d;
        for (int64_t i = 0; i < half; ++i) {
          const float a = f32(x[i]), b = f32(x[i + half]);
          const float lo1 = f32(store<T>(a * f32(c[i]))), lo2 = f32(store<T>(-b * f32(s[i])));
          const float hi1 = f32(store<T>(b * f32(c[i + half]))), hi2 = f32(store<T>(a * f32(s[i + half])));
          x[i] = store<T>(lo1 + lo2);
          x[i + half] = store<T>(hi1 + hi2);
        }
      }
    }
  });
}

// silu [rows, I] (torch's silu of gate_up[:, :I], rounded to T) *= up = gate_up[:, I:], in place;
// up rows start at gu + I with row stride 2I
template <typename T>
void mul_up_impl(T* silu, const T* gu, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, grain_rows(inter), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* u = gu + r * 2 * inter + inter;
      T* o = silu + r * inter;
      for (int64_t i = 0; i < inter; ++i) o[i] = store<T>(f32(o[i]) * f32(u[i]));
    }
  });
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.stride(1) == 1,
              name, ": a CPU tensor [rows, width] with unit stride along width expected");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16,
              name, ": float32 or bfloat16 expected");
}

// x [T, N] contiguous, updated in place (x += h); h [T, N] contiguous or None; weight [N].
// Returns rmsnorm(x) * weight, a new [T, N] tensor of x's dtype.
at::Tensor add_rms_norm(at::Tensor x, std::optional<at::Tensor> h, const at::Tensor& weight, double eps) {
  check_rows(x, "add_rms_norm: x");
  TORCH_CHECK(x.is_contiguous(), "add_rms_norm: x must be contiguous");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "add_rms_norm: weight must be contiguous [N] of x's dtype");
  if (h) {
    TORCH_CHECK(h->is_contiguous() && h->sizes() == x.sizes() && h->scalar_type() == x.scalar_type(),
                "add_rms_norm: h must be contiguous and shaped and typed like x");
  }
  at::Tensor out = at::empty_like(x);
  const int64_t rows = x.size(0), n = x.size(1);
  const bool f = x.scalar_type() == at::kFloat;
  using B = c10::BFloat16;
  if (h) {
    if (f) add_impl<float>(x.data_ptr<float>(), h->data_ptr<float>(), rows, n);
    else add_impl<B>(x.data_ptr<B>(), h->data_ptr<B>(), rows, n);
  }
  const at::Tensor var = x.to(at::kFloat).pow(2).mean(-1).contiguous();  // torch's order: same bits
  const float* vp = var.data_ptr<float>();
  if (f) rms_norm_impl<float>(x.data_ptr<float>(), vp, weight.data_ptr<float>(), out.data_ptr<float>(), rows, n,
                              static_cast<float>(eps));
  else rms_norm_impl<B>(x.data_ptr<B>(), vp, weight.data_ptr<B>(), out.data_ptr<B>(), rows, n,
                        static_cast<float>(eps));
  return out;
}

// qkv [T, W] (row stride any, unit column stride): RoPE on its first `heads` * head_dim columns,
// in place; cos / sin [T, head_dim] contiguous, of qkv's dtype.
void rope_(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t head_dim) {
  check_rows(qkv, "rope_: qkv");
  TORCH_CHECK(head_dim % 2 == 0 && heads * head_dim <= qkv.size(1), "rope_: heads * head_dim exceeds the row");
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->is_contiguous() && t->dim() == 2 && t->size(0) == qkv.size(0) && t->size(1) == head_dim &&
                    t->scalar_type() == qkv.scalar_type(),
                "rope_: cos and sin must be contiguous [T, head_dim] of qkv's dtype");
  }
  if (qkv.scalar_type() == at::kFloat) {
    rope_impl<float>(qkv.data_ptr<float>(), qkv.stride(0), cos.data_ptr<float>(), sin.data_ptr<float>(),
                     qkv.size(0), heads, head_dim);
  } else {
    using B = c10::BFloat16;
    rope_impl<B>(qkv.data_ptr<B>(), qkv.stride(0), cos.data_ptr<B>(), sin.data_ptr<B>(), qkv.size(0), heads,
                 head_dim);
  }
}

// gate_up [T, 2I] contiguous -> silu(gate_up[:, :I]) * gate_up[:, I:], a new [T, I] tensor.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_mul: gate_up");
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.size(1) % 2 == 0, "silu_mul: gate_up must be contiguous [T, 2I]");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  at::Tensor out = at::silu(gate_up.narrow(1, 0, inter)).contiguous();  // torch's exp: same bits
  if (gate_up.scalar_type() == at::kFloat) {
    mul_up_impl<float>(out.data_ptr<float>(), gate_up.data_ptr<float>(), rows, inter);
  } else {
    using B = c10::BFloat16;
    mul_up_impl<B>(out.data_ptr<B>(), gate_up.data_ptr<B>(), rows, inter);
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rms_norm", &add_rms_norm, "x += h; weight * rmsnorm(x)", py::arg("x"), py::arg("h"),
        py::arg("weight"), py::arg("eps"));
  m.def("rope_", &rope_, "rotate-half RoPE in place on the first heads of each row");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused gate/up row");
}
