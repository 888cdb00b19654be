"""What each CLI command does: builds the parts it needs and runs them."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from edgetp import client, store
from edgetp.params import ContextError, SamplingParams
from edgetp.net import auth
from edgetp.net.httpauth import Credentials
from edgetp.net.loopthread import in_daemon_thread

if TYPE_CHECKING:
    from edgetp.model.tokenizer import Tokenizer

# What runs a model (numba, the kernels, the runners) is imported by the commands that run one:
# `edgetp ask` of a cluster, `status` and `chat` only speak HTTP, and start in 0.4 s and 50 MB
# without it, against 1.2 s and 140 MB with it (an AVX2 EPYC core; a Pi pays seconds).

# `ask --stats` waits at most this long after the answer for the request's end record (published
# before the last chunk, so it is normally a few ms behind it); an event stream that drops it costs this.
STATS_TRAIL_S = 2.0


class WorkerError(OSError):
    """The worker could not start."""


# Errors a user can cause; the CLI prints them as one line and exits non-zero. Named by module: an
# error's class exists only once its module is imported, so user_errors() imports nothing.
_USER_ERRORS = (
    ("edgetp.model.isa", "IsaError"),
    ("edgetp.model.gguf", "GGUFError"),
    ("edgetp.store", "StoreError"),
    ("edgetp.model.quant", "UnsupportedTensorType"),
    ("edgetp.model.quant", "ThreadCountError"),
    ("edgetp.model.tokenizer", "UnsupportedTokenizer"),
    ("edgetp.params", "SamplingError"),
    ("edgetp.params", "ContextError"),
    ("edgetp.model.llama", "ContextFull"),
    ("edgetp.net.auth", "AuthError"),
    ("edgetp.net.link", "LinkClosed"),  # WorkerLost is one
    ("edgetp.net.link", "SpinError"),
    ("edgetp.parallel.plan", "PlanError"),
    ("edgetp.commands", "WorkerError"),
    ("edgetp.config", "ConfigError"),
    ("edgetp.model.kvcache", "KVTypeError"),
)


def user_errors() -> tuple[type[BaseException], ...]:
    """The classes of _USER_ERRORS among the modules imported so far."""
    return tuple(getattr(sys.modules[module], name) for module, name in _USER_ERRORS if module in sys.modules)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repeat_penalty=args.repeat_penalty,
        frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty,
        seed=args.seed,
    )


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt from the command line or standard input; ContextError when it is not UTF-8 text."""
    if args.prompt is not None:
        try:
            args.prompt.encode("utf-8")  # bytes that are not UTF-8 arrive as U+DC80..U+DCFF (surrogateescape)
        except UnicodeEncodeError as exc:
            code = ord(args.prompt[exc.start])
            what = f"byte 0x{code - 0xDC00:02X}" if 0xDC80 <= code <= 0xDCFF else f"U+{code:04X}"
            raise ContextError(f"the prompt is not UTF-8 text ({what} at character {exc.start}); "
                               "convert it first, e.g. with iconv -t utf-8") from None
        return args.prompt
    if sys.stdin.isatty():
        raise ContextError("no prompt: give one as an argument or on standard input")
    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ContextError(f"standard input is not UTF-8 text (byte 0x{data[exc.start]:02X} at byte {exc.start}); "
                           "convert it first, e.g. with iconv -t utf-8") from None


def encode_prompt(tok: Tokenizer, prompt: str, raw: bool) -> list[int]:
    """The ids the API makes of the same prompt, so `ask --local` and `ask --url` answer alike:
    with --raw the text as it is (/v1/completions), else one user message through the chat
    template (/v1/chat/completions; ChatML for a model without a template)."""
    if raw:
        return tok.encode(prompt, add_special=True, parse_special=False)
    return tok.encode_chat([{"role": "user", "content": prompt}])[1]


def credentials(args: argparse.Namespace) -> Credentials:
    """The cluster key (--key) and API token (--api-key) a client command shows the node."""
    return Credentials(auth.read_key(args.key) if args.key else None, getattr(args, "api_key", None) or None)


