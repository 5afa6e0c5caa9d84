"""A step's host inputs (engine/step_inputs.py): the vectorised build against a
per-token reference, and where the previous step's device samples go."""

from __future__ import annotations

import random

import numpy as np
import torch

from engine.async_step import InFlightStep, patch_indices
from engine.scheduler import ScheduledBatch
from engine.step_inputs import HostStaging, host_inputs, to_model_inputs
from tests.unit.engine.helpers import make_seq

BS = 4


def reference(token_ids, starts, num_new, tables):
    ids, positions, slots = [], [], []
    for toks, s, n, table in zip(token_ids, starts, num_new, tables, strict=True):
        for p in range(s, s + n):
            ids.append(toks[p])
            positions.append(p)
            slots.append(table[p // BS] * BS + p % BS)
    return ids, positions, slots


def test_host_inputs_match_a_per_token_reference():
    rng = random.Random(0)
    for _ in range(50):
        num_seqs = rng.randint(1, 9)
        decode = rng.random() < 0.5
        token_ids, starts, num_new, tables = [], [], [], []
        for _ in range(num_seqs):
            length = rng.randint(1, 40)
            n = 1 if decode else rng.randint(1, length)
            start = length - n if rng.random() < 0.5 else rng.randint(0, length - n)
            token_ids.append([rng.randrange(1000) for _ in range(length)])
            starts.append(start)
            num_new.append(n)
            tables.append(rng.sample(range(500), -(-length // BS)))
        host = host_inputs(token_ids, starts, num_new, tables, BS)
        ids, positions, slots = reference(token_ids, starts, num_new, tables)
        assert host.input_ids.tolist() == ids
        assert host.positions.tolist() == positions
        assert host.slot_mapping.tolist() == slots
        assert host.seq_lens.tolist() == [s + n for s, n in zip(starts, num_new, strict=True)]
        assert host.query_start_loc.tolist() == [0, *np.cumsum(num_new).tolist()]
        for row, table in zip(host.block_tables, tables, strict=True):
            assert row[: len(table)].tolist() == table and not row[len(table) :].any()
        inputs, (extra,) = to_model_inputs(host, HostStaging(torch.device("cpu")), [host.seq_lens])
        assert inputs.input_ids.tolist() == ids and extra.tolist() == host.seq_lens.tolist()
        assert inputs.meta.max_query_len == max(num_new)
        assert inputs.meta.block_tables.dtype == torch.int32


def test_patch_indices_point_each_pending_sample_at_its_chunks_last_token():
    seqs = [make_seq(6, BS) for _ in range(4)]
    for s in seqs:
        s.num_computed_tokens = 5  # each decodes its 6th token
    prev = InFlightStep(ScheduledBatch(), [], None, None, sampled_device=torch.tensor([7, 8, 9]))
    # seqs[1] and seqs[3] end with a token the previous step sampled (indices 2 and 0).
    seqs[1].pending_sample, seqs[3].pending_sample = 2, 0
    prev.placeholders = [(seqs[1], 2, 5), (seqs[3], 0, 5)]
    # A prefill chunk of 3 tokens first shifts every decode row by 2 tokens.
    chunk = make_seq(8, BS)
    batch = [chunk, *seqs]
    tables = [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    host = host_inputs([s.token_ids for s in batch], [0, 5, 5, 5, 5], [3, 1, 1, 1, 1], tables, BS)
    dest, src = patch_indices(host, batch, prev)
    assert dest.tolist() == [4, 6] and src.tolist() == [2, 0]
    ids = torch.from_numpy(host.input_ids.copy())
    ids[torch.from_numpy(dest)] = prev.sampled_device[torch.from_numpy(src)]
    assert ids[4].item() == 9 and ids[6].item() == 7
    prev.read()  # reading the step clears the marks
    assert all(s.pending_sample == -1 for s in seqs)
    assert patch_indices(host, batch, None) is None
