"""Remote sources, side by side with what a user would do instead, in one run:

  ls     time to the first `ckptfs ls` of a remote 1 GiB torch.save .pt (nginx on loopback)
         and of a DeepSpeed ZeRO folder in an S3 bucket (moto's server on loopback), and the
         bytes fetched for it (nginx's access log / ckptfs info's counters), against the
         size of the source (what downloading it first would fetch);
  read   sequential read of the mounted model.safetensors vs `curl -o /dev/null` of the
         same .pt from the same server (goal: >= 0.8x curl's throughput), and vs the same file
         mounted from local disk (what FUSE allows on the machine), taking turns in each
         repeat; with the CPU seconds each side spent (curl or the ckptfs daemon, nginx, and
         the reading process), which a loaded machine changes much less than wall time;
  https  the same read over TLS (nginx with a self-signed certificate) vs `curl --cacert`
         (information: both sides then pay for the cipher);
  cache  a second mount with -o cache_dir: bytes the server sends for a full read (goal: 0).

Run as a script: `python tests/bench/bench_remote.py [--size-mib 1024] [--repeats 3]
[--baseline-bin OLD_CKPTFS]`
(build/ckptfs or CKPTFS_BIN; nginx from scripts/install-deps.sh, moto from the test venv)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import benchlib

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))
from remote_servers import MotoS3, Nginx  # noqa: E402

MiB = 1 << 20


def ckptfs_bin() -> Path:
    return Path(os.environ.get("CKPTFS_BIN", TESTS.parent / "build" / "ckptfs")).resolve()


def timed(argv, env=None, timeout=600) -> tuple[float, str]:
    t0 = time.perf_counter()
    res = subprocess.run([str(a) for a in argv], capture_output=True, text=True, env=env, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"{argv}: exit {res.returncode}: {res.stderr.strip()}")
    return time.perf_counter() - t0, res.stdout


def mount(binary, source, mnt: Path, *options, env=None):
    mnt.mkdir(parents=True, exist_ok=True)
    argv = [binary, source, mnt] + (["-o", ",".join(options)] if options else [])
    timed(argv, env=env, timeout=120)


def read_file(path: Path) -> float:
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(4 * MiB):
            pass
    return time.perf_counter() - t0


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process PID so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def children_cpu_seconds() -> float:
    t = os.times()
    return t.children_user + t.children_system


def mounted_read(binary, source, mnt: Path, server_pid: int, env=None) -> tuple[float, dict]:
    """Mounts SOURCE, reads model.safetensors once; (seconds, CPU seconds of the daemon,
    the server and this reading process during the read)."""
    mount(binary, source, mnt, env=env)
    try:
        daemon = benchlib.daemon_pids(mnt)[0]
        d0, s0, r0 = cpu_seconds(daemon), cpu_seconds(server_pid), own_cpu_seconds()
        secs = read_file(mnt / "model.safetensors")
        cpu = {"daemon": cpu_seconds(daemon) - d0, "server": cpu_seconds(server_pid) - s0,
               "reader": own_cpu_seconds() - r0}
    finally:
        benchlib.unmount(mnt)
    return secs, cpu


def median_cpu(samples: list[dict]) -> dict:
    return {k: round(statistics.median(s[k] for s in samples), 3) for k in samples[0]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "ckptfs-bench-remote")
    ap.add_argument("--baseline-bin", type=Path, default=None,
                    help="another ckptfs binary (an older build) whose remote read takes its turn in "
                         "every repeat too: a before/after pair measured under the same load")
    args = ap.parse_args()
    binary = ckptfs_bin()
    work = args.workdir
    shutil.rmtree(work, ignore_errors=True)
    (work / "www").mkdir(parents=True)
    import torch

    pt = work / "www" / "big.pt"
    g = torch.Generator().manual_seed(0)
    n = max(1, args.size_mib // 64)
    torch.save({f"layer{i}.weight": torch.randn(16 * MiB, generator=g) for i in range(n)}, pt)
    size = pt.stat().st_size
    nginx = Nginx(work / "www", work / "nginx")
    nginx_tls = Nginx(work / "www", work / "nginx-tls", tls=True)
    s3 = None
    results = {}
    try:
        url = nginx.url("big.pt")
        # --- ls ---------------------------------------------------------------------------
        mark = nginx.log_mark()
        secs, _ = timed([binary, "ls", url])
        fetched = nginx.bytes_since(mark)
        results["ls_pt"] = {"seconds": round(secs, 3), "bytes_fetched": fetched, "source_bytes": size,
                            "fraction": fetched / size, "requests": len(nginx.requests_since(mark))}
        print(f"ls of a remote {size / MiB:.0f} MiB .pt: {secs:.3f} s, fetched {fetched} bytes "
              f"({100 * fetched / size:.2f}% of the file) in {results['ls_pt']['requests']} requests")

        zero_root = None
        try:
            from ckptfs_fixture_cache import ZERO_CHECKPOINTS, cached_fixtures

            zero_root = cached_fixtures(ZERO_CHECKPOINTS) / "w12-s3-bf16-sg8" / "checkpoint"
        except Exception as error:  # the fixture generator needs DeepSpeed
            print(f"ZeRO folder: skipped ({error})")
        if zero_root is not None:
            s3 = MotoS3(work / "moto")
            s3.client().create_bucket(Bucket="bench")
            s3.upload_folder("bench", "zero", zero_root)
            zero_bytes = sum(p.stat().st_size for p in zero_root.rglob("*") if p.is_file())
            secs, out = timed([binary, "info", "--json", "s3://bench/zero"], env=s3.env())
            counted = json.loads(out)["fetched"]
            results["ls_zero_s3"] = {"seconds": round(secs, 3), "bytes_fetched": counted["bytes"],
                                     "requests": counted["requests"], "source_bytes": zero_bytes}
            print(f"info of a ZeRO folder in S3 ({zero_bytes} bytes, 12 ranks): {secs:.3f} s, fetched "
                  f"{counted['bytes']} bytes in {counted['requests']} requests")

        # --- sequential read vs curl -------------------------------------------------------
        mnt = work / "mnt"
        load_before = os.getloadavg()
        curl_s, mount_s, local_s = [], [], []
        curl_cpu, mount_cpu, local_cpu = [], [], []
        baseline_s, baseline_cpu = [], []
        def remote_read():
            secs, cpu = mounted_read(binary, url, mnt, nginx.proc.pid)
            mount_s.append(secs)
            mount_cpu.append(cpu)

        def baseline_read():
            secs, cpu = mounted_read(args.baseline_bin.resolve(), url, mnt, nginx.proc.pid)
            baseline_s.append(secs)
            baseline_cpu.append(cpu)

        for repeat in range(args.repeats):
            s0, c0 = cpu_seconds(nginx.proc.pid), children_cpu_seconds()
            secs, _ = timed(["curl", "-sf", "-o", "/dev/null", url])
            curl_s.append(secs)
            curl_cpu.append({"curl": children_cpu_seconds() - c0, "server": cpu_seconds(nginx.proc.pid) - s0})
            # The two binaries swap places every repeat: a daemon's first touches of fresh
            # memory cost more or less depending on what ran just before it.
            order = [remote_read] + ([baseline_read] if args.baseline_bin else [])
            for read in order if repeat % 2 == 0 else reversed(order):
                read()
            # The same file mounted from the local disk (in the page cache, as nginx serves
            # it): what FUSE itself allows on this machine.
            secs, cpu = mounted_read(binary, pt, mnt, nginx.proc.pid)
            local_s.append(secs)
            local_cpu.append(cpu)
        served = size  # model.safetensors holds the same tensor bytes (plus a header)
        curl_rate = served / statistics.median(curl_s) / MiB
        mount_rate = served / statistics.median(mount_s) / MiB
        local_rate = served / statistics.median(local_s) / MiB
        cpu = {"curl": median_cpu(curl_cpu), "mount": median_cpu(mount_cpu), "local_mount": median_cpu(local_cpu)}
        if baseline_s:
            cpu["baseline_mount"] = median_cpu(baseline_cpu)
            baseline_rate = served / statistics.median(baseline_s) / MiB
            results["read_baseline"] = {"binary": str(args.baseline_bin), "mount_mib_s": round(baseline_rate, 1),
                                        "ratio": round(baseline_rate / curl_rate, 3), "samples_s": baseline_s}
        results["read"] = {"curl_mib_s": round(curl_rate, 1), "mount_mib_s": round(mount_rate, 1),
                           "local_mount_mib_s": round(local_rate, 1),
                           "ratio": round(mount_rate / curl_rate, 3), "goal": 0.8,
                           "ratio_to_local_mount": round(mount_rate / local_rate, 3),
                           "cpu_seconds_median": cpu,
                           "cpu_seconds_samples": {"curl": curl_cpu, "mount": mount_cpu, "local_mount": local_cpu,
                                                   **({"baseline_mount": baseline_cpu} if baseline_s else {})},
                           "load_before": [round(x, 2) for x in load_before],
                           "load_after": [round(x, 2) for x in os.getloadavg()],
                           "curl_samples_s": curl_s, "mount_samples_s": mount_s, "local_samples_s": local_s}
        print(f"sequential read: mount {mount_rate:.0f} MiB/s vs curl {curl_rate:.0f} MiB/s "
              f"= {mount_rate / curl_rate:.2f}x (goal >= 0.8x; median of {args.repeats}); the same file "
              f"mounted from local disk: {local_rate:.0f} MiB/s (remote = {mount_rate / local_rate:.2f}x local)")
        if baseline_s:
            print(f"  baseline binary {args.baseline_bin}: mount {baseline_rate:.0f} MiB/s = "
                  f"{baseline_rate / curl_rate:.2f}x curl (same repeats)")
        print("  CPU seconds (median): " + "; ".join(
            f"{side}: " + ", ".join(f"{k} {v:.2f}" for k, v in c.items()) + f" (total {sum(c.values()):.2f})"
            for side, c in cpu.items()) + f"; load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after")

        # --- the same over https ---------------------------------------------------------------
        tls_url = nginx_tls.url("big.pt")
        tls_env = dict(os.environ, CURL_CA_BUNDLE=str(nginx_tls.ca_file))
        curl_tls_s, mount_tls_s = [], []
        for _ in range(args.repeats):
            secs, _ = timed(["curl", "-sf", "--cacert", nginx_tls.ca_file, "-o", "/dev/null", tls_url])
            curl_tls_s.append(secs)
            secs, _ = mounted_read(binary, tls_url, mnt, nginx_tls.proc.pid, env=tls_env)
            mount_tls_s.append(secs)
        curl_tls = served / statistics.median(curl_tls_s) / MiB
        mount_tls = served / statistics.median(mount_tls_s) / MiB
        results["read_https"] = {"curl_mib_s": round(curl_tls, 1), "mount_mib_s": round(mount_tls, 1),
                                 "ratio": round(mount_tls / curl_tls, 3),
                                 "curl_samples_s": curl_tls_s, "mount_samples_s": mount_tls_s}
        print(f"sequential read over https: mount {mount_tls:.0f} MiB/s vs curl {curl_tls:.0f} MiB/s "
              f"= {mount_tls / curl_tls:.2f}x (median of {args.repeats})")

        # --- disk cache ----------------------------------------------------------------------
        cache = work / "cache"
        mount(binary, url, mnt, f"cache_dir={cache}")
        try:
            read_file(mnt / "model.safetensors")
        finally:
            benchlib.unmount(mnt)
        mark = nginx.log_mark()
        mount(binary, url, mnt, f"cache_dir={cache}")
        try:
            secs = read_file(mnt / "model.safetensors")
        finally:
            benchlib.unmount(mnt)
        second = nginx.bytes_since(mark)
        results["disk_cache"] = {"bytes_fetched_second_mount": second, "read_seconds": round(secs, 3), "goal": 0}
        print(f"second mount with the disk cache: the server sent {second} bytes "
              f"({len(nginx.requests_since(mark))} requests, HEAD only); full read {secs:.2f} s")
    finally:
        nginx.stop()
        nginx_tls.stop()
        if s3:
            s3.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"bench": "remote", "machine": f"{os.cpu_count()} cpus, load {' '.join(f'{x:.2f}' for x in os.getloadavg())}", **results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
