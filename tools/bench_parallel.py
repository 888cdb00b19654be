#!/usr/bin/env python3
"""Benchmark of tensor parallelism over real processes on 127.0.0.1: one Markdown report.

Sections (``--section``, default all):

- **bytes**    bytes per decode token on each of the root's links, measured
               (link counters) beside the exact formula of our protocol
               (frame prefixes and msgpack headers included) and beside
               distributed-llama's count for the same shape and node count.
- **scaling**  decode tok/s of 1 process x 1 thread against 2 processes x 1
               thread (root on core 0, worker on core 1), equal weights.
- **hetero**   one worker slowed down for real (cgroup CPU quota, or a busy
               sibling on its core): speed-weighted plan vs equal plan vs
               the ideal (sum of single-node speeds under the same slowdown).
- **memory**   each node's resident memory beside its plan share of weights
               (run in a fresh child process so the root's RSS is clean).
- **seal**     what sealing the data links (ChaCha20-Poly1305 after a keyed
               handshake) costs per decode token: bytes (16-byte tag per
               frame, measured on the link counters), CPU microseconds to
               seal and open one token's frames (timed on the real codec),
               and decode tok/s of a keyed (sealed) cluster beside a keyless
               (plain) one. Keyless links are the existing trusted-network
               mode, not a bench switch.

    python tools/bench_parallel.py --quick
    python tools/bench_parallel.py --section bytes --out bench.md

Every process started here is stopped in a finally (terminate, then kill);
every loop is bounded in count and in time. One numba thread per process:
several processes with OpenMP spin-waiting on two cores run 100x slower.
"""

from __future__ import annotations

import os

# Before numba / numpy load: one thread per process, no OpenMP spinning, no OpenBLAS threads.
for _k, _v in {"NUMBA_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
               "OPENBLAS_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}.items():
    os.environ.setdefault(_k, _v)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Sequence  # noqa: E402

import msgpack  # noqa: E402

ROOT_DIR = Path(__file__).resolve().parent.parent
if str(ROOT_DIR) not in sys.path:
    sys.path.insert(0, str(ROOT_DIR))

from edgetp.model import gguf, quant, sampling  # noqa: E402
from edgetp.model.generate import LocalRunner  # noqa: E402
from edgetp.net.loopthread import LoopThread  # noqa: E402
from edgetp.net.link import spin_ns  # noqa: E402
from edgetp.parallel import runner as runner_mod  # noqa: E402
from edgetp.parallel.runner import ClusterRunner  # noqa: E402

SMOLLM2 = Path.home() / ".cache/edgetp/models/SmolLM2-135M-Instruct.Q4_1.gguf"
BENCH_DIR = Path.home() / ".cache/edgetp/bench"
SYNTH_1B = BENCH_DIR / "llama-3.2-1b-q8_0.gguf"
GREEDY = sampling.SamplingParams(temperature=0)
CTX = 256
PREFIX_BYTES = 16  # frames.PREFIX.size, restated: the formula must not lean on the code it checks
THIS = Path(__file__).resolve()


# =========================================================================== processes


def _pin(cpus: set[int] | None, cgroup_procs: Path | None = None) -> Callable[[], None] | None:
    """preexec_fn for a child: pin it to cpus and/or put it into a cgroup before it runs."""
    if not cpus and cgroup_procs is None:
        return None

    def fn() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)
        if cgroup_procs is not None:
            cgroup_procs.write_text(str(os.getpid()))
    return fn


