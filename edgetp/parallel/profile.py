"""How fast and how roomy this device is: the inputs of the planner.

Speed is measured with decode's own kernel calls (`decode.Matvecs`) on random
matrices of the model's own shapes and types: a *token pass*, one layer's
matrices grouped as decode calls them (q, k and v in one call; o; gate and up
in one; down; a mixture's used experts) and 1/L of the output head's rows
(`token_pass`). So a pass is 1/L of what a token reads, and the speed, weight
bytes per second, is what this device will actually do per token. Small
models' matrices read slower than large ones (a kernel call costs some
microseconds whatever its size): one 8192-row matrix of SmolLM2's type read
1.65-2.5x faster than SmolLM2 decodes on the AMD EPYC here, its token pass
1.2-1.3x (tools/bench_profile.py), so the one matrix, which the profile
timed before, took a node's share of a small model (or of a mixture's small
experts) for far more than it could do. A node given no pass (an old root, a
daemon's advert without a model) times that one matrix still.

A token reads every weight once, from RAM, so the timing cycles through copies
of the pass that together exceed the last-level cache twice over
(`cache_bytes`, `copies_for`): one matrix read again and again stays in a 32
MiB L3, and there an 8192 x 2048 Q4_0 matvec ran 2.5x (one core) to 3.1x (two)
faster than from RAM on the AMD EPYC here, where a Pi 5's 2 MiB L3 holds none
of it. A node with a large cache was thus planned a share its memory could not
feed. A pass larger than a quarter of the room this process has is timed with
fewer rows of each matrix (`fit`). The same passes then time a decode step of
BATCH_ROWS tokens (the several-token kernels, weights read once): what each
further token of a step costs (`Profile.row_cost`), which the cost model
stretches batched steps by. The machine is named by the kernel's boot id
(`host_id`): the root times nodes that share one again, all from one clock's
start (`start_at`), since together they read less than the sum of what each
reads alone. Free memory comes
from the kernel's own estimate (MemAvailable), lowered to the room left under
our cgroup's memory limit (systemd MemoryMax=, a container) where that is less:
past it the kernel kills us however much the machine has free, and to what is left
of the user's `max_memory_mb` (`limit_memory`) once our runtime is counted.

Free memory is measured in this process after the timing run, the warm-up: the
Python/numba runtime (about 580 MiB on a Pi, README "Memory") and the kernels it
compiled are resident by then, so MemAvailable no longer counts them. The runtime
itself is measured too (`runtime_bytes`: resident memory that no file backs, so not
the model's mapped pages) and reported with the profile; it is what a cap on the
whole of edgetp's memory must leave out of the room for a share. Every re-plan
profiles again, so a node re-measures after its model is loaded and warmed up.
"""

from __future__ import annotations

import time
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT

from edgetp.model import intdot, intgemm, quant
from edgetp.model.decode import Matvecs
from edgetp.parallel.plan import MAX_ROW_COST

DEFAULT_ROWS, DEFAULT_COLS = 8192, 2048  # a Llama-3.2-1B FFN projection: 17.8 MB in Q8_0


@dataclass(frozen=True)
class Profile:
    speed: float      # weight bytes per second through the matvec kernel
    mem_free: int     # bytes we may still allocate for a share: MemAvailable, a cgroup's room, max_memory_mb
    threads: int
    runtime: int = 0  # bytes resident for the runtime itself when measured (runtime_bytes)
    host: str = ""    # the machine it runs on (host_id)
    row_cost: float = 0.0  # each token of a step of BATCH_ROWS beyond the first, relative to the first (0: not measured)


def random_weight(qtype: int, rows: int, cols: int, seed: int = 0) -> quant.Weight:
    """A random (rows, cols) matrix of any supported type, for timing only: float types
    get normal values, quantized ones random blocks with finite, small f16 scales
    (intdot.random_blocks), so no NaN, inf or subnormal changes a kernel's pace."""
    rng = np.random.default_rng(seed)
    if qtype in (QT.F32, QT.F16, QT.BF16):
        vals = rng.standard_normal((rows, cols)).astype(np.float32)
        raw = {QT.F32: vals, QT.F16: vals.astype(np.float16), QT.BF16: (vals.view(np.uint32) >> 16).astype(np.uint16)}
        return quant.Weight(int(qtype), rows, cols, np.ascontiguousarray(raw[QT(qtype)]).view(np.uint8))
    data = intdot.random_blocks(int(qtype), rows, cols // quant.block_size(qtype), rng)
    return quant.Weight(int(qtype), rows, cols, data)


CACHE_FALLBACK = 32 << 20  # the last-level cache assumed where sysfs does not tell (a large desktop L3)


def cache_bytes(root: str = "/sys/devices/system/cpu/cpu0/cache") -> int | None:
    """The size of the largest data or unified cache of cpu0 (the last level), as sysfs lists it;
    None where it lists none."""
    sizes = []
    for index in Path(root).glob("index*"):
        try:
            kind, size = (index / "type").read_text().strip(), (index / "size").read_text().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:].upper(), 1)
        digits = size[:-1] if unit > 1 else size
        if kind in ("Data", "Unified") and digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes) if sizes else None


