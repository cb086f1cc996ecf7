"""Give sgl-kernel's ``fused_experts_cpu`` the ``activation`` argument SGLang 0.5.18 passes.

    patch_kernel.py SGL_KERNEL_DIR

SGLang 0.5.18 calls ``torch.ops.sgl_kernel.fused_experts_cpu(..., is_vnni, activation)`` (18
arguments: ``layers/quantization/unquant.py``) wherever a CPU with AMX has prepacked the MoE
weights, but the vendored kernel source (2f14d6c) registers the op with 17, so every MoE model
fails its first forward there ("expected at most 17 argument(s) but received 18"). The kernel
chooses its activation from ``alpha``/``limit`` (clamped SwiGLU when both are set, SiLU-and-mul
otherwise); this patch adds ``str activation="silu"`` to the schema and refuses, with the
activation named, a non-SiLU activation the kernel would silently compute as SiLU. Refuses to
patch files that do not look as expected (another kernel version): never guesses.
"""

import sys
from pathlib import Path

cpu = Path(sys.argv[1]) / "csrc" / "cpu"
TAIL = "    const std::optional<double>& limit,\n    bool is_vnni"
edits = {
    "torch_extension_cpu.cpp": [
        (
            'float? alpha, float? "\n      "limit, bool is_vnni) -> Tensor");',
            'float? alpha, float? "\n      "limit, bool is_vnni, str activation=\\"silu\\") -> Tensor");',
        ),
        (TAIL + ");", TAIL + ",\n    c10::string_view activation);"),
    ],
    "moe.cpp": [
        (
            TAIL + ") {\n",
            TAIL + ",\n    c10::string_view activation) {\n"
            "  TORCH_CHECK(\n"
            '      activation == "silu" || (alpha.has_value() && limit.has_value()),\n'
            '      "fused_experts_cpu: activation \\"", std::string(activation),\n'
            '      "\\" is not computed by this kernel (SiLU-and-mul, or clamped SwiGLU when alpha and limit are set)");\n',
        ),
    ],
}
for name, pairs in edits.items():
    path = cpu / name
    s = path.read_text()
    for old, new in pairs:
        if s.count(old) != 1:
            sys.exit(
                f"patch_kernel.py: {path} does not contain the expected block once:\n{old}\n(another sgl-kernel version?)"
            )
        s = s.replace(old, new)
    path.write_text(s)
print(f"patched {cpu}: fused_experts_cpu takes SGLang 0.5.18's activation argument")