class Procs:
    """Every child process of a section; all stopped on exit, whatever happened."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Any] = []

    def __enter__(self) -> "Procs":
        return self

    def __exit__(self, *exc: object) -> None:
        for p in reversed(self.procs):
            stop(p)
        for f in self.logs:
            f.close()

    def worker(self, cpus: set[int] | None = None, cgroup_procs: Path | None = None,
               node_id: str | None = None, key_file: Path | None = None,
               extra: Sequence[str] = ()) -> tuple[subprocess.Popen, str]:
        """An `edgetp worker --threads 1` on a free loopback port: (process, "127.0.0.1:PORT")."""
        log = tempfile.TemporaryFile(mode="w+")
        self.logs.append(log)
        cmd = [sys.executable, "-m", "edgetp", "worker", "--listen", "127.0.0.1:0", "--threads", "1"]
        if node_id:
            cmd += ["--node-id", node_id]
        if key_file:
            cmd += ["--key", str(key_file)]
        cmd += list(extra)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT_DIR,
                                preexec_fn=_pin(cpus, cgroup_procs))
        self.procs.append(proc)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if m := re.search(r"listening on (\S+:\d+)", line):
                return proc, m.group(1)
            if proc.poll() is not None:
                break
        log.seek(0)
        raise RuntimeError(f"worker did not start: {log.read()[-2000:]}")

    def busy(self, cpu: int, seconds: float) -> subprocess.Popen:
        """A CPU-bound sibling pinned to `cpu`, ending by itself after `seconds` at the latest."""
        code = f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"
        proc = subprocess.Popen([sys.executable, "-c", code], preexec_fn=_pin({cpu}),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append(proc)
        return proc

    def run_child(self, args: list[str], cpus: set[int] | None = None, cgroup_procs: Path | None = None,
                  timeout: float = 900) -> str:
        """This script in a child process (pinned/cgrouped); returns its stdout."""
        proc = subprocess.Popen([sys.executable, str(THIS), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=ROOT_DIR, preexec_fn=_pin(cpus, cgroup_procs))
        self.procs.append(proc)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop(proc)
            raise RuntimeError(f"child {args} timed out after {timeout:.0f} s") from None
        if proc.returncode:
            raise RuntimeError(f"child {args} failed ({proc.returncode}): {err[-3000:]}")
        return out


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout:
        proc.stdout.close()
    if proc.stderr:
        proc.stderr.close()


def rss_of(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# =========================================================================== slowdown


class CpuQuota:
    """A cgroup with a CPU quota (v2 cpu.max, else v1 cfs_quota_us); removed on exit."""

    def __init__(self, fraction: float, period_us: int = 20000) -> None:
        self.fraction, self.period = fraction, period_us
        self.dir: Path | None = None
        self.kind = ""

    @staticmethod
    def available() -> str | None:
        for base in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
            ctl = base / "cgroup.controllers"
            if ctl.exists() and "cpu" in ctl.read_text().split() and os.access(base, os.W_OK):
                return "v2"
        v1 = Path("/sys/fs/cgroup/cpu")
        if (v1 / "cpu.cfs_quota_us").exists() and os.access(v1, os.W_OK):
            return "v1"
        return None

    def __enter__(self) -> "CpuQuota":
        self.kind = self.available() or ""
        name = f"edgetp_bench_{os.getpid()}"
        if self.kind == "v2":
            base = next(b for b in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"))
                        if (b / "cgroup.controllers").exists() and "cpu" in (b / "cgroup.controllers").read_text())
            self.dir = base / name
            self.dir.mkdir()
        elif self.kind == "v1":
            self.dir = Path("/sys/fs/cgroup/cpu") / name
            self.dir.mkdir()
            (self.dir / "cpu.cfs_period_us").write_text(str(self.period))
        else:
            raise RuntimeError("no writable cgroup cpu controller")
        self.set(self.fraction)
        return self

    def set(self, fraction: float) -> None:
        """Change the quota, members and all, at once (tools/bench_rebalance.py cuts it mid-answer)."""
        assert self.dir is not None
        self.fraction, quota = fraction, int(fraction * self.period)
        if self.kind == "v2":
            (self.dir / "cpu.max").write_text(f"{quota} {self.period}")
        else:
            (self.dir / "cpu.cfs_quota_us").write_text(str(quota))

    @property
    def procs(self) -> Path:
        assert self.dir is not None
        return self.dir / "cgroup.procs"

    def describe(self) -> str:
        return (f"cgroup {self.kind} CPU quota {self.fraction:.0%} of one core "
                f"({int(self.fraction * self.period)} us per {self.period} us)")

    def __exit__(self, *exc: object) -> None:
        if self.dir is None:
            return
        for _ in range(50):  # the members must be gone (they are stopped before this runs)
            try:
                self.dir.rmdir()
                return
            except OSError:
                time.sleep(0.1)


# =========================================================================== decoding


_CAPTURED: list[dict[str, Any]] = []
_orig_candidates_rows_from = runner_mod.candidates_rows_from


def _capturing_candidates_rows_from(frame, n):  # the root's view of each worker's LOGITS header
    _CAPTURED.append({"ids": list(frame.header.get("rows", [[]])[0])})
    return _orig_candidates_rows_from(frame, n)


runner_mod.candidates_rows_from = _capturing_candidates_rows_from


@dataclass
class Tok:
    pos: int                 # position of the fed token
    fed: int                 # token id fed (the STEP header's ids)
    dt: float                # seconds of runner.run
    links: dict[str, Any] = field(default_factory=dict)   # link name -> Counters delta
    cids: list[list[int]] = field(default_factory=list)   # per worker link: candidate ids it sent


@dataclass
class Decode:
    toks: list[Tok]
    prefill_s: float

    @property
    def tok_s(self) -> float:
        return len(self.toks) / sum(t.dt for t in self.toks) if self.toks else float("nan")

    @property
    def median_tok_s(self) -> float:
        return 1 / statistics.median(t.dt for t in self.toks) if self.toks else float("nan")


def decode(runner, prompt: Sequence[int], n: int, limit_s: float) -> Decode:
    """Greedy: prefill the prompt, then up to n single-token steps (stops early after limit_s)."""
    is_cluster = isinstance(runner, ClusterRunner)
    runner.begin(GREEDY)
    try:
        history = list(prompt)
        t0 = time.perf_counter()
        cand = runner.run(list(prompt), 0, history, GREEDY)
        prefill = time.perf_counter() - t0
        tok, pos, toks = int(cand.ids[0]), len(prompt), []
        start = time.perf_counter()
        for _ in range(n):
            history.append(tok)
            before = runner.counters() if is_cluster else {}
            _CAPTURED.clear()
            t0 = time.perf_counter()
            cand = runner.run([tok], pos, history, GREEDY)
            dt = time.perf_counter() - t0
            rec = Tok(pos, tok, dt)
            if is_cluster:
                after = runner.counters()
                rec.links = {k: after[k].minus(before[k]) for k in after}
                rec.cids = [c["ids"] for c in _CAPTURED]
            toks.append(rec)
            tok, pos = int(cand.ids[0]), pos + 1
            if time.perf_counter() - start > limit_s or pos >= runner.ctx - 1:
                break
        return Decode(toks, prefill)
    finally:
        runner.end()


def prompt_for(path: Path) -> list[int]:
    mf = gguf.open_model(path)
    if "SmolLM2" in path.name:
        from edgetp.model.tokenizer import Tokenizer  # noqa: PLC0415
        return Tokenizer.from_metadata(mf.metadata).encode("The capital of France is a city that", parse_special=True)
    vocab = mf.config.vocab
    return [1, 17, 300, 5000, 20000 % vocab, 70000 % vocab, 100000 % vocab, vocab - 1]


def connect(control: LoopThread, path: Path, addresses: Sequence[str], weights, sync: str,
            key: bytes | None = None) -> ClusterRunner:
    mf = gguf.open_model(path)
    return control.run(ClusterRunner.connect(mf, list(addresses), ctx=CTX, weights=weights, sync=sync, threads=1,
                                             key=key), timeout=600)


def ensure_1b() -> Path:
    if not SYNTH_1B.exists():
        from tools import synth_gguf  # noqa: PLC0415
        BENCH_DIR.mkdir(parents=True, exist_ok=True)
        synth_gguf.write_preset(SYNTH_1B, "llama-3.2-1b", weight_type="q8_0")
    return SYNTH_1B


# =========================================================================== formulas


def frame_bytes(header: dict[str, Any], payload: int) -> int:
    """One frame on the wire: 16-byte prefix + msgpack header + payload."""
    return PREFIX_BYTES + len(msgpack.packb(header, use_bin_type=True)) + payload


def sync_frame_bytes(dim: int, sync: str) -> int:
    """One PARTIAL or REDUCED frame of a single position: empty header, bare payload."""
    return frame_bytes({}, 4 * dim if sync == "f32" else dim // 32 * 34)


def step_frame_bytes(dim: int, pos: int, fed: int) -> int:
    """STEP to a worker that maps the embedding table: the token id only, no vector; its slot and the
    sampling parameters it answers candidates for."""
    return frame_bytes({"slot": 0, "pos": pos, "ids": [fed], "want": "candidates", "params": asdict(GREEDY)}, 0)


def logits_frame_bytes(cids: list[int]) -> int:
    """Greedy candidates of one row: header {rows, lse, own} (+ dtype/shape) and one f32 per candidate."""
    lse = 0.0 if cids else float("-inf")
    return frame_bytes({"rows": [list(cids)], "lse": [lse], "own": [None], "dtype": "float32",
                        "shape": [len(cids)]}, 4 * len(cids))


def ours_per_link(dim: int, layers: int, sync: str, pos: int, fed: int, cids: list[int]) -> tuple[int, int]:
    """(down, up) bytes of one decode token on one root<->worker link."""
    s = sync_frame_bytes(dim, sync)
    down = step_frame_bytes(dim, pos, fed) + 2 * layers * s        # STEP + REDUCED x 2 per layer
    up = 2 * layers * s + logits_frame_bytes(cids)                  # PARTIAL x 2 per layer + LOGITS
    return down, up


def dllama_totals(dim: int, layers: int, vocab: int, n: int) -> tuple[float, float]:
    """distributed-llama, Q80 sync, per direction, summed over the root's n-1 links."""
    sync = 2 * layers * (n - 1) * dim * 34 / 32
    return sync + (n - 1) * dim * 4, sync + vocab * 4 * (n - 1) / n


