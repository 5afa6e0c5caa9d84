"""``step_jit``: ``triton.jit`` for kernels that read a step's metadata.

Triton compiles one variant of a kernel per specialisation of its arguments:
an integer that is 1 or a multiple of 16, a pointer aligned to 16 bytes. A
step's metadata differs from step to step in exactly those ways: the block
table's width (the step's longest sequence, in blocks) and the slices of the
metadata that a mixed step hands its decode and prefill parts (offset by the
number of decode rows). So new variants kept turning up under load, each a
compile inside a step while every request waited
(docs/lab/2026-11-25-stalls-under-load.md).

Those arguments are only read as scalars or gathered (block ids, sequence
lengths, query offsets), so specialising on them buys nothing: ``step_jit``
turns it off for the ones named, and the variants that remain are the
kernels' constexpr choices, which ``engine/kernel_warmup.py`` compiles at
start-up.
"""

from __future__ import annotations

import inspect

import triton

# Triton releases that have it keep integer and alignment specialisation apart.
_HAS_ALIGNMENT_SWITCH = "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters


def step_jit(*, ints: tuple[str, ...] = (), pointers: tuple[str, ...] = ()):
    """``triton.jit`` without specialising the named per-step integers and pointers."""
    kwargs = {"do_not_specialize": [*ints, *pointers]}
    if _HAS_ALIGNMENT_SWITCH:
        kwargs["do_not_specialize_on_alignment"] = list(pointers)
    return triton.jit(**kwargs)
