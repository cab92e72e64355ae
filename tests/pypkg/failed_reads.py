#!/usr/bin/env python3
"""Loads a ZeRO-3 save through ckptfs_load_mapped in a process where every pread64 fails with
EIO once the checkpoint is open, and reports on stdout, as JSON, what the failed load left.

    python failed_reads.py SAVE_DIR RANK_FILE...

ckptfs_load_mapped maps the pages of the rank files that line up, then reads the bytes no map
supplies (small tensors, the partial pages where two ranks meet) with pread. The seccomp
filter (installed after the open, so the catalog is read normally) makes that read fail after
the maps are made: the call must fail with one error naming the file, and unmap everything it
mapped. Runs apart from pytest because the filter stays for the rest of the process
(test_zero3_maps.py)."""

import errno
import gc
import json
import platform
import sys

import ckptfs
from ckptfs._source import Source
from refused_maps import AUDIT_ARCH_X86_64, BPF_JEQ_K, BPF_LD_W_ABS, BPF_RET_K, SECCOMP_RET_ALLOW, \
    SECCOMP_RET_ERRNO, Unsupported, install_filter, mapped_files

NR_PREAD64 = 17


def fail_preads() -> None:
    """From now on pread64 fails with EIO in this process."""
    install_filter([
        (BPF_LD_W_ABS, 0, 0, 4),
        (BPF_JEQ_K, 0, 3, AUDIT_ARCH_X86_64),  # another ABI: allow
        (BPF_LD_W_ABS, 0, 0, 0),
        (BPF_JEQ_K, 0, 1, NR_PREAD64),
        (BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | errno.EIO),
        (BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW),
    ])


def main() -> int:
    save_dir, *rank_files = sys.argv[1:]
    if platform.machine() != "x86_64":
        print(json.dumps({"skip": f"the seccomp filter is written for x86_64, not {platform.machine()}"}))
        return 0
    with Source(save_dir, {}) as opened:
        entries = opened.tensors
        loaded = opened.load_mapped_torch(entries)  # unfiltered: it maps and it reads
        before = ckptfs.last_load_stats()
        del loaded
        gc.collect()
        try:
            fail_preads()
        except Unsupported as why:
            print(json.dumps({"skip": str(why)}))
            return 0
        error = None
        try:
            opened.load_mapped_torch(entries)
        except ckptfs.CkptfsError as e:
            error = str(e)
        gc.collect()
        print(json.dumps({"before": before, "error": error,
                          "rank_files_mapped": sorted(set(rank_files) & mapped_files())}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