# =========================================================================== markdown


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def kb(n: float) -> str:
    return f"{n:,.0f}"


def mb(n: float) -> str:
    return f"{n / 2**20:,.1f}"


# =========================================================================== section: bytes


def section_bytes(args, control: LoopThread) -> str:
    models = [("SmolLM2-135M Q4_1", SMOLLM2, True)]
    models.append(("Llama-3.2-1B shape, Q8_0 (synthetic)", ensure_1b(), not args.quick))
    out = ["## 1. Bytes per decode token\n",
           "Measured: root link counters (sent = down to the worker, received = up from it), summed over "
           f"{args.bytes_tokens} decode tokens and divided by the token count. Formula: per worker link and token, "
           "down = STEP(16 + msgpack{pos, ids, want}) + 2·L·REDUCED, "
           "up = 2·L·PARTIAL + LOGITS(16 + msgpack{ids, lse, dtype, shape} + 4 per candidate), "
           "a sync frame being 16 + msgpack{} + payload (f32: 4·dim; q8_0: dim/32·34). "
           "Header sizes are msgpack.packb of the same dicts with each token's pos, fed id and the worker's "
           "candidate id; 'match' means formula == measured for every single token on every link.\n",
           "distributed-llama (dllama), Q80 sync, per direction over the root's N−1 links: "
           "sync 2·L·(N−1)·dim·34/32, plus the embedding broadcast (N−1)·dim·4 down and the logits gather "
           "vocab·4·(N−1)/N up. (dllama itself only runs N = 2^k; N = 3 is its formula extrapolated.)\n"]
    with Procs() as procs:
        workers = [procs.worker(node_id=f"w{i + 1}")[1] for i in range(3)]
        for label, path, measure in models:
            cfg = gguf.open_model(path).config
            dim, L, vocab = cfg.dim, cfg.n_layers, cfg.vocab
            out.append(f"### {label}: dim {dim}, {L} layers, vocab {vocab}\n")
            if not measure:
                out.append("_Formula only (`--quick`; the full run measures it too). Headers computed with "
                           "pos 100, fed id 1000 and a 3-byte candidate id: a few bytes per token off the "
                           "measured value at most._\n")
            prompt = prompt_for(path)
            rows = []
            for sync in ("f32", "q8_0"):
                for n in (2, 3, 4):
                    dl_down, dl_up = dllama_totals(dim, L, vocab, n)
                    if measure:
                        runner = connect(control, path, workers[: n - 1], [1] * n, sync)
                        try:
                            d = decode(runner, prompt, args.bytes_tokens, args.limit)
                            names = [link.name for link in runner.links]
                        finally:
                            runner.close()
                        T = len(d.toks)
                        m_down = sum(t.links[k].sent for t in d.toks for k in names) / T
                        m_up = sum(t.links[k].received for t in d.toks for k in names) / T
                        f_down = f_up = 0
                        exact = True
                        for t in d.toks:
                            for i, k in enumerate(names):
                                fd, fu = ours_per_link(dim, L, sync, t.pos, t.fed, t.cids[i])
                                f_down += fd
                                f_up += fu
                                exact &= (fd, fu) == (t.links[k].sent, t.links[k].received)
                        f_down /= T
                        f_up /= T
                        match = f"yes ({T} tok × {n - 1} links)" if exact else "**NO**"
                    else:
                        per = [ours_per_link(dim, L, sync, 100, 1000, [1000]) for _ in range(n - 1)]
                        f_down, f_up = sum(p[0] for p in per), sum(p[1] for p in per)
                        m_down = m_up = float("nan")
                        match = "n/a"
                    ratio = lambda a, b: f"{a / b:.3f}"  # noqa: E731
                    rows.append([sync, n, kb(m_down) if measure else "—", kb(f_down),
                                 kb(m_up) if measure else "—", kb(f_up), match,
                                 f"{kb(f_down / (n - 1))} / {kb(f_up / (n - 1))}",
                                 kb(dl_down), kb(dl_up),
                                 f"{ratio(f_down, dl_down)} / {ratio(f_up, dl_up)} / "
                                 f"**{ratio(f_down + f_up, dl_down + dl_up)}**"])
            out.append(table(["sync", "N", "ours down (measured)", "ours down (formula)", "ours up (measured)",
                              "ours up (formula)", "match", "ours per link down / up", "dllama down", "dllama up",
                              "ours ÷ dllama: down / up / **total**"], rows))
            s32, s8 = sync_frame_bytes(dim, "f32"), sync_frame_bytes(dim, "q8_0")
            out.append(f"\nFrame sizes here: sync frame f32 {s32} B (payload {4 * dim} + {s32 - 4 * dim} overhead), "
                       f"q8_0 {s8} B (payload {dim // 32 * 34} + {s8 - dim // 32 * 34} overhead); "
                       f"STEP {step_frame_bytes(dim, 100, 1000)} B; LOGITS {logits_frame_bytes([1000])} B "
                       f"(dllama's logits slice per worker: {kb(vocab * 4 / 2)} B at N=2).\n")
    return "\n".join(out)


