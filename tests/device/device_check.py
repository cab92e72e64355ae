#!/usr/bin/env python3
"""The GPU check of scripts/device-check.sh: every step that proves ckptfs's device path on a
lent GPU machine, in one run that ends in a few minutes, writing its summary whatever fails.

    python tests/device/device_check.py --pack DIR --out DIR [--dry-run] [--budget-s S]

Steps, each with its share of the time budget (a step that runs out is stopped and reported):
  environment  the machine: nvidia-smi, driver and CUDA versions, torch, glibc, and what the
               image holds for building ckptfs itself
  ckptfs       the packed build (scripts/device-pack.sh) if it starts here, else a build made
               here when the image has what it needs; then whether the cuda and cufile back
               ends open, as `ckptfs load` reports them (cuFile/GDS usable or not, and why)
  suite        tests/device with this machine's torch (CKPTFS_REQUIRE_GPU=1: a GPU test fails
               rather than skips where there is no GPU)
  verify       `ckptfs load --verify` of every source kind (device_sources.KINDS) with every
               --dtype, on each back end that opens: each tensor's device bytes read back and
               compared with the View's bytes, computed on the CPU
  bench        tests/bench/bench_device_load.py, fp32 as stored and fp32 -> bf16, on a 4 GiB
               checkpoint from the page cache (64 MiB in a dry run)
With --dry-run (CI) the same steps run on the host back end: the GPU is neither needed nor
looked for, so the check cannot rot between the GPU draws.

The out folder receives summary.json (every step's outcome and the figures), device-check.log
(everything the steps printed), device-suite.xml (the suite's JUnit report) and bench-*.json."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

SUITE_DIR = Path(__file__).resolve().parent
REPO = SUITE_DIR.parents[1]
sys.path.insert(0, str(SUITE_DIR))


class Check:
    """The run's log, summary and clock."""

    def __init__(self, out: Path, budget_s: float, dry_run: bool):
        self.out = out
        self.deadline = time.monotonic() + budget_s
        self.started = time.time()
        self.log = open(out / "device-check.log", "w", buffering=1)
        self.summary = {"mode": "dry-run" if dry_run else "gpu", "started": time.strftime(
            "%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "budget_s": budget_s, "steps": {}, "ok": False}

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, argv, timeout: float, env=None, cwd=None, check=False) -> subprocess.CompletedProcess:
        """ARGV's output (stdout and stderr together) into the log; never past the budget."""
        timeout = max(1.0, min(timeout, self.left()))
        self.say(f"$ {' '.join(map(str, argv))}")
        try:
            result = subprocess.run(list(map(str, argv)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, errors="replace", timeout=timeout, env=env, cwd=cwd)
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            result = subprocess.CompletedProcess(argv, 124, f"{out}\n[stopped after {timeout:.0f} s]")
        except OSError as e:
            result = subprocess.CompletedProcess(argv, 127, str(e))
        self.log.write(result.stdout if result.stdout.endswith("\n") else result.stdout + "\n")
        if check and result.returncode != 0:
            raise StepFailed(f"{Path(str(argv[0])).name} exited {result.returncode}: {last_line(result.stdout)}")
        return result

    def write_summary(self) -> None:
        self.summary["seconds"] = round(time.time() - self.started, 1)
        (self.out / "summary.json").write_text(json.dumps(self.summary, indent=1, default=str))


class StepFailed(Exception):
    pass


def last_line(text: str) -> str:
    lines = [line for line in (text or "").strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def last_json(text: str) -> dict:
    """The last line of TEXT that is a JSON object (stderr's notes may follow it)."""
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise StepFailed(f"no JSON in the output: {last_line(text)}")


def step(check: Check, name: str, fn, *args):
    """Runs FN(*ARGS) -> details dict; records ok/seconds/details or the failure."""
    check.say(f"\n=== {name} ({check.left():.0f} s of the budget left)")
    t0 = time.monotonic()
    record = {"ok": False}
    try:
        if check.left() < 5:
            raise StepFailed("no time left in the budget")
        record["details"] = fn(check, *args)
        record["ok"] = True
    except StepFailed as e:
        record["error"] = str(e)
    except Exception as e:  # noqa: BLE001  (one step's bug must not lose the other steps' results)
        record["error"] = f"{type(e).__name__}: {e}"
    record["seconds"] = round(time.monotonic() - t0, 1)
    check.summary["steps"][name] = record
    check.say(f"=== {name}: {'ok' if record['ok'] else 'FAILED: ' + record.get('error', '')} "
              f"({record['seconds']} s)")
    check.write_summary()
    return record


# --- environment -----------------------------------------------------------------------------


def environment(check: Check, dry_run: bool) -> dict:
    import torch

    info = {
        "host": platform.node(), "kernel": platform.release(), "machine": platform.machine(),
        "cpus": os.cpu_count(), "glibc": "-".join(platform.libc_ver()), "python": sys.version.split()[0],
        "python_executable": sys.executable, "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "torch_sees_gpu": torch.cuda.is_available(),
    }
    try:
        info["os"] = next((line.split("=", 1)[1].strip('"') for line in Path("/etc/os-release").read_text().splitlines()
                           if line.startswith("PRETTY_NAME=")), "")
    except OSError:
        info["os"] = "unknown"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                       "multiprocessors": props.multi_processor_count,
                       "capability": f"{props.major}.{props.minor}"}
    if shutil.which("nvidia-smi"):
        check.run(["nvidia-smi"], 60)
        q = check.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,pcie.link.gen.max,"
                       "pcie.link.width.max", "--format=csv,noheader"], 60)
        info["nvidia_smi"] = q.stdout.strip()
        v = check.run(["nvidia-smi", "-q", "-d", "COMPUTE"], 30)
        info["nvidia_smi_cuda"] = next((line.split(":", 1)[1].strip() for line in v.stdout.splitlines()
                                        if "CUDA Version" in line), None)
    else:
        info["nvidia_smi"] = "not found"
        if not dry_run:
            check.say("nvidia-smi: not found")
    # What the image holds to build ckptfs here (the fallback when the packed build cannot run).
    tools = {}
    for tool in ("cmake", "ninja", "g++", "pkg-config", "nvcc", "patchelf"):
        tools[tool] = shutil.which(tool) is not None
    if tools["pkg-config"]:
        for module in ("fuse3", "libcurl", "libxxhash"):
            tools[f"pkg-config {module}"] = subprocess.run(["pkg-config", "--exists", module]).returncode == 0
    tools["nlohmann/json.hpp"] = any(Path(p, "nlohmann/json.hpp").is_file()
                                     for p in ("/usr/include", "/usr/local/include"))
    info["build_tools"] = tools
    for key, value in info.items():
        check.say(f"{key}: {value}")
    if not dry_run and not info["torch_sees_gpu"]:
        raise StepFailed("torch.cuda.is_available() is False on the GPU machine (driver, or a CPU-only torch)")
    return info


