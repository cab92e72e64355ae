#!/usr/bin/env python3
"""Loads a ZeRO-3 save with ckptfs.load(device="cpu") in a process where the kernel refuses every
MAP_FIXED map of a file, as a file system without mmap refuses it (ENODEV), and reports on
stdout, as JSON, what was mapped and which tensors differ from a reference.

    python refused_maps.py SAVE_DIR REFERENCE.pt

The refusal is a seccomp filter on mmap: a call with MAP_FIXED and a file descriptor gets
ENODEV, every other call (anonymous memory, the dynamic loader's maps made before the filter,
torch's own maps without MAP_FIXED) goes through. libckptfs must then read every byte it meant
to map into the anonymous memory it reserved. The filter is installed after a first load, so
that nothing imported lazily needs a refused map, and stays for the rest of this process,
which is why this runs apart from pytest (test_zero3_maps.py)."""

import ctypes
import errno
import gc
import json
import platform
import sys

import torch

import ckptfs
from ckptfs._source import Source

# linux/filter.h, linux/seccomp.h, linux/audit.h, asm/unistd_64.h, sys/mman.h, errno.h
BPF_LD_W_ABS, BPF_JEQ_K, BPF_JSET_K, BPF_RET_K = 0x20, 0x15, 0x45, 0x06
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000
AUDIT_ARCH_X86_64, NR_MMAP, MAP_FIXED, ENODEV = 0xC000003E, 9, 0x10, 19
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2


class Unsupported(Exception):
    """The refusal cannot be set up here: the test skips, saying why."""


class SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]


def refuse_fixed_file_maps() -> None:
    """From now on mmap(..., MAP_FIXED, fd >= 0, ...) fails with ENODEV in this process."""
    # struct seccomp_data: nr (0), arch (4), instruction_pointer (8), args[6] (16, 8 bytes each;
    # the low half first on x86-64). Jumps count instructions after the next one.
    program = [
        (BPF_LD_W_ABS, 0, 0, 4),
        (BPF_JEQ_K, 0, 7, AUDIT_ARCH_X86_64),  # another ABI: allow
        (BPF_LD_W_ABS, 0, 0, 0),
        (BPF_JEQ_K, 0, 5, NR_MMAP),
        (BPF_LD_W_ABS, 0, 0, 16 + 8 * 3),  # flags
        (BPF_JSET_K, 0, 3, MAP_FIXED),
        (BPF_LD_W_ABS, 0, 0, 16 + 8 * 4),  # fd
        (BPF_JEQ_K, 1, 0, 0xFFFFFFFF),  # -1: anonymous, allow
        (BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | ENODEV),
        (BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW),
    ]
    install_filter(program)


def install_filter(program: list) -> None:
    """Installs the seccomp filter PROGRAM ((code, jt, jf, k) tuples) for the rest of this
    process; Unsupported where the kernel has no seccomp filters."""
    filters = (SockFilter * len(program))(*[SockFilter(*op) for op in program])
    prog = SockFprog(len(program), filters)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        error = ctypes.get_errno()
        if error == errno.EINVAL:  # a kernel built without CONFIG_SECCOMP_FILTER
            raise Unsupported("this kernel has no seccomp filters (prctl(PR_SET_SECCOMP): EINVAL)")
        raise OSError(error, "prctl(PR_SET_SECCOMP)")


def mapped_files() -> set:
    with open("/proc/self/maps") as f:
        return {fields[5].strip() for fields in (line.split(maxsplit=5) for line in f) if len(fields) == 6}


def differing(loaded: dict, reference: dict) -> list:
    if list(loaded) != list(reference):
        return ["<keys>"]
    return [key for key, want in reference.items()
            if loaded[key].dtype != want.dtype or loaded[key].shape != want.shape
            or not torch.equal(loaded[key].reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))]


def load_report(save_dir: str, reference: dict, rank_files: list) -> dict:
    loaded = ckptfs.load(save_dir, device="cpu")
    stats = ckptfs.last_load_stats()
    with Source(save_dir, {}) as opened:
        # ckptfs_map_tensors (the C API's lower call): its layout says what it mapped.
        composed = [e for e in opened.tensors if e.get("maps")]
        indices = (ctypes.c_uint64 * len(composed))(*[e["index"] for e in composed])
        region, size = ctypes.c_void_p(), ctypes.c_uint64()
        layout = opened.lib.ckptfs_map_tensors(opened.ptr, len(composed), indices, ctypes.byref(region),
                                               ctypes.byref(size))
        layout = json.loads(layout)
        opened.lib.ckptfs_unmap(region, size)
    report = {"load_stats": stats, "map_tensors_maps": layout["maps"],
              "map_tensors_read_bytes": sum(length for _, _, length in layout["reads"]),
              "map_tensors_bytes": sum(e["nbytes"] for e in composed),
              "rank_files_mapped": sorted(set(rank_files) & mapped_files()),
              "differing": differing(loaded, reference)}
    del loaded
    return report


def main() -> int:
    save_dir, reference_path, *rank_files = sys.argv[1:]
    if platform.machine() != "x86_64":
        print(json.dumps({"skip": f"the seccomp filter is written for x86_64, not {platform.machine()}"}))
        return 0
    reference = torch.load(reference_path, weights_only=False)
    before = load_report(save_dir, reference, rank_files)
    gc.collect()  # the first load's region goes with its tensors
    try:
        refuse_fixed_file_maps()
    except Unsupported as why:
        print(json.dumps({"skip": str(why)}))
        return 0
    after = load_report(save_dir, reference, rank_files)
    print(json.dumps({"before": before, "refused": after}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
