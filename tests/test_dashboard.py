"""The dashboard: the pure fold, the charts, the app driven by Pilot, its sources, and snapshots."""

from __future__ import annotations

import asyncio
import io
import json
from dataclasses import replace

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console
from rich.style import Style

from dashboard import scenes
from dashboard.app import DashboardApp
from dashboard.charts import BLOCKS, columns, nice_top, sparkline
from dashboard.source import AskError, HttpAsker, ScriptedAsker, ScriptedSource, WebSocketSource
from dashboard.state import (FINISHED_KEPT, AskChunk, AskFinished, AskStarted, ClearLog, ConnectionStatus,
                             DashboardState, apply)
from dashboard.widgets import BatchChart, EventLog, GenerationView, NodesTable, RequestsView, StatusBar
from edgetp.model import gguf
from edgetp.model.generate import LocalRunner
from edgetp.model.tokenizer import Tokenizer
from edgetp.serve.api import make_app, serving
from edgetp.serve.root import Engine
from edgetp.events import (ClusterEvent, ClusterView, LinkBytes, NodeView, RequestRecord, SlotsView, StepRecord,
                           TokenRecord, to_dict)

SIZE = (140, 44)


def fold(records, state: DashboardState | None = None) -> DashboardState:
    state = state or DashboardState()
    for r in records:
        state = apply(state, r)
    return state


def token(i: int, total: float = 50.0, text: str = "x", request_id: str = "r1") -> TokenRecord:
    return TokenRecord(request_id, i, text, total, total * 0.75, total * 0.25, {"10.0.0.2:7070": LinkBytes(100, 90)})


def node(state: DashboardState, node_id: str):
    return next(n for n in state.nodes if n.node_id == node_id)


# --- the fold ---------------------------------------------------------------------------------

@settings(max_examples=60)
@given(history=st.integers(1, 30), totals=st.lists(st.floats(0.5, 500.0), max_size=80))
def test_token_history_keeps_the_last_n_tokens_and_counts_every_one(history, totals):
    state = fold([token(i, t) for i, t in enumerate(totals)], DashboardState(history=history))
    assert state.token_count == len(totals)
    assert len(state.tokens) == min(history, len(totals))
    assert [s.index for s in state.tokens] == list(range(len(totals)))[-history:]
    assert [s.total_ms for s in state.tokens] == totals[-history:]


@settings(max_examples=60)
@given(size=st.integers(1, 20), messages=st.lists(st.text(min_size=1, max_size=8), max_size=60))
def test_event_log_keeps_the_last_m_entries(size, messages):
    state = fold([ClusterEvent("error", m) for m in messages], DashboardState(log_size=size))
    assert [e.message for e in state.log] == messages[-size:]


@settings(max_examples=60)
@given(pieces=st.lists(st.text(max_size=5), max_size=40))
def test_generation_text_is_the_token_texts_in_order(pieces):
    state = fold([RequestRecord("r1", "started", "hi"), *(token(i, text=p) for i, p in enumerate(pieces))])
    assert state.generation.text == "".join(pieces)
    assert state.generation.tokens == len(pieces)
    assert state.generation.prompt == "hi"


def test_tokens_per_second_is_tokens_over_their_summed_wall_time():
    # 4 tokens of 50, 50, 100, 200 ms: 4 tokens in 0.4 s is 10 tok/s
    state = fold([token(0, 50), token(1, 50), token(2, 100), token(3, 200)])
    assert state.tokens_per_s == pytest.approx(10.0)
    assert DashboardState().tokens_per_s == 0.0


def test_a_leaving_node_stays_listed_as_lost_and_a_rejoin_makes_it_ready():
    state = fold(scenes.generating(3) + [ClusterEvent("leave", "gone", "opi-c", 3)])
    assert node(state, "opi-c").state == "lost" and node(state, "opi-c").rtt_ms is None
    assert state.lost == 1
    state = apply(state, ClusterEvent("join", "back", "opi-c", 4, {"rtt_ms": 0.5}))
    assert node(state, "opi-c").state == "ready" and node(state, "opi-c").rtt_ms == 0.5
    assert state.epoch == 4


def test_a_join_of_an_unknown_node_adds_it_with_what_the_event_says():
    state = fold(scenes.forming())
    c = node(state, "opi-c")
    assert (c.address, c.state, c.speed, c.rtt_ms) == ("192.168.1.23:7070", "loading", scenes.C.speed, 0.66)
    assert [n.node_id for n in state.nodes] == ["pi5-a", "pi5-b", "opi-c"]
    assert state.root is None