# =========================================================================== section: scaling


def local_decode(path: Path, n: int, limit: float) -> Decode:
    quant.set_threads(1)
    runner = LocalRunner(gguf.open_model(path), CTX)
    decode(runner, prompt_for(path), 2, limit)  # warm-up: kernels compiled/loaded, pages touched
    return decode(runner, prompt_for(path), n, limit)


def cluster_stats(d: Decode) -> tuple[float, float]:
    """Per token: root seconds blocked receiving, sending (all links), as fractions of the token time."""
    total = sum(t.dt for t in d.toks)
    recv = sum(c.recv_s for t in d.toks for c in t.links.values())
    send = sum(c.send_s for t in d.toks for c in t.links.values())
    return recv / total, send / total


def section_scaling(args, control: LoopThread) -> str:
    models = [("SmolLM2-135M Q4_1", SMOLLM2)]
    if not args.quick:
        models.insert(0, ("Llama-3.2-1B shape Q8_0", ensure_1b()))
    rounds = 1 if args.quick else args.rounds
    out = ["## 2. Scaling: 1 process × 1 thread vs 2 processes × 1 thread\n",
           f"Root (and the single process) pinned to core 0, worker pinned to core 1, weights [1, 1]. "
           f"{args.tokens} decode tokens after an {len(prompt_for(SMOLLM2))}-ish-token prompt, {rounds} round(s) "
           "alternating single/cluster; tok/s = tokens / total decode time, 'best' is the best round "
           "(the machine is shared, slower rounds are other load). Root wait = time the root spent blocked "
           "receiving from the worker (partials + logits, i.e. the worker's compute beyond the root's plus the "
           "transfer), as a share of the token time.\n"]
    rows = []
    with Procs() as procs:
        _, addr = procs.worker(cpus={1}, node_id="w-core1")
        for label, path in models:
            local_runs: list[Decode] = []
            cl_runs: dict[str, list[Decode]] = {"f32": [], "q8_0": []}
            modes: dict[str, str] = {}
            quant.set_threads(1)
            local = LocalRunner(gguf.open_model(path), CTX)
            prompt = prompt_for(path)
            decode(local, prompt, 2, args.limit)
            try:
                for _ in range(rounds):
                    local_runs.append(decode(local, prompt, args.tokens, args.limit))
                    for sync in cl_runs:
                        runner = connect(control, path, [addr], [1, 1], sync)
                        try:
                            decode(runner, prompt, 2, args.limit)
                            cl_runs[sync].append(decode(runner, prompt, args.tokens, args.limit))
                            modes[sync] = runner.nodes[1].mode
                        finally:
                            runner.close()
            finally:
                del local
            best_local = max(d.tok_s for d in local_runs)
            rows.append([label, "1 × 1 (core 0)", "—", f"{best_local:.2f}",
                         f"{statistics.median(d.tok_s for d in local_runs):.2f}", "1.00×", "—", "—"])
            child = procs.run_child(["--_local-child", str(path), "--tokens", str(args.tokens),
                                     "--limit", str(args.limit)], cpus={1})
            core1 = json.loads(child.strip().splitlines()[-1])["tok_s"]
            rows.append([label, "1 × 1 (core 1, the worker's core)", "—", f"{core1:.2f}", "—",
                         f"{core1 / best_local:.2f}×", "—", "—"])
            for sync, runs in cl_runs.items():
                best = max(runs, key=lambda d: d.tok_s)
                recv, send = cluster_stats(best)
                rows.append([label, f"2 × 1 ({sync} sync)", modes[sync], f"{best.tok_s:.2f}",
                             f"{statistics.median(d.tok_s for d in runs):.2f}",
                             f"**{best.tok_s / best_local:.2f}×**", f"{recv:.0%}", f"{send:.1%}"])
    out.append(table(["model", "processes × threads", "link mode", "tok/s best", "tok/s median",
                      "speed-up (best/best)", "root wait (recv)", "root send"], rows))
    out.append("\nTarget: ≥ 1.6× on the 1B shape.\n")
    return "\n".join(out)


