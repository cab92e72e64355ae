"""Test fixtures that take long to generate (real DeepSpeed, Megatron and veRL saves), generated
once per machine and kept outside the clone, like the Python environment of scripts/setup-venv.sh:

    ${CKPTFS_CACHE:-~/.cache/ckptfs}/fixtures/<generator name>-<key>/

The key covers everything that can change what a generator writes, so that an entry made on
another day, by another process or on another machine is used only when generating afresh
would give the same files: the generator's source and that of every test module it imports
(and of INPUTS, other generators whose fixtures it reads), every installed package's version
in the environment that runs it (the overlay's pins on top), the Python version, the CPU
features torch's kernels pick their code by, and the settings the generator runs under
(GENERATION_ENV: one thread, a fixed hash seed, the CPU). Editing any of them gives a new
entry and a stale one is never used. An entry is written into a temporary folder beside it
and renamed into place only when the generator succeeded, so no reader ever sees half of
one; a lock file makes a concurrent run wait for the one generating instead of generating
the same thing twice, and whoever holds it removes what an interrupted run left. Entries are
read-only by convention: a test that damages a fixture damages a copy. Delete the folder to
reclaim the space; scripts/test-from-nothing.sh runs the suite with an empty one.

Importable without pytest (tests/corpus/make_corpus.py uses it too)."""

import ast
import fcntl
import functools
import hashlib
import importlib.metadata
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent
ZERO_CHECKPOINTS = TESTS_DIR / "zero" / "make_zero_checkpoints.py"
PARALLEL_CHECKPOINTS = TESTS_DIR / "zero" / "make_parallel_checkpoints.py"
DCP_CHECKPOINTS = TESTS_DIR / "dcp" / "make_dcp_checkpoints.py"
# Converts cached ZERO_CHECKPOINTS saves (its key includes that generator: inputs=).
UNIVERSAL_CHECKPOINTS = TESTS_DIR / "zero" / "make_universal_checkpoints.py"
# Both run DeepSpeed on the CPU: about 45 s and 10 s on two cores.
GENERATE_TIMEOUT_S = 300
# What every generator runs under, part of the key: values computed on one thread (a thread
# count changes how sums are split, so their last bits), string hashes that do not change
# from run to run (set and dict orders), DeepSpeed and torch on the CPU.
GENERATION_ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                  "OPENBLAS_NUM_THREADS": "1", "PYTHONHASHSEED": "0", "CUDA_VISIBLE_DEVICES": ""}
# Bumped when what the key covers changes.
KEY_FORMAT = 2
# Where a generator's `import name` finds a test module of ours.
_LOCAL_MODULE_DIRS = (TESTS_DIR, TESTS_DIR / "zero")
# Not what a generator runs: the package under test and the installers.
_UNKEYED_DISTRIBUTIONS = {"ckptfs", "pip", "setuptools", "wheel"}


class FixtureGenerationError(Exception):
    pass


def cache_root() -> Path:
    return Path(os.environ.get("CKPTFS_CACHE") or Path.home() / ".cache" / "ckptfs") / "fixtures"


def entry_name(generator: Path, overlay: str | None = None, inputs=()) -> str:
    """<generator name>-<16 hex digits of the key>."""
    key = hashlib.sha256(f"ckptfs fixture key {KEY_FORMAT}".encode())
    for path in local_sources(Path(generator), *map(Path, inputs)):
        key.update(f"\0{path.relative_to(TESTS_DIR)}\0".encode() + path.read_bytes())
    for line in environment_lines():
        key.update(f"\0{line}".encode())
    if overlay:
        # The overlay's pins are what it runs with, on top of this environment (its versions
        # are not importable here).
        key.update(b"\0" + overlay_requirements(overlay).read_bytes())
    return f"{Path(generator).stem}-{key.hexdigest()[:16]}"