def ask(args: argparse.Namespace) -> int:
    if not args.local:
        return asyncio.run(_ask_cluster(args))
    return _ask_local(args)


def _ask_local(args: argparse.Namespace) -> int:
    """ask --local: this process runs the model, alone or with --workers."""
    from edgetp.model import gguf, quant  # noqa: PLC0415 - numba and the kernels: only where a model runs
    from edgetp.model.batch import RunnerLost  # noqa: PLC0415
    from edgetp.model.generate import LocalRunner  # noqa: PLC0415
    from edgetp.model.tokenizer import Tokenizer  # noqa: PLC0415
    from edgetp.net.link import check_env  # noqa: PLC0415
    from edgetp.net.loopthread import LoopThread  # noqa: PLC0415
    from edgetp.parallel import pipeline, profile  # noqa: PLC0415
    from edgetp.parallel.runner import ClusterRunner  # noqa: PLC0415
    from edgetp.parallel.shard import local_slots  # noqa: PLC0415

    check_env()  # EDGETP_SPIN_US, EDGETP_LINK_MODE and EDGETP_INT8 checked before anything starts
    params = sampling_params(args)
    prompt = read_prompt(args)
    key = auth.read_key(args.key) if args.key else None
    path = store.resolve(args.model, pull_missing=True)
    mf = gguf.open_model(path, store.cache_dir() / "index")
    tok = Tokenizer.from_metadata(mf.metadata)
    if args.threads:
        quant.set_threads(args.threads)
    ctx = min(args.ctx, mf.config.ctx_train)
    ids = encode_prompt(tok, prompt, args.raw)
    t0 = time.perf_counter()
    if not args.workers:
        local_slots(mf, ctx, 1, "f16", profile.memory_free())  # PlanError: a context this machine cannot hold
        runner = LocalRunner(mf, ctx)
        return _stream(runner, tok, ids, params, args, ctx, t0)
    with LoopThread() as lt:
        runner = lt.run(ClusterRunner.connect(mf, args.workers, ctx=ctx, weights=args.weights, sync=args.sync,
                                              key=key, threads=args.threads, parallel=args.parallel,
                                              experts=args.experts, sync_pieces=args.sync_pieces))
        current = [runner]  # the runner in use: a recovery replaces it

        def recover(exc: RunnerLost) -> ClusterRunner:
            current[0] = lt.run(current[0].recovered(exc), timeout=600)
            return current[0]

        try:
            if args.stats:
                print(f"plan {pipeline.describe(runner.plan)}", file=sys.stderr)
                shares = {s.node_id: s for s in runner.plan.shares}
                for n in runner.nodes:
                    speed = f"{n.speed / 1e9:.2f} GB/s" if n.speed else "-"
                    link = "" if n.address == "local" else f"p90 {n.rtt_p90_ms:.3f} ms  {n.mbps:.0f} Mbit/s  "
                    share = shares.get(n.node_id)
                    what = "idle (left out of the plan)" if share is None else \
                        f"kv {share.kv_groups} ffn {share.ffn_cols} vocab {share.vocab_rows}" \
                        + (f" layers {share.layers}" if share.layers else "") \
                        + (f" experts {share.experts}" if share.experts else "")
                    print(f"node {n.node_id:<14} {n.address:<21} {speed:<12} rtt {n.rtt_ms:6.3f} ms  {link}{n.mode:<8} "
                          f"{what}", file=sys.stderr)
            return _stream(runner, tok, ids, params, args, ctx, t0, recover)
        finally:
            current[0].close()


def _remote_options(args: argparse.Namespace) -> dict:
    sampling_params(args)  # the same checks as --local, before anything is sent
    opts = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
            "top_k": args.top_k, "min_p": args.min_p, "repeat_penalty": args.repeat_penalty,
            "frequency_penalty": args.frequency_penalty, "presence_penalty": args.presence_penalty}
    return opts | ({"seed": args.seed} if args.seed is not None else {})


