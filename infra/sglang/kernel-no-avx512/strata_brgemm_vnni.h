// Built into SGLang's CPU kernel only for CPUs without AVX-512 (variant "avx2"): the attention
// kernels pack K and V into the VNNI layout ([K/2][ld][2]) and hand them to
// at::native::cpublas::brgemm, which torch runs only on CPUs with AVX-512-class oneDNN ukernels
// ("BFloat16 Brgemm VNNI format is only supported on X64 when ... `amx` is supported"). This is
// the same product, C (+)= A @ B with B in that VNNI layout, as plain loops the compiler
// vectorises. Zero entries of A are skipped: the kernels pad K with zero columns of A over rows of
// B they never wrote (stale buffer contents), which a multiply would turn into NaN if stale data
// happened to hold one.
#pragma once

#include <ATen/native/CPUBlas.h>

#include <cstdint>
#include <type_traits>

template <typename scalar_t>
inline void strata_brgemm_vnni(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add_C,
                               const scalar_t* __restrict__ A, const scalar_t* __restrict__ B, float* __restrict__ C) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add_C, A, B, C);  // fp32 has no VNNI layout
  } else {
    for (int64_t m = 0; m < M; ++m) {
      float* __restrict__ c = C + m * ldc;
      if (!add_C) {
        for (int64_t n = 0; n < N; ++n) c[n] = 0.f;
      }
      for (int64_t k = 0; k < K; ++k) {
        const float a = static_cast<float>(A[m * lda + k]);
        if (a == 0.f) continue;
        const scalar_t* __restrict__ b = B + (k >> 1) * ldb * 2 + (k & 1);
        for (int64_t n = 0; n < N; ++n) c[n] += a * static_cast<float>(b[n * 2]);
      }
    }
  }
}
