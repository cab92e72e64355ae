#!/usr/bin/env bash
# Installs the build dependencies, builds ckptfs, and runs it on the bundled sample
# checkpoint (a small training checkpoint written by torch.save): info, ls, and an
# export of the virtual tree to build/sample-export/.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install-deps.sh"
"$root/scripts/build.sh"
sample="$root/tests/data/sample-mlp-training.pt"
ckptfs="$root/build/ckptfs"
set -x
"$ckptfs" info "$sample"
"$ckptfs" ls "$sample"
rm -rf "$root/build/sample-export"
"$ckptfs" export "$sample" "$root/build/sample-export"
ls -l "$root/build/sample-export" "$root/build/sample-export/tensors"
"$ckptfs" cat "$sample" metadata.json