# =========================================================================== section: hetero


def section_hetero(args, control: LoopThread) -> str:
    path, label = (SMOLLM2, "SmolLM2-135M Q4_1") if args.quick else (ensure_1b(), "Llama-3.2-1B shape Q8_0")
    rounds = 1 if args.quick else args.rounds
    method = args.slow
    if method == "auto":
        method = "quota" if CpuQuota.available() else "busy"
    out = [f"## 3. Heterogeneity: one slowed worker ({label})\n"]
    with contextlib.ExitStack() as stack:
        cg = (stack.enter_context(CpuQuota(args.slow_fraction, args.quota_period_us))
              if method == "quota" else None)
        procs = stack.enter_context(Procs())  # exits first (LIFO): members gone before the cgroup is removed
        if cg is not None:
            how = cg.describe() + " on the worker (core 1)"
        else:
            procs.busy(1, seconds=args.limit * 20)
            how = "a busy Python sibling pinned to the worker's core 1 (CFS shares the core ~50/50)"
        procs_cg = cg.procs if cg else None
        out.append(f"Slowdown: {how}. Root on core 0, worker on core 1, 1 thread each, f32 sync, "
                   f"{args.tokens} decode tokens, {rounds} round(s). Single-node speeds are measured in the same "
                   "conditions (root: in this process on core 0; slowed node: a child process on core 1 "
                   "under the same slowdown).\n")
        # single-node speeds
        root_single = local_decode(path, args.tokens, args.limit).tok_s
        child = procs.run_child(["--_local-child", str(path), "--tokens", str(args.tokens),
                                 "--limit", str(args.limit)], cpus={1}, cgroup_procs=procs_cg)
        slow_single = json.loads(child.strip().splitlines()[-1])["tok_s"]
        ideal = root_single + slow_single
        _, addr = procs.worker(cpus={1}, cgroup_procs=procs_cg, node_id="w-slow")
        res: dict[str, list[Decode]] = {"weighted": [], "equal": []}
        plans: dict[str, str] = {}
        for _ in range(rounds):
            for kind in res:
                runner = connect(control, path, [addr], None if kind == "weighted" else [1, 1], "f32")
                try:
                    decode(runner, prompt_for(path), 2, args.limit)
                    res[kind].append(decode(runner, prompt_for(path), args.tokens, args.limit))
                    shape = runner.plan.shape
                    works = [shape.share_work(s) for s in runner.plan.shares]
                    speeds = [n.speed for n in runner.nodes]
                    plans[kind] = (", ".join(f"{n.node_id}: {w / sum(works):.0%} of weights"
                                             for n, w in zip(runner.nodes, works))
                                   + ("; measured speeds " + " / ".join(f"{s / 1e9:.2f} GB/s" for s in speeds)
                                      if kind == "weighted" else ""))
                finally:
                    runner.close()
        w = max(d.tok_s for d in res["weighted"])
        e = max(d.tok_s for d in res["equal"])
        rows = [["root alone (core 0)", "—", f"{root_single:.2f}"],
                ["slowed node alone (core 1)", "—", f"{slow_single:.2f}"],
                ["ideal = sum of the two", "—", f"{ideal:.2f}"],
                ["equal plan (weights [1, 1])", plans["equal"], f"{e:.2f}"],
                ["speed-weighted plan (PROFILE)", plans["weighted"], f"{w:.2f}"]]
        out.append(table(["configuration", "plan", "decode tok/s (best)"], rows))
        out.append(f"\n**weighted / equal = {w / e:.2f}×** (target ≥ 1.25×), "
                   f"**weighted / ideal = {w / ideal:.0%}** (target ≥ 85%). "
                   f"Medians: weighted {statistics.median(d.tok_s for d in res['weighted']):.2f}, "
                   f"equal {statistics.median(d.tok_s for d in res['equal']):.2f} tok/s.\n")
    return "\n".join(out)