async def _ask_cluster(args: argparse.Namespace) -> int:
    options = _remote_options(args)
    prompt = read_prompt(args)
    creds = credentials(args)
    url = await client.find_url(args.url, creds.key)
    stats = client.TokenStats()
    events_url = url
    if args.stats:  # per-token records are published where the tokens are made: on the root
        events_url = (await client.cluster_view(url, creds)).get("root_url") or url
    request_id: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    watching = asyncio.Event()
    watcher = asyncio.create_task(client.watch_tokens(events_url, stats, request_id, watching, creds)) \
        if args.stats else None
    answer = client.stream_completion(url, prompt, options, creds) if args.raw else \
        client.stream_chat(url, [{"role": "user", "content": prompt}], options, creds)
    try:
        if watcher:
            async with asyncio.timeout(10):
                await watching.wait()
        reason = None
        async for piece, reason, rid in answer:
            if not request_id.done():
                request_id.set_result(rid)
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
        if reason == "context":
            print(f"edgetp: stopped: the context of {url} is full", file=sys.stderr)
        if watcher:  # the last records trail the last chunk: wait for the request's end record
            ended = asyncio.ensure_future(stats.ended.wait())
            await asyncio.wait((ended, watcher), timeout=STATS_TRAIL_S, return_when=asyncio.FIRST_COMPLETED)
            ended.cancel()
    finally:
        if watcher:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
    if args.stats:
        print(f"{url}: {stats.summary()}", file=sys.stderr)
    return 0


def status(args: argparse.Namespace) -> int:
    async def go() -> dict:
        creds = credentials(args)
        return await client.cluster_view(await client.find_url(args.url, creds.key), creds)

    view = asyncio.run(go())
    print(f"epoch {view['epoch']}  root {view['root']}  model {view['model']}")
    if view.get("plan"):
        print(f"plan {view['plan']}")
    if (line := slots_line(view.get("slots"))) is not None:
        print(line)
    print(f"{'node':<16} {'address':<22} {'role':<7} {'state':<8} {'speed':>10} {'mem free':>9} "
          f"{'layers':>7} {'kv groups':>9} {'ffn cols':>11} {'vocab rows':>13} {'rtt p50/p90':>15} {'link':>12}")
    for n in view["nodes"]:
        rtt = "-" if n.get("rtt_ms") is None else f"{n['rtt_ms']:.2f}/{n.get('rtt_p90_ms') or 0:.2f} ms"
        link = "-" if not n.get("mbps") else f"{n['mbps']:.0f} Mbit/s"
        if n.get("transfer") and n["transfer"][0] < n["transfer"][1]:  # fetching its slice from the root
            n["state"] = f"{100 * n['transfer'][0] // max(n['transfer'][1], 1)}% in"
        span = lambda r: f"{r[0]}-{r[1]}" if r[1] > r[0] else "-"  # noqa: E731
        speed = f"{n['speed'] / 1e9:.2f} GB/s" if n["speed"] else "-"  # 0: never measured (a lone node plans nothing)
        print(f"{n['node_id']:<16} {n['address']:<22} {n['role']:<7} {n['state']:<8} "
              f"{speed:>11} {n['mem_free'] / 1e9:>6.1f} GB {span(n.get('layers') or (0, 0)):>7} "
              f"{span(n['kv_groups']):>9} "
              f"{span(n['ffn_cols']):>11} {span(n['vocab_rows']):>13} {rtt:>15} {link:>12}")
    for line in expert_lines(view["nodes"]) + shared_lines(view["nodes"]):
        print(line)
    return 0


def shared_lines(nodes: list[dict]) -> list[str]:
    """Nodes that share one machine, and what they read together: the planner's speed for them at once."""
    groups: dict[str, list[dict]] = {}
    for n in nodes:
        if n.get("machine") and n.get("host_speed"):
            groups.setdefault(n["machine"], []).append(n)
    return [f"{', '.join(n['node_id'] for n in g)} share machine {tag}: {g[0]['host_speed'] / 1e9:.2f} GB/s together"
            for tag, g in groups.items()]


