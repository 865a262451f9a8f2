"""Requests that arrive while others run, for the continuous-batching tests.

reqs = workload(vocab, n, max_prompt, max_new, seed)   # [(arrival step, prompt, max_tokens)]
outputs = run_arrivals(engine, reqs)                    # request id -> its tokens
"""

from __future__ import annotations

import random

from dsc.runtime.llm import LLMEngine, SamplingParams


def workload(vocab: int, n: int, max_prompt: int, max_new: int, seed: int = 0):
    """n requests: (arrival step, prompt, max_tokens), lengths drawn from 1..max_prompt / 1..max_new."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, max_prompt))]
        reqs.append((rng.randint(0, 30), prompt, rng.randint(1, max_new)))
    return reqs


def run_arrivals(engine: LLMEngine, reqs, params=None) -> dict[str, list[int]]:
    """Add each request at its arrival step (all at once when the queue drains), step until done."""
    pending = sorted(range(len(reqs)), key=lambda i: reqs[i][0])
    done: dict[str, list[int]] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and (reqs[pending[0]][0] <= step or not engine.has_unfinished_requests()):
            i = pending.pop(0)
            p = params[i] if params else SamplingParams(max_tokens=reqs[i][2], temperature=0, ignore_eos=True)
            engine.add_request(str(i), reqs[i][1], p)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        step += 1
    return done
