"""A tiny sd_notify client: tell systemd we are READY, what we are doing, that we live, that we stop.

systemd (Type=notify) passes a unix datagram socket in $NOTIFY_SOCKET: a path, or
"@name" for the abstract namespace. Each message is one datagram of KEY=VALUE lines.
Without $NOTIFY_SOCKET (not under systemd) every call is a no-op that returns False.

The socket is non-blocking: a full receive queue drops the message (logged) rather
than stalling the event loop. `run_watchdog` pings from the event loop itself, so a
blocked loop stops the pings and systemd restarts the daemon; given a health check,
it also stops them (and says why in STATUS) while the node cannot serve.

`extending()` keeps pushing systemd's start timeout out (EXTEND_TIMEOUT_USEC) from a
thread while a first model pull, load or kernel compile runs before READY.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)


def socket_address(value: str) -> str | bytes:
    """$NOTIFY_SOCKET as a socket address: '@name' is abstract (a leading NUL)."""
    if value.startswith("@"):
        return b"\0" + value[1:].encode()
    return value


def watchdog_interval(env: Mapping[str, str] | None = None, pid: int | None = None) -> float | None:
    """Seconds between WATCHDOG=1 pings (half of $WATCHDOG_USEC), or None when no watchdog is asked of us."""
    env = os.environ if env is None else env
    usec = env.get("WATCHDOG_USEC", "")
    owner = env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if owner and owner != str(os.getpid() if pid is None else pid):
        return None  # meant for another process
    return int(usec) / 2e6


class Notifier:
    """Sends sd_notify messages; a no-op when $NOTIFY_SOCKET is unset."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        raw = env.get("NOTIFY_SOCKET", "")
        self.address: str | bytes | None = socket_address(raw) if raw else None
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()  # the extender thread sends too

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, *lines: str) -> bool:
        """Send KEY=VALUE lines as one datagram; True if it was sent."""
        if self.address is None:
            return False
        for line in lines:
            if "=" not in line or "\n" in line:
                raise ValueError(f"an sd_notify line is KEY=VALUE without newlines, got {line!r}")
        with self._lock:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.setblocking(False)
            try:
                self._sock.sendto("\n".join(lines).encode(), self.address)
            except OSError as exc:  # queue full, socket gone: systemd will notice by itself
                log.warning("sd_notify to %r failed: %s", self.address, exc)
                return False
        return True

    def ready(self, status: str | None = None) -> bool:
        return self.notify("READY=1", *([f"STATUS={status}"] if status else []))

    def status(self, text: str) -> bool:
        return self.notify(f"STATUS={' '.join(text.splitlines())}")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def stopping(self, status: str | None = None) -> bool:
        return self.notify("STOPPING=1", *([f"STATUS={status}"] if status else []))

    def extend_timeout(self, seconds: float) -> bool:
        """Ask for `seconds` more before systemd gives up on our start (or stop)."""
        return self.notify(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}")

    def extending(self, period: float = 10.0, status: str = "loading") -> Extender:
        """A context (or `stop()`-able object) that extends the start timeout every `period` s until stopped."""
        return Extender(self, period, status)

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    async def run_watchdog(self, interval: float | None = None,
                           health: Callable[[], str | None] | None = None) -> None:
        """Ping WATCHDOG=1 every `interval` s (default: half of $WATCHDOG_USEC) until cancelled.

        `health()` returns None while the node can serve, else why not: then no ping is sent
        (systemd restarts us if it lasts) and STATUS says why; pings resume when it recovers.
        Returns at once when there is no watchdog to feed; the caller owns the task.
        """
        interval = watchdog_interval() if interval is None else interval
        if interval is None or not self.enabled:
            return
        said: str | None = None
        while True:
            why = health() if health is not None else None
            if why is None:
                if said is not None:
                    self.status("serving again")
                    log.info("this node can serve again")
                self.watchdog()
            elif why != said:
                self.status(f"cannot serve: {why}")
                log.error("watchdog withheld: this node cannot serve: %s", why)
            said = why
            await asyncio.sleep(interval)


class Extender:
    """Sends EXTEND_TIMEOUT_USEC (3 periods' worth) every `period` s from a thread until `stop()`."""

    def __init__(self, notifier: Notifier, period: float, status: str) -> None:
        self._notifier, self._period = notifier, period
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if notifier.enabled:
            notifier.status(status)
            notifier.extend_timeout(3 * period)
            self._thread = threading.Thread(target=self._run, name="edgetp-sd-extend", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            self._notifier.extend_timeout(3 * self._period)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self._period + 1)

    def __enter__(self) -> Extender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
