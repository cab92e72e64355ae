#!/usr/bin/env bash
# Packs what scripts/device-check.sh needs on a GPU machine that has no network and may lack
# the libraries ckptfs links: the build, its shared libraries, the fixtures only DeepSpeed and
# torch's distributed launcher can write, and the wheels of the peers the image lacks.
#
#   scripts/device-pack.sh [--build-dir DIR] [--out DIR]      (default: build/, device-pack/)
#
# Without --build-dir it brings build/ up to date first (scripts/build.sh), so the pack is the
# commit checked out.
# The pack is laid out like a build folder, so the device suite runs from it unchanged:
#   ckptfs, libckptfs.so          stripped; their run path is $ORIGIN/lib
#   lib/                          every shared library they need beyond the C and C++ runtimes
#                                 (libfuse3, libcurl and what it links, libxxhash), each with
#                                 run path $ORIGIN, so a chain of them resolves inside the pack
#   tests/libfake_cudart.so       the fake runtime tests/device/test_finding_cuda.py installs
#   fixtures/zero/<case>/         two real DeepSpeed saves (tests/zero/make_zero_checkpoints.py)
#   fixtures/dcp/<case>/          one real FSDP2 DCP save (tests/dcp/make_dcp_checkpoints.py)
#   wheels/device/                fastsafetensors for the GPU image's Python (3.12, manylinux)
#   wheels/host/                  the same release for this machine's test Python (the dry run)
#   pack.json                     commit, compiler, the newest glibc/libstdc++ symbol versions
#                                 the binaries need, what was bundled, sizes
# The device machine takes at most 64 MiB of working tree, the pack included: checked here.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=""
out="$root/device-pack"
while [ $# -gt 0 ]; do
  case "$1" in
    --build-dir) build=$(cd "$2" && pwd); shift 2 ;;
    --out) out=$2; shift 2 ;;
    *) echo "device-pack: unknown argument $1 (usage: device-pack.sh [--build-dir DIR] [--out DIR])" >&2; exit 2 ;;
  esac
done
# The release of fastsafetensors the benchmark compares with, and the Python of the GPU image.
FASTSAFETENSORS=fastsafetensors==0.5.0
DEVICE_PYTHON_VERSION=3.12

if [ -z "$build" ]; then
  build="$root/build"
  "$root/scripts/build.sh" >&2
fi
command -v patchelf >/dev/null || { echo "device-pack: patchelf not found (scripts/install-deps.sh installs it)" >&2; exit 1; }
for f in ckptfs libckptfs.so tests/libfake_cudart.so; do
  [ -f "$build/$f" ] || { echo "device-pack: $build/$f not found: build first (scripts/build.sh)" >&2; exit 1; }
done
venv=$("$root/scripts/setup-venv.sh")

stage=$(mktemp -d "${out%/}.tmp.XXXXXX")
trap 'rm -rf "$stage"' EXIT
chmod 755 "$stage"
mkdir -p "$stage/lib" "$stage/tests" "$stage/fixtures/zero" "$stage/fixtures/dcp" "$stage/wheels/device" "$stage/wheels/host"

# The binaries, stripped of debug information (the device machine reports by line, not by
# debugger), with their run path inside the pack.
cp "$build/ckptfs" "$build/libckptfs.so" "$stage/"
cp "$build/tests/libfake_cudart.so" "$stage/tests/"
strip --strip-unneeded "$stage/ckptfs" "$stage/libckptfs.so" "$stage/tests/libfake_cudart.so"

# Shared libraries: everything ldd resolves except the C runtime (glibc's own objects), the
# C++ runtime (any machine with PyTorch has a newer one, and two in one process clash) and
# the kernel's vDSO.
system_lib='^(linux-vdso|ld-linux|libc\.|libm\.|libdl\.|libpthread\.|librt\.|libresolv\.|libutil\.|libstdc\+\+\.|libgcc_s\.)'
bundled=()
while read -r name path; do
  [[ "$name" =~ $system_lib ]] && continue
  cp -L "$path" "$stage/lib/$name"
  bundled+=("$name")
done < <(ldd "$build/ckptfs" "$build/libckptfs.so" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | sort -u)
if ldd "$build/ckptfs" "$build/libckptfs.so" | grep -q "not found"; then
  echo "device-pack: the build itself has unresolved libraries:" >&2
  ldd "$build/ckptfs" "$build/libckptfs.so" | grep "not found" >&2
  exit 1