def test_a_profile_event_brings_the_node_its_new_figures_and_a_log_line():
    state = fold(scenes.generating(0) + [ClusterEvent("profile", "opi-c measured again", "opi-c", None,
                                                      {"speed": 1.5e9, "mem_free": 123})])
    c = node(state, "opi-c")
    assert (c.speed, c.mem_free, c.state) == (1.5e9, 123, "ready")
    assert state.log[-1].kind == "profile" and state.log[-1].message == "opi-c measured again"


def test_an_election_moves_the_root_role():
    state = fold(scenes.generating(0) + [ClusterEvent("election", "pi5-b leads", "pi5-b", 5)])
    assert state.root == "pi5-b" and state.epoch == 5
    assert {n.node_id: n.role for n in state.nodes} == {"pi5-a": "worker", "pi5-b": "root", "opi-c": "worker"}


def test_a_replan_changes_the_shares_it_names():
    state = fold(scenes.node_lost(2))
    assert node(state, "pi5-a").ffn_cols == (0, 864)
    assert node(state, "pi5-b").vocab_rows == (27648, 49152)
    assert node(state, "opi-c").kv_groups == (0, 0)


def test_transfer_progress_replaces_its_previous_log_line_and_clears_when_done():
    state = fold(scenes.forming())
    assert node(state, "pi5-b").transfer == (72_500_000, 145_000_000)
    done = ClusterEvent("transfer", "pi5-b has its weights", "pi5-b", 0, {"done": 145_000_000, "total": 145_000_000})
    state = fold([done, done], state)
    assert node(state, "pi5-b").transfer is None and node(state, "pi5-b").state == "ready"
    transfers = [e for e in state.log if e.kind == "transfer"]
    assert [e.node_id for e in transfers] == ["opi-c", "pi5-b"]


def test_an_answer_asked_here_streams_from_the_asker_not_twice_from_the_events():
    state = fold([AskStarted("2+2?"), RequestRecord("r9", "started", "<templated>"), AskChunk("4", "r9"),
                  token(0, text="4", request_id="r9"), AskFinished(),
                  token(1, text="!", request_id="r9")])
    assert state.generation.prompt == "2+2?" and state.generation.text == "4"
    assert state.generation.request_id == "r9" and state.generation.finished
    assert state.token_count == 2  # the charts still see both tokens


def test_an_answer_asked_here_is_known_by_its_stream_id_when_another_request_starts_first():
    state = fold([AskStarted("2+2?"), RequestRecord("r8", "started", "someone else's"),
                  token(0, text="Sure", request_id="r8"), RequestRecord("r9", "started", "<templated>"),
                  AskChunk("4", "r9"), token(0, text="4", request_id="r9"), token(1, text=",", request_id="r8")])
    gen = state.generation
    assert (gen.origin, gen.request_id, gen.prompt, gen.text, gen.tokens) == ("dashboard", "r9", "2+2?", "4", 1)


def test_a_disconnect_is_logged_once_with_its_retry_delay():
    lost = ConnectionStatus("disconnected", "connection closed", retry_in=2.0)
    state = fold([ConnectionStatus("connected", "up"), lost, lost])
    assert state.connection == lost
    assert [e.message for e in state.log] == ["up", "disconnected (connection closed), retrying in 2 s"]
    assert fold([ClearLog()], state).log == ()


def test_each_request_line_counts_its_tokens_and_rates_them_without_the_prefill_token():
    ms = {"a": [400.0, 50.0, 60.0, 70.0], "b": [300.0, 40.0]}
    records = [RequestRecord("a", "started", prompt_tokens=20, slot=0), RequestRecord("b", "started", slot=1)]
    for i in range(4):  # interleaved, as one decode step after another carries both
        records += [token(i, ms[k][i], request_id=k) for k in ("a", "b") if i < len(ms[k])]
    state = fold(records)
    a, b = state.requests
    assert (a.request_id, a.tokens, a.slot, a.prompt_tokens) == ("a", 4, 0, 20)
    assert a.tokens_per_s == pytest.approx(3 * 1000 / (50 + 60 + 70))  # 16.7 tok/s, the 400 ms prefill left out
    assert (b.tokens, b.tokens_per_s) == (2, pytest.approx(1000 / 40))
    assert fold([RequestRecord("c", "started"), token(0, 90.0, request_id="c")]).requests[0].tokens_per_s == 0.0