def expert_lines(nodes: list[dict]) -> list[str]:
    """A mixture's experts per node: which it computes (whole, or its columns of each) and the
    tokens routed to each so far (all layers summed); nothing for a dense model."""
    out = []
    for n in nodes:
        if n.get("experts") is None:
            continue
        a, b = n["experts"]
        hits = " ".join(f"{a + i}:{h}" for i, h in enumerate(n.get("expert_hits") or ()))
        c0, c1 = n["ffn_cols"]
        whole = "whole" if (c0, c1) == (0, max(m["ffn_cols"][1] for m in nodes)) else f"columns {c0}-{c1}"
        out.append(f"experts {n['node_id']:<16} {a}-{b} ({whole})  hits {hits or '-'}")
    return out


def slots_line(slots: dict | None) -> str | None:
    """One line on the root engine's slots (None when the view has none): in use, queued, batch, prefix hits."""
    if not isinstance(slots, dict):
        return None
    return (f"slots {slots.get('active', '?')}/{slots.get('total', '?')} in use  queued {slots.get('queued', '?')}  "
            f"last batch {slots.get('batch', 0)}  prefix hits {slots.get('prefix_hits', 0)} "
            f"({slots.get('cached_tokens', 0)} cached tokens)")


def reprofile(args: argparse.Namespace) -> int:
    """POST /v1/cluster/profile, proving the key: the node measures again; its root re-plans before the next request."""
    import aiohttp  # noqa: PLC0415

    from edgetp.cluster import peering  # noqa: PLC0415

    if not args.key:
        raise client.KeyRefused("edgetp profile needs the cluster key: --key FILE or EDGETP_KEY_FILE")
    key = auth.read_key(args.key)

    async def go() -> dict:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            return await peering.signed_post(session, args.url, peering.PROFILE_PATH, key)

    try:
        advert = asyncio.run(go())
    except aiohttp.ClientResponseError as exc:
        refused = client.KeyRefused if exc.status in (401, 403) else client.ServerError
        raise refused(f"{args.url}: HTTP {exc.status}: {exc.message}") from None
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        raise client.NoCluster(f"cannot reach {args.url}: {exc or type(exc).__name__}") from None
    print(f"{advert['id']}: {float(advert['spd']) / 1e9:.2f} GB/s, {int(advert['mem']) / 1e9:.1f} GB free")
    return 0


def chat(args: argparse.Namespace) -> int:
    """An interactive session that keeps its history; /exit or end of input leaves, /reset forgets.
    A turn the cluster fails (its answer broken off, the context full, the node down) is
    reported in one line and left out of the history, and the session goes on; it then exits
    with that failure's code (a script piping turns in sees it). A refused key ends it at once
    (no later turn could pass)."""
    options = _remote_options(args)
    creds = credentials(args)

    async def go() -> int:
        url = await client.find_url(args.url, creds.key)
        history: list[dict[str, str]] = []
        failed = 0  # the exit code of the last turn that failed
        print(f"chatting with {url} (/exit to leave)", file=sys.stderr)
        while True:
            try:
                line = await in_daemon_thread(input, "you> ", name="edgetp-input")  # Ctrl-C ends it at once
            except EOFError:
                return failed
            if line.strip() in ("/exit", "/quit"):
                return failed
            if line.strip() == "/reset":
                history.clear()
                print("edgetp: the history is forgotten", file=sys.stderr)
                continue
            if not line.strip():
                continue
            turn = history + [{"role": "user", "content": line}]
            answer = ""
            try:
                reason = None
                async for piece, reason, _ in client.stream_chat(url, turn, options, creds):
                    answer += piece
                    sys.stdout.write(piece)
                    sys.stdout.flush()
            except client.KeyRefused:
                raise
            except client.ClientError as exc:
                sys.stdout.write("\n" if answer else "")
                sys.stdout.flush()
                print(f"edgetp: {exc} (this turn is left out of the history; /reset forgets it all)",
                      file=sys.stderr)
                failed = exc.exit_code
                continue
            sys.stdout.write("\n")
            history[:] = turn + [{"role": "assistant", "content": answer}]
            if reason == "context":
                print("edgetp: the context is full (/reset starts over)", file=sys.stderr)

    return asyncio.run(go())