# --- ckptfs: the build and its back ends -----------------------------------------------------


def packed_build_runs(check: Check, pack: Path) -> str | None:
    """None if the packed build starts here, else why not."""
    if not (pack / "ckptfs").is_file():
        return f"no packed build at {pack} (scripts/device-pack.sh makes it)"
    for binary in (pack / "ckptfs", pack / "libckptfs.so"):
        ldd = check.run(["ldd", binary], 30)
        missing = [line.strip() for line in ldd.stdout.splitlines() if "not found" in line]
        if missing:
            return f"{binary.name} lacks {', '.join(missing)}"
    version = check.run([pack / "ckptfs", "--version"], 30)
    if version.returncode != 0:
        return f"ckptfs --version exited {version.returncode}: {last_line(version.stdout)}"
    return None


def build_here(check: Check) -> Path:
    """ckptfs built on this machine into a temporary folder laid out like a pack (no bundled
    libraries: the machine's own are used). With the unit tests' dependencies the fake CUDA
    runtime of test_finding_cuda.py is built too; without them that test fails, saying so."""
    build = Path(tempfile.mkdtemp(prefix="ckptfs-device-build-"))
    configure = ["cmake", "-S", REPO, "-B", build, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=RelWithDebInfo",
                 "-DCKPTFS_CCACHE=OFF"]
    targets = ["ckptfs", "ckptfs_shared", "fake_cudart"]
    if check.run(configure, 120).returncode != 0:
        shutil.rmtree(build)
        build.mkdir()
        check.run(configure + ["-DCKPTFS_BUILD_TESTS=OFF"], 120, check=True)
        targets = targets[:2]
    check.run(["cmake", "--build", build, "--target", *targets], 300, check=True)
    return build


def probe_backend(check: Check, binary: Path, backend: str, source: Path) -> dict:
    result = check.run([binary, "load", "--backend", backend, "--json", source], 60)
    if result.returncode == 0:
        stats = last_json(result.stdout)
        return {"opens": True, "backend": stats["backend"], "device": stats["device"]}
    return {"opens": False, "error": last_line(result.stdout)}


