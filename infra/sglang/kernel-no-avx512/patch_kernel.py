"""Patch sgl-kernel's CPU sources for an x86-64 CPU without AVX-512 (variant "avx2").

    patch_kernel.py SGL_KERNEL_DIR

The kernel's x86 build hard-codes ``-march=x86-64-v4 -mavx512bf16 ... -mamx-*``: on a CPU without
AVX-512 the library dies with SIGILL on import. Its Arm build shows the way: compile for the
machine (``-march=native``), leave out the AVX-512-only sources (int4/int8 GEMM, MoE, fused QKV,
mamba conv) and define ``SGLANG_CPU_ARM64_SKIP_X86_ONLY_OPS`` so their ops are not registered.
The kernels SGLang's CPU path uses without AMX (attention, norms, rope) have generic ``at::vec``
code for this case, except that the attention kernels multiply through torch's VNNI brgemm, which
torch runs only with AVX-512: they call ``strata_brgemm_vnni.h`` instead. ``strata_no_avx512_stubs.cpp``
defines the four ops still registered. Refuses to patch a file that does not look as expected
(another kernel version): never guesses.
"""

import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
cpu = Path(sys.argv[1]) / "csrc" / "cpu"
path = cpu / "CMakeLists.txt"
s = path.read_text()
edits = [
    (
        'if(CMAKE_SYSTEM_PROCESSOR MATCHES "aarch64|arm64")\n    add_compile_definitions(SGLANG_CPU_ARM64_SKIP_X86_ONLY_OPS)',
        "if(TRUE)\n    add_compile_definitions(SGLANG_CPU_ARM64_SKIP_X86_ONLY_OPS)",
    ),
    (
        'if(MY_ARCH_DIR STREQUAL "x86_64")\n    add_compile_options(\n        -O3\n        -Wno-unknown-pragmas\n        -march=x86-64-v4',
        "if(FALSE)\n    add_compile_options(\n        -O3\n        -Wno-unknown-pragmas\n        -march=x86-64-v4",
    ),
]
for old, new in edits:
    if s.count(old) != 1:
        sys.exit(f"patch_kernel.py: {path} does not contain the expected block:\n{old}\n(another sgl-kernel version?)")
    s = s.replace(old, new)
path.write_text(s)
for name in ("extend.cpp", "decode.cpp", "flash_attn.cpp"):
    src = (cpu / name).read_text()
    calls = src.count("at::native::cpublas::brgemm(")
    if calls == 0 or '#include "common.h"' not in src:
        sys.exit(
            f"patch_kernel.py: {cpu / name} has no brgemm call or no common.h include (another sgl-kernel version?)"
        )
    src = src.replace('#include "common.h"', '#include "common.h"\n#include "strata_brgemm_vnni.h"', 1)
    (cpu / name).write_text(src.replace("at::native::cpublas::brgemm(", "strata_brgemm_vnni("))
    print(f"{name}: {calls} VNNI brgemm calls -> strata_brgemm_vnni")
for name in ("strata_brgemm_vnni.h", "strata_no_avx512_stubs.cpp"):
    shutil.copy(HERE / name, cpu / name)
print(f"patched {cpu} for a CPU without AVX-512")
