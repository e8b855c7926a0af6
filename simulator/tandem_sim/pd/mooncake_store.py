"""HiCache's L3 on the Mooncake Store, as a prefill rank of SGLang 0.5.23 opens it: the real Store client of the
Mooncake wheel against a real ``mooncake_master``.

Read from ``sglang/srt/mem_cache/storage/mooncake_store/mooncake_store.py``:

- ``MooncakeStoreConfig.load_from_env``: ``MOONCAKE_MASTER`` (required: "Either the environment variable
  'MOONCAKE_MASTER' or 'MOONCAKE_CLIENT' is not set."), ``MOONCAKE_TE_META_DATA_SERVER`` (default P2PHANDSHAKE),
  ``MOONCAKE_PROTOCOL`` (rdma), ``MOONCAKE_DEVICE`` (""), ``MOONCAKE_LOCAL_HOSTNAME`` (default "localhost",
  ``_resolve_local_hostname``), ``MOONCAKE_GLOBAL_SEGMENT_SIZE`` (4gb, ``_parse_global_segment_size``).
  ``MC_STORE_CLUSTER_ID`` (the HA master's scope, default "mooncake_cluster") is read by the client library itself.
- ``MooncakeStore.__init__``: the segment is divided by the attention-TP size x PP size per rank
  (``rank_scale_factor``); the rank's PD engine is reused only when the metadata server is P2PHANDSHAKE, the
  protocol rdma and ``MOONCAKE_DEVICE`` its device string; otherwise ``setup`` starts an engine of its own that
  registers under the local hostname and takes its ports from the rank's ``MC_MIN_RPC_PORT..MC_MAX_RPC_PORT``.
  A non-zero ``setup`` is ``RuntimeError("Failed to setup Mooncake store, error code: N")``: the scheduler dies,
  after the weights loaded.
- ``MooncakeStore.warmup``: a 4 KiB put, ``is_exist`` and ``get``, 10 tries 1 s apart; else "Warmup put failed".

Not modelled (simulator/README.md, fidelity table): bytes move over TCP whatever the protocol (no RDMA here; a
reused engine is the rank's TCP engine); the segment each rank mounts is capped at ``SEGMENT_CAP`` (the logical
size is what the operator checks against host memory); pages are whole simulated KV rows under one key per page
(SGLang's MLA layout: rank-replicated, one writer), written by attention-TP rank 0 and read by every rank.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from tandem_sim.config import SimConfig
    from tandem_sim.model.ranks import Rank
    from tandem_sim.pd.transfer import MooncakeTransfer

log = logging.getLogger("tandem_sim")

LOCAL_BUFFER = 16 << 20  # DEFAULT_LOCAL_BUFFER_SIZE
SEGMENT_CAP = 32 << 20  # what a simulated rank mounts, whatever the logical segment
WARMUP_TRIES = 10
MISSING_MASTER = "Either the environment variable 'MOONCAKE_MASTER' or 'MOONCAKE_CLIENT' is not set."


class StoreStartError(RuntimeError):
    """SGLang's error when a rank's Store does not start (its scheduler dies with it)."""


def parse_segment_size(value: str) -> int:
    """``_parse_global_segment_size``: ``<n>gb`` or a number of bytes."""
    text = value.strip().lower()
    if text.endswith("gb"):
        number = text[:-2].strip()
        if not number:
            raise ValueError("Invalid global_segment_size: missing number before 'gb'")
        return int(number) << 30
    return int(text)


@dataclass(frozen=True)
class StoreEnv:
    master: str
    metadata_server: str
    protocol: str
    device: str
    local_hostname: str
    global_segment_size: int

    @classmethod
    def from_env(cls, env: dict[str, str]) -> StoreEnv:
        if not env.get("MOONCAKE_MASTER"):
            raise StoreStartError(MISSING_MASTER)
        return cls(
            master=env["MOONCAKE_MASTER"],
            metadata_server=env.get("MOONCAKE_TE_META_DATA_SERVER", "P2PHANDSHAKE"),
            protocol=env.get("MOONCAKE_PROTOCOL", "rdma"),
            device=env.get("MOONCAKE_DEVICE", ""),
            local_hostname=env.get("MOONCAKE_LOCAL_HOSTNAME") or env.get("LOCAL_HOSTNAME") or "localhost",
            global_segment_size=parse_segment_size(env.get("MOONCAKE_GLOBAL_SEGMENT_SIZE", "4gb")),
        )

    def reuses(self, pd_device: str) -> bool:
        """SGLang's condition for handing the rank's PD engine to the Store."""
        return self.metadata_server == "P2PHANDSHAKE" and self.protocol == "rdma" and self.device == pd_device


@dataclass(frozen=True)
class StoreRank:
    tp_rank: int
    attn_tp_size: int
    writer: bool  # attention-TP rank 0: MLA pages are the same on every rank, one writes them
    page_size: int
    kv_bytes: int


@dataclass(frozen=True)
class PdEngine:
    """The rank's PD transfer engine, as the Store may reuse it."""

    engine: Any  # mooncake.engine.TransferEngine
    session_id: str
    device: str  # SGLang's ``get_ib_device()``: the --disaggregation-ib-device string ("" over MC_FORCE_TCP=1)


