"""The speed profile times the model's own matrices, grouped as decode calls them: a token pass.

One layer's q, k and v (one kernel call), o, gate and up (one call), down, and vocab / L rows of
the output head: 1/L of a token's matvecs. References: the tensors' shapes, types and byte counts as
gguf-py's own reader lists them, the head's row count by hand, and a real worker process that times
the pass a root sends and refuses a malformed one with its reason.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import msgpack
import pytest
from gguf import GGUFReader

from edgetp.model import gguf, quant
from edgetp.parallel import profile
from edgetp.serve.spawn import start_worker, stop


def _shape(reader: GGUFReader, name: str) -> tuple[int, int, int]:
    t = next(t for t in reader.tensors if t.name == name)
    cols, rows = (int(v) for v in t.shape[:2])  # gguf lists the row length first
    return int(t.tensor_type), rows, cols


@pytest.mark.parametrize("which", ["stories_path", "smollm2_path"])
def test_the_pass_is_layer_0_as_decode_groups_it_and_the_heads_share_of_a_layer(which, request):
    path = request.getfixturevalue(which)
    reader = GGUFReader(path)
    names = {t.name for t in reader.tensors}
    n_layers = 1 + max(int(n.split(".")[1]) for n in names if n.startswith("blk."))
    head = "output.weight" if "output.weight" in names else "token_embd.weight"
    qtype, vocab, dim = _shape(reader, head)
    rows = min(vocab, math.ceil(math.ceil(vocab / n_layers) / 32) * 32)
    expect = [[_shape(reader, f"blk.0.attn_{x}.weight") for x in "qkv"], [_shape(reader, "blk.0.attn_output.weight")],
              [_shape(reader, f"blk.0.ffn_{x}.weight") for x in ("gate", "up")], [_shape(reader, "blk.0.ffn_down.weight")],
              [(qtype, rows, dim)]]
    got = profile.token_pass(gguf.open_model(path))
    assert got == expect
    # every layer has layer 0's shapes and types here: the pass without its head is 1/L of the layers' bytes
    layers = sum(int(t.n_bytes) for t in reader.tensors if t.name.startswith("blk.") and len(t.shape) >= 2
                 and int(t.shape[1]) > 1)
    assert profile.pass_bytes(got[:-1]) * n_layers == layers
    assert profile.pass_bytes(got[-1:]) == rows * int(next(t for t in reader.tensors if t.name == head).n_bytes) // vocab


def test_a_pass_crosses_the_wire_and_is_checked(smollm2_path):
    shapes = profile.token_pass(gguf.open_model(smollm2_path))
    assert profile.check_pass(msgpack.unpackb(msgpack.packb(shapes))) == shapes
    q8 = int(quant.QT.Q8_0)
    for bad, why in [
        ([], "1 to 64 groups"),
        ("pass", "1 to 64 groups"),
        ([[(q8, 32, 64)]] * 65, "1 to 64 groups"),
        ([[]], "1 to 8 matrices"),
        ([[(q8, 32, 64)] * 9], "1 to 8 matrices"),
        ([[(q8, 32)]], "[type, rows, cols]"),
        ([[(q8, 0, 64)]], "[type, rows, cols]"),
        ([[(q8, 32, 2**21)]], "[type, rows, cols]"),
        ([[(q8, True, 64)]], "[type, rows, cols]"),
        ([[(q8, 32.0, 64)]], "[type, rows, cols]"),
        ([[(-1, 32, 64)]], "[type, rows, cols]"),
        ([[(99, 32, 64)]], "type 99, which this node does not support"),
        ([[(q8, 32, 48)]], "48 columns of type Q8_0 are not whole blocks"),
        ([[(q8, 32, 64), (q8, 32, 96)]], "columns must agree"),
    ]:
        with pytest.raises(ValueError, match=why.replace("[", r"\[").replace("]", r"\]")):
            profile.check_pass(bad)


def test_a_pass_too_large_for_the_room_keeps_its_columns_and_a_share_of_its_rows():
    q8, q4 = int(quant.QT.Q8_0), int(quant.QT.Q4_0)
    shapes = [[(q8, 1024, 2048), (q8, 256, 2048)], [(q8, 2048, 1024)]]
    need = (1024 + 256) * 2048 // 32 * 34 + 2048 * 1024 // 32 * 34  # bytes of Q8_0: 34 per 32 values
    assert profile.pass_bytes(shapes) == need
    assert profile.fit(shapes, need) == shapes
    assert profile.fit(shapes, need // 4) == [[(q8, 256, 2048), (q8, 64, 2048)], [(q8, 512, 1024)]]
    assert profile.fit(shapes, 1000) == [[(q8, 32, 2048), (q8, 32, 2048)], [(q8, 32, 1024)]]  # at least 32 rows
    assert profile.fit([[(q8, 8, 64)]], 10) == [[(q8, 8, 64)]]  # a matrix never grows
    # Q4_0's panels are packed beside it where decode runs on integers: twice its 18 bytes per 32 values
    kept = 2 if quant.int8_decode() else 1
    assert profile.pass_bytes([[(q4, 64, 1024)]], kept=True) == kept * 64 * 1024 // 32 * 18


PROFILE = textwrap.dedent("""
    import asyncio, json, sys
    from edgetp.net.frames import FrameType
    from edgetp.net.link import Link, LinkClosed
    from edgetp.parallel.runner import _hello

    async def main(addr, shapes):
        out = {}
        host, _, port = addr.rpartition(":")
        for key, ask in (("good", shapes), ("bad", [[[8, 32, 48]]])):
            link = await Link.connect(host, int(port))
            try:
                await _hello(link, None, "root", 1)
                try:
                    rep = await link.request(FrameType.PROFILE, {"seconds": 0.05, "qtype": 8, "pass": ask},
                                             FrameType.READY, timeout=120)
                    out[key] = rep.header["speed"]
                except LinkClosed as exc:
                    out[key] = str(exc)
            finally:
                link.close()
        print(json.dumps(out))

    asyncio.run(main(sys.argv[1], json.loads(sys.argv[2])))
