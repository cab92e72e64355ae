"""A small fault-injecting HTTP proxy for the remote-source tests: it sits between ckptfs and
nginx, forwards each request (keeping the client's connection open, as nginx would) and, on
demand, damages answers the way networks and servers do: a body cut short, a Content-Range
that labels other bytes, a 500, a connection reset, a stall, or a server that is gone."""

import http.client
import socket
import socketserver
import threading
import time

# What can be done to one ranged GET answer.
FAULTS = ("truncate", "wrong_range", "error_500", "reset", "stall")


class FaultProxy:
    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.lock = threading.Lock()
        self.pending = []      # faults for the next ranged GETs, in order
        self.applied = []      # faults done so far
        self.always = None      # a fault for every ranged GET (concurrent reads included)
        self.stall_all = False  # hold every answer (until stall_s passes)
        self.down = False       # close every connection at once
        self.stall_s = 60.0
        self.ranged_gets = 0
        self.log = []  # (method, Range header, fault or None) of every request
        proxy = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                proxy._serve(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self.server = Server(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, relative: str) -> str:
        return f"http://127.0.0.1:{self.port}/{relative}"

    def inject(self, *faults) -> None:
        with self.lock:
            self.pending.extend(faults)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _next_fault(self):
        with self.lock:
            self.ranged_gets += 1
            if self.pending:
                fault = self.pending.pop(0)
                self.applied.append(fault)
                return fault
        return None

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(120)
        buffered = b""
        while True:
            if self.down:
                return
            while b"\r\n\r\n" not in buffered:
                try:
                    chunk = conn.recv(65536)
                except OSError:
                    return
                if not chunk:
                    return
                buffered += chunk
            head, buffered = buffered.split(b"\r\n\r\n", 1)
            if self.down:
                return
            lines = head.decode("latin-1").split("\r\n")
            method, target, _ = lines[0].split(" ", 2)
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip()] = value.strip()
            forwarded = {k: v for k, v in headers.items() if k.lower() in ("range", "if-match", "user-agent")}
            upstream = http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=60)
            upstream.request(method, target, headers=forwarded)
            resp = upstream.getresponse()
            body = resp.read() if method != "HEAD" else b""
            out_headers = [(k, v) for k, v in resp.getheaders() if k.lower() not in ("connection", "keep-alive")]
            upstream.close()
            fault = self._next_fault() if method == "GET" and "Range" in forwarded else None
            if fault is None and method == "GET" and self.always:
                fault = self.always
            if self.stall_all:
                fault = "stall"
            with self.lock:
                self.log.append((method, forwarded.get("Range"), fault))
            if fault == "reset":
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                conn.close()
                return
            if fault == "stall":
                time.sleep(self.stall_s)
                return
            status, reason = resp.status, resp.reason
            if fault == "error_500":
                status, reason, body = 500, "Internal Server Error", b"oops"
                out_headers = [("Content-Type", "text/plain")]
            if fault == "wrong_range":
                out_headers = [(k, self._shift(v) if k.lower() == "content-range" else v) for k, v in out_headers]
            if method != "HEAD":  # a HEAD answer keeps the object's length
                out_headers = [(k, v) for k, v in out_headers if k.lower() != "content-length"]
                out_headers.append(("Content-Length", str(len(body))))
            if fault == "truncate":
                body = body[: len(body) // 2]
            data = f"HTTP/1.1 {status} {reason}\r\n".encode()
            data += b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in out_headers) + b"\r\n" + body
            try:
                conn.sendall(data)
            except OSError:
                return
            if fault == "truncate":
                conn.close()
                return

    @staticmethod
    def _shift(content_range: str) -> str:
        """'bytes A-B/T' -> 'bytes A+1-B+1/T': a label for other bytes of the same object."""
        unit, _, rest = content_range.partition(" ")
        span, _, total = rest.partition("/")
        first, _, last = span.partition("-")
        return f"{unit} {int(first) + 1}-{int(last) + 1}/{total}"