def test_finished_requests_move_below_the_running_ones_and_only_the_last_few_stay():
    records = [RequestRecord(f"r{i}", "started") for i in range(FINISHED_KEPT + 3)]
    records += [RequestRecord(f"r{i}", "finished", finish_reason="stop") for i in range(FINISHED_KEPT + 2)]
    state = fold(records)
    ids = [r.request_id for r in state.requests]
    assert ids == [f"r{FINISHED_KEPT + 2}"] + [f"r{i}" for i in range(2, FINISHED_KEPT + 2)]
    assert [r.finished for r in state.requests] == [False] + [True] * FINISHED_KEPT


def test_decode_steps_draw_the_batch_history_and_every_step_updates_slots_in_use():
    state = fold([ClusterView(1, "a", "m", (), slots=SlotsView(4, 0, 0)),
                  StepRecord("prefill", 64, 80.0, active=1, queued=0), StepRecord("decode", 1, 20.0, 1, 0),
                  StepRecord("prefill", 32, 40.0, active=2, queued=1), StepRecord("decode", 2, 21.0, 2, 1),
                  StepRecord("decode", 2, 21.0, 2, 0)], DashboardState(history=2))
    assert state.batches == (2, 2)  # prefill chunks are not decode batches; the last `history` steps kept
    assert state.slots == SlotsView(4, 2, 0, batch=2)
    assert fold([StepRecord("decode", 3, 20.0, 3, 2)]).slots == SlotsView(0, 3, 2, batch=3)  # total not told yet


def test_the_generation_follows_one_request_while_others_interleave_then_takes_the_next_whole():
    records = [RequestRecord("a", "started", "first?"), RequestRecord("b", "started", "second?")]
    for i, (x, y) in enumerate(zip("abc", "xyz")):
        records += [token(i, text=x, request_id="a"), token(i, text=y, request_id="b")]
    state = fold(records)
    assert (state.generation.request_id, state.generation.prompt, state.generation.text) == ("a", "first?", "abc")
    state = fold([RequestRecord("a", "finished", finish_reason="stop"), token(3, text="!", request_id="b")], state)
    assert (state.generation.request_id, state.generation.prompt, state.generation.text) == ("b", "second?", "xyz!")
    assert state.generation.tokens == 4 and not state.generation.finished


def test_the_rate_over_all_streams_is_the_decode_steps_tokens_over_their_time():
    state = fold([StepRecord("decode", 4, 80.0, 4, 0), StepRecord("decode", 2, 40.0, 2, 0),
                  StepRecord("prefill", 64, 500.0, 2, 0), token(0, 40.0)])
    assert state.batch_tokens_per_s == pytest.approx(6 * 1000 / 120)  # 50 tok/s; prefill time not counted
    assert state.rate == state.batch_tokens_per_s
    assert fold([token(0, 40.0)]).rate == pytest.approx(25.0)  # no steps reported: the per-token rate


def test_a_prefix_hit_adds_to_the_snapshots_count_once_per_request():
    state = fold([ClusterView(1, "a", "m", (), slots=SlotsView(4, 0, 0, prefix_hits=5, cached_tokens=500)),
                  RequestRecord("r", "started", prompt_tokens=100, cached_tokens=64, slot=2),
                  RequestRecord("r", "finished", finish_reason="stop", cached_tokens=64, slot=2),
                  RequestRecord("s", "started", prompt_tokens=9, slot=1)])
    assert (state.slots.prefix_hits, state.slots.cached_tokens) == (6, 564)
    assert [(r.request_id, r.cached_tokens) for r in state.requests] == [("s", 0), ("r", 64)]


# --- charts -----------------------------------------------------------------------------------

def test_bars_start_at_zero_and_fill_eighths_of_a_cell():
    style = Style(color="red")
    assert sparkline([0.5, 0.0, 0.125], 3, 1.0, style).plain == f"{BLOCKS[4]} {BLOCKS[1]}"
    # two rows, value 0.75 of the top: the bottom row full (drawn as background), the top row half full
    rows = columns([[0.75]], [style], 1, 2, 1.0)
    assert [r.plain for r in rows] == [BLOCKS[4], " "]
    assert rows[1].spans[0].style.bgcolor.name == "red"


