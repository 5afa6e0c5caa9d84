"""StepClock: when to launch the next step so that it starts as the device
finishes the one in flight, and not sooner (late launch).

Async scheduling (engine/async_step.py) launches step N+1 right after step N,
so a request that arrives while the device runs N cannot join N+1: it is
added between steps, after N+1 was already built, and waits for N+2. Off,
it would join N+1, but the device would then sit idle while the host builds
every step. A late launch keeps both: the host builds N+1 as late as it can
while still handing it to the device before N ends, so the arrivals of most
of N's run join N+1 (the first token comes about one step sooner) and the
device never waits for the host.

The clock predicts when the step in flight ends: its start (the later of the
previous step's end, as the host saw it, and its own launch) plus its
predicted device time. That prediction is a least-squares line in the step's
token count, fitted per kind of step (decode only, or with prompt rows: a
different kernel path, CUDA graphs or not) on the device times of recent
steps, scaled down by how far recent predictions overshot (a low quantile of
actual / predicted) so that a wrong guess costs arrivals a step, not the
device its time. The next launch is due that end minus the host's recent
launch time (from scheduling to the launch returning) and a margin.

Plain Python bookkeeping, free of torch: the engine feeds it host times and
the device times its events measured.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

# Recent steps a fit or a quantile looks at: enough to smooth one odd step,
# few enough to follow a batch whose contexts grow.
WINDOW = 64
# Fewer samples than this for a kind of step: no prediction, launch at once.
MIN_SAMPLES = 8
# Launch this much before the predicted end on top of the host's launch time:
# the host's own jitter (a GIL wait, a garbage collection) must not idle the
# device.
MARGIN_S = 0.001
# The quantile of actual / predicted device time that scales predictions.
SAFE_QUANTILE = 0.1
# A late launch is only worth waiting for when it saves this much.
MIN_WAIT_S = 0.0005
# A launch that found the device idle scales later predictions by BACKOFF;
# each launch that found it busy gives back RECOVERY of that, up to 1.
BACKOFF = 0.8
RECOVERY = 1.02


@dataclass(slots=True)
class _Line:
    """Device seconds against a step's token count, over the last WINDOW steps."""

    samples: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=WINDOW))

    def add(self, num_tokens: int, seconds: float) -> None:
        self.samples.append((num_tokens, seconds))

    def predict(self, num_tokens: int) -> float | None:
        n = len(self.samples)
        if n < MIN_SAMPLES:
            return None
        mean_x = sum(x for x, _ in self.samples) / n
        mean_y = sum(y for _, y in self.samples) / n
        var = sum((x - mean_x) ** 2 for x, _ in self.samples)
        if var == 0:
            return mean_y
        slope = sum((x - mean_x) * (y - mean_y) for x, y in self.samples) / var
        # A noisy window can fit a negative slope: a step is never predicted
        # to take less than the fastest one seen.
        floor = min(y for _, y in self.samples)
        return max(floor, mean_y + slope * (num_tokens - mean_x))


@dataclass(slots=True)
class StepKind:
    """What the clock knows of a step when it is launched."""

    num_tokens: int
    has_prompt_rows: bool

    @classmethod
    def of(cls, num_tokens: int, num_seqs: int) -> StepKind:
        """A step of ``num_seqs`` rows: more tokens than rows means prompt rows."""
        return cls(num_tokens, num_tokens > num_seqs)


@dataclass(slots=True)
class _Launched:
    kind: StepKind
    began: float  # host time the host began scheduling it
    predicted_s: float | None  # its device time, as predicted at launch
    # Queued whole behind a busy device: its measured time is the device's.
    learn: bool


