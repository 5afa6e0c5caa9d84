"""EngineThread's hand-off of outputs to asyncio loops: one wake-up per loop and
step, items in order, and requests' first outputs ahead of the rest of a step."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from concurrent.futures import Future

import pytest

from engine.engine_thread import EngineDead, EngineThread
from engine.request_stream import RequestStream, one_wake_per_loop, settled
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
    ``launch_delay`` asks for 50 ms until the test lets go. The thread must run
    no step in that time, ask again every slice (2 ms), still serve calls, and
    a request added then must be in the first step launched after it."""
    hold = threading.Event()
    asked: list[float] = []

    def delay() -> float:
        if not hold.is_set() and tiny_engine._in_flight is not None:
            asked.append(time.monotonic())
            return 0.05
        return 0.0

    monkeypatch.setattr(tiny_engine, "launch_delay", delay)
    thread = EngineThread(tiny_engine, name="engine-test").start()
    steps: list[set[str]] = []  # per step: the requests with output in it
    thread.after_step.append(lambda outputs: steps.append({o.request_id for o in outputs}))
    params = SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0)
    pause = threading.Event()
    try:
        thread.add("a", lambda out: None, lambda e: e.add_request("a", [1, 2, 3], params))
        while not asked:
            pause.wait(0.001)
        before = len(steps)
        # Called during the wait: it runs at once, between two steps.
        added = thread.add("b", lambda out: None, lambda e: e.add_request("b", [4, 5], params))
        added.result(timeout=5)
        assert thread.call(lambda e: {"a", "b"} <= e.requests.keys()).result(timeout=5)
        start = time.monotonic()
        pause.wait(0.3)
        assert len(steps) == before, "a step ran while the launch was held"
        # Sliced: about one ask per 2 ms (a 50 ms wait would ask 6 times).
        assert sum(start <= t <= start + 0.3 for t in asked) >= 50
        hold.set()
        while thread.call(lambda e: e.has_unfinished_requests()).result(timeout=5):
            pause.wait(0.01)
    finally:
        thread.stop()
    # The first step after the hold was launched with "b" in it; its output is
    # read one step later (async scheduling), so it is in the second step's.
    after = steps[before:]
    assert "b" not in after[0] and "b" in after[1], after[:3]


def test_a_committed_prefills_first_token_lets_the_loop_go_first(tiny_engine):
    """The first output of a committed remote prefill is handed over by the
    command that committed it, before the command's future resolves (the loop
    resuming from the commit finds it in the request's stream), and no forward
    pass made it: the thread then sleeps HANDOFF_S so the loop sends it before
    the next launch. Steps that launch (a local prefill's first token, every
    decode) never do."""
    thread = EngineThread(tiny_engine, name="engine-test").start()
    params = SamplingParams(
        max_tokens=4, ignore_eos=True, temperature=0.0, output_kind=RequestOutputKind.DELTA
    )
    try:
        got: dict[str, list[int]] = {"local": [], "remote": []}

        def sink_for(rid: str):
            def sink(out) -> None:
                if getattr(out, "outputs", None):
                    got[rid].extend(out.outputs[0].token_ids)

            return sink

        thread.add("local", sink_for("local"), lambda e: e.add_request("local", [1, 2, 3], params))
        while len(got["local"]) < 4:
            time.sleep(0.001)
        assert thread.handoffs == 0
        thread.add(
            "remote", sink_for("remote"), lambda e: e.reserve_request("remote", [4, 5, 6], params)
        ).result(timeout=5)
        committed = thread.call(lambda e: e.commit_request("remote", 7))
        at_commit: list[list[int]] = []
        committed.add_done_callback(lambda _: at_commit.append(list(got["remote"])))
        committed.result(timeout=5)
        assert at_commit == [[7]], "the first token was not in the stream when the commit returned"
        while len(got["remote"]) < 4:
            time.sleep(0.001)
    finally:
        thread.stop()
    assert got["remote"][0] == 7  # the prefill node's token, reported as it came
    assert thread.handoffs == 1


