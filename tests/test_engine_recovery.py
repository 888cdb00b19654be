"""The root's engine outlives a node lost while the cluster was idle.

A worker killed between answers is noticed only when the root next sends to it, and the first frame
of an answer is runner.begin's RESET (not a step). That loss must re-plan as a loss mid-step does.
Before, it escaped the generation loop: the loop ended for good, silently, and this request and
every later one got "the server is shutting down". A real server on 127.0.0.1 (stories260K) driven
by the `openai` client; the lost node is a runner whose begin fails as a dead link's send does,
as tests/test_rebalance.py loses one mid-answer. Expected text: `generate` outside any server.
"""

from __future__ import annotations

import openai

from edgetp.model import sampling
from edgetp.model.batch import RunnerLost
from edgetp.model.generate import LocalRunner, generate
from edgetp.serve.api import make_app, serving
from edgetp.serve.root import Engine

PROMPT = "Once upon a time"
TOKENS = 24
CTX = 128


async def test_a_node_lost_while_idle_is_planned_around_at_the_next_answer_and_the_engine_serves_on(stories):
    mf, tok = stories
    greedy = sampling.SamplingParams(temperature=0)
    expected = "".join(ev.text for ev in generate(LocalRunner(mf, CTX), tok, tok.encode(PROMPT), greedy, TOKENS))

    class LostWhileIdle(LocalRunner):
        def begin(self, params=None):
            raise RunnerLost("link 127.0.0.1:9: send failed ([Errno 32] Broken pipe)")

    reasons: list[str] = []

    def recover(exc: Exception) -> LocalRunner:  # as the daemon's Recovery: the engine's runner from now on
        reasons.append(str(exc))
        engine.runner = LocalRunner(mf, CTX, slots=2)
        return engine.runner

    engine = Engine(LostWhileIdle(mf, CTX, slots=2), tok, "stories260K", recover=recover)
    async with serving(make_app(engine)) as url:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60) as client:
            for stream in (True, False, True):  # the re-planned answer, and the engine still serving after it
                answer = await client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=TOKENS,
                                                         temperature=0, stream=stream)
                text = "".join([c.choices[0].text async for c in answer]) if stream else answer.choices[0].text
                assert text == expected
    assert reasons == ["link 127.0.0.1:9: send failed ([Errno 32] Broken pipe)"]
