"""Late launch on CUDA (engine/step_clock.py), on the serving thread: the clock
learns the device's step times and holds each launch until the step in
flight nears its end; a request that arrives meanwhile reaches the engine at
once and joins the next step, so its first token comes about a step sooner;
the device is seldom left waiting. The same engine with the clock switched
off is the control, in the same test (the checks must tell the two apart).
Run on a GPU host: ``python -m pytest tests/gpu -m gpu``."""

from __future__ import annotations

import random
import threading
import time
from itertools import pairwise
from statistics import mean, median

import pytest
import torch

from engine import LLM, SamplingParams
from engine.engine_thread import EngineThread
from engine.models.shapes import write_shape_dir

pytestmark = pytest.mark.gpu

BACKGROUND = 32  # decoding sequences: steps of several ms on an 8B shape
PROBES = 40  # per phase


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model_dir = write_shape_dir("llama-3.1-8b", str(tmp_path_factory.mktemp("shape")))
    llm = LLM(
        str(model_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        device="cuda",
        max_model_len=2048,
        gpu_memory_utilization=0.5,
    )
    assert llm.llm_engine.step_clock is not None  # on by default with async scheduling
    return llm.llm_engine


def phase(thread: EngineThread, step_ends: list[float], late: bool, rng: random.Random):
    """PROBES one-token requests at random moments; per probe the hand-off (the
    call made, to the engine thread adding it) and the time to first token;
    the median step time over the phase; the clock's counts over it."""
    clock = thread.engine.step_clock
    clock.enabled = late
    counts0 = (clock.num_launches, clock.num_late_launches, clock.num_idle_launches)
    first_step = len(step_ends)
    handoffs, ttfts, done = [], [], threading.Semaphore(0)
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    for i in range(PROBES):
        time.sleep(rng.uniform(0.01, 0.03))
        rid = f"{'late' if late else 'early'}-{i}"
        sent = time.monotonic()

        def add(e, rid=rid, sent=sent):
            handoffs.append(time.monotonic() - sent)
            e.add_request(rid, [rng.randrange(1, 30000) for _ in range(64)], params)

        def sink(out, sent=sent):
            if out.finished:
                ttfts.append(time.monotonic() - sent)
                done.release()

        thread.add(rid, sink, add)
    for _ in range(PROBES):
        assert done.acquire(timeout=30)
    ends = step_ends[first_step:]
    gaps = [b - a for a, b in pairwise(ends)]
    now = (clock.num_launches, clock.num_late_launches, clock.num_idle_launches)
    counts = [a - b for a, b in zip(now, counts0, strict=True)]
    return median(handoffs), mean(ttfts), median(gaps), counts


def test_requests_join_the_next_step_without_idling_the_device(engine):
    thread = EngineThread(engine, name="late-launch-test").start()
    step_ends: list[float] = []
    thread.after_step.append(lambda outputs: step_ends.append(time.monotonic()))
    rng = random.Random(0)
    background = SamplingParams(max_tokens=1500, ignore_eos=True, temperature=0.0)
    try:
        for i in range(BACKGROUND):
            prompt = [rng.randrange(1, 30000) for _ in range(256)]
            thread.add(
                f"bg-{i}",
                lambda out: None,
                lambda e, i=i, p=prompt: e.add_request(f"bg-{i}", p, background),
            )
        time.sleep(2.0)  # all decoding; the clock has learned the steps
        late = phase(thread, step_ends, True, rng)
        early = phase(thread, step_ends, False, rng)
        assert thread.call(lambda e: e.get_num_unfinished_requests()).result(10) == BACKGROUND
    finally:
        thread.stop()
    (late_handoff, late_ttft, step_s, (launches, waited, idle)) = late
    (early_handoff, early_ttft, _, (early_launches, early_waited, early_idle)) = early
    report = f"late {late}, early {early}"
    assert step_s > 0.004, report  # steps long enough for a wait to matter
    # (The first launch after the switch may still have waited.)
    assert waited >= 0.3 * launches and early_waited <= 1, report
    # The device waited for the host (at least in part) hardly more often than
    # without the clock: a probe's prefill step takes longer to build than a
    # decode step runs, so some such launches are in both.
    assert idle / launches <= early_idle / early_launches + 0.1, report
    # Held launches leave the engine thread free: a request is taken at once
    # instead of after the step it arrived in (half a step, on average).
    assert late_handoff < 0.5 * early_handoff, report
    # And it joins the next step: its first token comes sooner by a good part
    # of a step.
    assert late_ttft < early_ttft - 0.3 * step_s, report