# =========================================================================== section: memory


def memory_rows(args, control: LoopThread, weights: list[float]) -> list[list[str]]:
    """One plan's rows; runs in a fresh child process so the root's RSS is this plan's alone."""
    path = SMOLLM2 if args.quick else ensure_1b()
    rows = []
    with Procs() as procs:
        started = [procs.worker(node_id=f"w{i + 1}") for i in range(len(weights) - 1)]
        time.sleep(0.5)
        idle = [rss_of(p.pid) for p, _ in started]
        root_before = rss_of()
        runner = connect(control, path, [a for _, a in started], weights, "f32")
        try:
            decode(runner, prompt_for(path), 4, args.limit)
            after = [rss_of()] + [rss_of(p.pid) for p, _ in started]
            shape = runner.plan.shape
            for i, (node, share) in enumerate(zip(runner.nodes, runner.plan.shares)):
                work = shape.share_work(share)
                base = root_before if i == 0 else idle[i - 1]
                ready = "—" if i == 0 else mb(node.rss)
                rows.append([str(weights), node.node_id, f"{mb(work)} ({work / shape.weight_bytes:.0%})",
                             mb(base), ready, mb(after[i]), mb(after[i] - base), mb(after[i] - work)])
        finally:
            runner.close()
    return rows


def section_memory(args, control: LoopThread) -> str:
    path, label = (SMOLLM2, "SmolLM2-135M Q4_1") if args.quick else (ensure_1b(), "Llama-3.2-1B shape Q8_0")
    file_bytes = path.stat().st_size
    out = [f"## 4. Memory: resident set vs plan share ({label}, file {mb(file_bytes)} MiB)\n",
           "Each plan in a fresh root process with fresh workers. 'idle' = the process's RSS before it got a "
           "shard (Python + numpy + numba, no kernel run yet); 'READY' = the RSS the worker reported after "
           "loading and warming its shard; 'after decode' = /proc/PID/statm after 4 tokens (the root: "
           "/proc/self/statm). Weights are mapped from the file, so RSS counts only pages of the node's own "
           f"slices (plus the embedding rows the root reads). KV cache: ctx {CTX}.\n"]
    configs = [[1, 1], [1, 3], [1, 2, 3]] if args.quick else [[1, 1], [1, 3], [1, 2, 3], [1, 1, 1, 1]]
    rows = []
    with Procs() as procs:
        for weights in configs:
            extra = ["--quick"] if args.quick else []
            text = procs.run_child(["--_memory-config", ",".join(str(w) for w in weights),
                                    "--limit", str(args.limit), *extra])
            rows += json.loads(text.strip().splitlines()[-1])
    out.append(table(["weights", "node", "share of weights MiB (%)", "idle RSS MiB", "READY RSS MiB",
                      "RSS after decode MiB", "growth MiB", "RSS − share MiB"], rows))
    out.append("\nRSS grows with the share, not the model, when 'RSS − share' stays flat for a node across "
               "plans (the rest is the per-process runtime: interpreter, numpy, numba and its loaded kernels, "
               "KV cache, buffers).\n")
    return "\n".join(out)


# =========================================================================== section: seal


