// Built into SGLang's CPU kernel only for CPUs without AVX-512 (setup-sglang-cpu.sh, variant
// "avx2"). The kernel's int8 GEMM and fused-MoE sources are AVX-512 code with no fallback, so that
// variant leaves them out, as the kernel's own Arm build does; these definitions keep its op
// registrations linkable. SGLang calls them only on CPUs with AMX (cpu_has_amx_support()), which
// such a CPU never has; if anything ever does, it fails loudly instead of computing garbage.
#include <ATen/ATen.h>

#include <optional>
#include <tuple>
#include <vector>

#define STRATA_NOT_BUILT(op) \
  TORCH_CHECK(false, op " is not in this build of SGLang's CPU kernel (built for a CPU without AVX-512)")

std::tuple<at::Tensor, at::Tensor> per_token_quant_int8_cpu(at::Tensor& A) {
  STRATA_NOT_BUILT("per_token_quant_int8_cpu");
}

at::Tensor int8_scaled_mm_cpu(at::Tensor& mat1, at::Tensor& mat2, at::Tensor& scales1, at::Tensor& scales2,
                              const std::optional<at::Tensor>& bias, at::ScalarType out_dtype, bool is_vnni) {
  STRATA_NOT_BUILT("int8_scaled_mm_cpu");
}

at::Tensor int8_scaled_mm_with_quant(at::Tensor& mat1, at::Tensor& mat2, at::Tensor& scales2,
                                     const std::optional<at::Tensor>& bias, at::ScalarType out_dtype, bool is_vnni) {
  STRATA_NOT_BUILT("int8_scaled_mm_with_quant");
}

at::Tensor fused_experts_cpu(at::Tensor& hidden_states, at::Tensor& w1, at::Tensor& w2, at::Tensor& topk_weights,
                             at::Tensor& topk_ids, bool inplace, int64_t moe_comp_method,
                             const std::optional<at::Tensor>& w1_scale, const std::optional<at::Tensor>& w2_scale,
                             const std::optional<at::Tensor>& w1_zero, const std::optional<at::Tensor>& w2_zero,
                             const std::optional<std::vector<int64_t>> block_size,
                             const std::optional<at::Tensor>& w1_bias, const std::optional<at::Tensor>& w2_bias,
                             const std::optional<double>& alpha, const std::optional<double>& limit, bool is_vnni) {
  STRATA_NOT_BUILT("fused_experts_cpu");
}
