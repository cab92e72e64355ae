"""Real servers on loopback for the remote-source tests (tests/remote) and benchmark
(tests/bench/bench_remote.py): nginx from Debian serving a folder with range support and an
access log of every request's body bytes, and moto's S3 server (SigV4 checked). Each is
started unprivileged on a free port with its own files and stopped by its owner."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

START_TIMEOUT_S = 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port: int, proc, what: str, log: Path = None) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            detail = log.read_text(errors="replace") if log and log.exists() else ""
            raise RuntimeError(f"{what} exited with {proc.returncode}: {detail[-2000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"{what} did not listen on port {port} within {START_TIMEOUT_S} s")


def _stop(proc) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def self_signed_certificate(workdir: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 signed by itself, made by the openssl tool: (cert, key).
    It is its own CA file: a client that trusts it reaches the server; others refuse."""
    cert, key = Path(workdir) / "cert.pem", Path(workdir) / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key


class Nginx:
    """nginx serving ROOT on 127.0.0.1:PORT, over TLS with a self-signed certificate when
    `tls` (its CA file is `ca_file`). One process (master_process off), so it runs as
    whoever starts it and reads whatever that user can. Its access log has one line per
    request: method, URI, status, body bytes sent; its agents log the User-Agent of each."""

    def __init__(self, root: Path, workdir: Path, tls: bool = False):
        self.nginx = shutil.which("nginx") or "/usr/sbin/nginx"
        if not Path(self.nginx).exists():
            raise RuntimeError("nginx is not installed (Debian package nginx; scripts/install-deps.sh)")
        self.root = Path(root)
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.access_log = self.workdir / "access.log"
        self.agents_log = self.workdir / "agents.log"
        self.error_log = self.workdir / "error.log"
        temp = {k: self.workdir / k for k in ("body", "proxy", "fastcgi", "uwsgi", "scgi")}
        for p in temp.values():
            p.mkdir(exist_ok=True)
        self.scheme = "https" if tls else "http"
        self.ca_file = None
        listen = f"127.0.0.1:{self.port}"
        if tls:
            cert, key = self_signed_certificate(self.workdir)
            self.ca_file = cert
            listen += f" ssl;\n    ssl_certificate {cert};\n    ssl_certificate_key {key}"
        conf = self.workdir / "nginx.conf"
        conf.write_text(f"""
daemon off;
master_process off;
pid {self.workdir}/nginx.pid;
error_log {self.error_log} warn;
events {{ worker_connections 1024; }}
http {{
  log_format bytes '$request_method $uri $status $body_bytes_sent';
  access_log {self.access_log} bytes;
  log_format agents '$http_user_agent';
  access_log {self.agents_log} agents;
  client_body_temp_path {temp['body']};
  proxy_temp_path {temp['proxy']};
  fastcgi_temp_path {temp['fastcgi']};
  uwsgi_temp_path {temp['uwsgi']};
  scgi_temp_path {temp['scgi']};
  sendfile on;
  keepalive_requests 100000;
  server {{
    listen {listen};
    root {self.root};
    default_type application/octet-stream;
  }}
}}
""")
        self.proc = subprocess.Popen(
            [self.nginx, "-p", str(self.workdir), "-c", str(conf), "-e", str(self.error_log)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        _wait_listening(self.port, self.proc, "nginx", self.error_log)

    def url(self, relative: str) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}/{relative}"

    def log_mark(self) -> int:
        return self.access_log.stat().st_size if self.access_log.exists() else 0

    def requests_since(self, mark: int) -> list:
        """[(method, uri, status, body bytes)] logged after MARK (nginx writes each line when
        the request ends)."""
        with open(self.access_log, "rb") as f:
            f.seek(mark)
            lines = f.read().decode().splitlines()
        out = []
        for line in lines:
            method, uri, status, sent = line.split(" ")
            out.append((method, uri, int(status), int(sent)))
        return out

    def agents_since(self, mark: int) -> list:
        """The User-Agent of each request logged after MARK (a log_mark of the agents log)."""
        with open(self.agents_log, "rb") as f:
            f.seek(mark)
            return f.read().decode().splitlines()

    def agents_mark(self) -> int:
        return self.agents_log.stat().st_size if self.agents_log.exists() else 0

    def bytes_since(self, mark: int, uri: str = None) -> int:
        return sum(b for (_, u, _, b) in self.requests_since(mark) if uri is None or u == uri)

    def stop(self) -> None:
        _stop(self.proc)


class MotoS3:
    """moto's S3 server (the stand-in most S3 client test suites use) on 127.0.0.1:PORT,
    checking every request's SigV4 signature against the IAM access keys it knows. Setup
    (IAM user, key, bucket) happens while authentication is still off: moto counts requests
    and turns it on after `setup_requests` of them (INITIAL_NO_AUTH_ACTION_COUNT)."""

    REGION = "us-east-1"

    def __init__(self, workdir: Path):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log = self.workdir / "moto.log"
        env = dict(os.environ)
        # IAM user, access key, policy, attach: 4 requests without authentication.
        env["INITIAL_NO_AUTH_ACTION_COUNT"] = "4"
        env.pop("AWS_ENDPOINT_URL", None)
        self._log_file = open(self.log, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdin=subprocess.DEVNULL, stdout=self._log_file, stderr=subprocess.STDOUT, env=env,
        )
        _wait_listening(self.port, self.proc, "moto.server", self.log)
        import boto3

        iam = boto3.client("iam", endpoint_url=self.endpoint, region_name=self.REGION,
                           aws_access_key_id="setup", aws_secret_access_key="setup")
        iam.create_user(UserName="ckptfs")
        key = iam.create_access_key(UserName="ckptfs")["AccessKey"]
        self.access_key, self.secret_key = key["AccessKeyId"], key["SecretAccessKey"]
        iam.put_user_policy(UserName="ckptfs", PolicyName="all", PolicyDocument=(
            '{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Action":"*","Resource":"*"}]}'))
        # The fourth request: authentication is on from the next one.
        iam.list_users()

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=self.REGION,
                            aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key)

    def env(self, **overrides) -> dict:
        """The environment a ckptfs process needs to reach this server."""
        env = dict(os.environ)
        for k in list(env):
            if k.startswith("AWS_"):
                del env[k]
        env.update(AWS_ENDPOINT_URL=self.endpoint, AWS_ACCESS_KEY_ID=self.access_key,
                   AWS_SECRET_ACCESS_KEY=self.secret_key, AWS_REGION=self.REGION,
                   AWS_SHARED_CREDENTIALS_FILE="/nonexistent", AWS_CONFIG_FILE="/nonexistent")
        env.update(overrides)
        return env

    def upload_folder(self, bucket: str, prefix: str, folder: Path) -> None:
        s3 = self.client()
        for path in sorted(Path(folder).rglob("*")):
            if path.is_file():
                s3.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(folder).as_posix()}")

    def stop(self) -> None:
        _stop(self.proc)
        self._log_file.close()
