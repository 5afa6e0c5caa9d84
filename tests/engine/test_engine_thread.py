"""EngineThread's hand-off of outputs to asyncio loops: one wake-up per loop and
step, items in order, and requests' first outputs ahead of the rest of a step."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine.engine_thread import EngineThread, RequestStream, one_wake_per_loop
from engine.sampling_params import RequestOutputKind, SamplingParams


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    from engine import LLM
    from engine.models.shapes import write_shape_dir

    model_dir = write_shape_dir("tiny", tmp_path_factory.mktemp("tiny"))
    llm = LLM(
        str(model_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        device="cpu",
        max_model_len=256,
        async_scheduling=True,
    )
    return llm.llm_engine


def from_thread(fn) -> None:
    t = threading.Thread(target=fn)
    t.start()
    t.join()


def test_items_put_in_one_hand_off_arrive_together():
    async def main():
        streams = [RequestStream() for _ in range(8)]

        def hand_off():
            with one_wake_per_loop():
                for i, stream in enumerate(streams):
                    stream.sink(i)

        from_thread(hand_off)
        first = await streams[0].queue.get()
        # One wake-up delivered all of them: the others are there already.
        return first, [s.queue.qsize() for s in streams[1:]]

    first, sizes = asyncio.run(main())
    assert first == 0
    assert sizes == [1] * 7


def test_items_keep_their_order_and_errors_reach_the_reader():
    async def main():
        stream = RequestStream()

        def produce():
            for i in range(200):
                if i % 50 == 0:
                    with one_wake_per_loop():
                        stream.sink(i)
                else:
                    stream.sink(i)
            stream.sink(ValueError("boom"))

        from_thread(produce)
        got = [await stream.queue.get() for _ in range(201)]
        return got

    got = asyncio.run(main())
    assert got[:200] == list(range(200))
    assert isinstance(got[200], ValueError)


def test_a_closed_loop_does_not_fail_the_sender():
    loops = [asyncio.new_event_loop() for _ in range(2)]
    streams = [RequestStream(loop) for loop in loops]
    for loop in loops:
        loop.close()
    streams[0].sink("late")  # nobody reads it any more
    with one_wake_per_loop():
        streams[1].sink("late too")


def test_first_outputs_are_handed_over_before_the_rest_of_their_step(tiny_engine):
    thread = EngineThread(tiny_engine, name="engine-test").start()
    order: list[str] = []  # request ids in hand-off order; "|" ends a step
    lock = threading.Lock()

    def sink_for(rid: str):
        def sink(out) -> None:
            if getattr(out, "outputs", None) and out.outputs[0].token_ids:
                with lock:
                    order.append(rid)

        return sink

    def params(n: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=n, ignore_eos=True, temperature=0.0, output_kind=RequestOutputKind.DELTA
        )

    thread.after_step.append(lambda outputs: order.append("|"))
    try:
        # "old" decodes for a while; "new" arrives while it does.
        thread.add("old", sink_for("old"), lambda e: e.add_request("old", [1, 2, 3], params(40)))
        while "old" not in order:
            threading.Event().wait(0.001)
        thread.add("new", sink_for("new"), lambda e: e.add_request("new", [4, 5, 6], params(4)))
        while order.count("new") < 4:
            threading.Event().wait(0.001)
    finally:
        thread.stop()
    steps = "".join(x if x == "|" else x[0] for x in order).split("|")
    first_new = next(s for s in steps if "n" in s)
    assert first_new.startswith("n"), steps  # ahead of "old" in its step
    # Later steps keep the engine's own order (nothing is fresh any more).
    later = [s for s in steps[steps.index(first_new) + 1 :] if len(s) == 2]
    assert later and all(s == "on" for s in later), steps


def test_a_late_launch_waits_for_the_step_in_flight_and_serves_calls_meanwhile(
    tiny_engine, monkeypatch
):
    """The thread's side of late launch (engine/step_clock.py). On a CPU every
    step is done when launched, so the engine never asks for a wait: here its
    ``launch_delay`` asks for one until the test lets go, and the thread must
    run no step in that time but still serve calls (a request added then
    joins the next step); after it, steps resume."""
    hold = threading.Event()
    asked: list[float] = []

    def delay() -> float:
        if not hold.is_set() and tiny_engine._in_flight is not None:
            asked.append(0.05)
            return 0.05
        return 0.0

    monkeypatch.setattr(tiny_engine, "launch_delay", delay)
    thread = EngineThread(tiny_engine, name="engine-test").start()
    steps: list[int] = []
    thread.after_step.append(lambda outputs: steps.append(len(outputs)))
    params = SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0)
    try:
        thread.add("a", lambda out: None, lambda e: e.add_request("a", [1, 2, 3], params))
        deadline = threading.Event()
        while not asked:
            deadline.wait(0.001)
        before = len(steps)
        # Called during the wait: it runs at once, between two steps.
        added = thread.add("b", lambda out: None, lambda e: e.add_request("b", [4, 5], params))
        added.result(timeout=5)
        assert thread.call(lambda e: len(e.requests)).result(timeout=5) == 2
        deadline.wait(0.3)
        assert len(steps) == before, "a step ran while the launch was held"
        assert len(asked) >= 6  # the wait is sliced: each slice asked again
        hold.set()
        while thread.call(lambda e: e.has_unfinished_requests()).result(timeout=5):
            deadline.wait(0.01)
        assert len(steps) > before
    finally:
        thread.stop()
