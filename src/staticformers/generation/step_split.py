"""Which decoding rows of a block cache run apart: a decode step split by context, and the cost that decides it.

Why this exists: a step over a block cache gathers and attends over K positions of every row of its batch, K the
bucket of its longest context (`models/block_kv_cache.py`). With one long row among many short ones, every short row
reads the long one's K, and on a pool sized for many rows that gather, not the weights, is most of what the step
reads. A block cache can run any subset of its rows as a view of the pool, so the decoding rows may run as two
steps instead: the short contexts over their own K, the long ones over theirs (or, when rows still prefilling set
the batch's K, the decoding rows alone over theirs). `split_by_context` decides it from
what each choice reads: one step reads the weights once and every row of the batch (free rows too) times the
batch's K; two steps read the weights twice and each group's batch bucket times its own K. A gathered position
counts `READS_PER_POSITION` times: read from the pool, written as the gathered copy, read by attention. It splits
only when two steps read clearly less (`GAIN`), since each step also costs a launch and a read-back.
"""

from __future__ import annotations

from typing import Optional

from .plan import ShapePlan

GAIN = 0.75  # two steps must read at most this fraction of what the one step reads
READS_PER_POSITION = 3  # the gather reads a position, writes its copy, and attention reads the copy


def split_by_context(
    reach: dict, batch: int, kv: int, plan: ShapePlan, weight_bytes: int, position_bytes: int
) -> Optional[list]:
    """The groups of decoding rows that run apart, each over a view of its own batch and KV buckets, or None: the one
    step of the batch's `[batch, kv]` shape.

    One group (every decoding row) when its own shape reads less than the batch's (rows still prefilling, or free
    slots, raise the batch's K or batch bucket); two, [short slots, long slots], when two steps read at most `GAIN` of
    the best single step. `reach` {slot: the positions its step reads}: the decoding rows; `weight_bytes`: the
    model's weights; `position_bytes`: one position of one row over the layers."""
    if not reach:
        return None
    per = position_bytes * READS_PER_POSITION

    def cost(group: list) -> int:
        return weight_bytes + per * plan.batch_bucket(len(group)) * plan.kv_bucket(max(reach[s] for s in group))

    slots = sorted(reach, key=lambda s: (reach[s], s))
    whole = weight_bytes + per * batch * kv
    single: tuple = ([sorted(slots)], cost(slots)) if cost(slots) < whole else (None, whole)
    best = None
    for i in range(1, len(slots)):
        short, long = slots[:i], slots[i:]
        if plan.kv_bucket(reach[short[-1]]) == plan.kv_bucket(reach[long[-1]]):
            continue
        two = cost(short) + cost(long)
        if best is None or two < best[0]:
            best = (two, [sorted(short), sorted(long)])
    if best is not None and best[0] <= GAIN * single[1]:
        return best[1]
    return single[0]


__all__ = ["GAIN", "READS_PER_POSITION", "split_by_context"]
