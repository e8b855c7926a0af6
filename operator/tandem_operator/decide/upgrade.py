"""Upgrades without surprises: whether a group whose pods differ from this operator's rendering may roll now. Pure.

A group is *outdated* when its pods' template hash (the revision of the pods as rendered, ``naming.template_hash``)
is not the one this operator renders for the current spec. Two causes, told apart by the PDCluster generation
stamped on the pods (``ANNOTATION_GENERATION``, at creation and again whenever a pass finds the group current):

* the **user** changed the spec since (the stamp is older than the PDCluster's ``metadata.generation``): the group
  rolls at once, through the planner's drain and revision-coherent pairing, as always;
* only the **operator** renders differently (an upgrade; the stamp is the current generation, or missing: pods from
  before the stamp existed): ``spec.upgradePolicy`` decides. ``Manual`` (default) waits for the ``tandem.dev/roll``
  annotation naming the role, ``Window`` for the maintenance window (or the annotation), ``OnChange`` rolls at once.

A held group is shown to the planner as current (``hold``), so it neither rolls nor makes the role surge; only a
Ready or Starting group is held (an Incomplete or Broken one is recreated anyway, from the current rendering). The
``PodsOutdated`` condition lists each role's held or rolling groups and what would change (``desired.compare``).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from tandem.registry import Role
from tandem_operator.api.common import Condition
from tandem_operator.api.upgrade import ANNOTATION_ROLL, WEEKDAYS, MaintenanceWindow, RollPolicy, UpgradePolicy
from tandem_operator.decide.observe import GroupState, GroupView
from tandem_operator.decide.status import condition
from tandem_operator.desired.naming import ANNOTATION_DESIRED_HASH, ANNOTATION_GENERATION

CONDITION_TYPE = "PodsOutdated"
_HOLDABLE = (GroupState.READY, GroupState.STARTING)
MAX_CHANGES = 20  # differences listed per role in the condition (the rest counted)


def stamps(generation: int, template_hash: str) -> dict[str, str]:
    """The annotations that record the PDCluster generation and the template hash the operator wanted then."""
    return {ANNOTATION_GENERATION: str(generation), ANNOTATION_DESIRED_HASH: template_hash}


def stamp_generation(pod: Mapping[str, Any], generation: int, template_hash: str) -> dict[str, Any]:
    """A copy of a pod manifest with ``stamps``."""
    stamped = copy.deepcopy(dict(pod))
    stamped["metadata"].setdefault("annotations", {}).update(stamps(generation, template_hash))
    return stamped


def operator_only(view: GroupView, template_hash: str, generation: int) -> bool:
    """The group is outdated, and not because the user changed the spec: the spec is the one it was last looked at
    under (or it was made before stamps existed), or the spec changed since but what the operator wants did not."""
    outdated = view.template_hash not in ("", template_hash)
    same_spec = view.generation is None or view.generation >= generation
    return outdated and (same_spec or view.desired_hash == template_hash)


def window_open(window: MaintenanceWindow, now: datetime) -> bool:
    """``now`` (UTC) is inside an opening of the weekly window (one that began yesterday included)."""
    minute = now.hour * 60 + now.minute
    today = WEEKDAYS[now.weekday()]
    yesterday = WEEKDAYS[(now.weekday() - 1) % 7]
    start, length = window.start_minute, window.duration_minutes
    if today in window.days and start <= minute < start + length:
        return True
    return yesterday in window.days and minute < start + length - 1440


def next_opening(window: MaintenanceWindow, now: datetime) -> datetime:
    """When the window next opens after ``now``."""
    midnight = now.replace(hour=0, minute=0, second=0, microsecond=0)
    for days in range(8):
        opening = midnight + timedelta(days=days, minutes=window.start_minute)
        if opening > now and WEEKDAYS[opening.weekday()] in window.days:
            return opening
    raise AssertionError("a window opens on at least one day a week")


def may_roll(policy: UpgradePolicy, role: Role, trigger: frozenset[Role], now: datetime) -> bool:
    """An operator-only change of ``role`` may roll now."""
    if role in trigger or policy.roll is RollPolicy.ON_CHANGE:
        return True
    return policy.roll is RollPolicy.WINDOW and policy.window is not None and window_open(policy.window, now)


@dataclass(frozen=True)
class RoleUpgrade:
    """A role's groups outdated by the operator alone (Ready or Starting), and those of them held back."""

    role: Role
    outdated: tuple[int, ...]
    held: tuple[int, ...]


