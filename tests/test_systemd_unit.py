"""systemd/edgetp.service: what the unit must say, and systemd's own verdict on it.

`systemd-analyze verify` comes with Debian's `systemd` package; it works without
systemd running as PID 1. It refuses an ExecStart binary that does not exist, so
the test verifies a copy whose ExecStart points at this checkout's venv script.
"""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edgetp import commands
from edgetp.cli import build_parser

UNIT = Path(__file__).resolve().parent.parent / "systemd" / "edgetp.service"


def parse_unit(path: Path) -> configparser.ConfigParser:
    """A unit as sections of key -> last value (systemd keys repeat; Environment= is collected apart)."""
    cp = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",),
                                   comment_prefixes=("#", ";"), empty_lines_in_values=False)
    cp.optionxform = str  # keys are case-sensitive
    cp.read(path)
    return cp


def environment(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        if line.startswith("Environment="):
            key, _, value = line.removeprefix("Environment=").partition("=")
            env[key] = value
    return env


def test_the_unit_declares_notify_restart_dynamic_user_and_directories():
    s = parse_unit(UNIT)["Service"]
    assert s["Type"] == "notify" and s["NotifyAccess"] == "main"
    args = build_parser().parse_args(s["ExecStart"].split()[1:])  # the real CLI must accept the line
    assert args.func is commands.serve and str(args.config) == "/etc/edgetp/edgetp.toml" and args.verbose == 1
    assert s["Restart"] == "on-failure"
    assert s["DynamicUser"] == "yes"
    assert s["StateDirectory"] == "edgetp" and s["CacheDirectory"] == "edgetp"
    assert s["WatchdogSec"] == "30"
    assert s["KillSignal"] == "SIGTERM" and "TimeoutStopSec" in s
    assert environment(UNIT)["EDGETP_CACHE_DIR"] == "%C/edgetp"  # %C is /var/cache: the CacheDirectory


def test_the_unit_is_hardened():
    s = parse_unit(UNIT)["Service"]
    expected = {
        "ProtectSystem": "strict", "ProtectHome": "yes", "NoNewPrivileges": "yes", "PrivateTmp": "yes",
        "PrivateDevices": "yes", "ProtectKernelTunables": "yes", "ProtectKernelModules": "yes",
        "ProtectControlGroups": "yes", "LockPersonality": "yes", "SystemCallArchitectures": "native",
        "MemoryDenyWriteExecute": "no",  # numba JIT needs W+X pages
    }
    assert {k: s.get(k) for k in expected} == expected
    assert set(s["RestrictAddressFamilies"].split()) == {"AF_INET", "AF_INET6", "AF_UNIX", "AF_NETLINK"}


def test_the_unit_is_installed_for_multi_user_after_the_network():
    cp = parse_unit(UNIT)
    assert cp["Install"]["WantedBy"] == "multi-user.target"
    assert "network-online.target" in cp["Unit"]["After"]


def test_systemd_analyze_verify_accepts_the_unit(tmp_path):
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("SKIPPED LOUDLY: systemd-analyze is not installed, so the unit is not checked by systemd; "
                    "on Debian it comes with the `systemd` package (apt-get install -y systemd)")
    exe = Path(sys.executable).with_name("edgetp")
    if not exe.exists():
        pytest.skip(f"SKIPPED LOUDLY: {exe} is missing (pip install -e . first); verify needs a real ExecStart")
    copy = tmp_path / UNIT.name
    copy.write_text(UNIT.read_text().replace("ExecStart=/usr/local/bin/edgetp", f"ExecStart={exe}"))
    r = subprocess.run([tool, "verify", "--man=no", str(copy)], capture_output=True, text=True, timeout=60)
    # verify exits 0 on mere warnings (an unknown key is "ignoring"): any line about our unit fails.
    complaints = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert r.returncode == 0 and not complaints, "\n".join(complaints)


def test_the_unit_orders_itself_after_time_sync_and_reloads_with_sighup():
    cp = parse_unit(UNIT)
    assert "time-sync.target" in cp["Unit"]["After"].split()
    assert "time-sync.target" not in cp["Unit"].get("Wants", ""), "ordering only: never pull a sync wait in"
    assert cp["Service"]["ExecReload"] == "/bin/kill -HUP $MAINPID"