def test_a_failure_handing_over_what_a_command_changed_stops_the_thread_for_all(
    tiny_engine, monkeypatch
):
    """What a command changed is handed over right after it (take_outputs). If
    that fails, the engine's state is unknown, as after a failed step: the
    command's future still resolves, every stream gets EngineDead, and later
    calls fail at once instead of waiting on a dead thread."""
    thread = EngineThread(tiny_engine, name="engine-test").start()
    got: list = []
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    try:
        reserve = thread.add(
            "held", got.append, lambda e: e.reserve_request("held", [4, 5], params)
        )
        assert reserve.result(timeout=5) is not None

        def broken() -> list:
            raise RuntimeError("output processing broke")

        monkeypatch.setattr(tiny_engine, "take_outputs", broken)
        assert thread.call(lambda e: 42).result(timeout=5) == 42
        deadline = time.monotonic() + 5
        while thread.alive and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not thread.alive and isinstance(thread.error, RuntimeError)
        assert len(got) == 1 and isinstance(got[0], EngineDead)
        with pytest.raises(EngineDead):
            thread.call(lambda e: None).result(timeout=1)
    finally:
        monkeypatch.undo()
        thread.stop()
        tiny_engine.abort_request("held")
        tiny_engine.take_outputs()  # nobody's: the next test starts clean


def wait_idle(thread: EngineThread) -> None:
    deadline = time.monotonic() + 5
    while not thread._idle:
        assert time.monotonic() < deadline, "the engine thread never went idle"
        time.sleep(0.001)


def delta_params(n: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=n, ignore_eos=True, temperature=0.0, output_kind=RequestOutputKind.DELTA
    )


def test_an_idle_engine_runs_inline_commands_on_the_callers_thread(tiny_engine, monkeypatch):
    """A decode node's reservation and commit, inline: each runs on the calling
    thread, done when ``call`` returns; the commit's first token is in the
    stream by then, and the engine thread, woken (its idle poll is made far
    longer than the test waits), decodes the rest."""
    monkeypatch.setattr("engine.engine_thread.IDLE_POLL_S", 60.0)
    thread = EngineThread(tiny_engine, name="engine-test").start()
    me = threading.current_thread().name
    got: list[int] = []

    def sink(out) -> None:
        if getattr(out, "outputs", None):
            got.extend(out.outputs[0].token_ids)

    try:
        wait_idle(thread)
        reserved = thread.add(
            "r",
            sink,
            lambda e: (
                threading.current_thread().name,
                e.reserve_request("r", [4, 5], delta_params(4)),
            ),
            inline=True,
        )
        assert reserved.done() and reserved.result()[0] == me
        wait_idle(thread)  # a reservation makes no step due: the thread was not woken for one
        committed = thread.call(lambda e: e.commit_request("r", 7), inline=True)
        assert committed.done() and got == [7]
        assert thread.inline_calls == 2
        deadline = time.monotonic() + 5
        while len(got) < 4 and time.monotonic() < deadline:
            time.sleep(0.001)
    finally:
        thread.stop()
    assert len(got) == 4 and got[0] == 7
    # Woken for the decode step, the thread first let the caller send the
    # first token (HANDOFF_S), as after a commit of its own.
    assert thread.handoffs == 1


def test_an_inline_commit_on_a_loop_leaves_the_first_token_in_the_stream_in_the_same_turn(
    tiny_engine,
):
    """On the decode node's loop: once the inline commit's ``settled`` returns,
    its first token is in the request's stream, with no turn of the loop
    between (the mailbox puts it straight in on the loop's own thread)."""
    thread = EngineThread(tiny_engine, name="engine-test").start()

    async def main() -> tuple[int, list[int]]:
        stream = RequestStream()
        wait_idle(thread)
        reserve = thread.add(
            "r", stream.sink, lambda e: e.reserve_request("r", [4, 5], delta_params(4)), inline=True
        )
        assert await settled(reserve) is not None
        wait_idle(thread)
        await settled(thread.call(lambda e: e.commit_request("r", 7), inline=True))
        first = stream.queue.get_nowait()  # raises QueueEmpty if it was not there
        rest = [t async for out in stream for t in out.outputs[0].token_ids]
        return first.outputs[0].token_ids, rest

    try:
        first, rest = asyncio.run(main())
    finally:
        thread.stop()
    assert first == [7] and len(rest) == 3


def test_settled_takes_a_done_futures_result_without_suspending():
    done: Future = Future()
    done.set_result(42)
    coro = settled(done)
    with pytest.raises(StopIteration) as stop:
        coro.send(None)  # it ran to its end in one go
    assert stop.value.value == 42


def test_a_put_on_the_loops_own_thread_goes_in_behind_other_threads_items():
    async def main() -> list[str]:
        stream = RequestStream()
        from_thread(lambda: stream.sink("from another thread"))  # waits for its wake-up
        stream.sink("on the loop's thread")  # straight in, behind it
        return [stream.queue.get_nowait(), stream.queue.get_nowait()]

    assert asyncio.run(main()) == ["from another thread", "on the loop's thread"]


