// Small-M GEMM for CPU decode: y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]), M up to a few dozen rows
// (a decode batch, a short extend), W float32 or bfloat16, packed once at load; sums in float32.
//
// Why our own: at decode sizes the step is a stream of weight bytes, and the BLAS the torch CPU
// wheel ships (MKL, and oneDNN's f32 matmul, which ends in the same code there) reached 7.3 GB/s
// at M=1 and 3.5 GB/s at M=8 on the 2-core AMD test box (AVX2), where a plain stream reads
// ~11 GB/s: MKL picks its generic code path on non-Intel CPUs. This kernel streams each weight
// byte once per call whatever M is, at close to the copy bandwidth, on any x86 or ARM CPU the
// compiler targets (-march=native; GCC vector extensions, no intrinsics).
//
// Layout: W is packed as [ceil(N / NB), K, NB] (block j, column k holds W[NB j .. NB j + NB - 1, k];
// rows past N are zero), NB = two native vectors (16 floats with AVX2, 32 with AVX-512), so one
// block is one contiguous stream and a work item is a block: its NB outputs for every row of x, kept
// in registers (up to MT rows x 2 vectors per pass: 8 rows = 16 accumulators of AVX-512's 32
// registers, 6 rows = 12 of AVX2's 16; two FMA pipes of 4-cycle latency need 8 independent ones;
// more rows re-read the block from L1/L2, not from memory).
// Threads split the blocks (at::parallel_for: torch's OpenMP pool, so torch.set_num_threads
// applies). With AVX-512 the vectors are 512-bit: on the Zen 5 test box 256-bit ones left the
// kernel at half of oneDNN's speed from 16 rows up.
//
// bfloat16 weights: same layout, half the bytes; each weight vector is widened to float32 in
// registers (a bf16 is the top half of a float32: zero-extend, shift left 16) and the FMAs run in
// float32 on float32 x. A decode step is bound by the weight stream, so this halves its floor; on
// the Xeon box oneDNN's own bf16 GEMM (AMX) streamed only ~10 GB/s of weights at M=1.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

#if defined(__AVX512F__)
constexpr int VW = 16;  // floats per native vector
// x rows per pass: 16 accumulators + 2 weight vectors + 1 broadcast. A decode batch of 8 in one
// pass instead of 6 + 2 (the 2-row pass is FMA-latency bound): on the Xeon box a SmolLM2-sized
// stream of 538 MB at M=8 went 30.5 -> 28.1 ms (2 threads), 17.7 -> 13.9 ms with bf16 weights
constexpr int MT = 8;
#else
constexpr int VW = 8;
constexpr int MT = 6;  // 12 accumulators + 2 weight vectors + 1 broadcast of 16 registers
#endif
constexpr int64_t NB = 2 * VW;  // output rows per block: two vectors
constexpr int64_t KC = 128;  // K columns per chunk: 8 (AVX2) or 16 KB (AVX-512) of a block, in L1 for every row tile
constexpr int64_t MAX_M = 64;  // rows per call (the accumulators live on the stack)
// prefetch distance in K steps (NB weights each): one chunk ahead, so the next chunk streams in
// while this one is computed (on the AMD AVX2 test box: 32 -> 128 took M=8 from 6.7 to 9.7 GB/s)
constexpr int64_t PF = 128;
// the prefetch's cache hint, set per CPU vendor by engine/cpu_kernels.py (cflags): 0 (NTA) where the
// kernel was tuned on AMD; 3 (T0) on Intel, whose NTA prefetches fill L1 only and held the stream
// to ~6 GB/s, a quarter of what T0 reaches there
#ifndef HALFMOON_PREFETCH_LOCALITY
#define HALFMOON_PREFETCH_LOCALITY 3
#endif

typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vfu __attribute__((vector_size(VW * 4), aligned(4)));  // unaligned loads / stores
typedef uint32_t vu __attribute__((vector_size(VW * 4)));
typedef uint16_t vhu __attribute__((vector_size(VW * 2), aligned(2)));  // VW bfloat16, unaligned

