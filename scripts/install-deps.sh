#!/usr/bin/env bash
# Installs the Debian packages ckptfs builds and tests with (skips what is present).
set -euo pipefail
packages=(g++ cmake ninja-build pkg-config libfuse3-dev fuse3 nlohmann-json3-dev libxxhash-dev
          libboost-test-dev python3-venv rsync attr xxhash clang libclang-rt-14-dev)
packages+=(ccache)  # CMakeLists.txt: the builds of scripts/test.sh and CI share objects
packages+=(fuse-zip)  # tests/bench/bench_archive_peers.py: the archive-mount peer
packages+=(libcurl4-openssl-dev)  # remote sources (src/remote): range requests, SigV4
packages+=(nginx)  # tests/remote, tests/bench/bench_remote.py: the web server on loopback
packages+=(openssl)  # tests/remote: the self-signed certificate of the https:// server
packages+=(patchelf)  # scripts/device-pack.sh: the packed build finds its libraries inside the pack
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  sudo_cmd=(); [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
  echo "install-deps: apt-get install ${missing[*]}" >&2
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq "${missing[@]}" >&2
fi
# tests/compat/test_torch_family.py: files written by a second, older torch (Debian's 1.13,
# through /usr/bin/python3); nothing else uses it. Without its recommends (libtorch-dev and
# a compiler toolchain: hundreds of packages the test does not need).
if ! dpkg-query -W -f='${Status}' python3-torch 2>/dev/null | grep -q "install ok installed"; then
  sudo_cmd=(); [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
  echo "install-deps: apt-get install --no-install-recommends python3-torch" >&2
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends python3-torch >&2
fi
