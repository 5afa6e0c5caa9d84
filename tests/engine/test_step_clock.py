"""StepClock (late launch): when the next step is due, from measured device
times. Host times here are plain numbers in seconds; the clock never reads a
clock of its own, so every figure below is exact."""

from __future__ import annotations

import pytest

from engine.step_clock import MARGIN_S, MIN_SAMPLES, StepClock, StepKind

DECODE = StepKind(num_tokens=64, has_prompt_rows=False)


def feed(clock: StepClock, kind: StepKind, device_s: float, steps: int, t: float) -> float:
    """Run ``steps`` steady async steps (each launched while the one before it
    runs, each taking ``device_s``, each launch 1 ms of host time); returns the
    host time after the last read. Leaves one step in flight."""
    if not clock.pending:
        clock.launched(kind, t, t + 0.001, caught_up=False)
    for _ in range(steps):
        clock.launched(kind, t, t + 0.001, caught_up=False)
        t += device_s
        clock.read(device_s, t, was_done=False)
    return t


def test_no_prediction_until_enough_steps_were_measured():
    clock = StepClock()
    t = feed(clock, DECODE, 0.010, MIN_SAMPLES - 2, 0.0)
    assert clock.wait(t, False) == 0.0  # too few samples: launch at once, as without it
    t = feed(clock, DECODE, 0.010, 4, t)
    assert clock.wait(t, False) > 0


def test_the_next_launch_is_due_one_launch_time_and_a_margin_before_the_end():
    clock = StepClock()
    t = feed(clock, DECODE, 0.010, 3 * MIN_SAMPLES, 0.0)
    # Every step took what was predicted: the safety factor is 1, the step in
    # flight started at the last read and ends 10 ms later.
    assert clock.safety() == pytest.approx(1.0)
    assert clock.due_end == pytest.approx(t + 0.010)
    assert clock.wait(t, False) == pytest.approx(0.010 - 0.001 - MARGIN_S)
    assert clock.wait(t + 0.007, False) == pytest.approx(0.001)
    assert clock.wait(t + 0.0079, False) == 0.0  # less than worth a wait: launch now


def test_device_time_is_a_line_in_the_step_token_count_per_kind():
    clock = StepClock()
    in_flight: list[int] = []
    t = 0.0
    for i in range(21):
        tokens = 100 + 50 * (i % 5)
        clock.launched(StepKind(tokens, True), t, t, caught_up=False)
        in_flight.append(tokens)
        if len(in_flight) == 2:  # read the older one: 2 ms and 10 µs a token
            done = in_flight.pop(0)
            t += 0.002 + done * 1e-5
            clock.read(0.002 + done * 1e-5, t, was_done=False)
    # The first step met an idle device (nothing ahead of it): not learned.
    assert len(clock.lines[True].samples) == 19
    assert clock.lines[True].predict(1000) == pytest.approx(0.002 + 1000 * 1e-5, rel=1e-6)
    assert clock.lines[False].predict(1000) is None  # decode steps have their own line


def test_a_step_whose_predecessor_was_already_done_starts_at_its_own_launch():
    clock = StepClock()
    t = feed(clock, DECODE, 0.010, 3 * MIN_SAMPLES, 0.0)
    # The next step is launched at t; the host comes to read the one before it
    # 4 ms later, finding it done: the new one began at its launch, not at 4 ms.
    clock.launched(DECODE, t, t + 0.001, caught_up=False)
    clock.read(0.010, t + 0.004, was_done=True)
    assert clock.due_end == pytest.approx(t + 0.010)
    # Found still running instead, it started when the host saw it end.
    clock.launched(DECODE, t + 0.005, t + 0.006, caught_up=False)
    clock.read(0.010, t + 0.012, was_done=False)
    assert clock.due_end == pytest.approx(t + 0.022)


def test_overshooting_predictions_scale_later_ones_down():
    clock = StepClock()
    t = feed(clock, DECODE, 0.010, 3 * MIN_SAMPLES, 0.0)
    # The steps turn twice as fast: their measured times come in below what
    # was predicted, and the due end moves early before the line catches up.
    for _ in range(MIN_SAMPLES):
        clock.launched(DECODE, t, t + 0.001, caught_up=False)
        t += 0.005
        clock.read(0.005, t, was_done=False)
    assert clock.safety() < 0.6
    assert clock.due_end - t < 0.006


