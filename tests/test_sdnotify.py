"""sd_notify over a real unix datagram socket that the test binds (a path and the abstract namespace)."""

from __future__ import annotations

import asyncio
import os
import secrets
import socket

import pytest

from edgetp.cluster.sdnotify import Notifier, watchdog_interval


@pytest.fixture
def path_socket(tmp_path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "notify.sock")
    sock.bind(path)
    sock.settimeout(2.0)
    yield path, sock
    sock.close()


@pytest.fixture
def abstract_socket():
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    name = f"edgetp-test-{os.getpid()}-{secrets.token_hex(4)}"
    sock.bind(b"\0" + name.encode())
    sock.settimeout(2.0)
    yield "@" + name, sock
    sock.close()


def test_without_notify_socket_every_call_is_a_quiet_no_op():
    n = Notifier(env={})
    assert not n.enabled
    assert n.ready("up") is False and n.status("x") is False and n.watchdog() is False and n.stopping() is False


def test_ready_status_watchdog_and_stopping_arrive_as_datagrams_on_a_path_socket(path_socket):
    path, sock = path_socket
    n = Notifier(env={"NOTIFY_SOCKET": path})
    try:
        assert n.ready("serving 3 nodes")
        assert sock.recv(4096) == b"READY=1\nSTATUS=serving 3 nodes"
        assert n.status("electing\nroot")
        assert sock.recv(4096) == b"STATUS=electing root"  # one line, whatever the caller gave
        assert n.watchdog()
        assert sock.recv(4096) == b"WATCHDOG=1"
        assert n.stopping()
        assert sock.recv(4096) == b"STOPPING=1"
    finally:
        n.close()


def test_an_abstract_namespace_socket_given_with_an_at_sign_is_reached(abstract_socket):
    name, sock = abstract_socket
    n = Notifier(env={"NOTIFY_SOCKET": name})
    try:
        assert n.ready()
        assert sock.recv(4096) == b"READY=1"
    finally:
        n.close()


def test_a_vanished_socket_is_logged_not_raised(tmp_path, caplog):
    n = Notifier(env={"NOTIFY_SOCKET": str(tmp_path / "gone.sock")})
    try:
        assert n.watchdog() is False
        assert "sd_notify" in caplog.text
    finally:
        n.close()


def test_a_line_without_key_or_with_a_newline_is_refused(path_socket):
    n = Notifier(env={"NOTIFY_SOCKET": path_socket[0]})
    try:
        with pytest.raises(ValueError):
            n.notify("READY")
        with pytest.raises(ValueError):
            n.notify("STATUS=a\nREADY=1")
    finally:
        n.close()


def test_the_watchdog_interval_is_half_of_watchdog_usec_and_only_for_our_pid():
    assert watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "42"}, pid=42) == 15.0
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "43"}, pid=42) is None
    assert watchdog_interval({}) is None and watchdog_interval({"WATCHDOG_USEC": "x"}) is None


@pytest.mark.asyncio
async def test_run_watchdog_pings_repeatedly_until_cancelled(path_socket):
    path, sock = path_socket
    sock.setblocking(False)
    n = Notifier(env={"NOTIFY_SOCKET": path})
    task = asyncio.create_task(n.run_watchdog(interval=0.01))
    try:
        loop = asyncio.get_running_loop()
        for _ in range(3):
            assert await asyncio.wait_for(loop.sock_recv(sock, 4096), 2.0) == b"WATCHDOG=1"
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        n.close()


@pytest.mark.asyncio
async def test_run_watchdog_returns_at_once_when_no_watchdog_is_asked():
    await asyncio.wait_for(Notifier(env={}).run_watchdog(), 1.0)