def copies_for(nbytes: int, cache: int, room: int, footprint: int | None = None) -> int:
    """How many copies of an nbytes matrix the timing cycles through: together at least twice the
    cache, so each is evicted before it is read again; at most as many as `room` bytes hold at
    `footprint` bytes each (nbytes, or twice that for a kept type, whose panels are packed beside
    it), and at least one."""
    want = -(-2 * cache // nbytes)
    return max(1, min(want, room // (footprint or nbytes)))


Shape = tuple[int, int, int]  # one matrix: (GGML type, rows, cols)
Pass = list[list[Shape]]  # groups of matrices that read one input, each group one decode kernel call per type

MAX_GROUPS, MAX_GROUP, MAX_DIM = 64, 8, 1 << 20  # the most a pass may ask (a PROFILE's "pass" is checked)
FIT_ROWS = 32  # a matrix cut to fit the room keeps a multiple of this many rows, and at least this many


def token_pass(mf) -> Pass:
    """1/L of a token's matvecs, as decode runs them: layer 0's groups (q, k, v; o; gate, up; down;
    or a mixture's `experts_used` experts, each gate, up and down, and its shared expert) and
    vocab / L rows of the output head (a multiple of FIT_ROWS, at most all of them), L the model's layers.

    Empty for a shard file (it holds one slice of the model, and the profile times the single
    matrix of its dominant type instead)."""
    from edgetp.model import llama  # noqa: PLC0415 (the model's code only where a model is timed)

    cfg = mf.config
    if llama.stored_spec(mf) is not None or cfg.n_layers < 1:
        return []
    w = llama.load_weights(mf, llama.ShardSpec((0, cfg.n_kv_heads), (0, cfg.ffn), (0, cfg.vocab), (0, 1)))
    layer = w.layers[0]
    groups = [[layer.wq, layer.wk, layer.wv], [layer.wo]]
    if layer.moe is None:
        groups += [[layer.w_gate, layer.w_up], [layer.w_down]]
    else:
        e = layer.moe
        x = next(i for i, g in enumerate(e.gate) if g is not None)
        groups += [[e.gate[x], e.up[x]], [e.down[x]]] * e.used
        if e.shared is not None and e.shared.gate is not None:
            groups += [[e.shared.gate, e.shared.up], [e.shared.down]]
    head = w.lm_head
    rows = min(head.rows, -(-head.rows // cfg.n_layers // FIT_ROWS) * FIT_ROWS)
    groups.append([quant.slice_rows(head, 0, rows)])
    return [[(int(m.qtype), int(m.rows), int(m.cols)) for m in g if m is not None] for g in groups
            if any(m is not None for m in g)]


def check_pass(obj: object) -> Pass:
    """A pass as a PROFILE carries it (lists of [type, rows, cols]), checked; ValueError saying what is wrong."""
    def whole(v: object, lo: int, hi: int) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi

    if not isinstance(obj, (list, tuple)) or not 0 < len(obj) <= MAX_GROUPS:
        raise ValueError(f"a pass is a list of 1 to {MAX_GROUPS} groups of matrices")
    out: Pass = []
    for g in obj:
        if not isinstance(g, (list, tuple)) or not 0 < len(g) <= MAX_GROUP:
            raise ValueError(f"a pass's group is a list of 1 to {MAX_GROUP} matrices, got {g!r:.60}")
        group = []
        for m in g:
            if not (isinstance(m, (list, tuple)) and len(m) == 3 and whole(m[0], 0, 255)
                    and all(whole(v, 1, MAX_DIM) for v in m[1:])):
                raise ValueError(f"a matrix of a pass is [type, rows, cols], rows and cols 1 to {MAX_DIM}, "
                                 f"got {m!r:.60}")
            qtype, rows, cols = m
            if qtype not in quant.SUPPORTED:
                raise ValueError(f"a pass asks for tensor type {qtype}, which this node does not support")
            if cols % quant.block_size(qtype):
                raise ValueError(f"{cols} columns of type {QT(qtype).name} are not whole blocks")
            group.append((qtype, rows, cols))
        if len({c for _, _, c in group}) != 1:
            raise ValueError("the matrices of a pass's group read one input: their columns must agree")
        out.append(group)
    return out


def pass_bytes(shapes: Pass, kept: bool = False) -> int:
    """Bytes of a pass's matrices; with `kept`, a kept type's packed panels counted beside them."""
    panels = quant.int8_decode() and kept
    return sum(rows * quant.row_bytes(t, cols) * (2 if panels and intgemm.kept(t) else 1)
               for g in shapes for t, rows, cols in g)


def fit(shapes: Pass, room: int) -> Pass:
    """The pass with each matrix's rows cut in one proportion, where its bytes (kept panels counted)
    exceed `room`: a multiple of FIT_ROWS, at least FIT_ROWS (or all it has). A matrix's speed hardly
    depends on its row count past a few hundred; its columns, which set each row's work, are kept."""
    need = pass_bytes(shapes, kept=True)
    if need <= room:
        return shapes
    f = room / need
    return [[(t, min(rows, max(FIT_ROWS, int(rows * f) // FIT_ROWS * FIT_ROWS)), cols) for t, rows, cols in g]
            for g in shapes]


def random_pass(shapes: Pass, seed: int = 0) -> list[list[quant.Weight]]:
    return [[random_weight(t, rows, cols, seed + i) for i, (t, rows, cols) in enumerate(g)] for g in shapes]


def timing_set(p: list[list[quant.Weight]], cache: int | None = None) -> list[list[list[quant.Weight]]]:
    """The pass p and copies of it in memory of their own, copies_for() of them in all (`cache` bytes of
    last-level cache, by default `cache_bytes()`, or CACHE_FALLBACK where sysfs does not tell),
    within a quarter of what this process may allocate (`memory_free`: a cgroup's room and the
    user's cap count). They live only while the speed is measured."""
    if cache is None:
        cache = cache_bytes() or CACHE_FALLBACK
    shapes = [[(w.qtype, w.rows, w.cols) for w in g] for g in p]
    n = copies_for(pass_bytes(shapes), cache, memory_free() // 4, pass_bytes(shapes, kept=True))
    return [p] + [[[quant.Weight(w.qtype, w.rows, w.cols, w.data.copy()) for w in g] for g in p] for _ in range(n - 1)]


MAX_WAIT_S = 10.0  # the longest a timing waits for its start_at


def step_seconds(passes: list[list[list[quant.Weight]]], rows: int, seconds: float, max_runs: int = 5000,
                 start_at: float | None = None) -> float:
    """Seconds of one decode step of `rows` tokens through one pass, cycling through `passes` (a
    timing_set): each group in one call of decode's own kernels (decode.Matvecs: the single-token
    kernel for one token, the several-token one for more, weights read once for all of them). Each
    pass runs once first. With `start_at` (time.time()) the clock starts then, not before: nodes of
    one machine, which read one clock, time the same window.

    Throughput over the whole window, not the best burst: a CPU quota (cgroup cpu.max, 100 ms
    periods) or a busy neighbour on the core must show up in the figure, as it will in every token."""
    quant.use_threads()
    serial, int8 = quant.threads() == 1, quant.int8_decode()
    rng = np.random.default_rng(1)
    inputs: dict[int, tuple[np.ndarray, intdot.Rounded]] = {}
    for cols in {g[0].cols for p in passes for g in p}:
        x = rng.standard_normal((rows, cols)).astype(np.float32)
        inputs[cols] = x, intdot.rounded_rows(x) if cols % 32 == 0 else intdot.Rounded.rows(rows, cols)
    calls = [[Matvecs(g, *inputs[g[0].cols], int8) for g in p] for p in passes]

    def step(p: list[Matvecs]) -> None:
        for m in p:
            m(rows, serial)

    for p in calls:  # compile / pack / warm up
        step(p)
    if start_at is not None:
        time.sleep(min(max(0.0, start_at - time.time()), MAX_WAIT_S))
    runs = 0
    t0 = time.perf_counter()
    while runs < max_runs:
        step(calls[runs % len(calls)])
        runs += 1
        if time.perf_counter() - t0 >= seconds:
            break
    return (time.perf_counter() - t0) / runs


def mem_available(meminfo: str = "/proc/meminfo") -> int:
    with open(meminfo) as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError(f"{meminfo} has no MemAvailable line")


def cgroup_room(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes left under the tightest memory limit of our cgroup and its ancestors (v1 or v2); None if unlimited."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    rooms = []
    for line in lines:
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and not controllers:
            base, limit_name, usage_name = Path(root), "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            base, limit_name, usage_name = Path(root) / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        d = base / path.strip("/")
        while True:
            try:
                limit = (d / limit_name).read_text().strip()
                usage = int((d / usage_name).read_text())
                if limit.isdigit() and int(limit) < 2**60:  # "max" / v1's huge number: no limit
                    rooms.append(max(0, int(limit) - usage))
            except (OSError, ValueError):
                pass
            if d == base or base not in d.parents:
                break
            d = d.parent
    return min(rooms) if rooms else None


def runtime_bytes(rollup: str = "/proc/self/smaps_rollup", status: str = "/proc/self/status") -> int:
    """This process's resident memory that no file backs: the interpreter, numba and its compiled
    kernels, buffers. Mapped model pages are page cache and not in it.

    Read from smaps_rollup (Anonymous + Pss_Shmem), which walks the page tables and is exact.
    /proc/self/status's RssAnon is the kernel's per-CPU-batched counter, read without its
    per-CPU parts (proc(5): "some of these values are inaccurate ... use smaps or smaps_rollup");
    on a CI host it missed a whole 64 MiB allocation. It is the fallback for a kernel without
    smaps_rollup (before 4.14)."""
    try:
        path, anon, found = rollup, "Anonymous", _kib_fields(rollup, {"Anonymous", "Pss_Shmem"})
    except FileNotFoundError:
        path, anon, found = status, "RssAnon", _kib_fields(status, {"RssAnon", "RssShmem"})
    if anon not in found:
        raise OSError(f"{path} has no {anon} line")
    return sum(found.values())


def _kib_fields(path: str, names: set[str]) -> dict[str, int]:
    """The `Name:  N kB` lines of a /proc file that `names` asks for, in bytes."""
    found = {}
    with open(path) as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in names:
                found[name] = int(rest.split()[0]) * 1024
    return found


_cap_lock = threading.Lock()
_cap: int | None = None  # max_memory_mb in bytes; None: no cap of our own


def limit_memory(max_bytes: int | None) -> None:
    """Use at most `max_bytes` for edgetp as a whole (the runtime included); None lifts the cap.
    Takes effect at the next profile (each re-plan profiles every node again)."""
    global _cap
    if max_bytes is not None and max_bytes < 0:
        raise ValueError(f"a memory cap must be >= 0 bytes, got {max_bytes}")
    with _cap_lock:
        _cap = max_bytes


def memory_cap() -> int | None:
    with _cap_lock:
        return _cap


def memory_free(meminfo: str = "/proc/meminfo", runtime: int | None = None) -> int:
    """What this process may still allocate: MemAvailable, or less when a cgroup limit or the
    user's cap (less the runtime already resident) is closer."""
    free = mem_available(meminfo)
    room = cgroup_room()
    if room is not None:
        free = min(free, room)
    cap = memory_cap()
    if cap is not None:
        free = min(free, max(0, cap - (runtime_bytes() if runtime is None else runtime)))
    return free


# the tokens of the decode step the row cost is timed on: the server's default 4 slots and a batch of 8
# give a line through one token that holds within the noise here (1B shapes, one and two threads)
BATCH_ROWS = 8


def profile(threads: int | None = None, seconds: float = 0.5, qtype: int = QT.Q8_0,
            start_at: float | None = None, shapes: Pass | None = None) -> Profile:
    """Speed at the thread count compute uses, on the model's token pass `shapes` (`token_pass`),
    or where none is given on one layer-sized matrix of `qtype` (timed from `start_at`, if given:
    step_seconds), and what each further token of a step costs (row_cost: a step of BATCH_ROWS
    tokens through the same passes, for half as long; a figure outside (0, MAX_ROW_COST] is no
    measurement and reads 0, the cost model's constant).

    Without a pass, qtype should be the model's dominant weight type (`ModelFile.dominant_type`):
    kernels of different types run at different speeds, and not in the same ratio
    on every CPU, so a plan sized by Q8_0 misjudges a Q4_K model on a mixed cluster.
    """
    if threads:
        quant.set_threads(threads)
    if not shapes:
        shapes = [[(int(qtype), DEFAULT_ROWS, DEFAULT_COLS - DEFAULT_COLS % quant.block_size(qtype))]]
    passes = timing_set(random_pass(fit(shapes, memory_free() // 4)))
    one = step_seconds(passes, 1, seconds, start_at=start_at)
    row_cost = 0.0
    if start_at is None:  # a timing beside the other nodes of this machine (start_at) asks for the speed only
        row_cost = (step_seconds(passes, BATCH_ROWS, seconds / 2) / one - 1) / (BATCH_ROWS - 1)
        row_cost = row_cost if 0 < row_cost <= MAX_ROW_COST else 0.0
    speed = sum(w.nbytes for g in passes[0] for w in g) / one
    del passes  # measured after the run (kernels compiled and loaded), without the timing matrices
    runtime = runtime_bytes()
    return Profile(speed, memory_free(runtime=runtime), quant.threads(), runtime, host_id(), row_cost)


def host_id(path: str = "/proc/sys/kernel/random/boot_id") -> str:
    """The machine this process runs on: the kernel's boot id, which every process under one kernel
    reads alike (network namespaces and containers included) and no other machine has; "" where
    there is none to read. Nodes with the same one share cores and memory bandwidth."""
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""