""")


def test_a_worker_times_the_pass_its_root_sends_and_refuses_a_malformed_one_with_its_reason():
    shapes = [[(8, 256, 512), (8, 64, 512)], [(8, 512, 256)]]  # Q8_0
    proc, addr = start_worker()
    try:
        done = subprocess.run([sys.executable, "-c", PROFILE, addr, json.dumps(shapes)], capture_output=True,
                              text=True, timeout=300)
    finally:
        stop(proc)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout)
    assert isinstance(got["good"], float) and got["good"] > 0
    assert "PROFILE: 48 columns of type Q8_0 are not whole blocks" in got["bad"]


def test_a_mixtures_pass_runs_the_experts_a_token_uses(synth_model):
    path = synth_model("tiny-odd", "q8_0", arch="mixtral", n_experts=16, n_experts_used=4, n_heads=4, n_kv_heads=2)
    reader = GGUFReader(path)
    got = profile.token_pass(gguf.open_model(path))

    def expert(name: str) -> tuple[int, int, int]:
        t = next(t for t in reader.tensors if t.name == f"blk.0.{name}.weight")
        cols, rows, n = (int(v) for v in t.shape)  # (row length, rows, experts)
        assert n == 16
        return int(t.tensor_type), rows, cols

    gate_up = [expert("ffn_gate_exps"), expert("ffn_up_exps")]
    assert got[:2] == [[_shape(reader, f"blk.0.attn_{x}.weight") for x in "qkv"],
                       [_shape(reader, "blk.0.attn_output.weight")]]
    assert got[2:-1] == [gate_up, [expert("ffn_down_exps")]] * 4  # 4 experts of 16 per token


_CAPPED = """
import json, resource
from edgetp.parallel import profile
MiB = 1 << 20
profile.profile(1, 0.01, shapes=[[(8, 64, 2048)]])  # its kernels compiled first: compiling takes memory too
profile.limit_memory(profile.runtime_bytes() + 64 * MiB)
shapes = [[(8, 65536, 2048)]] * 4  # Q8_0: 4 x 142.6 MB, far beyond a quarter of the 64 MiB left
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
p = profile.profile(1, 0.05, shapes=shapes)
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
print(json.dumps({"speed": p.speed, "grew": grew, "need": profile.pass_bytes(shapes)}))
"""


def test_a_pass_beyond_the_room_left_under_a_cap_is_timed_on_fewer_rows_not_allocated_whole():
    done = subprocess.run([sys.executable, "-c", _CAPPED], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout)
    assert got["need"] > 500 * 2**20 and got["speed"] > 0
    assert got["grew"] < 100 * 2**20, got  # the kernel's peak resident figure: a quarter of 64 MiB and buffers
