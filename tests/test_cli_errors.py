"""Bad input at the command line: one clear line, a non-zero exit, no traceback, nothing partial.

Every case runs the real `edgetp` CLI in a subprocess, as a user would.
"""

from __future__ import annotations

import asyncio
import os
import struct
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants


def edgetp(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgetp", *args], capture_output=True, text=True,
                          timeout=timeout, env=os.environ | (env or {}))


def assert_one_line_error(result: subprocess.CompletedProcess, *needles: str, progress: bool = False) -> None:
    """One `edgetp: ...` line (a pull may print progress lines before it), nothing else."""
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    if progress:
        lines = [line for line in lines if line.startswith("edgetp: ")] or lines
    assert len(lines) == 1, f"expected one line, got:\n{result.stderr}"
    assert lines[0].startswith("edgetp: ")
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"


def ask(model: Path | str, **kw) -> subprocess.CompletedProcess:
    return edgetp("ask", "--local", "--model", str(model), "--max-tokens", "4", "hello", **kw)


@pytest.fixture(scope="module")
def tiny(synth_model) -> Path:
    return synth_model("tiny-odd", "f32")


def test_a_truncated_gguf_is_named_and_refused(tiny, tmp_path):
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(tiny.read_bytes()[: tiny.stat().st_size // 2])
    assert_one_line_error(ask(bad), str(bad), "truncated")


def test_a_file_with_the_wrong_magic_is_named_and_refused(tiny, tmp_path):
    bad = tmp_path / "magic.gguf"
    bad.write_bytes(b"GGML" + tiny.read_bytes()[4:])
    assert_one_line_error(ask(bad), str(bad), "not a GGUF file")


def _tensor_offset_field(path: Path, name: str) -> int:
    """Byte position of a tensor's data-offset field in the tensor table (GGUF v3 layout)."""
    reader = GGUFReader(path)
    raw = path.read_bytes()
    key = struct.pack("<Q", len(name)) + name.encode()
    at = raw.index(key) + len(key)
    n_dims = struct.unpack_from("<I", raw, at)[0]
    at += 4 + 8 * n_dims + 4  # dims, then the type
    assert struct.unpack_from("<Q", raw, at)[0] + reader.data_offset == reader.tensors[
        [t.name for t in reader.tensors].index(name)].data_offset
    return at


def test_lying_tensor_offsets_are_named_and_refused(tiny, tmp_path):
    raw = bytearray(tiny.read_bytes())
    at = _tensor_offset_field(tiny, "blk.0.attn_q.weight")
    struct.pack_into("<Q", raw, at, 0)  # points at another tensor's bytes
    bad = tmp_path / "overlap.gguf"
    bad.write_bytes(bytes(raw))
    assert_one_line_error(ask(bad), str(bad), "overlap")

    struct.pack_into("<Q", raw, at, 1 << 40)  # far past the end of the file
    bad2 = tmp_path / "beyond.gguf"
    bad2.write_bytes(bytes(raw))
    assert_one_line_error(ask(bad2), str(bad2))


def _rewrite(src: Path, dst: Path, *, arch: str | None = None, retype: str | None = None) -> Path:
    """A copy of src with another architecture name, or one tensor stored as MXFP4 (unsupported)."""
    reader = GGUFReader(src)
    old_arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(dst, arch or old_arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = field.contents()
        key = name.replace(f"{old_arch}.", f"{arch}.", 1) if arch else name
        vtype = field.types[0]
        sub = field.types[-1] if len(field.types) > 1 else None
        writer.add_key_value(key, value, vtype, sub_type=sub)
    for t in reader.tensors:
        data = np.asarray(t.data)
        if t.name == retype:
            q = quants.quantize(data.astype(np.float32), GGMLQuantizationType.MXFP4)
            writer.add_tensor(t.name, q, raw_dtype=GGMLQuantizationType.MXFP4)
        else:
            writer.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_an_unsupported_architecture_is_named(tiny, tmp_path):
    bad = _rewrite(tiny, tmp_path / "falcon.gguf", arch="falcon")
    assert_one_line_error(ask(bad), str(bad), "unsupported architecture 'falcon'")


def test_an_unsupported_tensor_type_is_named_with_its_tensor(tiny, tmp_path):
    bad = _rewrite(tiny, tmp_path / "mxfp4.gguf", retype="blk.0.ffn_up.weight")
    assert_one_line_error(ask(bad), str(bad), "blk.0.ffn_up.weight", "MXFP4")


def test_a_missing_model_says_what_was_looked_for(tmp_path):
    result = ask("no-such-model", env={"EDGETP_CACHE_DIR": str(tmp_path)})
    assert_one_line_error(result, "no-such-model", "edgetp model pull")


def test_a_missing_model_path_is_named(tmp_path):
    assert_one_line_error(ask(tmp_path / "gone.gguf"), "gone.gguf")


class _DroppingServer:
    """A local HTTP server that sends part of a GGUF body, then hangs up."""

    def __init__(self, body: bytes, cut: int) -> None:
        self.body, self.cut = body, cut
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Length": str(len(self.body))})
        await resp.prepare(request)
        await resp.write(self.body[: self.cut])
        request.transport.close()
        return resp

    def __enter__(self) -> str:
        self.thread.start()
        app = web.Application()
        app.router.add_get("/{name}", self._handle)
        self.runner = web.AppRunner(app)

        async def start() -> int:
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            return site._server.sockets[0].getsockname()[1]

        port = asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def test_an_interrupted_download_leaves_no_file_under_the_final_name(tiny, tmp_path):
    body = tiny.read_bytes()
    with _DroppingServer(body, len(body) // 3) as url:
        result = edgetp("model", "pull", f"{url}/tiny.gguf", env={"EDGETP_CACHE_DIR": str(tmp_path)})
    assert_one_line_error(result, "tiny.gguf", "interrupted", progress=True)
    assert result.stderr.strip().splitlines()[-1].startswith("edgetp: ")
    models = tmp_path / "models"
    assert not (models / "tiny.gguf").exists()
    assert (models / "tiny.gguf.part").stat().st_size == len(body) // 3  # kept for a resume
    listed = edgetp("model", "list", env={"EDGETP_CACHE_DIR": str(tmp_path)})
    assert listed.returncode == 0 and "tiny.gguf" not in listed.stdout.replace("tiny.gguf.part", "")


def test_serving_without_a_model_outside_a_cluster_is_refused_in_one_line(tmp_path):
    result = edgetp("serve", "--model", "none", "--listen", "127.0.0.1:0", env={"EDGETP_CACHE_DIR": str(tmp_path)})
    assert_one_line_error(result, "--model none", "--key")


def test_profile_without_a_key_is_refused_in_one_line():
    result = edgetp("profile", "--url", "http://127.0.0.1:9", env={"EDGETP_KEY_FILE": ""})
    assert result.returncode == 4 and "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1 and "cluster key" in result.stderr


@pytest.mark.parametrize("cluster", [False, True], ids=["alone", "cluster"])
def test_a_port_in_use_is_refused_in_one_line(cluster, stories_path, tmp_path):
    import socket  # noqa: PLC0415

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        extra = []
        if cluster:  # the ports open inside a TaskGroup there: an ExceptionGroup, once a traceback
            key = tmp_path / "cluster.key"
            assert edgetp("keygen", str(key)).returncode == 0
            extra = ["--key", str(key), "--data-port", "0", "--interface", "127.0.0.1"]
        result = edgetp("serve", "--model", str(stories_path), "--listen", f"127.0.0.1:{port}", *extra,
                        env={"EDGETP_CACHE_DIR": str(tmp_path)})
    assert_one_line_error(result, f"{port}", "in use")


# Another mDNS user on the same host (a zeroconf process that only listens), as a home server running
# Home Assistant or a second edgetp has. Its sockets join port 5353's SO_REUSEPORT group, where Linux
# gives each unicast datagram to one socket: the holder's unicast answer to a probe may go to it.
BYSTANDER = """
import sys
from zeroconf import Zeroconf
zc = Zeroconf(interfaces=["127.0.0.1"])
print("listening", flush=True)
try:
    sys.stdin.read()  # until the test closes our stdin
finally:
    zc.close()
"""


@pytest.mark.parametrize("bystanders", [0, 3])
def test_a_node_id_already_on_the_network_is_refused_in_one_line(stories_path, tmp_path, bystanders):
    from edgetp.serve.spawn import start_daemon, stop  # noqa: PLC0415

    key = tmp_path / "cluster.key"
    assert edgetp("keygen", str(key)).returncode == 0
    node_id = f"twin-{os.getpid()}-{bystanders}"  # mDNS names are machine-wide: unique to this run
    others = [subprocess.Popen([sys.executable, "-c", BYSTANDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True) for _ in range(bystanders)]
    try:
        assert all(p.stdout.readline().strip() == "listening" for p in others)
        first, _ = start_daemon(stories_path, key, node_id)
        try:
            result = edgetp("serve", "--model", str(stories_path), "--key", str(key), "--node-id", node_id,
                            "--listen", "127.0.0.1:0", "--data-port", "0", "--interface", "127.0.0.1",
                            env={"EDGETP_CACHE_DIR": str(tmp_path)})
        finally:
            stop(first)
    finally:
        for p in others:
            p.stdin.close()
            p.wait(timeout=30)
    assert_one_line_error(result, repr(node_id), "already on the network", "--node-id")


@pytest.mark.parametrize("value", ["abc", "-1", "1000001", "2.5"])
def test_a_bad_receive_polling_time_is_one_line_for_each_command(value):
    for args in (("worker", "--listen", "127.0.0.1:0"), ("serve", "--model", "none"), ("ask", "--local", "hi")):
        assert_one_line_error(edgetp(*args, env={"EDGETP_SPIN_US": value}, timeout=60), "EDGETP_SPIN_US",
                              "0 to 1000000", repr(value))


@pytest.mark.parametrize(("name", "value", "says"), [("EDGETP_LINK_MODE", "fast", "blocking or asyncio"),
                                                     ("EDGETP_INT8", "2", "0 or 1")])
def test_a_bad_kernel_or_link_switch_is_one_line_for_each_command(name, value, says):
    # both were read as "not set" before: a typo silently ran the other kernels or link mode
    for args in (("worker", "--listen", "127.0.0.1:0"), ("serve", "--model", "none"), ("ask", "--local", "hi")):
        assert_one_line_error(edgetp(*args, env={name: value}, timeout=60), name, says, repr(value))


def test_a_prompt_that_is_not_utf8_is_refused_in_one_line(stories_path):
    """Latin-1 bytes, on the command line (Python hands them on as lone surrogates) or piped in: one
    line naming the byte, before any model is opened, never a traceback from the tokenizer."""
    argv = [sys.executable, "-m", "edgetp", "ask", "--local", "--model", str(stories_path), "--max-tokens", "2"]
    for extra, stdin, needle in (([b"caf\xe9 ok"], None, "byte 0xE9 at character 3"),
                                 ([], b"caf\xe9 \xff hello", "byte 0xE9 at byte 3")):
        result = subprocess.run(argv + extra, input=stdin or b"", capture_output=True, timeout=120)
        result = subprocess.CompletedProcess(result.args, result.returncode, result.stdout.decode(),
                                             result.stderr.decode())
        assert_one_line_error(result, "not UTF-8 text", needle)


def test_workers_without_local_are_refused_not_ignored():
    """Without --local, ask goes to a running server; a --workers list there was silently unused."""
    result = edgetp("ask", "--workers", "127.0.0.1:1", "hi", timeout=60)
    assert result.returncode == 2 and "--workers needs --local" in result.stderr and "Traceback" not in result.stderr


def test_every_user_error_the_cli_names_exists():
    # the CLI finds them by module and name (a client command imports no model code): a name
    # that is not there would turn a user's one-line error into a traceback
    import importlib  # noqa: PLC0415

    from edgetp import commands  # noqa: PLC0415

    for module, _ in commands._USER_ERRORS:
        importlib.import_module(module)
    found = commands.user_errors()
    assert len(found) == len(commands._USER_ERRORS)
    assert all(isinstance(c, type) and issubclass(c, Exception) for c in found)