@dataclass(slots=True)
class StepClock:
    lines: dict[bool, _Line] = field(default_factory=lambda: {False: _Line(), True: _Line()})
    ratios: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    # Host seconds from scheduling to the launch returning, per kind of step.
    launch_times: dict[bool, deque[float]] = field(
        default_factory=lambda: {False: deque(maxlen=WINDOW), True: deque(maxlen=WINDOW)}
    )
    # Launched and not read yet, oldest first (two at most under async scheduling).
    pending: deque[_Launched] = field(default_factory=deque)
    # When the oldest pending step should end on the device, in host time
    # (None: no prediction, launch the next step at once).
    due_end: float | None = None
    # Counters (benchmarks, tests): launches that waited for the clock, and
    # launches the device had to wait for, at least in part (it finished the
    # step before while the host was still building this one: what a late
    # launch must not cause; a host-bound step does it without one).
    num_launches: int = 0
    num_late_launches: int = 0
    num_idle_launches: int = 0
    # Off: the clock still learns and counts, but never asks for a wait (a
    # benchmark's A/B of late launch on one engine).
    enabled: bool = True
    # Shrinks on every held decode launch the device had to wait for, and
    # recovers slowly: the clock backs off when its waits were too long.
    backoff: float = 1.0
    # The last wait asked for (None: none since the last launch): whether it
    # was for a step with prompt rows.
    _waited_for: bool | None = None

    def launched(self, kind: StepKind, began: float, returned: float, caught_up: bool) -> None:
        """A step was scheduled and launched between host times ``began`` and
        ``returned``; ``caught_up``: by ``returned`` the device had finished
        every step before it."""
        self.launch_times[kind.has_prompt_rows].append(returned - began)
        self.num_launches += 1
        waited_for, self._waited_for = self._waited_for, None
        if waited_for is not None:
            self.num_late_launches += 1
        # Fully queued while the device still ran the step before: its measured
        # time is the device's own. Otherwise the device caught up with the
        # host building it, and its time includes the host's; learning from
        # it would stretch later predictions and hold later launches longer.
        busy = bool(self.pending) and not caught_up
        if self.pending and caught_up:
            self.num_idle_launches += 1
            # A held step the device caught up with: the wait was too long,
            # hold later launches less. Not when the hold was for a decode step
            # and a request arrived during it: the longer build of the step it
            # became is the price of that request joining it, not a wrong guess.
            if waited_for == kind.has_prompt_rows:
                self.backoff *= BACKOFF
        elif busy:
            self.backoff = min(1.0, self.backoff * RECOVERY)
        line = self.lines[kind.has_prompt_rows]
        step = _Launched(kind, began, line.predict(kind.num_tokens), learn=busy)
        self.pending.append(step)
        if len(self.pending) == 1:  # nothing ahead of it: it starts now
            self._set_due(step, began)

    def read(self, device_s: float | None, now: float, was_done: bool) -> None:
        """The oldest pending step's samples were read at ``now``; ``device_s``
        is its measured device time (None without CUDA events); ``was_done``:
        the device had finished it before the host came to wait for it."""
        if not self.pending:
            return
        step = self.pending.popleft()
        if device_s is not None and step.learn:
            if step.predicted_s:
                self.ratios.append(device_s / step.predicted_s)
            self.lines[step.kind.has_prompt_rows].add(step.kind.num_tokens, device_s)
        self.due_end = None
        if not self.pending:
            self._waited_for = None  # nothing in flight: the next launch is not held
        else:
            # The next one started when this one ended: now, when the host
            # waited for it; some time before now, when it was already done
            # (then its own launch is the earliest it can have started).
            nxt = self.pending[0]
            self._set_due(nxt, nxt.began if was_done else max(now, nxt.began))

    def _set_due(self, step: _Launched, start: float) -> None:
        if step.predicted_s is None:
            self.due_end = None
        else:
            self.due_end = start + step.predicted_s * self.safety() * self.backoff

    def safety(self) -> float:
        """The factor predictions are scaled by: a low quantile of recent
        actual / predicted, at most 1 (never stretched past the prediction)."""
        if len(self.ratios) < MIN_SAMPLES:
            return 0.5
        ordered = sorted(self.ratios)
        return min(1.0, ordered[int(SAFE_QUANTILE * (len(ordered) - 1))])

    def lead(self, prompt_rows: bool) -> float:
        """How long before the device is done the host starts the next launch:
        the slowest recent launch of that kind of step (one with prompt rows
        builds more and, eager or piecewise, launches more), and the margin."""
        times = self.launch_times[prompt_rows] or self.launch_times[not prompt_rows]
        return (max(times) if times else 0.0) + MARGIN_S

    def wait(self, now: float, prompt_rows: bool) -> float:
        """Seconds to wait before launching the next step (0: launch now);
        ``prompt_rows``: the next step will have some (a request is waiting),
        which asks for the longer lead. A request that arrives during a wait
        shortens it: the engine asks again after adding it."""
        if not self.enabled or self.due_end is None or len(self.pending) != 1:
            return 0.0
        wait = self.due_end - self.lead(prompt_rows) - now
        if wait < MIN_WAIT_S:
            return 0.0
        self._waited_for = prompt_rows
        return wait
