#!/usr/bin/env python3
"""Several test "hosts" on one machine: network namespaces on a private bridge.

Each host is a network namespace with one interface, ``eth0``, plugged into a
bridge (``br0``, ``mcast_snooping 0``) that lives in a namespace of its own, so
the machine's own network is never touched and nothing in the testbed can reach
anything outside it (no default route, no link to the root namespace).  Host
``hN`` gets the address ``10.99.0.(10+N)/24`` and a ``224.0.0.0/4`` route on
``eth0``, so zeroconf's default interface choice sends mDNS there.  Each host's
egress is shaped by ``tbf`` (100 mbit by default; ``rate=None`` leaves the link
unshaped).  Because every testbed has its own bridge namespace, parallel
testbeds may use the same subnet without seeing each other; the namespace names
carry a per-run prefix, ``etp-<pid>-<n>``.

Library use::

    from tools.netns import Testbed, require_root_and_netns

    reason = require_root_and_netns()          # None when it can work here
    with Testbed(hosts=3, rate="100mbit") as tb:
        h1, h2, h3 = tb.hosts
        proc = h1.popen([sys.executable, "-m", "edgetp", "serve", ...])
        print(h2.run(["ip", "-brief", "addr"]).stdout, h1.address)
    # every namespace is gone here, and every process started by popen ended

Cleanup runs in ``__exit__``, at interpreter exit (atexit) and on SIGTERM /
SIGHUP (when nothing else handles them).  After a SIGKILL, ``down --stale``
(testbeds whose creating process is dead) or ``down --all`` (every ``etp-*``
namespace) removes what is left; both are idempotent.

Command line::

    python tools/netns.py check                      # can testbeds work here?
    python tools/netns.py up [--hosts 3] [--rate 100mbit|none] [--prefix etp-cli]
    python tools/netns.py run [--prefix etp-cli] h1 -- CMD...
    python tools/netns.py list
    python tools/netns.py down [--prefix etp-cli | --stale | --all]

Needs root and iproute2 (Debian package ``iproute2``: ``ip`` and ``tc``).
"""

from __future__ import annotations

import argparse
import atexit
import functools
import itertools
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

PREFIX_ROOT = "etp-"
SUBNET = "10.99.0"           # hosts are SUBNET.(10+i)/24
HOST_IFACE = "eth0"
BRIDGE = "br0"
IP_TIMEOUT = 10.0            # seconds for any single ip/tc command
DEFAULT_RATE = "100mbit"
DEFAULT_BURST = "32kbit"
DEFAULT_LATENCY = "400ms"

_seq = itertools.count(1)
_live: "set[Testbed]" = set()
_live_lock = threading.RLock()   # re-entrant: the signal handler may run inside a locked section
_handlers_installed = False


class NetnsError(RuntimeError):
    """An ip/tc command failed or timed out."""


def _cmd(argv: Sequence[str], *, timeout: float = IP_TIMEOUT, check: bool = True) -> subprocess.CompletedProcess:
    try:
        res = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise NetnsError(f"timed out after {timeout}s: {' '.join(argv)}") from exc
    except FileNotFoundError as exc:
        raise NetnsError(f"not found: {argv[0]} (install Debian's iproute2)") from exc
    if check and res.returncode != 0:
        raise NetnsError(f"{' '.join(argv)} failed ({res.returncode}): {res.stderr.strip()}")
    return res


def list_namespaces() -> list[str]:
    """Names of all named network namespaces (``ip netns list``)."""
    res = _cmd(["ip", "-json", "netns", "list"], check=False)
    if res.returncode != 0 or not res.stdout.strip():
        return []
    return [entry["name"] for entry in json.loads(res.stdout)]


def _namespace_pids(ns: str) -> list[int]:
    res = _cmd(["ip", "netns", "pids", ns], check=False)
    return [int(tok) for tok in res.stdout.split() if tok.isdigit()]


