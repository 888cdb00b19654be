"""Links measured, not assumed: each link's round trips (median, p90) and throughput, from a short
probe at connect, reach the plan's node records, /v1/cluster's view and `ask --stats`.

References: a raw TCP transfer between the same network namespaces over a tbf-shaped link
(tools/netns.tcp_throughput), and the shaping rate itself.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from edgetp.daemon import cluster_view
from edgetp.model import gguf
from edgetp.net.loopthread import LoopThread
from edgetp.parallel.runner import ClusterRunner
from edgetp.serve.spawn import start_worker, stop
from tools.netns import Testbed, require_root_and_netns, tcp_throughput

MEASURE = textwrap.dedent("""
    import asyncio, json, sys
    from edgetp.net.link import Link
    from edgetp.parallel.runner import _hello

    async def main(addr):
        host, _, port = addr.rpartition(":")
        link = await Link.connect(host, int(port))
        try:
            await _hello(link, None, "root", 1)
            st = await link.measure()
            print(json.dumps({"rtt_ms": st.rtt_ms, "rtt_p90_ms": st.rtt_p90_ms, "mbps": st.mbps}))
        finally:
            link.close()

    asyncio.run(main(sys.argv[1]))
""")


def test_a_plan_over_a_real_worker_carries_its_links_round_trips_and_throughput(stories_path):
    proc, addr = start_worker()
    try:
        mf = gguf.open_model(stories_path)
        with LoopThread() as lt:
            runner = lt.run(ClusterRunner.connect(mf, [addr], ctx=64, weights=[1, 1]), timeout=300)
            try:
                node = runner.nodes[1]
                view = cluster_view(runner, "stories260K")
            finally:
                runner.close()
    finally:
        stop(proc)
    assert 0 < node.rtt_ms <= node.rtt_p90_ms < 1000
    assert node.mbps > 100  # loopback: far more than any LAN
    assert node.mode == "blocking" and 0 < node.round_ms < 1000  # an all-reduce round timed as generations run it
    remote = next(n for n in view.nodes if n.address == addr)
    assert (remote.rtt_ms, remote.rtt_p90_ms, remote.mbps) == (node.rtt_ms, node.rtt_p90_ms, node.mbps)
    assert next(n for n in view.nodes if n.address == "local").mbps is None


ROUNDS = textwrap.dedent("""
    import asyncio, json, sys
    from edgetp.net.frames import FrameType
    from edgetp.net.link import Link, LinkClosed
    from edgetp.parallel.runner import _hello

    async def main(addr):
        out = {}
        host, _, port = addr.rpartition(":")
        link = await Link.connect(host, int(port))
        try:
            await _hello(link, None, "root", 1)
            out["round_s"] = await link.measure_rounds(576, rounds=16)
            out["pong"] = (await link.request(FrameType.PING, {"i": 7}, FrameType.PONG)).header  # still in step
            out["rtt_ms"] = (await link.measure(pings=3, probes=1)).rtt_ms
            await link.send(FrameType.PING, {"rounds": 0, "cols": 576})
            try:
                await link.expect(FrameType.PONG)
            except LinkClosed as exc:
                out["refused"] = str(exc)
        finally:
            link.close()
        print(json.dumps(out))

    asyncio.run(main(sys.argv[1]))
""")


def test_an_all_reduce_round_is_timed_against_a_real_worker_and_the_link_stays_in_step():
    proc, addr = start_worker()
    try:
        done = subprocess.run([sys.executable, "-c", ROUNDS, addr], capture_output=True, text=True, timeout=120)
    finally:
        stop(proc)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout)
    assert 0 < got["round_s"] < 1 and got["pong"] == {"i": 7} and got["rtt_ms"] > 0
    assert "PING asks for 0 rounds of 576 values" in got["refused"]


def test_the_measured_throughput_of_a_shaped_link_agrees_with_a_raw_tcp_transfer_over_it():
    reason = require_root_and_netns()
    if reason:
        pytest.skip(reason)
    with Testbed(2, rate="40mbit") as tb:
        root, far = tb[0], tb[1]
        proc, addr = start_worker(host=far.address, prefix=far.argv([]))
        try:
            out = root.run([sys.executable, "-c", MEASURE, addr], timeout=120)
            got = json.loads(out.stdout)
        finally:
            stop(proc)
        raw = tcp_throughput(root, far) / 1e6
    assert 0 < got["rtt_ms"] <= got["rtt_p90_ms"]
    # the probe is half a MiB, short against 5 MB of raw TCP: within a factor of the reference,
    # and never more than the shaping allows
    assert 0.4 * raw <= got["mbps"] <= 1.15 * 40, (got, raw)
    assert raw <= 1.15 * 40