def seal_micro(dim: int, layers: int, sync: str, tokens: int = 100) -> tuple[float, float]:
    """(sealed, plain) CPU microseconds to send and receive one decode token's frames on one link.

    One token on one link is 2·L PARTIAL and 2·L REDUCED frames, a STEP and a LOGITS. Each goes as
    the product moves it, between two blocking Links over a loopback TCP pair, both ends in this
    thread: the all-reduce frames on the compiled path (net/wire.py; sealed ones sealed and opened
    in the same call, net/aead.py), the STEP and LOGITS through the general codec.
    """
    import numpy as np  # noqa: PLC0415

    from edgetp.net import frames  # noqa: PLC0415
    from edgetp.net.link import Link  # noqa: PLC0415

    key = bytes(range(32))
    x = np.random.default_rng(0).standard_normal((1, dim)).astype(np.float32)
    y = np.zeros_like(x)
    step, logits = {"tokens": [1], "pos": [0]}, np.zeros(64, np.float32)

    def run(keys) -> float:
        with socket.create_server(("127.0.0.1", 0)) as lst:
            sa = socket.create_connection(lst.getsockname(), timeout=10)
            sb = lst.accept()[0]
        a, b = Link(sa, "a", timeout=10), Link(sb, "b", timeout=10)
        try:
            a.trust(keys)
            b.trust(keys[::-1] if keys else None)
            a.enter_blocking()
            b.enter_blocking()

            def hot(src: Link, dst: Link, ftype) -> None:
                if sync == "f32":
                    src.send_values_blocking(ftype, x)
                    dst.recv_values_blocking(ftype, y, add=True)
                else:
                    src.send_q8_blocking(ftype, x.reshape(-1), back=False)
                    dst.recv_q8_blocking(ftype, y.reshape(-1), add=True)

            def token() -> None:
                a.send_blocking(frames.FrameType.STEP, step)
                b.recv_blocking(frames.FrameType.STEP)
                for _ in range(2 * layers):
                    hot(b, a, frames.FrameType.PARTIAL)
                    hot(a, b, frames.FrameType.REDUCED)
                b.send_blocking(frames.FrameType.LOGITS, {}, logits)
                a.recv_blocking(frames.FrameType.LOGITS)
                y[...] = 0

            token()  # compiled code loaded, buffers made
            t0 = time.thread_time()
            for _ in range(tokens):
                token()
            return (time.thread_time() - t0) / tokens * 1e6
        finally:
            a.close()
            b.close()

    return run((key, key[::-1])), run(None)


def section_seal(args, control: LoopThread) -> str:
    path, label = SMOLLM2, "SmolLM2-135M Q4_1"
    cfg = gguf.open_model(path).config
    dim, L = cfg.dim, cfg.n_layers
    rounds = 1 if args.quick else args.rounds
    out = ["## 5. Sealed data links: cost per decode token\n",
           f"{label} (dim {dim}, {L} layers): one decode token moves 4·L + 2 = {4 * L + 2} frames on each "
           "root↔worker link, each 16 bytes longer when sealed (the Poly1305 tag; the prefix stays in clear "
           "as associated data). CPU: `thread_time` of sending and receiving those frames as the product does "
           "(the all-reduce frames on the compiled path, sealed there too) over loopback TCP in one thread, "
           "sealed vs plain, so it is the sum over both ends of the link. "
           f"Decode: root on core 0, one worker on core 1, weights [1, 1], {args.tokens} tokens, "
           f"{rounds} round(s) alternating keyless (plain) and keyed (sealed); best round.\n"]
    rows = []
    for sync in ("f32", "q8_0"):
        sealed, plain = seal_micro(dim, L, sync)
        rows.append([sync, f"{16 * (4 * L + 2):,}", f"{plain:.0f}", f"{sealed:.0f}", f"**{sealed - plain:.0f}**"])
    out.append(table(["sync", "extra bytes per token per link", "codec µs/token plain", "codec µs/token sealed",
                      "sealing µs/token"], rows))
    key_dir = Path(tempfile.mkdtemp(prefix="edgetp-bench-key-"))
    key_file = key_dir / "cluster.key"
    from edgetp.net import auth  # noqa: PLC0415
    key = auth.write_key(key_file)
    rows = []
    try:
        with Procs() as procs:
            _, plain_addr = procs.worker(cpus={1}, node_id="w-plain")
            _, keyed_addr = procs.worker(cpus={1}, node_id="w-sealed", key_file=key_file)
            prompt = prompt_for(path)
            for sync in ("f32", "q8_0"):
                runs: dict[str, list[Decode]] = {"plain (no key)": [], "sealed (--key)": []}
                for _ in range(rounds):
                    for name, addr, k in (("plain (no key)", plain_addr, None), ("sealed (--key)", keyed_addr, key)):
                        runner = connect(control, path, [addr], [1, 1], sync, key=k)
                        try:
                            decode(runner, prompt, 2, args.limit)
                            runs[name].append(decode(runner, prompt, args.tokens, args.limit))
                        finally:
                            runner.close()
                for name, ds in runs.items():
                    best = max(ds, key=lambda d: d.tok_s)
                    down = statistics.mean(sum(v.sent for v in t.links.values()) for t in best.toks)
                    up = statistics.mean(sum(v.received for v in t.links.values()) for t in best.toks)
                    rows.append([sync, name, f"{down:,.0f}", f"{up:,.0f}", f"{best.tok_s:.2f}",
                                 f"{1e6 / best.tok_s:,.0f}"])
    finally:
        key_file.unlink(missing_ok=True)
        key_dir.rmdir()
    out.append("\n" + table(["sync", "link", "bytes down / token (measured)", "bytes up / token (measured)",
                              "tok/s best", "µs per token"], rows))
    return "\n".join(out)


# =========================================================================== main