def test_stacked_bars_put_the_second_series_on_top_of_the_first():
    low, high = Style(color="green"), Style(color="yellow")
    # one row, 0.25 + 0.5 of the top: 2 eighths of green under yellow that fills the rest of the cell's half
    (row,) = columns([[0.25], [0.5]], [low, high], 1, 1, 1.0)
    assert row.plain == BLOCKS[2]
    assert row.spans[0].style.color.name == "green" and row.spans[0].style.bgcolor.name == "yellow"


def test_bars_keep_the_newest_samples_at_the_right():
    (row,) = columns([[1.0, 0.0, 0.0, 0.5]], [Style(color="red")], 2, 1, 1.0)
    assert row.plain == f" {BLOCKS[4]}"
    (row,) = columns([[0.5]], [Style(color="red")], 3, 1, 1.0)
    assert row.plain == f"  {BLOCKS[4]}"  # padded on the left


@pytest.mark.parametrize("value, top", [(0, 1), (0.7, 0.8), (60.6, 80), (101, 200), (9.1, 10), (350, 400)])
def test_axis_tops_are_round_numbers_at_or_above_the_data(value, top):
    assert nice_top(value) == pytest.approx(top)


# --- the app, driven by Pilot -----------------------------------------------------------------

def text_of(widget) -> str:
    console = Console(width=widget.size.width or 120, file=io.StringIO(), color_system=None, legacy_windows=False)
    console.print(widget.render())
    return console.file.getvalue()


async def settle(pilot, count: int) -> None:
    """Wait until the app has folded `count` records."""
    for _ in range(500):
        if pilot.app.state.received >= count:
            break
        await pilot.pause(0.01)
    await pilot.pause()


async def test_nodes_appear_as_the_cluster_forms():
    records = scenes.forming()
    app = DashboardApp(ScriptedSource(records, hold=True))
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, len(records))
        table = text_of(app.main.query_one(NodesTable))
        for name in ("pi5-a", "pi5-b", "opi-c", "192.168.1.23:7070", "loading"):
            assert name in table
        assert "50%" in table  # 72.5 of 145 MB


async def test_a_mixtures_nodes_show_the_experts_they_compute_and_how_often_those_were_hit():
    nodes = (NodeView("root", "local", "root", "ready", 2e9, 10**9, (0, 1), (0, 224), (0, 300), experts=(0, 5),
                      expert_hits=(3, 0, 4, 1, 2)),
             NodeView("w1", "10.0.0.2:7070", "worker", "ready", 1e9, 10**9, (1, 3), (0, 224), (300, 600),
                      experts=(5, 8), expert_hits=(6, 0, 0)))
    placed = ClusterView(1, "root", "m", nodes)
    columns = ClusterEvent("replan", "columns", None, 1, {"nodes": {"root": {"kv_groups": [0, 1], "ffn_cols": [0, 96]},
                                                                    "w1": {"kv_groups": [1, 3], "ffn_cols": [96, 224]}}})
    app = DashboardApp(ScriptedSource([placed], hold=True))
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, 1)
        rows = text_of(app.main.query_one(NodesTable)).splitlines()
        assert "experts" in rows[0]
        assert "0–5 · 10 hits" in next(r for r in rows if "root" in r)
        assert "5–8 · 6 hits" in next(r for r in rows if "w1" in r)
    state = fold([placed, columns])
    assert all(n.experts is None for n in state.nodes)  # a column split names no experts: the column goes


async def test_a_lost_node_shows_as_lost():
    records = scenes.node_lost()
    app = DashboardApp(ScriptedSource(records, hold=True))
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, len(records))
        row = next(line for line in text_of(app.main.query_one(NodesTable)).splitlines() if "opi-c" in line)
        assert "lost" in row
        assert "1 lost" in text_of(app.main.query_one(StatusBar))
        assert "opi-c lost: no heartbeat" in text_of(app.main.query_one(EventLog))


async def test_the_generation_text_streams_in_as_tokens_arrive():
    head = scenes.generating(0)
    words = scenes.ANSWER[:12]
    gate = asyncio.Event()

    class Gated:
        async def __aiter__(self):
            for r in head + scenes.tokens("req-7", words[:6]):
                yield r
            await gate.wait()
            for r in scenes.tokens("req-7", words[6:], start=6):
                yield r
            yield RequestRecord("req-7", "finished", finish_reason="stop", completion_tokens=12)
            await asyncio.Event().wait()

    app = DashboardApp(Gated())
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, len(head) + 6)
        view = app.main.query_one(GenerationView)
        assert " ".join(words[:6]) in text_of(view) and words[6] not in text_of(view)
        assert "streaming" in view.border_subtitle
        gate.set()
        await settle(pilot, len(head) + 13)
        assert " ".join(words) in " ".join(text_of(view).split())
        assert "finished (stop)" in view.border_subtitle