def _stream(runner, tok: Tokenizer, ids: list[int], params, args, ctx: int, t0: float, recover=None) -> int:
    from edgetp.model.generate import generate  # noqa: PLC0415

    load_ms = (time.perf_counter() - t0) * 1000
    times = []
    reason = None
    for ev in generate(runner, tok, ids, params, args.max_tokens, recover=recover):
        if ev.note:
            print(f"\nedgetp: {ev.note}", file=sys.stderr)
        sys.stdout.write(ev.text)
        sys.stdout.flush()
        times.append(ev.ms)
        reason = ev.finish_reason
    sys.stdout.write("\n")
    sys.stdout.flush()
    if reason == "context":
        print(f"edgetp: stopped: the context of {ctx} tokens is full (raise --ctx)", file=sys.stderr)
    if args.stats and times:
        decode = times[1:]
        rate = len(decode) / (sum(decode) / 1000) if decode else float("nan")
        print(f"load {load_ms:.0f} ms | prompt {len(ids)} tokens in {times[0]:.0f} ms "
              f"({len(ids) / times[0] * 1000:.1f} tok/s) | {len(times)} tokens, decode {rate:.1f} tok/s",
              file=sys.stderr)
    return 0


def worker(args: argparse.Namespace) -> int:
    from edgetp.net.link import check_env  # noqa: PLC0415
    from edgetp.serve.worker import Worker  # noqa: PLC0415

    check_env()  # EDGETP_SPIN_US and EDGETP_LINK_MODE checked before anything starts
    key = auth.read_key(args.key) if args.key else None
    host, port = args.listen
    node_id = args.node_id or f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
    if key is None:
        print("edgetp: warning: no cluster key; any root that can reach this port may use it", file=sys.stderr)
    if args.max_memory_mb:
        from edgetp.parallel import profile  # noqa: PLC0415
        profile.limit_memory(args.max_memory_mb * 2**20)
    model = str(store.resolve(args.model)) if args.model else None  # a missing file stops here, not at a LOAD
    w = Worker(node_id, key=key, threads=args.threads, model_path=model,
               resolve=lambda ref: str(store.resolve(ref)), index_dir=str(store.cache_dir() / "index"))

    def listening(bound: int) -> None:
        print(f"edgetp worker {node_id} listening on {host}:{bound}", flush=True)

    async def main() -> None:
        task = asyncio.current_task()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        try:
            await w.serve(host, port, listening)
        except asyncio.CancelledError:
            print(f"edgetp worker {node_id} stopped", file=sys.stderr)

    try:
        asyncio.run(main())
    except OSError as exc:
        raise WorkerError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return 0