def local_sources(*scripts: Path) -> list[Path]:
    """SCRIPTS and every test module they import, directly or through each other, in a fixed
    order (found by reading their imports, not by running them)."""
    seen, todo = {}, [Path(s).resolve() for s in scripts]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen[path] = True
        for node in ast.walk(ast.parse(path.read_bytes(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            for name in names:
                for folder in (path.parent, *_LOCAL_MODULE_DIRS):
                    module = folder / (name.split(".")[0] + ".py")
                    if module.is_file():
                        todo.append(module.resolve())
                        break
    return sorted(seen, key=lambda p: str(p.relative_to(TESTS_DIR)))


@functools.cache
def environment_lines() -> tuple[str, ...]:
    """What of the running environment shapes a generator's output: the Python version, every
    installed distribution's version, the machine and its CPU features, GENERATION_ENV."""
    lines = [f"python {platform.python_version()} {platform.machine()}", f"cpu {cpu_features()}"]
    lines += sorted({f"{d.metadata['Name'].lower().replace('_', '-')}=={d.version}"
                     for d in importlib.metadata.distributions()
                     if d.metadata["Name"] and d.metadata["Name"].lower() not in _UNKEYED_DISTRIBUTIONS})
    lines += [f"{k}={v}" for k, v in sorted(GENERATION_ENV.items())]
    return tuple(lines)


def cpu_features() -> str:
    """The CPU flags torch's CPU kernels choose their code by (its dispatch levels and oneDNN's)."""
    wanted = ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_fp16", "avx512_vnni",
              "amx_bf16", "amx_tile", "amx_int8", "fma", "f16c")
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    return " ".join(sorted(set(wanted) & set(flags)))


def overlay_requirements(overlay: str) -> Path:
    return TESTS_DIR / f"requirements-{overlay}.txt"


def overlay_python(overlay: str) -> str:
    """The python of scripts/setup-venv.sh OVERLAY (created on first use: a minute)."""
    script = TESTS_DIR.parent / "scripts" / "setup-venv.sh"
    done = subprocess.run([str(script), overlay], capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise FixtureGenerationError(f"scripts/setup-venv.sh {overlay} failed:\n{done.stderr[-4000:]}")
    return str(Path(done.stdout.strip()) / "bin" / "python")


def cached_fixtures(generator: Path, timeout_s: float = GENERATE_TIMEOUT_S, overlay: str | None = None,
                    inputs=()) -> Path:
    """The folder `python GENERATOR OUT` filled, from the cache; generated first if absent
    (by the environment of scripts/setup-venv.sh OVERLAY when given, else this one), under
    the key entry_name() makes (INPUTS: scripts whose code or fixtures the generator uses).
    Raises FixtureGenerationError (naming the generator's log) if it fails or runs past
    TIMEOUT_S."""
    root = cache_root()
    name = entry_name(generator, overlay, inputs)
    entry = root / name
    if entry.is_dir():
        return entry
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{name}.lock", "w") as lock:
        _lock(lock, timeout_s + 60, entry)
        if entry.is_dir():  # generated by the run we waited for
            return entry
        for leftover in root.glob(f".{name}.*"):
            shutil.rmtree(leftover, ignore_errors=True)
        work = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
        python = overlay_python(overlay) if overlay else sys.executable
        _generate(generator, work, timeout_s, root / f"{name}.failed.log", python)
        os.rename(work, entry)
    return entry


def _lock(lock, timeout_s: float, entry: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise FixtureGenerationError(
                    f"another process has been generating {entry} for over {timeout_s:.0f}s "
                    f"(it holds {lock.name})"
                ) from None
            time.sleep(0.5)


def _generate(generator: Path, out: Path, timeout_s: float, failed_log: Path, python: str) -> None:
    """Run GENERATOR into OUT; on failure keep its log as FAILED_LOG, remove OUT and raise."""
    log_path = out / "generate.log"
    env = dict(os.environ, **GENERATION_ENV)
    started = time.monotonic()
    with open(log_path, "wb") as log:
        # A new session, so that a hang is ended by killing the generator and every rank it
        # forked (its process group), and nothing else.
        process = subprocess.Popen(
            [python, str(generator), str(out)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        try:
            returncode = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            returncode = None
    if returncode == 0:
        with open(log_path, "a") as log:
            log.write(f"generated in {time.monotonic() - started:.1f}s\n")
        return
    shutil.copyfile(log_path, failed_log)
    shutil.rmtree(out, ignore_errors=True)
    tail = "\n".join(failed_log.read_text(errors="replace").splitlines()[-40:])
    problem = f"timed out after {timeout_s:.0f}s" if returncode is None else f"exited {returncode}"
    raise FixtureGenerationError(
        f"{generator.name} {problem} (needs the versions of tests/requirements.txt; DeepSpeed runs "
        f"on the CPU with gloo). Full log: {failed_log}\n--- last lines ---\n{tail}"
    )