def pingpong(n: int = 1000, size: int = 2346, poll: int = 0) -> tuple[float, float, float]:
    """Round trips of a sync-sized message between core 0 and core 1 over a socketpair: median, mean, p99 (us).
    Each receive polls for `poll` ns before it waits in the kernel (tools/bench_allreduce.receive).

    The floor of one all-reduce here; on a machine shared with other jobs the mean shows
    how long a woken process waits for its core.
    """
    from tools.bench_allreduce import echo, receive  # noqa: PLC0415

    a, b = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # child: echo, pinned to core 1; never returns into the caller's code
        try:
            os.sched_setaffinity(0, {1})
            a.close()
            echo(b, size, n, poll)
        finally:
            os._exit(0)
    b.close()
    buf = memoryview(bytearray(size))
    times = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            a.sendall(buf)
            receive(a, buf, poll)
            times.append(time.perf_counter() - t0)
    finally:
        a.close()
        os.waitpid(pid, 0)
    times.sort()
    return times[n // 2] * 1e6, sum(times) / n * 1e6, times[int(n * 0.99)] * 1e6


def header(args) -> str:
    med, mean, p99 = pingpong()
    polled = pingpong(poll=spin_ns())
    load = os.getloadavg()
    slow = args.slow if args.slow != "auto" else ("quota" if CpuQuota.available() else "busy")
    return "\n".join([
        "# edgetp tensor-parallel benchmark\n",
        f"- {time.strftime('%Y-%m-%d %H:%M:%S')}, {os.cpu_count()} CPUs, load average at start "
        f"{load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (other jobs share this machine: timings are noisy)",
        f"- 1 numba thread per process; env NUMBA_NUM_THREADS={os.environ['NUMBA_NUM_THREADS']} "
        f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']} OPENBLAS_NUM_THREADS={os.environ['OPENBLAS_NUM_THREADS']}; "
        f"link mode forced: {os.environ.get('EDGETP_LINK_MODE', 'no (measured per link)')}",
        f"- options: {'--quick ' if args.quick else ''}sections {','.join(args.sections)}, tokens {args.tokens}, "
        f"bytes tokens {args.bytes_tokens}, slowdown {slow}, limit {args.limit:.0f} s per decode loop",
        f"- socket round trip core 0 <-> core 1, 2346 B each way (one f32 all-reduce of SmolLM2): "
        f"median {med:.0f} us, mean {mean:.0f} us, p99 {p99:.0f} us; each receive polling first for "
        f"{spin_ns() / 1000:g} us as the product's do (EDGETP_SPIN_US): median {polled[0]:.0f} us, mean "
        f"{polled[1]:.0f} us, p99 {polled[2]:.0f} us (one decode token does 2 x layers of these)\n",
    ])


def local_child(args) -> int:
    """Child mode: single-process decode tok/s of a model, as one JSON line."""
    d = local_decode(Path(args.local_child), args.tokens, args.limit)
    print(json.dumps({"tok_s": d.tok_s, "median_tok_s": d.median_tok_s, "tokens": len(d.toks)}))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="SmolLM2 only, small token counts")
    ap.add_argument("--section", action="append", choices=["bytes", "scaling", "hetero", "memory", "seal"],
                    help="run only this section (repeatable)")
    ap.add_argument("--tokens", type=int, default=None, help="decode tokens per measurement")
    ap.add_argument("--bytes-tokens", type=int, default=None, help="decode tokens for the bytes section")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds in scaling/hetero (full run)")
    ap.add_argument("--limit", type=float, default=90.0, help="seconds at most per decode loop")
    ap.add_argument("--slow", choices=["auto", "quota", "busy"], default="auto",
                    help="how to slow the worker down in the hetero section (auto: quota if a cgroup is writable)")
    ap.add_argument("--slow-fraction", type=float, default=0.5, help="CPU quota of the slowed node (quota mode)")
    ap.add_argument("--quota-period-us", type=int, default=20000, help="cgroup CPU period (quota mode)")
    ap.add_argument("--out", help="also write the report to this file")
    ap.add_argument("--_local-child", dest="local_child", help=argparse.SUPPRESS)
    ap.add_argument("--_memory-config", dest="memory_config", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.tokens is None:
        args.tokens = 12 if args.quick else 32
    if args.bytes_tokens is None:
        args.bytes_tokens = 6 if args.quick else 8
    args.sections = args.section or ["bytes", "scaling", "hetero", "memory", "seal"]
    quant.set_threads(1)
    if args.local_child:  # pinned (and cgrouped) by the parent
        return local_child(args)
    os.sched_setaffinity(0, {0})  # the root (this process and every thread it starts) on core 0
    if args.memory_config:
        with LoopThread() as control:
            print(json.dumps(memory_rows(args, control, [int(w) for w in args.memory_config.split(",")])))
        return 0
    parts = [header(args)]
    with LoopThread() as control:
        for name in args.sections:
            t0 = time.perf_counter()
            text = {"bytes": section_bytes, "scaling": section_scaling, "hetero": section_hetero,
                    "memory": section_memory, "seal": section_seal}[name](args, control)
            parts.append(text + f"\n_(section took {time.perf_counter() - t0:.0f} s)_\n")
            print(f"[bench_parallel] section {name} done in {time.perf_counter() - t0:.0f} s",
                  file=sys.stderr, flush=True)
    report = "\n".join(parts)
    print(report)
    if args.out:
        Path(args.out).write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
