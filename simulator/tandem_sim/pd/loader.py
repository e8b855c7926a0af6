"""The start-up of one simulated SGLang 0.5.23 node: the load phases of ``model/weights.py`` in wall time, and for
``--load-format remote_instance`` the rank-by-rank pull of real bytes from a running seed over the Mooncake
transfer engine (protocol: ``seed.py``).

A peer rank (``model_loader/loader.py``: ``RemoteInstanceModelLoader.load_model``,
``load_model_from_remote_instance_by_transfer_engine``) registers its weight memory with its own engine, asks the
seed for the same TP rank's session id and weight info, checks every tensor's ``numel`` and ``element_size``
("Weight info does not match for ..."; "Cannot find weight info for ..."), and reads every tensor with
``batch_transfer_sync_read``. A negative result ("batch transfer failed, error: N") or missing info ("Cannot get
transfer engine session or weight info.") makes it raise ``RuntimeError("Failed to load weights from remote
instance via transfer engine.")`` in the scheduler: "Scheduler hit an exception", the scheduler SIGQUITs the
launcher and the server exits (``managers/scheduler.py``: ``run_scheduler_process``). There is no retry and no
fallback to another source: that is the caller's job.

Not as SGLang: SGLang reads all of a rank's tensors in one ``batch_transfer_sync_read``; the simulator reads them
one tensor at a time, paced so the pull takes the profile's modelled time (a few MiB move in milliseconds on
loopback), so a seed that dies during the modelled pull fails the next read, as it would fail SGLang's one call.
The pulled bytes are the weights the server then computes with: their header is the seed's ``--sim-seed``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from tandem_sim.config import SimConfig
from tandem_sim.model import weights
from tandem_sim.model.ranks import Rank
from tandem_sim.pd import seed
from tandem_sim.pd.multinode import split_addr
from tandem_sim.pd.transfer import MooncakeTransfer

log = logging.getLogger("tandem_sim.loader")
LOAD_FAILED = "Failed to load weights from remote instance via transfer engine."


class LoadError(RuntimeError):
    """A rank failed to load its weights (SGLang: its scheduler raises; the server exits 1)."""

    def __init__(self, tp_rank: int, message: str) -> None:
        super().__init__(message)
        self.tp_rank = tp_rank


@dataclass
class RankWeights:
    """One rank's weight tensors, in one buffer, registered with the rank's own transfer engine."""

    rank: Rank
    data: npt.NDArray[np.uint8]
    transfer: MooncakeTransfer | None = None
    sizes: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sizes = weights.param_sizes(len(self.data))

    def tensors(self) -> list[tuple[str, int, int]]:
        """(name, address, bytes) of every tensor (element size 1: packed INT4)."""
        base, out, offset = int(self.data.ctypes.data), [], 0
        for name, size in zip(weights.param_names(), self.sizes, strict=True):
            out.append((name, base + offset, size))
            offset += size
        return out

    def info(self) -> seed.WeightInfo:
        return {name: [address, size, 1] for name, address, size in self.tensors()}


class Loader:
    """Runs the node's start-up phases; ``run`` returns the config to serve with (its ``seed`` from the weights)."""

    def __init__(self, cfg: SimConfig, host: str) -> None:
        self.cfg = cfg
        self.host = host
        self.settings = cfg.load
        self.ranks = cfg.topology.local_ranks()
        self.phases = weights.phases(cfg.profile.load, cfg.load, cfg.tp_size, len(self.ranks))
        self.rank_weights: list[RankWeights] = []
        self.elapsed: dict[str, float] = {}

    def start_engines(self) -> None:
        """``ModelRunner.maybe_init_remote_instance_transfer_engine``: one weight engine per rank, before loading."""
        if not self.settings.transfer_engine:
            return
        size = self.settings.weight_bytes_per_rank
        for rank in self.ranks:
            data = np.zeros(size, dtype=np.uint8)
            self.rank_weights.append(RankWeights(rank, data, MooncakeTransfer(self.host)))

    async def run(self) -> SimConfig:
        for message in self.settings.warnings:
            log.warning(message)
        log.info("Load weight begin.", extra={"phases": {p.name: round(p.seconds, 3) for p in self.phases}})
        seed_value = self.cfg.seed
        for phase in self.phases:
            started = time.monotonic()
            wall = self.cfg.profile.wall_s(phase.seconds)
            if phase.name == "peer":
                seed_value = await self._pull_all(wall)
            elif phase.name == "register":
                await asyncio.sleep(wall)
                self._register_all()
                if not self.settings.peer:  # a seed publishes; a peer-loaded rank never does (seed.py)
                    await self._publish_all()
            else:
                await asyncio.sleep(wall)
                if phase.name == "read":
                    self._fill_all()
            self.elapsed[phase.name] = time.monotonic() - started
        log.info("Load weight end.", extra={"elapsed_s": {k: round(v, 3) for k, v in self.elapsed.items()}})
        return self.cfg if seed_value == self.cfg.seed else replace(self.cfg, seed=seed_value)

    def report(self) -> dict[str, Any]:
        """What ``/server_info`` shows under ``tandem_sim.weights``."""
        source = "peer" if self.settings.peer else "local" if self.settings.local_copy else "download"
        return {
            "source": source,
            "seed_url": self.settings.seed_url or None,
            "start_seed": self.settings.start_seed,
            "phases_s": {p.name: p.seconds for p in self.phases},
            "elapsed_s": self.elapsed,
            "digests": {str(w.rank.tp_rank): weights.digest(w.data) for w in self.rank_weights},
            "sessions": {str(w.rank.tp_rank): w.transfer.session_id for w in self.rank_weights if w.transfer},
        }

    def _fill_all(self) -> None:
        for w in self.rank_weights:
            w.data[:] = weights.make_weights(self.cfg.seed, w.rank.tp_rank, len(w.data))

    def _register_all(self) -> None:
        for w in self.rank_weights:
            if w.transfer is not None:
                w.transfer.register(int(w.data.ctypes.data), len(w.data))

    async def _publish_all(self) -> None:
        # SGLang 0.5.23 (``_register_to_engine_info_bootstrap``) asks only whether --dist-init-addr is set, on one
        # node too: the bootstrap then is at its host (it listens on --host), else at 127.0.0.1.
        host = split_addr(self.cfg.dist_init_addr)[0] if self.cfg.dist_init_addr else "127.0.0.1"
        port = self.settings.engine_info_bootstrap_port
        await asyncio.gather(
            *(
                seed.publish(host, port, w.rank.tp_rank, w.transfer.session_id, w.info())
                for w in self.rank_weights
                if w.transfer is not None
            )
        )

    async def _pull_all(self, wall_s: float) -> int:
        """Every local rank pulls its shard from the seed's same TP rank, side by side; the seed they came from."""
        await asyncio.gather(*(self._pull(w, wall_s) for w in self.rank_weights))
        seeds = {weights.seed_of(w.data) for w in self.rank_weights}
        if len(seeds) != 1:
            raise LoadError(self.ranks[0].tp_rank, f"ranks pulled weights of different seeds: {sorted(seeds)}")
        return seeds.pop()

    async def _pull(self, w: RankWeights, wall_s: float) -> None:
        tp_rank = w.rank.tp_rank
        found = await seed.fetch_info(self.settings.seed_url, tp_rank)
        if found is None:
            log.error("Cannot get transfer engine session or weight info.", extra={"tp_rank": tp_rank})
            raise LoadError(tp_rank, LOAD_FAILED)
        session, remote = found
        reads = []
        for name, address, size in w.tensors():
            if (theirs := remote.get(name)) is None:
                log.error(f"Cannot find weight info for {name}.", extra={"tp_rank": tp_rank})
                raise LoadError(tp_rank, LOAD_FAILED)
            seed_ptr, numel, element_size = (int(v) for v in theirs)
            if (numel, element_size) != (size, 1):
                log.error(
                    f"Weight info does not match for {name}, expected ({numel}, {element_size}), got ({size}, 1)",
                    extra={"tp_rank": tp_rank},
                )
                raise LoadError(tp_rank, LOAD_FAILED)
            reads.append((address, seed_ptr, size))
        assert w.transfer is not None  # a peer rank always has its weight engine
        started = time.monotonic()
        for i, (address, seed_ptr, size) in enumerate(reads):
            rc = await w.transfer.read(session, [address], [seed_ptr], [size])
            if rc < 0:
                log.error(f"batch transfer failed, error: {rc}", extra={"tp_rank": tp_rank})
                raise LoadError(tp_rank, LOAD_FAILED)
            await asyncio.sleep(max(0.0, started + wall_s * (i + 1) / len(reads) - time.monotonic()))

    def close(self) -> None:
        for w in self.rank_weights:
            if w.transfer is not None:
                w.transfer.close()
