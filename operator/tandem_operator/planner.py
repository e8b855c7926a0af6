"""What to do with one role's groups: a pure decision from (desired size, observed groups, current template).

Rules, in order:

1. **Scale down** to ``desired`` (plus one surge group while a rollout is under way): victims are chosen broken
   first, then incomplete, starting, ready; outdated before current; highest index first.
2. **Gang recovery**: a BROKEN group is deleted whole. It keeps its index while its pods terminate and is then
   recreated under the same name (step 4), so the registry key and Services stay stable.
3. **Rollout**, one group at a time, keeping serving capacity: outdated groups that are not Ready are replaced at
   once (they serve nothing). A Ready outdated group is deleted only when the role still has ``desired`` Ready
   groups without it: with ``maxSurgeGroups: 1`` a new group is created first (step 4) and the old one goes
   when the new one is Ready; with ``0`` the old one goes only when every group is Ready, and its replacement
   is created at once.
4. **Fill** up to ``desired`` (``desired + 1`` while surging, only when every current group is Ready, so one new
   group starts at a time) at the lowest free indices; INCOMPLETE current groups get their missing pods.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from tandem_operator.status import GroupState, GroupView


class DeleteReason(StrEnum):
    BROKEN = "MemberDied"
    SCALE_DOWN = "ScaleDown"
    ROLLOUT = "Rollout"


@dataclass(frozen=True)
class CreateGroup:
    """Apply the group's Service and every pod (existing ones are unchanged by the apply)."""

    index: int


@dataclass(frozen=True)
class DeleteGroup:
    """Delete every pod of the group (and its Service on scale-down)."""

    index: int
    reason: DeleteReason


Action = CreateGroup | DeleteGroup

_STATE_ORDER = {GroupState.BROKEN: 0, GroupState.INCOMPLETE: 1, GroupState.STARTING: 2, GroupState.READY: 3}


def plan(desired: int, groups: Mapping[int, GroupView], template_hash: str, max_surge: int) -> list[Action]:
    actions: list[Action] = []
    rolling = any(g.template_hash != template_hash for g in groups.values())
    budget = desired + (max_surge if rolling else 0)

    def victim_order(g: GroupView) -> tuple[int, int, int]:
        return (_STATE_ORDER[g.state], g.template_hash == template_hash, -g.index)

    ordered = sorted(groups.values(), key=victim_order)
    surplus = ordered[: max(0, len(groups) - budget)]
    actions += [DeleteGroup(g.index, DeleteReason.SCALE_DOWN) for g in surplus]
    remaining = {g.index: g for g in ordered[len(surplus) :]}

    actions += [
        DeleteGroup(i, DeleteReason.BROKEN) for i, g in sorted(remaining.items()) if g.state is GroupState.BROKEN
    ]

    outdated = [g for g in remaining.values() if g.template_hash != template_hash and g.state is not GroupState.BROKEN]
    replaced = [g for g in outdated if g.state is not GroupState.READY]
    ready = sum(g.state is GroupState.READY for g in remaining.values())
    ready_outdated = sorted((g for g in outdated if g.state is GroupState.READY), key=lambda g: -g.index)
    if ready_outdated:
        everything_ready = ready == len(remaining) == desired
        if ready - 1 >= desired or (max_surge == 0 and everything_ready):
            replaced.append(ready_outdated[0])
    actions += [DeleteGroup(g.index, DeleteReason.ROLLOUT) for g in sorted(replaced, key=lambda g: g.index)]

    current = [g for g in remaining.values() if g.template_hash == template_hash and g.state is not GroupState.BROKEN]
    still_outdated = len(outdated) > len(replaced)
    target = desired
    if still_outdated and max_surge > 0 and all(g.state is GroupState.READY for g in current):
        target = desired + max_surge
    live = len(remaining) - len(replaced)
    actions += [
        CreateGroup(i) for i, g in sorted(remaining.items()) if g in current and g.state is GroupState.INCOMPLETE
    ]
    free = (i for i in range(len(groups) + target + 1) if i not in groups)
    actions += [CreateGroup(next(free)) for _ in range(max(0, target - live))]
    return actions