def gate(
    role: Role,
    views: Mapping[int, GroupView],
    template_hash: str,
    generation: int,
    policy: UpgradePolicy,
    trigger: frozenset[Role],
    now: datetime,
) -> RoleUpgrade:
    outdated = tuple(
        i for i, v in sorted(views.items()) if v.state in _HOLDABLE and operator_only(v, template_hash, generation)
    )
    held = () if may_roll(policy, role, trigger, now) else outdated
    return RoleUpgrade(role, outdated, held)


def hold(views: Mapping[int, GroupView], upgrade: RoleUpgrade, template_hash: str) -> dict[int, GroupView]:
    """The views the planner gets: a held group reads as current."""
    return {i: replace(v, template_hash=template_hash) if i in upgrade.held else v for i, v in views.items()}


def restamp(views: Mapping[int, GroupView], template_hash: str, generation: int) -> tuple[int, ...]:
    """Groups to stamp again (``stamps``): current or outdated by the operator alone, Ready or Starting, stamped
    with another generation or wanted hash (or none). A spec change that does not change what the operator wants
    then leaves them as they were, and a later operator-only change is told from a spec change."""
    return tuple(
        i
        for i, v in sorted(views.items())
        if v.state in _HOLDABLE
        and (v.template_hash == template_hash or operator_only(v, template_hash, generation))
        and (v.generation, v.desired_hash) != (generation, template_hash)
    )


def trigger_done(trigger: frozenset[Role], upgrades: Iterable[RoleUpgrade]) -> bool:
    """Every role the trigger names has no operator-only outdated group left (the annotation can go)."""
    return bool(trigger) and not any(u.outdated for u in upgrades if u.role in trigger)


def _waiting_for(policy: UpgradePolicy, roles: list[str], cluster: str, now: datetime) -> str:
    annotate = f"kubectl annotate pdcluster/{cluster} {ANNOTATION_ROLL}={','.join(roles)}"
    if policy.roll is RollPolicy.WINDOW and policy.window is not None:
        opens = next_opening(policy.window, now).strftime("%a %Y-%m-%dT%H:%MZ")
        return f"upgradePolicy Window: rolls when the window opens ({opens}), or now with: {annotate}"
    return f"upgradePolicy Manual: roll with: {annotate}"


def pods_outdated_condition(
    upgrades: Iterable[RoleUpgrade],
    changes: Mapping[Role, list[str]],
    policy: UpgradePolicy,
    cluster: str,
    trigger_error: str | None,
    generation: int,
    previous: Iterable[Condition],
    now: datetime,
) -> Condition:
    """True while some role has groups that differ from this operator's rendering, the spec unchanged; the message
    names the roles, how many groups are held or rolling, what would change, and how to roll them."""
    outdated = [u for u in upgrades if u.outdated]
    parts = [trigger_error] if trigger_error else []
    for u in outdated:
        listed = changes.get(u.role, [])
        shown = "; ".join(listed[:MAX_CHANGES]) + (
            f"; {len(listed) - MAX_CHANGES} more" if len(listed) > MAX_CHANGES else ""
        )
        what = "held" if u.held else "rolling"
        parts.append(
            f"{u.role.value}: {len(u.outdated)} group(s) {what}, pods differ from this operator's "
            f"rendering with the spec unchanged: {shown or 'no difference in image, flags or env'}"
        )
    held = [u.role.value for u in outdated if u.held]
    if held:
        parts.append(_waiting_for(policy, held, cluster, now))
    reason = "InvalidRollTrigger" if trigger_error else "OperatorRenderingChanged" if outdated else "UpToDate"
    message = ". ".join(parts) if parts else "every pod is what this operator renders"
    stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    return condition(CONDITION_TYPE, bool(outdated), reason, message, generation, previous, stamp)