async def test_submitting_a_prompt_asks_the_asker_and_shows_its_answer():
    asker = ScriptedAsker(["Four", ".", " Obviously."])
    app = DashboardApp(ScriptedSource(scenes.connected(), hold=True), asker)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("p")
        await pilot.press(*"2+2?")
        await pilot.press("enter")
        for _ in range(500):
            if app.state.generation is not None and app.state.generation.finished:
                break
            await pilot.pause(0.01)
        assert asker.prompts == ["2+2?"]
        view = app.main.query_one(GenerationView)
        assert "2+2?" in text_of(view) and "Four. Obviously." in text_of(view)
        assert "asked here · 3 tokens · finished" in view.border_subtitle


async def test_a_dropped_source_says_it_is_retrying():
    records = [*scenes.connected(), ConnectionStatus("disconnected", "connection closed", retry_in=2.0)]
    app = DashboardApp(ScriptedSource(records, hold=True))
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, len(records))
        assert "disconnected, retrying in 2 s (connection closed)" in text_of(app.main.query_one(StatusBar))


async def test_c_clears_the_log_and_q_quits():
    records = scenes.generating(2)
    app = DashboardApp(ScriptedSource(records, hold=True))
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, len(records))
        assert app.state.log
        await pilot.press("c")
        assert app.state.log == ()
        await pilot.press("q")
        await pilot.pause()
        assert not app.is_running


async def test_running_requests_and_the_batch_size_show_as_requests_join_the_slots():
    records = scenes.batching()
    app = DashboardApp(ScriptedSource(records, hold=True))
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, len(records))
        view = app.main.query_one(RequestsView)
        rows = {line.split()[0]: line.split() for line in text_of(view).splitlines()[1:]}
        tokens = {}
        for r in records:
            if isinstance(r, TokenRecord):
                tokens[r.request_id] = tokens.get(r.request_id, 0) + 1
        assert rows["req-2"][:5] == ["req-2", "1", "96", "80", str(tokens["req-2"])]
        assert rows["req-1"][-1] == "stop" and rows["req-5"][-1] == "running"
        assert list(rows) == ["req-2", "req-3", "req-4", "req-5", "req-1"]
        assert view.border_subtitle == "slots 4/4 in use · 1 queued · prefix hits 1 (80 tokens)"
        decode = [r.batch for r in records if isinstance(r, StepRecord) and r.kind == "decode"]
        head = text_of(app.main.query_one(BatchChart)).splitlines()[0]
        assert head.startswith(f"batch 4 · mean {sum(decode) / len(decode):.1f} over {len(decode)} steps")


# --- the real sources, against a local server -------------------------------------------------

async def serve(app: web.Application):
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


async def test_the_websocket_source_reconnects_after_its_node_closes_the_stream():
    snapshot = to_dict(scenes.generating(0)[2])

    async def events(request):
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.send_str(json.dumps(snapshot))
        await ws.send_str("not json")
        await ws.close()
        return ws

    app = web.Application()
    app.router.add_get("/v1/events", events)
    runner, url = await serve(app)
    try:
        got = []
        source = WebSocketSource(url, first=0.01, cap=0.02)
        async for item in source:
            got.append(item)
            if len(got) == 10:
                break
    finally:
        await runner.cleanup()
    kinds = [getattr(g, "state", None) or type(g).__name__ for g in got]
    assert kinds == ["connecting", "connected", "ClusterView", "Notice", "disconnected",
                     "connecting", "connected", "ClusterView", "Notice", "disconnected"]
    assert got[4].retry_in == 0.01
    assert [source.delay(a) for a in range(4)] == [0.01, 0.02, 0.02, 0.02]


async def test_the_websocket_source_says_when_nobody_answers():
    runner, url = await serve(web.Application())
    await runner.cleanup()  # the port is closed now
    source = WebSocketSource(url, first=0.01)
    got = []
    async for item in source:
        got.append(item)
        if len(got) == 2:
            break
    assert [g.state for g in got] == ["connecting", "disconnected"]


