"""ZeRO-2: ZeRO-1, but each unit's gradients are reduce-scattered as soon as they exist.

The delta from ``zero1.py`` is one line: ``reduce_as_ready = True``. ZeRO-1 waits for the
whole backward, so every full gradient is alive at its end (2Ψ bytes in bf16). ZeRO-2 starts a
unit's reduce-scatter the moment its last gradient is accumulated, packs and drops the
per-parameter gradients, and frees the packed buffer as soon as the reduce-scatter lands (after
each issue it waits until ``max_reductions_in_flight`` = 2 remain pending: three are, as one is
issued). So only a few units' full gradients exist at any time and, at rest, a rank holds just
the gradient shard it optimizes. The reduce-scatter also overlaps the backward of the units
still to come. Communication is unchanged: 2Ψ a step.
"""

from __future__ import annotations

from shardlab.engine.zero1 import ZeRO1


class ZeRO2(ZeRO1):
    stage = 2
    reduce_as_ready = True