def _kill_pids(pids: Sequence[int], grace: float = 2.0) -> None:
    """SIGTERM, wait up to ``grace`` seconds, then SIGKILL (processes inside our own namespaces only)."""
    pids = [p for p in pids if p != os.getpid()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if _alive(p)]
        if pids:
            time.sleep(0.05)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:   # reap it if it is our child; a zombie counts as gone
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def delete_namespaces(names: Sequence[str]) -> list[str]:
    """Kill what runs inside, then delete each namespace; idempotent.  Returns what it deleted."""
    existing = set(list_namespaces())
    names = [n for n in names if n in existing]
    pids: list[int] = []
    for ns in names:
        pids.extend(_namespace_pids(ns))
    if pids:
        _kill_pids(sorted(set(pids)))
    deleted = []
    # hosts before bridges: deleting a host removes its veth pair from the bridge as well
    for ns in sorted(names, key=lambda n: n.endswith("-br")):
        res = _cmd(["ip", "netns", "delete", ns], check=False)
        if res.returncode == 0:
            deleted.append(ns)
    return deleted


def testbed_prefixes() -> dict[str, list[str]]:
    """Existing testbeds: prefix -> its namespace names."""
    out: dict[str, list[str]] = {}
    for ns in list_namespaces():
        m = re.fullmatch(r"(etp-.+)-(h\d+|br)", ns)
        if m:
            out.setdefault(m.group(1), []).append(ns)
    return out


def down(prefix: str | None = None, *, all: bool = False, stale: bool = False) -> list[str]:
    """Remove one testbed (``prefix``), all ``etp-*`` namespaces, or those of dead processes."""
    if all:
        return delete_namespaces([ns for ns in list_namespaces() if ns.startswith(PREFIX_ROOT)])
    if stale:
        victims = []
        for pfx, names in testbed_prefixes().items():
            m = re.fullmatch(r"etp-(\d+)-\d+", pfx)
            if m and not _pid_exists(int(m.group(1))):
                victims.extend(names)
        return delete_namespaces(victims)
    if prefix is None:
        raise ValueError("down() needs a prefix, all=True or stale=True")
    return delete_namespaces(testbed_prefixes().get(prefix, []))


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@functools.lru_cache(maxsize=1)
def require_root_and_netns() -> str | None:
    """None when testbeds can be built here; otherwise a clear reason to skip.

    Probes for real: a namespace with a bridge (mcast_snooping 0), a veth pair
    into a second namespace and a tbf qdisc, then removes them.
    """
    if sys.platform != "linux":
        return f"NETNS TESTBED UNAVAILABLE: needs Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return "NETNS TESTBED UNAVAILABLE: needs root (ip netns add), running as uid %d" % os.geteuid()
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"NETNS TESTBED UNAVAILABLE: `{tool}` not found (install Debian's iproute2)"
    a, b = f"etp-probe{os.getpid()}-br", f"etp-probe{os.getpid()}-h1"
    try:
        for ns in (a, b):
            _cmd(["ip", "netns", "add", ns])
        _cmd(["ip", "-n", a, "link", "add", BRIDGE, "type", "bridge", "mcast_snooping", "0"])
        _cmd(["ip", "-n", a, "link", "add", "h1", "type", "veth", "peer", "name", HOST_IFACE, "netns", b])
        _cmd(["tc", "-n", b, "qdisc", "add", "dev", HOST_IFACE, "root", "tbf",
              "rate", DEFAULT_RATE, "burst", DEFAULT_BURST, "latency", DEFAULT_LATENCY])
        _cmd(["ip", "netns", "exec", b, "true"])
    except NetnsError as exc:
        return f"NETNS TESTBED UNAVAILABLE: {exc}"
    finally:
        delete_namespaces([b, a])
    return None


@dataclass(eq=False)
class Host:
    """One host of a testbed: a network namespace with ``eth0`` on the bridge."""

    name: str                 # "h1"
    netns: str                # "etp-1234-1-h1"
    address: str              # "10.99.0.11"
    iface: str = HOST_IFACE
    _procs: list = field(default_factory=list, repr=False)

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside this host (``ip netns exec NS ...``)."""
        return ["ip", "netns", "exec", self.netns, *map(str, argv)]

    def run(self, argv: Sequence[str], *, timeout: float = 60.0, check: bool = True,
            capture_output: bool = True, text: bool = True, **kw) -> subprocess.CompletedProcess:
        """subprocess.run inside this host; always bounded by ``timeout``."""
        kw.setdefault("stdin", subprocess.DEVNULL)
        return subprocess.run(self.argv(argv), timeout=timeout, check=check,
                              capture_output=capture_output, text=text, **kw)

    def popen(self, argv: Sequence[str], **kw) -> subprocess.Popen:
        """subprocess.Popen inside this host; the testbed ends it on teardown.

        ``ip netns exec`` execs the command, so ``proc.pid`` is the command
        itself.  It runs in a session of its own (``start_new_session``) so
        the testbed can end it together with its children.
        """
        kw.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.argv(argv), **kw)
        self._procs.append(proc)
        return proc

    def stop_processes(self, grace: float = 2.0) -> None:
        """End every process this host's popen started (SIGTERM, then SIGKILL)."""
        procs, self._procs = self._procs, []
        for proc in procs:
            if proc.poll() is None:
                _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                try:
                    proc.wait(timeout=2.0)
                except subprocess.TimeoutExpired:
                    pass
        for proc in procs:
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    try:
                        stream.close()
                    except OSError:
                        pass


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)       # started with start_new_session: pgid == pid
    except (ProcessLookupError, PermissionError):
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass


