"""When the registry says workers are gone: one removal takes effect at once, a removal storm is held (pure).

The registry (etcd) is the control plane. When it freezes or loses quorum for longer than a writer's lease TTL and
comes back, etcd expires the writer's lease and deletes every key under it in one revision; the writer puts them
back a moment later (``tandem.leased_writer``). A router that applied those deletions would drop every worker at
once and answer 503 while the workers themselves are alive and serving. The same happens when a registry comes
back empty, with another cluster's data or with values the operator did not sign.

The rule, Envoy's panic threshold for mass host removal applied to registry removals:

- A removal takes effect at once, unless the removals of the last ``window_s`` seconds (this one included, keys
  put back since not counted) number at least ``min_removals`` and reach ``panic_share`` of the workers the
  registry named before them. Then the router **panics**: the removed workers are **held** (kept in routing) and
  so are those removed earlier in the window, when their last outcome was healthy (``restore``).
- A held worker leaves routing as soon as the router's own checks see it fail (its health probe or a request
  finds it unreachable, or its breaker opens): a fenced worker is dead, so traffic to it stops within one health
  interval even while the registry is unreachable.
- A held worker that the registry names again is an ordinary worker again; a panic with nothing held ends.
- Convergence: once the registry has been connected, with no further removal, for ``settle_s``, the workers still
  held are removed (the registry really did drop them) and the panic ends.

No I/O and no clock: the caller passes ``now`` (monotonic seconds) and the health verdicts, so every transition is
table-tested without etcd.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class GuardConfig:
    panic_share: float = 0.5  # share of the registry's workers removed within the window that starts a panic
    min_removals: int = 2  # ... and at least this many: one fence in a 1 prefill + 1 decode cluster is no storm
    window_s: float = 10.0
    settle_s: float = 30.0  # connected registry, no removal for this long: the held workers really are gone


@dataclass(frozen=True)
class Verdict:
    """What discovery does with one batch of removals."""

    remove: tuple[str, ...] = ()  # out of routing now
    hold: tuple[str, ...] = ()  # kept in routing (a panic)
    restore: tuple[str, ...] = ()  # removed earlier in the window, back in routing (the panic just started)


@dataclass
class RegistryGuard:
    config: GuardConfig = field(default_factory=GuardConfig)
    registered: set[str] = field(default_factory=set)  # keys the registry names now
    held: dict[str, float] = field(default_factory=dict)  # key -> held since
    panic_since: float | None = None
    panics: int = 0  # panics started
    released: int = 0  # held workers removed after all (failed checks, or the registry settled without them)
    _recent: deque[tuple[float, str]] = field(default_factory=deque)  # (removed at, key) within the window
    _last_removal: float = float("-inf")

    @property
    def panicking(self) -> bool:
        return self.panic_since is not None

    def put(self, key: str) -> None:
        """The registry names ``key`` (a put, or a listing that holds it)."""
        self.registered.add(key)
        self.held.pop(key, None)
        if self._recent and any(k == key for _, k in self._recent):
            self._recent = deque((t, k) for t, k in self._recent if k != key)
        if not self.held:
            self.panic_since = None

    def removed(self, keys: Iterable[str], now: float, healthy_earlier: Callable[[str], bool]) -> Verdict:
        """The registry no longer names ``keys`` (deletions in one revision, or missing from a re-listing).
        ``healthy_earlier(key)``: whether a worker removed earlier in the window was healthy when it went."""
        keys = tuple(k for k in dict.fromkeys(keys) if k in self.registered)
        if not keys:
            return Verdict()
        self._forget_before(now - self.config.window_s)
        earlier = [k for _, k in self._recent if k not in self.held]
        self.registered.difference_update(keys)
        self._recent.extend((now, k) for k in keys)
        self._last_removal = now
        removed_in_window = len(earlier) + len(keys)
        named_before = len(self.registered) + removed_in_window
        storm = removed_in_window >= self.config.min_removals and removed_in_window >= (
            self.config.panic_share * named_before
        )
        if not self.panicking and not storm:
            return Verdict(remove=keys)
        restore: tuple[str, ...] = ()
        if not self.panicking:
            self.panic_since = now
            self.panics += 1
            restore = tuple(k for k in dict.fromkeys(earlier) if healthy_earlier(k))
        for key in (*keys, *restore):
            self.held.setdefault(key, now)
        return Verdict(hold=keys, restore=restore)

    def tick(self, now: float, registry_connected: bool, failing: Callable[[str], bool]) -> tuple[str, ...]:
        """The held workers to remove now: those ``failing`` the router's own checks, and all of them once the
        connected registry has settled without them."""
        if not self.held:
            self.panic_since = None
            return ()
        settled = registry_connected and now - self._last_removal >= self.config.settle_s
        release = tuple(k for k in self.held if settled or failing(k))
        for key in release:
            del self.held[key]
        self.released += len(release)
        if not self.held:
            self.panic_since = None
        return release

    def _forget_before(self, cutoff: float) -> None:
        while self._recent and self._recent[0][0] < cutoff:
            self._recent.popleft()
