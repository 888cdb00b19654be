"""Scripted records of a made-up three-board cluster, for tests and headless screenshots.

Numbers are plausible, not measured: SmolLM2-135M (3 KV groups, 1536 FFN
columns, 49152 vocab rows) split by speed over two Raspberry Pi 5s and an
Orange Pi. Every list is deterministic.
"""

from __future__ import annotations

from edgetp.events import (ClusterEvent, ClusterView, LinkBytes, NodeView, RequestRecord, SlotsView, StepRecord,
                           TokenRecord)

from .state import ConnectionStatus

MODEL = "SmolLM2-135M-Instruct Q4_1"
GB = 1_000_000_000
ANSWER = ("The sky looks blue because air molecules scatter short (blue) wavelengths of sunlight much "
          "more strongly than long (red) ones, an effect called Rayleigh scattering. Looking anywhere "
          "away from the sun, you see that scattered blue light.").split(" ")

A = NodeView("pi5-a", "192.168.1.21:7070", "root", "ready", 2.1 * GB, int(5.2 * GB), (0, 1), (0, 672),
             (0, 21504), None)
B = NodeView("pi5-b", "192.168.1.22:7070", "worker", "ready", 1.6 * GB, int(3.1 * GB), (1, 2), (672, 1184),
             (21504, 37888), 0.42)
C = NodeView("opi-c", "192.168.1.23:7070", "worker", "ready", 1.1 * GB, int(1.4 * GB), (2, 3), (1184, 1536),
             (37888, 49152), 0.61)


def connected() -> list:
    return [ConnectionStatus("connecting", "connecting to http://192.168.1.21:8080"),
            ConnectionStatus("connected", "connected to http://192.168.1.21:8080")]


def forming() -> list:
    """Two boards found each other, a third joins, weights are still moving; nobody leads yet."""
    a = NodeView(A.node_id, A.address, "worker", "ready", A.speed, A.mem_free)
    b = NodeView(B.node_id, B.address, "worker", "loading", B.speed, B.mem_free, rtt_ms=0.45, rtt_p90_ms=1.2, mbps=94.0,
                 transfer=(40_000_000, 145_000_000))
    return [*connected(),
            ClusterView(0, None, MODEL, (a, b)),
            ClusterEvent("join", "opi-c joined from 192.168.1.23:7070", "opi-c", 0,
                         {"address": C.address, "speed": C.speed, "mem_free": C.mem_free, "rtt_ms": 0.66,
                          "state": "loading"}),
            ClusterEvent("transfer", "pi5-b fetching weights from pi5-a: 72.5/145.0 MB", "pi5-b", 0,
                         {"done": 72_500_000, "total": 145_000_000}),
            ClusterEvent("transfer", "opi-c fetching weights from pi5-a: 14.5/145.0 MB", "opi-c", 0,
                         {"done": 14_500_000, "total": 145_000_000})]


def tokens(request_id: str, words: list[str], start: int = 0) -> list:
    """One TokenRecord per word, with latencies and link bytes that wobble deterministically."""
    out = []
    for i, word in enumerate(words, start):
        wobble = ((i * 37) % 11) / 10  # 0.0 .. 1.0
        compute = 38.0 + 9.0 * wobble + (6.0 if i % 9 == 0 else 0.0)
        sync = 11.0 + 7.0 * ((i * 53) % 7) / 6
        sent = 69_120 + 1_152 * ((i * 5) % 4)
        links = {B.address: LinkBytes(sent, sent - 2_304), C.address: LinkBytes(sent, sent - 4_608)}
        out.append(TokenRecord(request_id, i, word if i == 0 else " " + word, compute + sync, compute, sync,
                               links))
    return out


