#!/usr/bin/env bash
# The `pypkg` CTest test: builds the wheel from pyproject.toml, installs it into a fresh
# virtual environment and runs tests/pypkg there, against the installed package (its console
# command, bundled binary and library), never the source tree's python/ or build folder.
#
#   CKPTFS_PYTHON   the test environment's python (scripts/setup-venv.sh), which has
#                   scikit-build-core: the wheel is built in it with --no-build-isolation
#   CKPTFS_PYPKG_DIR  where the wheel and the environment go
#   CKPTFS_PYPKG_CMAKE_DIR  the wheel's CMake build folder (default CKPTFS_PYPKG_DIR/cmake)
#   CKPTFS_PYPKG_CXX  the C++ compiler to build the wheel with (default: the backend's choice)
#   extra arguments go to pytest
#
# The fresh environment gets the test environment's site-packages through a .pth file
# instead of its own copy of torch, safetensors, DeepSpeed and pytest: installing those again
# would download and unpack gigabytes on every run. A .pth appends that folder after the
# environment's own site-packages, so `import ckptfs` finds only the installed wheel (the
# test environment has no ckptfs), and the wheel is installed with --no-deps for the same
# reason. The suite checks where ckptfs was imported from.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
python=${CKPTFS_PYTHON:?set CKPTFS_PYTHON to the python of the test environment}
work=${CKPTFS_PYPKG_DIR:?set CKPTFS_PYPKG_DIR to a work folder}
mkdir -p "$work"
work=$(cd "$work" && pwd)

# The wheel's CMake build: CKPTFS_PYPKG_CMAKE_DIR, which CTest puts beside the build folder
# (build-wheel/ beside build/): at the same depth below the sources, its compile commands are
# those of build/, and ccache (CMakeLists.txt) serves the objects build/ made.
# It is compiled by CKPTFS_PYPKG_CXX, build/'s compiler, where given: ccache tells compilers
# apart by the name they are called by, and the build backend would otherwise pick Python's
# own (x86_64-linux-gnu-g++ on Debian).
settings=(--config-settings=build-dir="${CKPTFS_PYPKG_CMAKE_DIR:-$work/cmake}")
if [ -n "${CKPTFS_PYPKG_CXX:-}" ]; then
  settings+=(--config-settings=cmake.define.CMAKE_CXX_COMPILER="$CKPTFS_PYPKG_CXX")
fi
rm -rf "$work/dist"
start=$(date +%s)
"$python" -m pip wheel "$root" --quiet --no-build-isolation --no-deps --no-index --disable-pip-version-check \
  -w "$work/dist" "${settings[@]}"
wheels=("$work"/dist/ckptfs-*.whl)
echo "pypkg: built ${wheels[0]##*/} in $(( $(date +%s) - start ))s" >&2

venv="$work/venv"
"$python" -m venv --clear "$venv"
purelib() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
purelib "$python" > "$(purelib "$venv/bin/python")/ckptfs-test-environment.pth"
"$venv/bin/python" -m pip install --quiet --no-deps --no-index --disable-pip-version-check "${wheels[0]}"

# The package must find its own binary and library: nothing points it at a build folder.
cd "$work"
exec env -u CKPTFS_LIB -u CKPTFS_BIN -u CKPTFS_BUILD_DIR PATH="$venv/bin:$PATH" \
  CKPTFS_PYPKG_VENV="$venv" CKPTFS_PYPKG_WHEEL="${wheels[0]}" \
  "$venv/bin/python" -m pytest -q -p no:cacheprovider -c "$root/pytest.ini" --rootdir "$root" "$root/tests/pypkg" "$@"
