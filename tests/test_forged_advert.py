"""Only key holders count as members, and epochs mean the same on every node: real `edgetp serve --key`
daemons on loopback, real zeroconf.

1. A forged advert (the public cluster id, no key, top priority, the model's fingerprint, pointing at a
   real node's ports) is listed as foreign and never becomes root; requests keep their right text.
2. The preferred root is killed and restarted: it rejoins and leads again, the other node following
   it as a worker, and nothing else is restarted.
"""

from __future__ import annotations

import secrets
import time

import pytest
from zeroconf import ServiceInfo, Zeroconf

from edgetp.cluster.discovery import SERVICE_TYPE
from edgetp.model import gguf
from edgetp.net.auth import cluster_id, read_key
from edgetp.net.frames import PROTOCOL_VERSION
from edgetp.serve.spawn import start_daemon, stop
from tests.test_cli_errors import edgetp
from tests.test_daemon import expected, stream, view, wait_for  # noqa: F401  (expected is a fixture)


def roots(*urls: str) -> list[str | None]:
    return [view(u)["root"] for u in urls]


def forge(key_path, model_path, http_port: int, data_port: int) -> tuple[Zeroconf, ServiceInfo]:
    """What a stranger who knows only the public cluster id can announce."""
    node_id = f"forged-{secrets.token_hex(3)}"
    txt = {"id": node_id, "pv": str(PROTOCOL_VERSION), "cid": cluster_id(read_key(key_path)),
           "dp": str(data_port), "hp": str(http_port), "spd": repr(9e12), "mem": str(1 << 40),
           "mdl": gguf.open_model(model_path).fingerprint, "pri": str(2**31 - 1), "nr": "0",
           "ep": "999", "ldr": node_id, "bt": secrets.token_hex(8), "sq": "1",
           "sig": secrets.token_hex(32)}  # no key: the best it can do is a random signature
    zc = Zeroconf(interfaces=["127.0.0.1"])
    info = ServiceInfo(SERVICE_TYPE, f"{node_id}.{SERVICE_TYPE}", port=data_port, properties=txt,
                       server=f"{node_id}.local.", parsed_addresses=["127.0.0.1"])
    zc.register_service(info)
    return zc, info


@pytest.mark.slow
def test_a_forged_advert_never_leads_and_a_rebooted_preferred_root_leads_again(stories_path, tmp_path, expected):
    key = tmp_path / "cluster.key"
    assert edgetp("keygen", str(key)).returncode == 0
    procs: dict[str, tuple] = {}
    zc = None
    try:
        procs["a"] = start_daemon(stories_path, key, "node-a", priority=5)
        procs["b"] = start_daemon(stories_path, key, "node-b")
        url = {name: u for name, (_, u) in procs.items()}
        wait_for(lambda: roots(url["a"], url["b"]) == ["node-a", "node-b"][:1] * 2, 30, "both follow node-a")
        first_epoch = view(url["b"])["epoch"]

        # 1. the forgery points at node-b's real HTTP and data ports
        b_data = next(n["address"] for n in view(url["a"])["nodes"] if n["node_id"] == "node-b")
        zc, info = forge(key, stories_path, int(url["b"].rsplit(":", 1)[1]), int(b_data.rsplit(":", 1)[1]))
        forged = info.properties[b"id"].decode()
        state = lambda u: {n["node_id"]: n["state"] for n in view(u)["nodes"]}.get(forged)  # noqa: E731
        wait_for(lambda: state(url["b"]) == "foreign" and state(url["a"]) == "foreign", 20,
                 "the forged advert listed as foreign on both nodes")
        for _ in range(3):  # it stays foreign: never elected, never planned over, never forwarded to
            assert roots(url["a"], url["b"]) == ["node-a", "node-a"]
            assert stream(url["b"]) == expected
            assert state(url["b"]) == "foreign"  # (the root's view, once it has planned, lists its plan only)
            assert sorted(n["node_id"] for n in view(url["a"])["nodes"]) == ["node-a", "node-b"]

        # 2. the preferred root is killed; node-b leads in a later epoch and serves
        procs["a"][0].kill()
        procs["a"][0].wait()
        wait_for(lambda: view(url["b"])["root"] == "node-b", 15, "node-b takes over")
        assert stream(url["b"]) == expected
        b_epoch = view(url["b"])["epoch"]
        assert b_epoch > first_epoch

        # ... node-a comes back with a fresh process (its epoch counter starts from nothing) and leads again
        b_pid = procs["b"][0].pid
        procs["a"] = start_daemon(stories_path, key, "node-a", priority=5)
        url["a"] = procs["a"][1]
        wait_for(lambda: roots(url["a"], url["b"]) == ["node-a", "node-a"], 30, "both follow node-a again")
        wait_for(lambda: view(url["b"])["epoch"] > b_epoch, 10, "node-b in the new root's later epoch")
        assert stream(url["b"]) == expected
        plan = view(url["a"])
        assert plan["root"] == "node-a" and plan["epoch"] > b_epoch
        assert sorted(n["node_id"] for n in plan["nodes"]) == ["node-a", "node-b"], \
            "node-b's worker must admit the rebooted root's epoch"
        assert procs["b"][0].poll() is None and procs["b"][0].pid == b_pid, "node-b was never restarted"
        assert state(url["b"]) == "foreign"
    finally:
        if zc is not None:
            zc.unregister_all_services()
            zc.close()
        for proc, _ in procs.values():
            stop(proc)