// s in every lane. Not `vf{} + s`: that is 0.0f + s, which IEEE does not let the compiler drop (it
// maps -0 to +0), so every broadcast became a dependent scalar add plus a register shuffle competing
// with the FMAs for their port; this form compiles to a broadcast load. On the Xeon box a
// SmolLM2-sized stream (538 MB) at M=8 went 35.5 -> 29.6 ms on 2 threads (68.5 -> 58.6 on 1)
inline vf bcast(const float* p) { return *p - vf{}; }  // s - (+0) == s for every s: folds away
inline vf loadv(const float* p) { return *reinterpret_cast<const vfu*>(p); }
inline void storev(float* p, vf v) { *reinterpret_cast<vfu*>(p) = v; }
// VW bfloat16 (their bits) -> VW float32
inline vf loadv(const uint16_t* p) {
  return reinterpret_cast<vf>(__builtin_convertvector(*reinterpret_cast<const vhu*>(p), vu) << 16);
}

// rows [0, R) of x (R <= MT), columns [0, kc) of a packed block chunk: acc[r, 0:NB] += x[r] . wb
// (W: float, or uint16_t holding bfloat16 bits)
template <int R, typename W>
inline void tile(const float* x, int64_t ldx, const W* wb, int64_t kc, float* acc) {
  constexpr int64_t LINE = 64 / sizeof(W);  // elements per cache line
  vf a0[R], a1[R];
  for (int r = 0; r < R; ++r) {
    a0[r] = loadv(acc + r * NB);
    a1[r] = loadv(acc + r * NB + VW);
  }
  for (int64_t k = 0; k < kc; ++k) {
    // the stream needs more loads in flight than the hardware prefetcher keeps once the FMAs per
    // line grow with R; past the chunk's end this touches what comes next in memory anyway
    for (int64_t line = 0; line < NB; line += LINE)
      __builtin_prefetch(wb + (k + PF) * NB + line, 0, HALFMOON_PREFETCH_LOCALITY);
    const vf w0 = loadv(wb + k * NB), w1 = loadv(wb + k * NB + VW);
    for (int r = 0; r < R; ++r) {
      const vf xb = bcast(x + r * ldx + k);
      a0[r] += xb * w0;
      a1[r] += xb * w1;
    }
  }
  for (int r = 0; r < R; ++r) {
    storev(acc + r * NB, a0[r]);
    storev(acc + r * NB + VW, a1[r]);
  }
}

template <typename W>
void tile_rows(int64_t R, const float* x, int64_t ldx, const W* wb, int64_t kc, float* acc) {
  switch (R) {
    case 8: tile<8>(x, ldx, wb, kc, acc); break;
    case 7: tile<7>(x, ldx, wb, kc, acc); break;
    case 6: tile<6>(x, ldx, wb, kc, acc); break;
    case 5: tile<5>(x, ldx, wb, kc, acc); break;
    case 4: tile<4>(x, ldx, wb, kc, acc); break;
    case 3: tile<3>(x, ldx, wb, kc, acc); break;
    case 2: tile<2>(x, ldx, wb, kc, acc); break;
    case 1: tile<1>(x, ldx, wb, kc, acc); break;
    default: break;
  }
}

// every row of x against one packed block -> y[:, 0:nvalid] (+ bias). K is walked in chunks of
// KC columns and every row tile runs on a chunk while it is in L1, so the
// block comes from memory once however many tiles M needs.
template <typename W>
void block(const float* x, int64_t M, int64_t ldx, const W* wb, int64_t K, float* y, int64_t ldy,
           int64_t nvalid, const float* bias) {
  alignas(64) float acc[MAX_M * NB];
  std::memset(acc, 0, sizeof(float) * M * NB);
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t kc = std::min(KC, K - k0);
    for (int64_t m = 0; m < M; m += MT)
      tile_rows(std::min<int64_t>(MT, M - m), x + m * ldx + k0, ldx, wb + k0 * NB, kc, acc + m * NB);
  }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t i = 0; i < nvalid; ++i) y[m * ldy + i] = acc[m * NB + i] + (bias ? bias[i] : 0.0f);
}

}  // namespace

