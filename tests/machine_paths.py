"""The folders of the machine that built a package, which no file it ships may name: they do
not exist where the package is installed, and they tell the world the builder's layout.
tests/packaging checks the .deb with this, tests/pypkg the wheel."""

import gzip
import os
import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def machine_folders(*more) -> list[str]:
    """The source tree, the test environment (this interpreter's), $HOME and MORE (build
    folders, other environments), each as given and with symbolic links resolved."""
    folders = set()
    for folder in (REPO_ROOT, sys.prefix, os.environ.get("HOME"), *more):
        if not folder:
            continue
        for form in (os.path.abspath(folder), os.path.realpath(folder)):
            if form.rstrip("/"):  # "/" (a HOME of root's) would match every path
                folders.add(form.rstrip("/"))
    return sorted(folders)


def strings_naming(root: Path, folders) -> dict:
    """{file: [the strings in it that name one of FOLDERS]} for every file under ROOT, found by
    binutils' strings: ELF binaries and libraries (every section, debug info included) and
    text files alike, gzip files (man pages) uncompressed; for a symbolic link, its target. A
    folder counts when a path starts with it: /home/ci does not match /home/ci2."""
    pattern = re.compile("(?:" + "|".join(re.escape(f) for f in folders) + r")(?![\w.+-])")
    found = {}
    for path in sorted(root.rglob("*")):
        if path.is_symlink():
            if pattern.search(os.readlink(path)):
                found[str(path.relative_to(root))] = [os.readlink(path)]
            continue
        if not path.is_file():
            continue
        data = path.read_bytes()
        if data.startswith(b"\x1f\x8b"):
            data = gzip.decompress(data)
        out = subprocess.run(["strings", "-a"], input=data, check=True, capture_output=True, timeout=120).stdout
        hits = [line for line in out.decode(errors="replace").splitlines() if pattern.search(line)]
        if hits:
            found[str(path.relative_to(root))] = hits[:5]
    return found