def keep_busy(thread: EngineThread) -> tuple[Future, threading.Event]:
    """The engine thread running a command until the event is set (or 5 s)."""
    running, release = threading.Event(), threading.Event()
    wait_idle(thread)
    busy = thread.call(lambda e: (running.set(), release.wait(5)))
    assert running.wait(5)
    return busy, release


def test_an_inline_command_queues_behind_a_busy_engine_thread(tiny_engine):
    thread = EngineThread(tiny_engine, name="engine-test").start()
    release = threading.Event()
    try:
        busy, release = keep_busy(thread)
        later = thread.call(lambda e: threading.current_thread().name, inline=True)
        assert not later.done()
        release.set()
        assert busy.result(timeout=5)[1] is True
        assert later.result(timeout=5) == "engine-test"  # the engine thread ran it
    finally:
        release.set()
        thread.stop()
    assert thread.inline_calls == 0


class _PausingQueue:
    """The engine thread's command queue, able to hold it just after it took a
    command off (the moment a caller could run an inline command first)."""

    def __init__(self) -> None:
        self.inner: queue.SimpleQueue = queue.SimpleQueue()
        self.armed = False
        self.taken, self.go = threading.Event(), threading.Event()

    def put(self, item) -> None:
        self.inner.put(item)

    def get_nowait(self):
        return self.inner.get_nowait()

    def get(self, timeout=None):
        item = self.inner.get(timeout=timeout)
        if self.armed and item is not None:
            self.armed = False
            self.taken.set()
            self.go.wait(5)
        return item


def test_an_inline_command_never_overtakes_one_queued_before_it(tiny_engine):
    """Between taking a command off its queue and taking the engine's lock, the
    engine thread still looks idle: a command asked for inline then must wait
    its turn (a decode node's kv_expect for its other ranks, say, queued before
    its inline commit)."""
    thread = EngineThread(tiny_engine, name="engine-test")
    commands = thread._commands = _PausingQueue()
    thread.start()
    order: list[str] = []
    try:
        wait_idle(thread)
        commands.armed = True
        first = thread.call(lambda e: order.append("queued"))
        assert commands.taken.wait(5)
        second = thread.call(lambda e: order.append("inline"), inline=True)
        assert not second.done(), "the inline command overtook one queued before it"
        commands.go.set()
        first.result(timeout=5)
        second.result(timeout=5)
    finally:
        commands.go.set()
        thread.stop()
    assert order == ["queued", "inline"]
    assert thread.inline_calls == 0


def test_an_inline_commands_failed_hand_over_stops_the_engine(tiny_engine, monkeypatch):
    """As on the engine thread: the command's future resolves, every stream
    gets EngineDead, the thread stops, and later calls fail at once."""
    thread = EngineThread(tiny_engine, name="engine-test").start()
    got: list = []
    try:
        wait_idle(thread)
        params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
        assert thread.add(
            "held", got.append, lambda e: e.reserve_request("held", [4, 5], params), inline=True
        ).result(timeout=5)

        def broken() -> list:
            raise RuntimeError("output processing broke")

        monkeypatch.setattr(tiny_engine, "take_outputs", broken)
        wait_idle(thread)
        answer = thread.call(lambda e: 42, inline=True)
        assert answer.done() and answer.result() == 42
        deadline = time.monotonic() + 5
        while thread._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not thread.alive and isinstance(thread.error, RuntimeError)
        assert len(got) == 1 and isinstance(got[0], EngineDead)
        with pytest.raises(EngineDead):
            thread.call(lambda e: None, inline=True).result(timeout=1)
    finally:
        monkeypatch.undo()
        thread.stop()
        tiny_engine.abort_request("held")
        tiny_engine.take_outputs()


def test_commands_queued_when_the_engine_dies_fail_instead_of_hanging(tiny_engine, monkeypatch):
    thread = EngineThread(tiny_engine, name="engine-test").start()
    release = threading.Event()
    try:
        busy, release = keep_busy(thread)
        queued = [thread.call(lambda e: "never runs") for _ in range(2)]

        def broken() -> list:
            raise RuntimeError("output processing broke")

        monkeypatch.setattr(tiny_engine, "take_outputs", broken)  # after the busy command
        release.set()
        assert busy.result(timeout=5)[1] is True  # its own future still resolves
        for future in queued:
            with pytest.raises(EngineDead):
                future.result(timeout=5)
        assert not thread.alive
    finally:
        release.set()
        monkeypatch.undo()
        thread.stop()
