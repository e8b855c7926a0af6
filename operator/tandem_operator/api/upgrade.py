"""``PDCluster.spec.upgradePolicy`` and the ``tandem.dev/roll`` trigger: when pods that differ from this operator's
rendering, without the user having changed the spec, are replaced.

Restarting a group reloads the model (10-30 minutes for Kimi K2.6), so an operator upgrade that renders the pods
differently (a new env var, a fixed flag) rolls nothing by itself: by default (``Manual``) the PDCluster reports the
difference in its ``PodsOutdated`` condition and the groups roll when the user annotates the PDCluster
(``tandem.dev/roll``). A change of the spec that changes the pods always rolls at once (``upgrade.py``).
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from tandem.registry import Role
from tandem_operator.api.common import GROUP
from tandem_operator.api.rules import CrdModel, Rule

ANNOTATION_ROLL = f"{GROUP}/roll"
ROLL_FIELD = f"metadata.annotations[{ANNOTATION_ROLL}]"
ROLL_ALL = "all"


class RollPolicy(StrEnum):
    ON_CHANGE = "OnChange"  # roll at once, as a spec change
    WINDOW = "Window"  # roll while the maintenance window is open
    MANUAL = "Manual"  # roll when the user annotates the PDCluster with tandem.dev/roll


class Weekday(StrEnum):
    MON = "Mon"
    TUE = "Tue"
    WED = "Wed"
    THU = "Thu"
    FRI = "Fri"
    SAT = "Sat"
    SUN = "Sun"


WEEKDAYS = tuple(Weekday)  # Monday first, as datetime.weekday()


class MaintenanceWindow(CrdModel):
    """A weekly window in UTC: it opens on each of ``days`` at ``start`` and stays open ``durationMinutes`` (it may
    run past midnight into the next day)."""

    days: list[Weekday] = Field(min_length=1, max_length=7, description="Days the window opens on (UTC).")
    start: str = Field(
        pattern=r"^([01][0-9]|2[0-3]):[0-5][0-9]$", description="When the window opens, HH:MM in UTC (00:00-23:59)."
    )
    duration_minutes: int = Field(ge=1, le=1440, description="How long it stays open, at most a day.")

    @property
    def start_minute(self) -> int:
        hours, minutes = self.start.split(":")
        return int(hours) * 60 + int(minutes)


class UpgradePolicy(CrdModel):
    """When groups whose pods differ from what this operator renders, the spec unchanged, are replaced."""

    roll: RollPolicy = Field(
        default=RollPolicy.MANUAL,
        description="Manual (default): only when the PDCluster is annotated tandem.dev/roll (prefill, decode, "
        "prefill,decode or all), which the operator removes once those roles are rolled. Window: while the "
        "maintenance window is open (and on the annotation). OnChange: at once. Until then the PodsOutdated "
        "condition lists the roles and the difference (image, flags, env). A change of the spec that changes the "
        "pods rolls at once whatever the policy.",
    )
    window: MaintenanceWindow | None = Field(default=None, description="The maintenance window of roll: Window.")

    cel_rules = (
        Rule(
            cel="self.roll != 'Window' || has(self.window)",
            message="upgradePolicy.window is required with roll: Window (days, start, durationMinutes)",
            check=lambda s: s.roll is not RollPolicy.WINDOW or s.window is not None,
            field_path=".window",
        ),
        Rule(
            cel="self.roll == 'Window' || !has(self.window)",
            message="upgradePolicy.window applies only to roll: Window",
            check=lambda s: s.roll is RollPolicy.WINDOW or s.window is None,
            field_path=".window",
        ),
    )


class InvalidTriggerError(ValueError):
    """A ``tandem.dev/roll`` annotation that names no role the operator knows."""


def parse_trigger(value: str | None) -> frozenset[Role]:
    """The roles a ``tandem.dev/roll`` annotation asks to roll: comma-separated ``prefill``, ``decode``, or
    ``all``; no annotation asks for none. Anything else raises ``InvalidTriggerError`` naming the field."""
    if value is None:
        return frozenset()
    names = [name.strip() for name in value.split(",")]
    if names == [ROLL_ALL]:
        return frozenset(Role)
    known = {role.value: role for role in Role}
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        allowed = ", ".join([*known, ROLL_ALL])
        raise InvalidTriggerError(f'{ROLL_FIELD}: Invalid value: "{value}": roles are {allowed} (comma-separated)')
    return frozenset(known[name] for name in names)