class Testbed:
    """N hosts in network namespaces on a private bridge; a context manager.

    ``rate``: ``"100mbit"`` style string, a number of Mbit/s, or None (unshaped);
    applied as ``tbf`` on each host's ``eth0`` egress.
    """

    __test__ = False  # not a pytest test class, though tests import it

    def __init__(self, hosts: int = 3, *, rate: str | float | None = DEFAULT_RATE,
                 burst: str = DEFAULT_BURST, latency: str = DEFAULT_LATENCY,
                 prefix: str | None = None, ipv6: bool = False, keep: bool = False):
        if not 1 <= hosts <= 200:
            raise ValueError("hosts must be between 1 and 200")
        self.n = hosts
        self.rate = f"{rate}mbit" if isinstance(rate, (int, float)) else rate
        self.burst, self.latency, self.ipv6 = burst, latency, ipv6
        self.prefix = prefix or f"{PREFIX_ROOT}{os.getpid()}-{next(_seq)}"
        if not self.prefix.startswith(PREFIX_ROOT):
            raise ValueError(f"prefix must start with {PREFIX_ROOT!r} so `down --all` finds it")
        self.bridge_netns = f"{self.prefix}-br"
        self.hosts: list[Host] = [Host(f"h{i}", f"{self.prefix}-h{i}", f"{SUBNET}.{10 + i}")
                                  for i in range(1, hosts + 1)]
        self.keep = keep          # True: survive process exit (the CLI's `up`)
        self.timings: dict[str, float] = {}
        self._up = False
        self._closed = False
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ access

    def __getitem__(self, key: int | str) -> Host:
        if isinstance(key, str):
            for h in self.hosts:
                if key in (h.name, h.netns):
                    return h
            raise KeyError(key)
        return self.hosts[key]

    def __iter__(self):
        return iter(self.hosts)

    def __len__(self) -> int:
        return len(self.hosts)

    @property
    def namespaces(self) -> list[str]:
        return [h.netns for h in self.hosts] + [self.bridge_netns]

    @classmethod
    def attach(cls, prefix: str) -> "Testbed":
        """A handle on a testbed made elsewhere (e.g. by ``netns.py up``); not cleaned up on exit."""
        names = testbed_prefixes().get(prefix)
        if not names:
            raise NetnsError(f"no testbed with prefix {prefix!r} (see `netns.py list`)")
        nums = sorted(int(n.rsplit("-h", 1)[1]) for n in names if re.search(r"-h\d+$", n))
        tb = cls(hosts=max(nums) if nums else 1, prefix=prefix, keep=True)
        tb.hosts = [h for h in tb.hosts if int(h.name[1:]) in nums]
        tb._up = True
        return tb

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> "Testbed":
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def up(self) -> "Testbed":
        if self._up:
            return self
        clash = set(self.namespaces) & set(list_namespaces())
        if clash:
            raise NetnsError(f"namespaces already exist: {sorted(clash)} (netns.py down --prefix {self.prefix})")
        t0 = time.monotonic()
        if not self.keep:
            _register(self)
        self._up = True        # from here on close() has something to remove
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        self.timings["up"] = time.monotonic() - t0
        return self

    def _build(self) -> None:
        br = self.bridge_netns
        batch_root = [f"netns add {ns}" for ns in self.namespaces]
        _ip_batch(batch_root)
        bridge_cmds = [
            "link set lo up",
            f"link add {BRIDGE} type bridge mcast_snooping 0 stp_state 0 forward_delay 0",
        ]
        for h in self.hosts:
            bridge_cmds += [
                f"link add {h.name} type veth peer name {h.iface} netns {h.netns}",
                f"link set {h.name} master {BRIDGE}",
                f"link set {h.name} up",
            ]
        bridge_cmds.append(f"link set {BRIDGE} up")
        if not self.ipv6:
            _disable_ipv6(br)
        _ip_batch(bridge_cmds, netns=br)
        for h in self.hosts:
            if not self.ipv6:
                _disable_ipv6(h.netns)
            _ip_batch([
                "link set lo up",
                f"addr add {h.address}/24 dev {h.iface}",
                f"link set {h.iface} up",
                f"route add 224.0.0.0/4 dev {h.iface}",
            ], netns=h.netns)
            if self.rate:
                _cmd(["tc", "-n", h.netns, "qdisc", "add", "dev", h.iface, "root", "tbf",
                      "rate", str(self.rate), "burst", self.burst, "latency", self.latency])

    def close(self) -> None:
        """Stop started processes and delete every namespace; idempotent, never raises NetnsError."""
        with self._lock:
            if self._closed or not self._up:
                self._closed = True
                _unregister(self)
                return
            self._closed = True
        t0 = time.monotonic()
        try:
            for h in self.hosts:
                h.stop_processes()
            delete_namespaces(self.namespaces)
            left = set(self.namespaces) & set(list_namespaces())
            if left:   # one more try, e.g. after a process we did not start left late
                delete_namespaces(sorted(left))
        except NetnsError as exc:
            print(f"netns: cleanup of {self.prefix} incomplete: {exc}", file=sys.stderr)
        finally:
            _unregister(self)
            self.timings["down"] = time.monotonic() - t0

    def describe(self) -> dict:
        return {"prefix": self.prefix, "bridge_netns": self.bridge_netns, "rate": self.rate,
                "hosts": {h.name: {"netns": h.netns, "address": h.address, "iface": h.iface}
                          for h in self.hosts}}


