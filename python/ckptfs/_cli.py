"""The `ckptfs` console command of the wheel: runs the bundled ckptfs binary in this process's
place, so its arguments, standard streams, exit status and signals are the binary's own."""

from __future__ import annotations

import os
import sys

from ._lib import CkptfsError, executable_path


def main() -> None:
    try:
        binary = os.fspath(executable_path())
    except CkptfsError as e:
        sys.exit(f"ckptfs: {e}")
    os.execv(binary, [binary, *sys.argv[1:]])
