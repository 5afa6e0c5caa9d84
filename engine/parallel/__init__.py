"""How the ranks of a tensor-parallel engine talk: their process groups
(group), the shared-memory channel (shm_channel) and rank 0's per-step
hand-off over it (handoff). Which rank holds what is engine/tp_layout.py; the
ranks' processes are engine/tp_workers.py."""