def serve(args: argparse.Namespace) -> int:
    from edgetp import config, daemon  # noqa: PLC0415
    from edgetp.cluster import sdnotify  # noqa: PLC0415
    from edgetp.cluster.discovery import DiscoveryError  # noqa: PLC0415
    from edgetp.net.link import check_env  # noqa: PLC0415

    flags = {name: getattr(args, name) for name in ("model", "key_file", "data_port", "node_id", "priority",
                                                    "no_root", "interfaces", "peers", "threads", "sync", "sync_pieces", "ctx", "slots", "kv_type",
                                                    "parallel", "experts")}
    if args.listen is not None:
        flags["host"], flags["http_port"] = args.listen
    flags = {k: v for k, v in flags.items() if v is not None}
    if "host" not in flags and not os.environ.get("EDGETP_HOST") and args.config is None \
            and not config.DEFAULT_CONFIG_PATH.exists() and not (flags.get("key_file") or os.environ.get("EDGETP_KEY_FILE")):
        flags["host"] = "127.0.0.1"  # alone, the API stays on this machine; a cluster's peers must reach it
    settings = config.load_settings(flags, os.environ, args.config)
    check_env()  # EDGETP_SPIN_US and EDGETP_LINK_MODE checked before anything starts
    key = auth.read_key(settings.key_file) if settings.key_file else None
    if settings.model == "none" and (key is None or args.workers):
        raise WorkerError("--model none (fetch a slice from the root) needs a cluster: --key FILE and no --workers")
    notifier = sdnotify.Notifier()
    with notifier.extending(status=f"getting model {settings.model}"):  # a first pull can outlast a start timeout
        path = None if settings.model == "none" else store.resolve(settings.model, pull_missing=True)
    opts = daemon.ServeOptions(
        model_path=path, model_name=path.stem if str(settings.model).endswith(".gguf") else settings.model,
        host=settings.host, port=settings.http_port, workers=tuple(args.workers),
        weights=tuple(args.weights) if args.weights else None, sync=settings.sync, sync_pieces=settings.sync_pieces, ctx=settings.ctx,
        slots=settings.slots, kv_type=settings.kv_type, parallel=settings.parallel, experts=settings.experts, threads=settings.threads, key=key, queue_size=args.queue, index_dir=Path(settings.cache_dir) / "index",
        cluster=key is not None and not args.workers, data_port=settings.data_port,
        node_id=settings.node_id if settings.node_id_given
        else config.persistent_node_id(config.state_dir(os.environ, Path(settings.cache_dir))),
        priority=settings.priority,
        no_root=settings.no_root, interfaces=tuple(settings.interfaces), peers=settings.peer_addresses,
        shard_dir=Path(settings.cache_dir) / "shards", api_tokens=settings.api_tokens,
        max_memory=settings.max_memory_mb << 20 if settings.max_memory_mb else None,
        slice_cache=settings.slice_cache_mb << 20,
        heartbeat=(settings.heartbeat_s, settings.heartbeat_timeout_s, settings.settle_s))

    def reload() -> int | None:  # SIGHUP: the memory cap from the settings as they are now
        cap = config.load_settings(flags, os.environ, args.config).max_memory_mb
        return cap << 20 if cap else None
    try:
        daemon.run(opts, on_listening=lambda url: print(f"edgetp serving on {url}", flush=True),
                   notifier=notifier, reload=reload)
    except (OSError, ExceptionGroup) as exc:  # in a cluster the ports and the mDNS name open inside a TaskGroup
        if (taken := _found(exc, DiscoveryError)) is not None:
            raise WorkerError(f"cannot join the cluster: {taken}; give each node its own --node-id") from None
        if (err := _found(exc, OSError)) is None:
            raise
        raise WorkerError(f"cannot serve on {settings.host} (HTTP {settings.http_port}, data "
                          f"{settings.data_port}): {err.strerror or err}") from None
    return 0


E = TypeVar("E", bound=BaseException)


def _found(exc: BaseException, kind: type[E]) -> E | None:
    """`exc` if it is a `kind`, else the first `kind` in the exception group it is, else None."""
    if isinstance(exc, kind):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        return next((e for e in (_found(x, kind) for x in exc.exceptions) if e is not None), None)
    return None


def dashboard(args: argparse.Namespace) -> int:
    from dashboard.app import run  # noqa: PLC0415 - Textual loads only for this command

    run(args.url, credentials(args))
    return 0


def keygen(args: argparse.Namespace) -> int:
    key = auth.write_key(args.path, force=args.force)
    print(f"wrote {args.path} (cluster id {auth.cluster_id(key)}); copy it to every node, keep it 0600")
    return 0


def model_pull(args: argparse.Namespace) -> int:
    path = store.pull(args.source, sha256=args.sha256, name=args.name)
    print(path)
    return 0


def model_list(args: argparse.Namespace) -> int:
    entries = store.list_models()
    if not entries:
        print(f"no models in {store.models_dir()} (try: edgetp model pull smollm2)")
        return 0
    width = max(len(e.name) for e in entries)
    for e in entries:
        print(f"{e.name:<{width}}  {e.size / 1e6:9.1f} MB  {e.path}")
    return 0
