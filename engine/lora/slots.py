"""Which adapter holds which of the ``max_loras`` device slots (torch-free).

The scheduler asks for a slot when it admits a sequence that names an
adapter and gives it back when the sequence leaves the running set (finish,
preemption). A slot stays with its adapter while no sequence uses it, so the
next request for that adapter finds its weights in place; when every slot is
taken and another adapter is wanted, the least recently idle adapter loses
its slot. When all slots are in use the sequence waits (others run).

Life cycle of a slot: FREE (never loaded) -> HELD (users > 0) -> IDLE (users
== 0, weights still in place) -> HELD again, or reassigned to another adapter,
or FREE again when its adapter was removed (``drop``).
The model runner copies an adapter's weights into its slot before the first
step that reads them (engine/lora/manager.py).
"""

from __future__ import annotations

from collections import OrderedDict


class LoRASlots:
    def __init__(self, max_loras: int) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1; got {max_loras}")
        self.max_loras = max_loras
        self._slot_of: dict[int, int] = {}  # lora_int_id -> slot
        self._users: dict[int, int] = {}  # lora_int_id -> sequences using it
        # Adapters with a slot and no user, least recently released first.
        self._idle: OrderedDict[int, None] = OrderedDict()
        self._free = list(range(max_loras - 1, -1, -1))  # popped from the end: 0 first

    def slot_of(self, lora_int_id: int) -> int:
        """The slot of an adapter that holds one (KeyError otherwise)."""
        return self._slot_of[lora_int_id]

    def acquire(self, lora_int_id: int) -> int | None:
        """A slot for one more sequence of this adapter, or None when every slot
        is used by sequences of other adapters (the caller waits)."""
        slot = self._slot_of.get(lora_int_id)
        if slot is None:
            if self._free:
                slot = self._free.pop()
            elif self._idle:
                evicted, _ = self._idle.popitem(last=False)
                slot = self._slot_of.pop(evicted)
                del self._users[evicted]
            else:
                return None
            self._slot_of[lora_int_id] = slot
            self._users[lora_int_id] = 0
        self._idle.pop(lora_int_id, None)
        self._users[lora_int_id] += 1
        return slot

    def release(self, lora_int_id: int) -> None:
        users = self._users.get(lora_int_id, 0) - 1
        if users < 0:
            raise RuntimeError(f"adapter {lora_int_id} released more often than acquired")
        self._users[lora_int_id] = users
        if users == 0:
            self._idle[lora_int_id] = None

    def drop(self, lora_int_id: int) -> int | None:
        """Free the slot of an adapter no sequence uses (it was removed); the
        slot it held, or None when it held none."""
        if self._users.get(lora_int_id, 0) > 0:
            raise RuntimeError(f"adapter {lora_int_id} is in use by running sequences")
        slot = self._slot_of.pop(lora_int_id, None)
        self._users.pop(lora_int_id, None)
        self._idle.pop(lora_int_id, None)
        if slot is not None:
            self._free.append(slot)
        return slot

    def users(self, lora_int_id: int) -> int:
        return self._users.get(lora_int_id, 0)

    @property
    def resident(self) -> dict[int, int]:
        """lora_int_id -> slot of every adapter with a slot (held or idle)."""
        return dict(self._slot_of)