// W [N, K] float32 or bfloat16 -> packed [ceil(N / NB), K, NB] of W's dtype (zero rows past N).
torch::Tensor small_gemm_pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.device().is_cpu() &&
                  (w.scalar_type() == torch::kFloat32 || w.scalar_type() == torch::kBFloat16),
              "small_gemm_pack: w must be a 2-D float32 or bfloat16 CPU tensor");
  const int64_t N = w.size(0), K = w.size(1), nb = (N + NB - 1) / NB;
  auto wc = w.contiguous();
  auto packed = torch::zeros({nb, K, NB}, w.options());
  const int64_t es = w.element_size();
  const char* src = static_cast<const char*>(wc.data_ptr());
  char* dst = static_cast<char*>(packed.data_ptr());
  at::parallel_for(0, nb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j)
      for (int64_t i = 0; i < NB && j * NB + i < N; ++i)
        for (int64_t k = 0; k < K; ++k)
          std::memcpy(dst + ((j * K + k) * NB + i) * es, src + ((j * NB + i) * K + k) * es, es);
  });
  return packed;
}

// x [M, K] float32 or bfloat16, packed from small_gemm_pack of W [N, K] (float32 or bfloat16),
// bias [N] or None -> y [M, N] of x's dtype. A float32 packed W takes float32 x only.
torch::Tensor small_gemm(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias) {
  const bool wbf16 = packed.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() &&
                  (x.scalar_type() == torch::kFloat32 || (wbf16 && x.scalar_type() == torch::kBFloat16)),
              "small_gemm: x must be a 2-D float32 CPU tensor (or bfloat16 with bfloat16 weights)");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == NB && packed.size(1) == x.size(1) &&
                  packed.size(0) == (N + NB - 1) / NB && packed.is_contiguous() &&
                  (wbf16 || packed.scalar_type() == torch::kFloat32),
              "small_gemm: packed does not match x's K or N");
  auto xf = x.scalar_type() == torch::kFloat32 ? x : x.to(torch::kFloat32);
  auto xc = xf.stride(1) == 1 ? xf : xf.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), ldx = xc.stride(0), nb = packed.size(0);
  auto y = torch::empty({M, N}, xc.options());
  const float* bp = nullptr;
  torch::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    bc = bias->to(torch::kFloat32).contiguous();
    TORCH_CHECK(bc.numel() == N, "small_gemm: bias must be [N]");
    bp = bc.data_ptr<float>();
  }
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  TORCH_CHECK(M <= MAX_M, "small_gemm: at most ", MAX_M, " rows, got ", M);
  if (M == 0) return y.to(x.scalar_type());
  // a few blocks per task: each is ~K * 64 bytes, so tasks stay well above the fork/join cost
  auto run = [&](auto* wp) {
    at::parallel_for(0, nb, 4, [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; ++j) {
        const int64_t n0 = j * NB, nvalid = std::min(NB, N - n0);
        block(xp, M, ldx, wp + j * K * NB, K, yp + n0, N, nvalid, bp ? bp + n0 : nullptr);
      }
    });
  };
  if (wbf16)
    run(reinterpret_cast<const uint16_t*>(packed.data_ptr()));
  else
    run(packed.data_ptr<float>());
  return x.scalar_type() == torch::kFloat32 ? y : y.to(x.scalar_type());
}

// A torch op (torch.ops.halfmoon.small_gemm / small_gemm_pack), so profilers and dispatch modes see
// each GEMM like aten's; the Python module exists only to be imported (which registers them).
TORCH_LIBRARY(halfmoon, m) {
  m.def("small_gemm_pack(Tensor w) -> Tensor");
  m.def("small_gemm(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(halfmoon, CPU, m) {
  m.impl("small_gemm_pack", &small_gemm_pack);
  m.impl("small_gemm", &small_gemm);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.attr("BLOCK") = NB; }  // the packed layout's last dim
