"""LoRA's torch-free parts: device-slot bookkeeping, the scheduler waiting for a
slot while others run, the per-step hand-off of adapter slots, the options."""

from __future__ import annotations

import numpy as np
import pytest

from engine.block_manager import BlockManager
from engine.lora.config import check_lora_options
from engine.lora.request import LoRARequest
from engine.lora.slots import LoRASlots
from engine.parallel.handoff import StepPlan, decode, encode
from engine.scheduler import Scheduler
from engine.step_inputs import host_inputs
from tests.unit.engine.helpers import make_seq

A, B, C = (LoRARequest(n, i, f"/adapters/{n}") for i, n in enumerate("abc", start=1))


def test_slots_are_shared_kept_while_idle_and_taken_least_recently_idle_first():
    slots = LoRASlots(2)
    assert slots.acquire(1) == 0 and slots.acquire(1) == 0 and slots.acquire(2) == 1
    assert slots.acquire(3) is None  # both held
    slots.release(1)
    assert slots.users(1) == 1 and slots.acquire(3) is None
    slots.release(1)
    slots.release(2)
    assert slots.acquire(2) == 1  # idle but still in place: no reload
    assert slots.acquire(3) == 0  # adapter 1, idle longest, loses its slot
    assert slots.resident == {2: 1, 3: 0}
    with pytest.raises(RuntimeError, match="released more often"):
        slots.release(1)


def _lora_seq(lora, n=8):
    seq = make_seq(n, 4)
    seq.lora_request = lora
    return seq


def test_scheduler_waits_for_a_free_slot_and_admits_the_others_meanwhile():
    slots = LoRASlots(1)
    sched = Scheduler(BlockManager(64, 4), 8, 256, 256, lora_slots=slots)
    a1, b1, base, a2 = _lora_seq(A), _lora_seq(B), _lora_seq(None), _lora_seq(A)
    for s in (a1, b1, base, a2):
        sched.add(s)
    batch = sched.schedule()
    # b waits for adapter a's slot; the base-model sequence behind it runs, a2
    # (another adapter's, behind b) waits its turn: it would keep the slot busy.
    assert batch.seqs == [a1, base]
    assert list(sched.waiting) == [b1, a2]
    assert slots.users(A.lora_int_id) == 1
    sched.finish(a1, reason=_stop())
    assert sched.schedule().admitted == [b1]  # first come, first served
    assert slots.resident == {B.lora_int_id: 0}
    sched.finish(b1, reason=_stop())
    assert sched.schedule().admitted == [a2]


def _stop():
    from engine.sequence import FinishReason

    return FinishReason.STOP


def test_preemption_gives_the_slot_back():
    slots = LoRASlots(1)
    sched = Scheduler(BlockManager(3, 4), 8, 256, 256, lora_slots=slots)
    seq = _lora_seq(A, 8)
    sched.add(seq)
    sched.schedule()
    sched._preempt(seq)
    assert slots.users(A.lora_int_id) == 0


def test_step_plan_carries_adapter_slots_and_loads_to_the_other_ranks():
    host = host_inputs([[1, 2, 3], [4, 5]], [0, 0], [3, 2], [[0], [1]], 4)
    plan = StepPlan(host)
    plan.lora_slots = np.array([0, 0, 0, -1, -1], dtype=np.int32)
    plan.lora_loads = [(0, A)]
    got = decode(*encode(plan))
    assert got.lora_slots.tolist() == [0, 0, 0, -1, -1] and got.lora_loads == [(0, A)]
    assert got.host.input_ids.tolist() == [1, 2, 3, 4, 5]
    bare = decode(*encode(StepPlan(host)))
    assert bare.lora_slots is None and bare.lora_loads == []


def test_lora_options_are_checked_by_name():
    assert check_lora_options(True, 4, 16, None, 1, False) == 4  # vLLM's default
    with pytest.raises(ValueError, match="max_cpu_loras"):
        check_lora_options(True, 4, 16, 2, 1, False)
    with pytest.raises(ValueError, match="max_loras"):
        check_lora_options(True, 0, 16, None, 1, False)
    with pytest.raises(ValueError, match="fully_sharded_loras"):
        check_lora_options(True, 1, 16, None, 2, True)
    with pytest.raises(ValueError, match="lora_path"):
        LoRARequest("x", 1, "")
