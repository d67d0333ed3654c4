"""A round's drafting: a drafter proposes while its policy asks for more (docs/design.md,
"Engine"), for one row or for many rows at once. Shared by the engine and the vLLM proposer
(integrations/vllm.py), so both draft exactly the same tokens."""

from __future__ import annotations

from failfast.drafters import Drafter
from failfast.decode.policies import Policy
from failfast.model.kv_cache import KVCache


def draft_alone(drafter: Drafter, policy: Policy, committed: list[int], budget: int) -> tuple[list[int], list[float]]:
    """Up to `budget` tokens after `committed` and their confidences, as many as `policy` asks for."""
    tokens: list[int] = []
    confs: list[float] = []
    if budget <= 0:
        return tokens, confs
    drafter.begin(committed)
    while (want := min(policy.request(confs), budget - len(tokens))) > 0:
        new, new_confs = drafter.draft(want)
        if not new:  # the drafter has nothing more to propose
            break
        tokens += new
        confs += new_confs
    return tokens, confs


def draft_together(drafters: list, policy: Policy, rows: dict[int, tuple[list[int], int]],
                   shared: KVCache) -> dict[int, tuple[list[int], list[float]]]:
    """`draft_alone` for every row (slot -> (committed, budget)) at once: a batchable
    drafter's `draft_rows` serves several rows per forward, `drafters[slot]` drafting into
    `shared.row(slot)`. Each row asks its policy whenever its last request is drafted, as
    `draft_alone` does, so the drafts are the same."""
    drafted: dict[int, tuple[list[int], list[float]]] = {slot: ([], []) for slot in rows}
    remaining = {}
    for slot, (committed, budget) in rows.items():
        remaining[slot] = 0
        if budget > 0:
            drafters[slot].begin(committed)
            remaining[slot] = min(policy.request([]), budget)
    while wants := {slot: n for slot, n in remaining.items() if n > 0}:
        for slot, (new, new_confs) in type(drafters[0]).draft_rows(drafters, wants, shared).items():
            if not new:  # the drafter has nothing more to propose
                remaining[slot] = 0
                continue
            tokens, confs = drafted[slot]
            tokens += new
            confs += new_confs
            remaining[slot] -= len(new)
            if remaining[slot] == 0:
                remaining[slot] = max(min(policy.request(confs), rows[slot][1] - len(tokens)), 0)
    return drafted