def choose_ckptfs(check: Check, pack: Path, dry_run: bool, state: dict) -> dict:
    if not (pack / "fixtures").is_dir():
        raise StepFailed(f"no pack at {pack}: run scripts/device-pack.sh where the tests run and name device-pack "
                         "in the device call's carry (README, Checking on a GPU machine)")
    why_not = packed_build_runs(check, pack)
    details = {}
    if why_not is None:
        details["build"] = "packed"
        details["pack"] = json.loads((pack / "pack.json").read_text())
        state["build"] = pack
    elif dry_run:
        raise StepFailed(f"the packed build does not run: {why_not}")
    else:
        check.say(f"the packed build does not run here ({why_not}); building here")
        details["build"] = "built here"
        details["packed_build_refused"] = why_not
        state["build"] = build_here(check)
    binary = state["build"] / "ckptfs"
    details["version"] = check.run([binary, "--version"], 30, check=True).stdout.strip()
    # Which back ends open, on a file of one tensor: what `ckptfs load` says is the answer
    # (the runtime it found, the driver, cuFile's mode), or its one-line refusal.
    import torch
    from safetensors.torch import save_file

    probe = state["work"] / "probe.safetensors"
    save_file({"x": torch.arange(1 << 20, dtype=torch.float32)}, probe)
    details["backends"] = {b: probe_backend(check, binary, b, probe) for b in ("cuda", "cufile", "auto")}
    for name, result in details["backends"].items():
        check.say(f"backend {name}: {result.get('device') or result.get('error')}")
    state["backends"] = ["host"] if dry_run else [b for b in ("cuda", "cufile") if details["backends"][b]["opens"]]
    if not dry_run and not details["backends"]["cuda"]["opens"]:
        raise StepFailed(f"the cuda back end does not open: {details['backends']['cuda']['error']}")
    return details


# --- the device suite ------------------------------------------------------------------------


def suite_env(state: dict, dry_run: bool) -> dict:
    env = dict(os.environ)
    build = state["build"]
    env.update(CKPTFS_BIN=str(build / "ckptfs"), CKPTFS_BUILD_DIR=str(build), CKPTFS_LIB=str(build / "libckptfs.so"),
               PYTHONUNBUFFERED="1")
    env["CKPTFS_DEVICE_FIXTURES"] = str(state["pack"] / "fixtures")
    if not dry_run:
        env["CKPTFS_REQUIRE_GPU"] = "1"
    if state.get("site"):
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(state["site"]), env.get("PYTHONPATH")]))
    return env


def device_suite(check: Check, state: dict, dry_run: bool) -> dict:
    report = check.out / "device-suite.xml"
    result = check.run([sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider",
                        f"--junitxml={report}", SUITE_DIR], 240, env=suite_env(state, dry_run), cwd=REPO)
    print(result.stdout[-4000:], flush=True)
    if not report.is_file():
        raise StepFailed(f"pytest wrote no report (exit {result.returncode}): {last_line(result.stdout)}")
    suite = ET.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    skipped = {}
    for case in suite.iter("testcase"):
        skip = case.find("skipped")
        if skip is not None:
            reason = skip.get("message", "")
            skipped[reason] = skipped.get(reason, 0) + 1
    details = {**counts, "skip_reasons": skipped, "exit": result.returncode}
    if result.returncode != 0:
        raise StepFailed(f"{counts['failures']} failed, {counts['errors']} errors of {counts['tests']}: "
                         f"{last_line(result.stdout)}")
    if not dry_run and any(reason.startswith("no GPU") for reason in skipped):
        raise StepFailed(f"GPU tests skipped on the GPU machine: {skipped}")
    return details


# --- ckptfs load --verify of every kind and dtype --------------------------------------------


def verify_loads(check: Check, state: dict, dry_run: bool) -> dict:
    from device_sources import DTYPES, KINDS, make_sources

    # make_sources (in this process) takes the framework saves from the pack, as the suite does.
    os.environ["CKPTFS_DEVICE_FIXTURES"] = str(state["pack"] / "fixtures")
    root = state["work"] / "sources"
    root.mkdir()
    sources = make_sources(root)
    if not state.get("backends"):
        raise StepFailed("no back end opens (the ckptfs step says why)")
    binary = state["build"] / "ckptfs"
    results, failed = [], []
    for backend in state["backends"]:
        for kind in KINDS:
            for dtype in DTYPES:
                argv = [binary, "load", "--backend", backend, "--verify", "--json", sources[kind][0]]
                if dtype:
                    argv[2:2] = ["--dtype", dtype]
                r = check.run(argv, 60)
                row = {"backend": backend, "kind": kind, "dtype": dtype or "as stored"}
                if r.returncode == 0:
                    stats = last_json(r.stdout)
                    row.update(ok=stats["verified"] is True, tensors=stats["tensors"], bytes=stats["bytes"],
                               direct_bytes=stats["direct_bytes"], view_bytes=stats["view_bytes"])
                else:
                    row.update(ok=False, error=last_line(r.stdout))
                results.append(row)
                if not row["ok"]:
                    failed.append(f"{backend} {kind} {row['dtype']}: {row.get('error', 'not verified')}")
    check.say(f"{len(results) - len(failed)} of {len(results)} loads verified")
    if failed:
        raise StepFailed("; ".join(failed[:5]) + (f" (and {len(failed) - 5} more)" if len(failed) > 5 else ""))
    return {"loads": len(results), "backends": state["backends"], "kinds": list(KINDS),
            "dtypes": [d or "as stored" for d in DTYPES]}