fi
for lib in "$stage"/lib/*; do
  chmod u+w "$lib"
  strip --strip-unneeded "$lib"
  # DT_RPATH, not DT_RUNPATH: it applies to the libraries each of these loads in turn.
  patchelf --force-rpath --set-rpath '$ORIGIN' "$lib"
done
patchelf --force-rpath --set-rpath '$ORIGIN/lib' "$stage/ckptfs" "$stage/libckptfs.so"
# Every library resolves inside the pack or to the excluded runtimes.
for bin in "$stage/ckptfs" "$stage/libckptfs.so"; do
  while read -r name _ path _; do
    [[ "$name" =~ $system_lib ]] && continue
    case "$path" in "$stage"/lib/*) ;; *) echo "device-pack: $bin takes $name from $path, not the pack" >&2; exit 1 ;; esac
  done < <(ldd "$bin" | awk '$2 == "=>"')
done

# Fixtures written by the real frameworks, from this machine's fixture cache (generated on
# first use): the GPU image has no DeepSpeed.
"$venv/bin/python" - "$root/tests" "$stage/fixtures" <<'EOF'
import shutil, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from ckptfs_fixture_cache import DCP_CHECKPOINTS, ZERO_CHECKPOINTS, cached_fixtures
sys.path.insert(0, str(Path(sys.argv[1]) / "device"))
from device_sources import DCP_FIXTURE, ZERO_FIXTURES
out = Path(sys.argv[2])
zero = cached_fixtures(ZERO_CHECKPOINTS)
for name in ZERO_FIXTURES:
    shutil.copytree(zero / name / "checkpoint", out / "zero" / name / "checkpoint")
dcp = cached_fixtures(DCP_CHECKPOINTS)
shutil.copytree(dcp / DCP_FIXTURE, out / "dcp" / DCP_FIXTURE)
EOF

# fastsafetensors: the GPU image's Python and this machine's (the dry run imports it here),
# downloaded once per machine into the cache beside the test environment.
wheels="${CKPTFS_CACHE:-$HOME/.cache/ckptfs}/device-wheels/${FASTSAFETENSORS/==/-}"
if [ ! -f "$wheels/.complete" ]; then
  rm -rf "$wheels"
  pip_download=("$venv/bin/python" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all:)
  "${pip_download[@]}" -d "$wheels/device" --python-version "$DEVICE_PYTHON_VERSION" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 "$FASTSAFETENSORS"
  "${pip_download[@]}" -d "$wheels/host" "$FASTSAFETENSORS"
  touch "$wheels/.complete"
fi
cp "$wheels"/device/*.whl "$stage/wheels/device/"
cp "$wheels"/host/*.whl "$stage/wheels/host/"

# What the pack needs of the machine: the newest glibc and libstdc++ symbol versions.
newest() { objdump -T "$stage/ckptfs" "$stage/libckptfs.so" "$stage"/lib/* | grep -o "$1_[0-9.]*" | sort -uV | tail -1; }
commit=$(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown)
dirty=false; [ -z "$(git -C "$root" status --porcelain --untracked-files=no 2>/dev/null)" ] || dirty=true
"$venv/bin/python" - "$stage" "$commit" "$dirty" "$(newest GLIBC)" "$(newest GLIBCXX)" "$FASTSAFETENSORS" \
  "$DEVICE_PYTHON_VERSION" "$(grep -m1 CMAKE_CXX_COMPILER: "$build/CMakeCache.txt" | cut -d= -f2)" "${bundled[@]}" <<'EOF'
import json, os, sys, time
from pathlib import Path
stage, commit, dirty, glibc, glibcxx, fst, pyver, cxx, *bundled = sys.argv[1:]
stage = Path(stage)
files = [p for p in stage.rglob("*") if p.is_file()]
json.dump({
    "commit": commit, "dirty": dirty == "true", "packed": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    "compiler": cxx, "needs": {"glibc": glibc, "libstdc++": glibcxx},
    "bundled_libraries": bundled, "fastsafetensors": fst.split("==")[1], "device_python": pyver,
    "bytes": sum(p.stat().st_size for p in files), "files": len(files),
}, open(stage / "pack.json", "w"), indent=1)
EOF

rm -rf "$out"
mv "$stage" "$out"
trap - EXIT
pack_bytes=$(du -sb "$out" | cut -f1)
# What else travels: tracked files and untracked ones git does not ignore.
tree_bytes=$(cd "$root" && git ls-files -z -co --exclude-standard | xargs -0 -r stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
limit=$((64 << 20))
total=$((pack_bytes + tree_bytes))
echo "device-pack: $out: $((pack_bytes >> 20)) MiB (${#bundled[@]} libraries bundled); with the working tree $((total >> 20)) MiB of the 64 MiB that travel"
if [ "$total" -gt "$limit" ]; then
  echo "device-pack: the pack and working tree are over the 64 MiB a device call takes" >&2
  exit 1
fi