def generating(count: int = 40) -> list:
    """All three boards ready, pi5-a elected, an answer streaming."""
    return [*connected(),
            ClusterView(2, "pi5-a", MODEL, (A, B, C)),
            ClusterEvent("election", "pi5-a elected root (epoch 2)", "pi5-a", 2),
            ClusterEvent("replan", "plan over 3 nodes: attention 1/1/1, FFN 672/512/352", None, 2),
            RequestRecord("req-7", "started", "Why is the sky blue?", prompt_tokens=14),
            *tokens("req-7", ANSWER[:count])]


def node_lost(count: int = 30) -> list:
    """Mid-answer, opi-c stops answering; the rest re-plan over two boards."""
    return [*generating(count),
            ClusterEvent("leave", "opi-c lost: no heartbeat for 3.0 s", "opi-c", 3),
            ClusterEvent("error", "req-7 aborted: link to 192.168.1.23:7070 closed", "pi5-a", 3),
            RequestRecord("req-7", "finished", finish_reason="error", prompt_tokens=14, completion_tokens=count),
            ClusterEvent("replan", "plan over 2 nodes: attention 2/1, FFN 864/672", None, 3,
                         {"nodes": {"pi5-a": {"kv_groups": [0, 2], "ffn_cols": [0, 864],
                                              "vocab_rows": [0, 27648]},
                                    "pi5-b": {"kv_groups": [2, 3], "ffn_cols": [864, 1536],
                                              "vocab_rows": [27648, 49152]},
                                    "opi-c": {"kv_groups": [0, 0], "ffn_cols": [0, 0],
                                              "vocab_rows": [0, 0]}}})]


QUESTIONS = ("Why is the sky blue?", "Turn off the hall lights at 23:00.", "Summarise today's log.",
             "What is 17 * 23?", "Write a haiku about rain.")


def batching(steps: int = 36) -> list:
    """Four slots on the same three boards: requests join one by one, one reuses a cached prefix, a fifth
    waits in the queue until the first finishes, a sixth is still waiting. Each decode step carries one
    token per running request."""
    head = [*connected(), ClusterView(2, "pi5-a", MODEL, (A, B, C), slots=SlotsView(4, 0, 0)),
            ClusterEvent("election", "pi5-a elected root (epoch 2)", "pi5-a", 2)]
    joins = {0: 0, 4: 1, 9: 2, 14: 3, 25: 4}  # step -> request that joins before it
    prompts = (14, 96, 31, 12, 22)
    cached = (0, 80, 0, 0, 0)
    finish = {0: 24}  # request -> step after which it finishes (its slot goes to the queued one next step)
    out, running, queued, counts = head, [], [], {}
    for step in range(steps):
        if step in joins:
            n = joins[step]
            if len(running) < 4:
                if n in queued:
                    queued.remove(n)
                running.append(n)
                out.append(RequestRecord(f"req-{n + 1}", "started", QUESTIONS[n], prompt_tokens=prompts[n],
                                         cached_tokens=cached[n], slot=len(running) - 1 if n < 4 else 0))
                out.append(StepRecord("prefill", prompts[n] - cached[n], 30.0 + prompts[n] - cached[n],
                                      len(running), len(queued)))
        if step in (20, 30):
            queued.append(4 if step == 20 else 5)  # they arrive while every slot is taken, and wait
        ms = 52.0 + 6.0 * len(running) + ((step * 7) % 5)
        for n in running:
            i = counts.get(n, 0)
            out.append(TokenRecord(f"req-{n + 1}", i, (" " if i else "") + ANSWER[(i + 5 * n) % len(ANSWER)],
                                   ms, ms - 14.0, 14.0, {B.address: LinkBytes(69_120 * len(running), 66_816),
                                                         C.address: LinkBytes(69_120 * len(running), 64_512)}))
            counts[n] = i + 1
        out.append(StepRecord("decode", len(running), ms, len(running), len(queued)))
        for n, last in finish.items():
            if step == last and n in running:
                running.remove(n)
                out.append(RequestRecord(f"req-{n + 1}", "finished", QUESTIONS[n], "stop", prompts[n], counts[n],
                                         cached[n], slot=0))
    return out