def _ip_batch(lines: Sequence[str], netns: str | None = None) -> None:
    """Many ip commands in one process (``ip -batch -``); fast and bounded."""
    argv = ["ip"] + (["-n", netns] if netns else []) + ["-batch", "-"]
    try:
        res = subprocess.run(argv, input="\n".join(lines) + "\n", capture_output=True, text=True,
                             timeout=IP_TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        raise NetnsError(f"timed out after {IP_TIMEOUT}s: {' '.join(argv)}") from exc
    if res.returncode != 0:
        raise NetnsError(f"{' '.join(argv)} failed: {res.stderr.strip()} (commands: {list(lines)})")


def _disable_ipv6(netns: str) -> None:
    """IPv4 only inside ``netns`` (no link-local chatter); /proc/sys/net follows the caller's netns."""
    script = "; ".join(f"echo 1 > /proc/sys/net/ipv6/conf/{c}/disable_ipv6" for c in ("all", "default"))
    _cmd(["ip", "netns", "exec", netns, "sh", "-c", f"[ -d /proc/sys/net/ipv6 ] || exit 0; {script}"])


# ---------------------------------------------------------------------- cleanup on exit / signals


def _register(tb: Testbed) -> None:
    global _handlers_installed
    with _live_lock:
        _live.add(tb)
        if not _handlers_installed:
            _handlers_installed = True
            atexit.register(_cleanup_all)
            if threading.current_thread() is threading.main_thread():
                for sig in (signal.SIGTERM, signal.SIGHUP):
                    if signal.getsignal(sig) in (signal.SIG_DFL, None):
                        signal.signal(sig, _on_signal)


def _unregister(tb: Testbed) -> None:
    with _live_lock:
        _live.discard(tb)


def _cleanup_all() -> None:
    with _live_lock:
        beds = list(_live)
    for tb in beds:
        tb.close()


def _on_signal(signum, frame) -> None:
    _cleanup_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


# ---------------------------------------------------------------------- helpers for tests and tools


def read_line(proc: subprocess.Popen, timeout: float) -> str:
    """One line from ``proc.stdout`` (opened with ``bufsize=0``, binary), or "" at timeout/EOF."""
    fd = proc.stdout.fileno()
    buf = b""
    deadline = time.monotonic() + timeout
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            break
        chunk = os.read(fd, 1)
        if not chunk:
            break
        buf += chunk
    return buf.decode(errors="replace").strip()


_RECEIVER = r"""
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); s.settimeout(float(sys.argv[3]))
print("ready", flush=True)
c, _ = s.accept(); c.settimeout(float(sys.argv[3]))
n = 0; t0 = None
while True:
    b = c.recv(1 << 20)
    if not b: break
    if t0 is None: t0 = time.monotonic(); first = len(b)
    n += len(b)
t1 = time.monotonic()
print(n, (n - first) * 8 / (t1 - t0) if t1 > t0 else 0.0, flush=True)
"""

_SENDER = r"""
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[4]))
c.sendall(b"\0" * int(sys.argv[3])); c.shutdown(socket.SHUT_WR); c.recv(1); c.close()
"""


def tcp_throughput(src: Host, dst: Host, nbytes: int = 5_000_000, port: int = 5201,
                   timeout: float = 30.0) -> float:
    """Bits per second of one TCP stream from ``src`` to ``dst``, measured at the receiver."""
    recv = dst.popen([sys.executable, "-c", _RECEIVER, dst.address, str(port), str(timeout)],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0)
    try:
        if read_line(recv, timeout) != "ready":
            raise NetnsError(f"receiver in {dst.netns} did not start: {recv.stderr.read().decode() if recv.poll() is not None else ''}")
        src.run([sys.executable, "-c", _SENDER, dst.address, str(port), str(nbytes), str(timeout)],
                timeout=timeout)
        out, err = recv.communicate(timeout=timeout)
        got, bps = out.decode().split()
        if int(got) != nbytes:
            raise NetnsError(f"receiver got {got} bytes of {nbytes}: {err.decode()}")
        return float(bps)
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait(timeout=5)


# ---------------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="netns.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check", help="say whether testbeds can be built here")
    p_up = sub.add_parser("up", help="create a testbed that stays until `down`")
    p_up.add_argument("--hosts", type=int, default=3)
    p_up.add_argument("--rate", default=DEFAULT_RATE, help="tbf rate, e.g. 100mbit; 'none' for unshaped")
    p_up.add_argument("--prefix", default="etp-cli")
    p_run = sub.add_parser("run", help="run a command inside a host: run h1 -- CMD...")
    p_run.add_argument("--prefix", default="etp-cli")
    p_run.add_argument("--timeout", type=float, default=None)
    p_run.add_argument("host", help="h1, h2, ... or a full namespace name")
    p_run.add_argument("command", nargs=argparse.REMAINDER)
    sub.add_parser("list", help="list testbeds")
    p_down = sub.add_parser("down", help="remove a testbed (idempotent)")
    g = p_down.add_mutually_exclusive_group()
    g.add_argument("--prefix", default="etp-cli")
    g.add_argument("--all", action="store_true", help="every etp-* namespace")
    g.add_argument("--stale", action="store_true", help="testbeds whose creating process is gone")
    args = ap.parse_args(argv)

    if args.cmd == "check":
        reason = require_root_and_netns()
        print(reason or "ok: network namespace testbeds work here")
        return 1 if reason else 0
    if args.cmd == "up":
        reason = require_root_and_netns()
        if reason:
            print(reason, file=sys.stderr)
            return 1
        rate = None if args.rate.lower() in ("none", "0", "") else args.rate
        tb = Testbed(args.hosts, rate=rate, prefix=args.prefix, keep=True).up()
        print(json.dumps(tb.describe() | {"up_seconds": round(tb.timings["up"], 3)}, indent=2))
        return 0
    if args.cmd == "run":
        cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not cmd:
            ap.error("run needs a command after --")
        existing = list_namespaces()
        ns = args.host if args.host in existing else f"{args.prefix}-{args.host}"
        if ns not in existing:
            raise NetnsError(f"no namespace {ns!r} (is the testbed up? see `netns.py list`)")
        try:
            return subprocess.run(["ip", "netns", "exec", ns, *cmd], timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            print(f"timed out after {args.timeout}s", file=sys.stderr)
            return 124
    if args.cmd == "list":
        print(json.dumps(testbed_prefixes(), indent=2))
        return 0
    if args.cmd == "down":
        t0 = time.monotonic()
        gone = down(args.prefix, all=args.all, stale=args.stale)
        print(f"removed {len(gone)} namespaces in {time.monotonic() - t0:.2f}s" + (f": {' '.join(gone)}" if gone else ""))
        return 0
    return 2


def _cli(argv: Sequence[str] | None = None) -> int:
    try:
        return main(argv)
    except (NetnsError, ValueError) as exc:
        print(f"netns.py: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(_cli())
