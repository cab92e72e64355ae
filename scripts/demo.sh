#!/usr/bin/env bash
# Installs the build dependencies, builds ckptfs, and runs it on the bundled sample
# checkpoint (a small training checkpoint written by torch.save): info, ls, an export of the
# virtual tree to build/sample-export/, and the main job: a read-only mount of the sample
# (build/sample-mount/), listed, one tensor read through it, then unmounted. Every mount
# step has a timeout, and the mount is undone on any exit of this script.
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
"$ckptfs" export --write all "$sample" "$root/build/sample-export"
ls -l "$root/build/sample-export" "$root/build/sample-export/tensors"
"$ckptfs" cat "$sample" metadata.json
{ set +x; } 2>/dev/null

mnt="$root/build/sample-mount"
fuse=0
"$root/scripts/check-fuse.sh" demo || fuse=$?
case $fuse in
  0) ;;
  3) echo "demo: everything above works without a mount" >&2; exit 0 ;;
  *) exit 1 ;;
esac
unmount() {
  if mountpoint -q "$mnt"; then
    # A busy or unresponsive mount is detached lazily rather than left behind.
    timeout 30 fusermount3 -u "$mnt" 2>/dev/null || timeout 30 fusermount3 -u -z "$mnt"
  fi
}
unmount
trap unmount EXIT
mkdir -p "$mnt"
set -x
timeout 60 "$ckptfs" "$sample" "$mnt"     # returns once the mount is ready
timeout 30 ls -l "$mnt"
timeout 30 ls "$mnt/tensors"
# One tensor as its own safetensors file: an 8-byte header length, the JSON header, then the
# tensor's bytes (32 float32 values), read through the mount.
tensor="$mnt/tensors/model.0.bias.safetensors"
header_len=$(( $(timeout 30 od -A n -t u8 -N 8 "$tensor") ))
timeout 30 dd if="$tensor" bs=1 skip=8 count="$header_len" status=none; echo
timeout 30 od -A d -t f4 -j $((8 + header_len)) "$tensor"
timeout 30 cmp "$tensor" "$root/build/sample-export/tensors/model.0.bias.safetensors"
{ set +x; } 2>/dev/null
unmount
trap - EXIT
echo "demo: mounted, listed, read a tensor through the mount and unmounted $mnt"
