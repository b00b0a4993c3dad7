"""The benchmark's two load shapes (``vllm_runs._steady`` / ``_waves``) drive an
engine the way a server under steady load and a batch job do.

The engine here is a stand-in with vLLM's ``LLMEngine`` surface (add_request,
step, RequestOutput-like outputs): this tests our request loop (in-flight
count, output order, unique ids), not vLLM; the real engine runs it in
tests/model/test_bench_interleave_engine.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from spec_plugins import vllm_runs as vr


class FakeEngine:
    """Each request needs ``lengths[prompt]`` steps; every step advances all in flight."""

    def __init__(self, lengths):
        self.lengths = lengths
        self.running: dict[str, list] = {}
        self.max_in_flight = 0
        self.ids: list[str] = []

    def add_request(self, request_id, prompt, params):
        assert request_id not in self.ids, "request ids must be unique"
        self.ids.append(request_id)
        internal = request_id + "-internal"  # vLLM may return an id of its own
        self.running[internal] = [prompt, self.lengths[prompt]]
        self.max_in_flight = max(self.max_in_flight, len(self.running))
        return internal

    def step(self):
        out = []
        for rid, state in list(self.running.items()):
            state[1] -= 1
            if state[1] == 0:
                del self.running[rid]
                out.append(SimpleNamespace(request_id=rid, finished=True,
                                           outputs=[SimpleNamespace(token_ids=[state[0]], finish_reason="length")]))
        return out


@pytest.mark.parametrize("concurrency", [1, 3, 8])
def test_steady_keeps_the_requests_in_flight_and_the_prompt_order(concurrency):
    prompts = [f"p{i}" for i in range(7)]
    engine = FakeEngine({p: 1 + (i * 5) % 4 for i, p in enumerate(prompts)})
    done = []
    outs = vr._steady(SimpleNamespace(llm_engine=engine), prompts, [None] * 7, concurrency,
                      lambda d, n: done.append((d, n)))
    assert [o.outputs[0].token_ids[0] for o in outs] == prompts
    assert engine.max_in_flight == min(concurrency, 7)
    assert done[-1] == (7, 7) and len(done) == 7
    outs2 = vr._steady(SimpleNamespace(llm_engine=engine), prompts, [None] * 7, concurrency, None)
    assert len(outs2) == 7 and len(set(engine.ids)) == 14  # ids stay unique across runs on one engine


def test_steady_refills_as_soon_as_one_finishes():
    """One long request and short ones at concurrency 2: the short ones run
    beside the long one, so the run takes the long one's steps (waves would
    wait for the long one before starting the rest)."""
    prompts = ["long", "a", "b", "c"]
    engine = FakeEngine({"long": 6, "a": 2, "b": 2, "c": 2})
    steps = 0
    step = engine.step

    def counting_step():
        nonlocal steps
        steps += 1
        return step()

    engine.step = counting_step
    vr._steady(SimpleNamespace(llm_engine=engine), prompts, [None] * 4, 2, None)
    assert steps == 6


def test_unknown_load_is_refused():
    with pytest.raises(ValueError, match="load='bursty'"):
        vr._timed_run(None, vr.SpecConfig(), ["p"], 4, 1, 0.0, None, load="bursty")