def test_a_launch_the_device_caught_up_with_is_not_learned():
    clock = StepClock()
    t = feed(clock, DECODE, 0.010, 3 * MIN_SAMPLES, 0.0)
    samples = len(clock.lines[False].samples)
    # Not held (a host-bound build): counted, not learned, no backoff.
    clock.launched(DECODE, t, t + 0.012, caught_up=True)
    clock.read(0.010, t + 0.012, was_done=True)  # the step before: learned
    assert (clock.num_idle_launches, clock.backoff) == (1, 1.0)
    assert len(clock.lines[False].samples) == samples + 1
    clock.launched(DECODE, t + 0.013, t + 0.014, caught_up=False)
    clock.read(0.030, t + 0.030, was_done=False)  # its time includes the host's build
    assert len(clock.lines[False].samples) == samples + 1
    assert clock.lines[False].predict(64) == pytest.approx(0.010)


def test_a_held_launch_the_device_caught_up_with_backs_off_later_holds():
    clock = StepClock()
    t = feed(clock, DECODE, 0.010, 3 * MIN_SAMPLES, 0.0)
    assert clock.wait(t, False) > 0
    clock.launched(DECODE, t + 0.011, t + 0.012, caught_up=True)  # held too long
    assert (clock.num_late_launches, clock.num_idle_launches) == (1, 1)
    assert clock.backoff == pytest.approx(0.8)
    clock.read(0.010, t + 0.012, was_done=True)
    # The next steady step's due end is 0.8 of its prediction; launches the
    # device did not catch up with give the backoff back.
    t = feed(clock, DECODE, 0.010, 1, t + 0.012)
    assert clock.due_end == pytest.approx(t + 0.010 * clock.backoff)
    t = feed(clock, DECODE, 0.010, 20, t)
    assert clock.backoff == pytest.approx(1.0)


def test_a_hold_for_a_decode_step_that_a_request_turned_into_a_prefill_does_not_back_off():
    clock = StepClock()
    t = feed(clock, DECODE, 0.010, 3 * MIN_SAMPLES, 0.0)
    assert clock.wait(t, False) > 0  # no request waiting: held for a decode step
    clock.launched(StepKind(300, True), t + 0.008, t + 0.012, caught_up=True)
    assert (clock.num_idle_launches, clock.backoff) == (1, 1.0)
    clock.read(0.010, t + 0.012, was_done=True)
    # Held for a step with prompt rows (a request was waiting, or a prefill
    # node, whose steps all have them) and still caught up: that backs off.
    prefill = StepKind(300, True)
    t = feed(clock, prefill, 0.010, 3 * MIN_SAMPLES, t + 0.012)
    assert clock.wait(t, True) > 0
    clock.launched(prefill, t + 0.011, t + 0.012, caught_up=True)
    assert clock.backoff == pytest.approx(0.8)


def test_nothing_in_flight_forgets_a_wait():
    clock = StepClock()
    t = feed(clock, DECODE, 0.010, 3 * MIN_SAMPLES, 0.0)
    assert clock.wait(t, False) > 0
    clock.read(0.010, t + 0.010, was_done=False)  # the engine went idle instead
    clock.launched(DECODE, t + 60.0, t + 60.001, caught_up=True)  # a minute later
    assert clock.num_late_launches == 0
    assert clock.due_end == pytest.approx(t + 60.0 + 0.010)  # from its own launch


def test_waits_are_counted_once_per_launch_and_never_with_two_in_flight():
    clock = StepClock()
    t = feed(clock, DECODE, 0.010, 3 * MIN_SAMPLES, 0.0)
    assert clock.wait(t, False) > 0 and clock.wait(t + 0.001, False) > 0
    clock.launched(DECODE, t + 0.008, t + 0.009, caught_up=False)
    assert clock.num_late_launches == 1
    assert clock.wait(t + 0.008, False) == 0.0  # two steps pending: nothing to wait for
    clock.read(0.010, t + 0.010, was_done=False)
    clock.launched(DECODE, t + 0.010, t + 0.011, caught_up=False)
    assert clock.num_late_launches == 1


def test_a_waiting_request_asks_for_the_lead_of_a_step_with_prompt_rows():
    clock = StepClock()
    # Steps with prompt rows took 5 ms to build and launch, decode steps 1 ms.
    clock.launched(StepKind(300, True), 0.0, 0.005, caught_up=False)
    t = feed(clock, DECODE, 0.020, 3 * MIN_SAMPLES, 0.0)
    assert clock.lead(False) == pytest.approx(0.001 + MARGIN_S)
    assert clock.lead(True) == pytest.approx(0.005 + MARGIN_S)
    # A request arrived: the next step prefills it, so the launch starts 4 ms sooner.
    assert clock.wait(t, False) - clock.wait(t, True) == pytest.approx(0.004)