class MooncakeL3:
    """One prefill rank's Store client: ``longest_prefix`` and ``put`` as the simulator's file L3 offers them."""

    def __init__(self, env: StoreEnv, rank: StoreRank, pd: PdEngine) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.tp_rank, self.writer, self.page = rank.tp_rank, rank.writer, (rank.page_size, rank.kv_bytes)
        self.store = MooncakeDistributedStore()
        per_rank = env.global_segment_size // rank.attn_tp_size
        reuse = env.reuses(pd.device)
        rc = self.store.setup(
            pd.session_id if reuse else env.local_hostname,  # SGLang: the shared engine's get_session_id()
            env.metadata_server,
            min(per_rank, SEGMENT_CAP),
            LOCAL_BUFFER,
            "tcp",  # the simulator's bytes always move over TCP
            "",
            env.master,
            pd.engine if reuse else None,
        )
        if rc:
            raise StoreStartError(f"Failed to setup Mooncake store, error code: {rc}")
        log.info("Mooncake store setup successfully.", extra={"tp_rank": self.tp_rank, "reused_pd_engine": reuse})
        self._warmup()
        log.info("Mooncake store warmup successfully.", extra={"tp_rank": self.tp_rank})

    def _warmup(self) -> None:
        key, value = "sglang_mooncake_store_warmup_key" + uuid.uuid4().hex, bytes(4096)
        for _ in range(WARMUP_TRIES):
            if self.store.put(key, value) == 0:
                break
            time.sleep(1.0)
        else:
            raise StoreStartError(
                f"[TP{self.tp_rank}] Warmup put failed after {WARMUP_TRIES} attempts, "
                "Transfer Engine might not be ready"
            )
        if self.store.is_exist(key) != 1 or self.store.get(key) != value:
            raise StoreStartError(f"[TP{self.tp_rank}] Warmup read back another value: the Store is not shared right")

    def put(self, key: str, rows: npt.NDArray[np.uint8]) -> None:
        if self.writer:
            self.store.put(key, rows.tobytes())

    def longest_prefix(self, keys: list[str]) -> list[npt.NDArray[np.uint8]]:
        """The pages of the longest run of leading keys the Store holds."""
        pages: list[npt.NDArray[np.uint8]] = []
        for key in keys:
            data = self.store.get(key)
            if len(data) != self.page[0] * self.page[1]:
                break
            pages.append(np.frombuffer(data, dtype=np.uint8).reshape(self.page).copy())
        return pages

    def close(self) -> None:
        self.store.close()


def open_store(cfg: SimConfig, rank: Rank, transfer: MooncakeTransfer) -> MooncakeL3:
    """The Store of one prefill rank, opened at start-up as SGLang's cache controller opens it."""
    assert cfg.mooncake_store_env is not None
    attn_tp = cfg.tp_size // cfg.attn_dp_size
    store_rank = StoreRank(rank.tp_rank, attn_tp, rank.attn_tp_rank == 0, cfg.page_size, cfg.kv_bytes_per_token)
    pd = PdEngine(transfer.engine, transfer.session_id, cfg.pd_ib_device)
    return MooncakeL3(StoreEnv.from_env(dict(cfg.mooncake_store_env)), store_rank, pd)