# --- the benchmark ---------------------------------------------------------------------------


def install_peers(check: Check, state: dict, dry_run: bool) -> None:
    """fastsafetensors from the pack's wheels unless this Python has it."""
    if subprocess.run([sys.executable, "-c", "import fastsafetensors"], capture_output=True).returncode == 0:
        return
    wheels = sorted((state["pack"] / "wheels" / ("host" if dry_run else "device")).glob("*.whl"))
    if not wheels:
        check.say("fastsafetensors: not installed and no wheel packed")
        return
    site = state["work"] / "site"
    r = check.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                   "--disable-pip-version-check", "--target", site, *wheels], 120)
    if r.returncode == 0:
        state["site"] = site


def bench(check: Check, state: dict, dry_run: bool, size_mb: int) -> dict:
    install_peers(check, state, dry_run)
    env = suite_env(state, dry_run)
    keep = state["work"] / "bench"
    runs = "1" if dry_run else "3"
    figures = {}
    for dtype in (None, "bf16"):
        name = f"bench-{dtype or 'fp32'}.json"
        argv = [sys.executable, REPO / "tests" / "bench" / "bench_device_load.py", "--size-mb", size_mb,
                "--runs", runs, "--keep", keep, "--json", check.out / name]
        if dtype:
            argv += ["--dtype", dtype]
        r = check.run(argv, 300, env=env, cwd=REPO)
        print(r.stdout[-3000:], flush=True)
        if r.returncode != 0:
            raise StepFailed(f"bench_device_load.py {'--dtype ' + dtype if dtype else ''} exited {r.returncode}: "
                             f"{last_line(r.stdout)}")
        figures[dtype or "as stored"] = json.loads((check.out / name).read_text())
    shutil.rmtree(keep, ignore_errors=True)
    summary = {}
    for dtype, fig in figures.items():
        summary[dtype] = {"rows": {row["name"]: round(row["gb_per_s"], 2) for row in fig["rows"]},
                          "ratios": {k: round(v, 2) for k, v in fig["ratios"].items()}, "notes": fig["notes"]}
    bf16 = figures.get("bf16", {}).get("ratios", {}).get("vs_safetensors")
    if bf16 is not None:
        summary["bf16_vs_load_then_convert"] = round(bf16, 2)
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pack", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dry-run", action="store_true", help="the host back end, no GPU (CI)")
    ap.add_argument("--budget-s", type=float, default=420)
    ap.add_argument("--bench-size-mb", type=int, default=None, help="default 4096, 64 in a dry run")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    size_mb = args.bench_size_mb or (64 if args.dry_run else 4096)
    check = Check(args.out, args.budget_s, args.dry_run)
    # `ckptfs load` finds the CUDA runtime of NVIDIA's wheels in the active environment, as a
    # user's shell has it; this Python may have been run without activating its own.
    if sys.prefix != sys.base_prefix:
        os.environ.setdefault("VIRTUAL_ENV", sys.prefix)
    with tempfile.TemporaryDirectory(prefix="ckptfs-device-check-") as work:
        state = {"pack": args.pack.resolve(), "work": Path(work)}
        env = step(check, "environment", environment, args.dry_run)
        check.summary["machine"] = (env.get("details", {}).get("gpu", {}).get("name")
                                    or ("no GPU (dry run)" if args.dry_run else "no GPU found"))
        step(check, "ckptfs", choose_ckptfs, args.pack.resolve(), args.dry_run, state)
        if "build" in state:  # a back end that does not open still leaves the suite to say more
            step(check, "suite", device_suite, state, args.dry_run)
            step(check, "verify", verify_loads, state, args.dry_run)
            step(check, "bench", bench, state, args.dry_run, size_mb)
    steps = check.summary["steps"]
    check.summary["ok"] = all(s["ok"] for s in steps.values()) and len(steps) == 5
    check.write_summary()
    check.say(f"\ndevice-check: {check.summary['mode']} on {check.summary['machine']}: "
              f"{'passed' if check.summary['ok'] else 'FAILED'} in {check.summary['seconds']} s; "
              + ", ".join(f"{name} {'ok' if s['ok'] else 'failed'}" for name, s in steps.items())
              + f"; summary in {args.out / 'summary.json'}")
    return 0 if check.summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
