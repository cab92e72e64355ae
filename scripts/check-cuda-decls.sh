#!/usr/bin/env bash
# Checks ckptfs's own CUDA runtime and cuFile declarations (src/device/cuda_api.hpp)
# against NVIDIA's, for CUDA 12 and 13, without a GPU or a toolkit:
#   1. tests/cuda_decls/check_decls.cpp compiles against the headers of NVIDIA's PyPI wheels
#      (static_asserts on every function type, constant and struct layout we rely on);
#   2. every symbol src/device/cuda_loader.cpp resolves with dlsym is exported by the
#      wheels' libcudart / libcufile (nm -D).
# --plant: the opposite check: copies of cuda_api.hpp with one wrong declaration each must
# fail step 1, with the static_assert that names it (shows the check can fail).
#
# The wheels are downloaded once with the test environment's pip and unpacked into
# ${CKPTFS_CACHE:-~/.cache/ckptfs}/nvidia-headers-<hash of the pinned versions>.
#   CKPTFS_PIP  the pip to download with (default: scripts/setup-venv.sh's)
#   CXX         the C++ compiler (default c++)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
mode=check
[ "${1:-}" = --plant ] && mode=plant
cxx=${CXX:-c++}
cache=${CKPTFS_CACHE:-$HOME/.cache/ckptfs}
# The runtime wheels lack crt/host_defines.h, which cuda_runtime_api.h includes: CUDA 12
# ships it in nvidia-cuda-nvcc-cu12, CUDA 13 in nvidia-cuda-crt.
wheels=(nvidia-cuda-runtime-cu12==12.9.79 nvidia-cuda-nvcc-cu12==12.9.86 nvidia-cufile-cu12==1.14.1.1
        nvidia-cuda-runtime==13.5.37 nvidia-cuda-crt==13.5.37 nvidia-cufile==1.20.0.107)
key=$(printf '%s\n' "${wheels[@]}" | sha256sum | cut -c1-16)
nvidia="$cache/nvidia-headers-$key"