async def test_the_http_asker_yields_the_streamed_deltas():
    seen = {}

    async def chat(request):
        seen.update(await request.json())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for piece in (None, "Hel", "lo", None):  # a role chunk first, an empty finish chunk last, as OpenAI's
            delta = {"content": piece} if piece else {}
            chunk = {"id": "chatcmpl-7", "choices": [{"delta": delta}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def refuse(request):
        return web.json_response({"error": {"message": "busy"}}, status=503)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    bad = web.Application()
    bad.router.add_post("/v1/chat/completions", refuse)
    runner, url = await serve(app)
    bad_runner, bad_url = await serve(bad)
    try:
        pieces = [p async for p in HttpAsker(url).ask("hi")]
        assert pieces == [AskChunk("Hel", "chatcmpl-7"), AskChunk("lo", "chatcmpl-7")]
        assert seen["stream"] is True and seen["messages"] == [{"role": "user", "content": "hi"}]
        with pytest.raises(AskError, match="503"):
            [p async for p in HttpAsker(bad_url).ask("hi")]
    finally:
        await runner.cleanup()
        await bad_runner.cleanup()


async def test_a_real_servers_request_shows_as_one_line_with_the_tokens_its_usage_counts(stories_path):
    mf = gguf.open_model(stories_path)
    engine = Engine(LocalRunner(mf, 128), Tokenizer.from_metadata(mf.metadata), "stories260K")
    async with serving(make_app(engine)) as url:
        app = DashboardApp(WebSocketSource(url, first=0.05))
        async with app.run_test(size=SIZE) as pilot:
            for _ in range(500):
                if app.state.connection.state == "connected" and engine.bus.subscribers:
                    break
                await pilot.pause(0.01)
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
                async with s.post(url + "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 12,
                                                                 "temperature": 0}) as r:
                    usage = (await r.json())["usage"]
            for _ in range(500):
                if app.state.requests and app.state.requests[-1].finished:
                    break
                await pilot.pause(0.01)
            (line,) = app.state.requests
            assert (line.tokens, line.prompt_tokens) == (usage["completion_tokens"], usage["prompt_tokens"])
            assert line.finish_reason == "length" and line.tokens_per_s > 0
            row = text_of(app.main.query_one(RequestsView)).splitlines()[1].split()
            assert row[0] == line.request_id[:len(row[0])] and len(row[0]) >= len("cmpl-") + 8
            assert row[4] == "12" and row[-1] == "length"


# --- snapshots --------------------------------------------------------------------------------

def snapshot_app(records) -> tuple[DashboardApp, object]:
    async def run_before(pilot) -> None:
        await settle(pilot, len(records))

    return DashboardApp(ScriptedSource(records, hold=True)), run_before


def test_snapshot_forming(snap_compare):
    """Two nodes in a snapshot, a third joining, weights moving, no root yet."""
    app, run_before = snapshot_app(scenes.forming())
    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_snapshot_generating(snap_compare):
    """Three nodes, pi5-a root, 40 tokens streamed: charts populated, answer in progress."""
    app, run_before = snapshot_app(scenes.generating(40))
    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_snapshot_node_lost(snap_compare):
    """opi-c lost mid-answer: its row marked lost, the error and the re-plan in the log."""
    app, run_before = snapshot_app(scenes.node_lost(30))
    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_snapshot_batching(snap_compare):
    """Four slots busy, a fifth request queued: one line per request, the batch size rising to 4."""
    app, run_before = snapshot_app(scenes.batching())
    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


async def test_a_pipeline_shows_each_nodes_stage_and_layers_and_an_idle_node():
    a = replace(scenes.A, stage=0, layers=(0, 10))
    b = replace(scenes.B, stage=1, layers=(10, 16))
    c = replace(scenes.C, state="idle", kv_groups=(0, 0), ffn_cols=(0, 0), vocab_rows=(0, 0))
    records = [ClusterView(3, "pi5-a", scenes.MODEL, (a, b, c), plan="pp: layers 0:10 on pi5-a; layers 10:16 on pi5-b")]
    app = DashboardApp(ScriptedSource(records, hold=True))
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, len(records))
        widget = app.main.query_one(NodesTable)
        rows = {line.split()[0]: line for line in text_of(widget).splitlines() if line.strip()}
        assert "0 · 0-10" in rows["pi5-a"] and "1 · 10-16" in rows["pi5-b"]
        assert "idle" in rows["opi-c"]
        assert widget.border_title.endswith("· pp")