if [ ! -f "$nvidia/.complete" ]; then
  pip=${CKPTFS_PIP:-$("$root/scripts/setup-venv.sh")/bin/pip}
  mkdir -p "$cache"
  tmp=$(mktemp -d "$cache/.nvidia-headers.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  echo "check-cuda-decls: downloading ${wheels[*]}" >&2
  "$pip" download --quiet --disable-pip-version-check --no-deps -d "$tmp/wheels" "${wheels[@]}" >&2
  # Only the headers and shared libraries (nvcc's wheel is mostly compiler).
  python3 - "$tmp/tree" "$tmp"/wheels/*.whl <<'PY'
import re, sys, zipfile
for wheel in sys.argv[2:]:
    with zipfile.ZipFile(wheel) as z:
        z.extractall(sys.argv[1], [n for n in z.namelist() if re.search(r"/include/|/lib/lib[^/]*\.so", n)])
PY
  touch "$tmp/tree/.complete"
  # Atomic: a concurrent run that got there first keeps its copy.
  mv -T "$tmp/tree" "$nvidia" 2>/dev/null || [ -f "$nvidia/.complete" ]
fi

# name | include dirs | libcudart | libcufile | extra flags
sets=(
  "CUDA 12.9 + cuFile 1.14|$nvidia/nvidia/cuda_runtime/include $nvidia/nvidia/cuda_nvcc/include $nvidia/nvidia/cufile/include|$nvidia/nvidia/cuda_runtime/lib/libcudart.so.12|$nvidia/nvidia/cufile/lib/libcufile.so.0|"
  "CUDA 13.5 + cuFile 1.20|$nvidia/nvidia/cu13/include|$nvidia/nvidia/cu13/lib/libcudart.so.13|$nvidia/nvidia/cu13/lib/libcufile.so.0|-DCKPTFS_CUFILE_HAS_P2P"
)

# Compiles the check with `first_include` ahead of src/ (a planted copy of cuda_api.hpp).
compile() {
  local incs=$1 flags=$2 first_include=$3 args=()
  [ -n "$first_include" ] && args+=(-I"$first_include")
  args+=(-I"$root/include" -I"$root/src")
  for d in $incs; do args+=(-isystem "$d"); done
  # shellcheck disable=SC2086
  "$cxx" -std=c++20 -fsyntax-only "${args[@]}" $flags "$root/tests/cuda_decls/check_decls.cpp"
}

rc=0
if [ "$mode" = check ]; then
  symbols=$(grep -oE '(Resolve|dlsym)\(lib, "[A-Za-z0-9_]+"' "$root/src/device/cuda_loader.cpp" | grep -oE '"[^"]+"' | tr -d '"')
  [ -n "$symbols" ] || { echo "check-cuda-decls: no dlsym'd symbols found in cuda_loader.cpp" >&2; exit 1; }
  for set in "${sets[@]}"; do
    IFS='|' read -r name incs cudart cufile flags <<<"$set"
    if compile "$incs" "$flags" ""; then
      echo "ok: declarations match $name"
    else
      echo "FAIL: declarations differ from $name" >&2
      rc=1
    fi
    exported_cudart=$(nm -D --defined-only "$cudart" | awk '{print $3}' | sed 's/@.*//')
    exported_cufile=$(nm -D --defined-only "$cufile" | awk '{print $3}' | sed 's/@.*//')
    for s in $symbols; do
      lib=$cudart exported=$exported_cudart
      [[ $s == cuFile* ]] && lib=$cufile exported=$exported_cufile
      if ! grep -qx "$s" <<<"$exported"; then
        echo "FAIL: $s is not exported by $lib ($name)" >&2
        rc=1
      fi
    done
    [ $rc = 0 ] && echo "ok: $(wc -w <<<"$symbols") symbols exported by $(basename "$cudart") and $(basename "$cufile") ($name)"
  done
  exit $rc
fi

# --plant: each wrong declaration (a sed expression on cuda_api.hpp) and the message that
# must reject it.
plants=(
  's/kCudaMemcpyDeviceToHost = 2;/kCudaMemcpyDeviceToHost = 3;/|ours::kCudaMemcpyDeviceToHost != NVIDIA'"'"'s cudaMemcpyDeviceToHost'
  's/size_t size, off_t file_offset, off_t buf_offset/size_t size, off_t file_offset, int buf_offset/|ours::CuFileApi::Read does not match NVIDIA'"'"'s cuFileRead'
  's/^  int type;/  long type;/|ours::CuFileDescr::type is not where NVIDIA'"'"'s CUfileDescr_t has it'
  's/(\*StreamWaitEvent)(void\* stream, void\* event, unsigned flags)/(*StreamWaitEvent)(void* stream, void* event)/|ours::CudaRuntime::StreamWaitEvent does not match'
)
planted=$(mktemp -d)
trap 'rm -rf "$planted"' EXIT
mkdir -p "$planted/device"
for set in "${sets[@]}"; do
  IFS='|' read -r name incs cudart cufile flags <<<"$set"
  for p in "${plants[@]}"; do
    expr=${p%%|*}
    want=${p#*|}
    sed "$expr" "$root/src/device/cuda_api.hpp" >"$planted/device/cuda_api.hpp"
    if cmp -s "$root/src/device/cuda_api.hpp" "$planted/device/cuda_api.hpp"; then
      echo "FAIL: plant '$expr' changed nothing in cuda_api.hpp" >&2
      rc=1
      continue
    fi
    if out=$(compile "$incs" "$flags" "$planted" 2>&1); then
      echo "FAIL: planted mismatch '$expr' compiled against $name" >&2
      rc=1
    elif grep -qF "$want" <<<"$out"; then
      echo "ok: planted '$expr' rejected against $name: $(grep -m1 -F "$want" <<<"$out" | sed 's/^.*error: //')"
    else
      echo "FAIL: planted '$expr' failed against $name without the expected message; compiler said:" >&2
      echo "$out" | head -20 >&2
      rc=1
    fi
  done
done
exit $rc
