"""How a simulated SGLang 0.5.23 server gets its weights: the load flags as SGLang resolves them, the start-up
phases and their times, and the scaled-down weight bytes a seed serves and a peer pulls.

Flags (``sglang/srt/arg_groups/model_path_hook.py``: ``_handle_load_format``, ``validate_transfer_engine``):

- ``--load-format remote_instance`` loads from a running seed. Without ``--remote-instance-weight-loader-seed-
  instance-ip`` and ``...-seed-instance-service-port`` (or, for the ``nccl`` backend, without
  ``--remote-instance-weight-loader-send-weights-group-ports``) SGLang warns "Fallback load_format to 'auto' due
  to incomplete remote instance weight loader settings." and loads as ``auto``; with ``--enable-memory-saver`` the
  ``transfer_engine`` backend falls back the same way. The simulator implements the ``transfer_engine`` backend
  (``nccl``, SGLang's default backend, and ``modelexpress`` are refused with exit 2).
- ``--remote-instance-weight-loader-start-seed-via-transfer-engine`` makes the server a seed: each rank's weights
  are registered with a transfer engine of their own and published to the engine-info bootstrap server
  (``--engine-info-bootstrap-port``, 6789), which the server's HTTP API proxies for peers.
- Any other ``--load-format`` (``auto`` by default) reads the checkpoint: from ``--model-path`` when it is a local
  directory, else after downloading it from the hub (``model_loader/loader.py``: ``DefaultModelLoader
  ._prepare_weights``; ``model_loader/weight_utils.py``: ``download_weights_from_hf``).

Phases before the HTTP server listens (``entrypoints/engine.py``: ``Engine._launch_subprocesses`` waits for every
scheduler's ``wait_for_ready`` before ``http_server.py``: ``_setup_and_run_http_server``; the scheduler gets ready
at the end of ``ModelRunner.initialize``: ``load_model``, kernel warm-up, KV cache, CUDA-graph capture), with the
profile's sizes and bandwidths (``profiles.LoadProfile``):

- ``init``: process start, ``torch.distributed`` and NCCL set-up, model construction.
- ``download`` (hub only): the whole checkpoint onto the node (every rank's process waits on one download).
- ``read``: the whole checkpoint from the node's copy: every TP rank reads every shard and keeps its slice, from the
  page cache after the first reader (``weight_utils.py``: ``safetensors_weights_iterator``).
- ``register`` + ``peer`` (``remote_instance``): the transfer engine registers the rank's weight memory
  (``remote_instance_weight_loader_utils.py``: ``register_memory_region``, "this may take a few seconds"), then
  pulls only the rank's own shard from the seed's same TP rank: the node's share of the weights over the fabric.
- ``jit``: kernel compilation and warm-up with warm caches (DeepGEMM, Triton, torch).
- ``cuda_graph``: decode CUDA-graph capture; none on a prefill server (``arg_groups/cuda_graph_hook.py``:
  ``apply_cuda_graph_disaggregation_roles`` disables decode graphs there) nor with ``--disable-cuda-graph`` or
  ``--disable-decode-cuda-graph``.

Then the HTTP server listens with the status ``Starting`` until the warm-up request passed
(``http_server.py``: ``_execute_server_warmup``: ``time.sleep(1)``, ``/model_info``, a request; then ``Up``):
``LoadProfile.server_warmup_s``.
"""

from __future__ import annotations

import argparse
import hashlib
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from tandem_sim.model.profiles import LoadProfile

REMOTE_INSTANCE = "remote_instance"
INCOMPLETE = "Fallback load_format to 'auto' due to incomplete remote instance weight loader settings."
INCOMPLETE_NCCL = (
    "Fallback load_format to 'auto' due to incomplete remote instance weight loader NCCL group ports settings."
)
TE_UNSUPPORTED = "Fallback load_format to 'auto' due to 'transfer_engine' backend is not supported."
MEMORY_SAVER = (
    "Memory saver is enabled, which is not compatible with TransferEngine. Does not support using TransferEngine "
    "as remote instance weight loader backend."
)
# The simulated weights of one rank are this many tensors (SGLang pulls every parameter of ``named_parameters``).
PARAMS_PER_RANK = 16
_HEADER = struct.Struct("<Q")  # the first tensor starts with the --sim-seed the bytes were made from


class LoadFlagError(ValueError):
    """A load flag combination the simulator refuses (exit 2)."""


@dataclass(frozen=True)
class LoadSettings:
    """The load flags as SGLang resolved them, and the simulated weight size."""

    peer: bool  # --load-format remote_instance over the transfer engine
    seed_url: str  # http://<seed ip>:<seed service port> ("" unless peer)
    start_seed: bool  # --remote-instance-weight-loader-start-seed-via-transfer-engine
    engine_info_bootstrap_port: int
    local_copy: bool  # --model-path is a directory on this node
    cuda_graphs: bool  # decode CUDA graphs are captured
    weight_bytes_per_rank: int  # the simulated weights (--sim-weight-mb): what a peer really pulls
    warnings: tuple[str, ...] = ()

    @property
    def transfer_engine(self) -> bool:
        """``runtime_context.remote_instance_transfer_engine_enabled``: each rank gets a weight transfer engine."""
        return self.peer or self.start_seed


def resolve_load(ns: argparse.Namespace) -> LoadSettings:
    """SGLang's ``_handle_load_format`` for the flags the simulator acts on."""
    warnings: list[str] = []
    backend = str(ns.remote_instance_weight_loader_backend)
    peer = ns.load_format == REMOTE_INSTANCE
    if peer:
        if backend != "modelexpress" and (
            ns.remote_instance_weight_loader_seed_instance_ip is None
            or ns.remote_instance_weight_loader_seed_instance_service_port is None
        ):
            warnings.append(INCOMPLETE)
            peer = False
        elif backend == "nccl" and ns.remote_instance_weight_loader_send_weights_group_ports is None:
            warnings.append(INCOMPLETE_NCCL)
            peer = False
        elif backend == "transfer_engine" and ns.enable_memory_saver:
            warnings += [MEMORY_SAVER, TE_UNSUPPORTED]
            peer = False
        elif backend != "transfer_engine":
            raise LoadFlagError(
                f"--remote-instance-weight-loader-backend {backend}: the simulator implements transfer_engine"
            )
    start_seed = bool(ns.remote_instance_weight_loader_start_seed_via_transfer_engine)
    if start_seed and ns.enable_memory_saver:
        warnings.append(MEMORY_SAVER)
        start_seed = False
    if ns.sim_weight_mb <= 0:
        raise LoadFlagError(f"--sim-weight-mb must be positive, got {ns.sim_weight_mb}")
    seed_url = ""
    if peer:
        host = str(ns.remote_instance_weight_loader_seed_instance_ip)
        host = f"[{host}]" if ":" in host else host
        seed_url = f"http://{host}:{int(ns.remote_instance_weight_loader_seed_instance_service_port)}"
    return LoadSettings(
        peer=peer,
        seed_url=seed_url,
        start_seed=start_seed,
        engine_info_bootstrap_port=int(ns.engine_info_bootstrap_port),
        local_copy=Path(str(ns.model_path)).is_dir(),
        cuda_graphs=ns.disaggregation_mode != "prefill"
        and not ns.disable_cuda_graph
        and not ns.disable_decode_cuda_graph,
        weight_bytes_per_rank=max(PARAMS_PER_RANK * _HEADER.size, int(ns.sim_weight_mb * 1024 * 1024)),
        warnings=tuple(warnings),
    )


@dataclass(frozen=True)
class Phase:
    name: str
    seconds: float  # simulated (GPU-node) seconds, before --sim-time-factor
    nbytes: float = 0.0  # bytes moved in this phase, per node
    gb_s: float = 0.0  # at this bandwidth (GB/s, 1e9 bytes)


def phases(load: LoadProfile, settings: LoadSettings, tp_size: int, ranks_per_node: int) -> list[Phase]:
    """The start-up phases of one node, before its HTTP server listens (zero-second ones too: a peer pulls and a
    seed publishes whatever the profile's times)."""
    out = [Phase("init", load.init_s)]
    whole = load.weight_bytes
    if settings.peer:
        share = whole * ranks_per_node / tp_size  # each rank pulls only its own shard
        out.append(Phase("register", load.register_s))
        out.append(Phase("peer", share / (load.peer_gb_s * 1e9), share, load.peer_gb_s))
    else:
        if not settings.local_copy:
            out.append(Phase("download", whole / (load.download_gb_s * 1e9), whole, load.download_gb_s))
        out.append(Phase("read", whole / (load.read_gb_s * 1e9), whole, load.read_gb_s))
        if settings.start_seed:  # the seed registers its weights after loading them
            out.append(Phase("register", load.register_s))
    out.append(Phase("jit", load.jit_s))
    if settings.cuda_graphs:
        out.append(Phase("cuda_graph", load.cuda_graph_s))
    return out


def physical_bound_s(load: LoadProfile, settings: LoadSettings, tp_size: int, ranks_per_node: int) -> float:
    """Bytes over bandwidth plus the warm-up the GPU must do whatever the source (kernels, CUDA graphs)."""
    return sum(
        p.seconds for p in phases(load, settings, tp_size, ranks_per_node) if p.gb_s or p.name in {"jit", "cuda_graph"}
    )


def param_sizes(nbytes: int) -> list[int]:
    """The sizes of a rank's simulated weight tensors (SGLang compares each with the seed's: ``numel``)."""
    base = nbytes // PARAMS_PER_RANK
    return [base] * (PARAMS_PER_RANK - 1) + [nbytes - base * (PARAMS_PER_RANK - 1)]


def param_names() -> list[str]:
    return [f"model.layers.{i}.mlp.experts.w13_weight" for i in range(PARAMS_PER_RANK)]


def make_weights(seed: int, tp_rank: int, nbytes: int) -> npt.NDArray[np.uint8]:
    """The bytes of one rank's checkpoint shard: a function of ``--sim-seed`` (the simulated model's weights, which
    decide its KV and text) and the rank; the first 8 bytes say the seed."""
    data = np.random.default_rng([seed, tp_rank]).integers(0, 256, nbytes, dtype=np.uint8)
    data[: _HEADER.size] = np.frombuffer(_HEADER.pack(seed), dtype=np.uint8)
    return data


def seed_of(data: npt.NDArray[np.uint8]) -> int:
    """The ``--sim-seed`` a weight buffer was made from: a server that pulled its weights computes with them."""
    return int(_HEADER.unpack(data[: _HEADER.size].tobytes())[0])


def digest(data: npt.NDArray[np.uint8]) -> str:
    return hashlib.sha256(data.tobytes()).hexdigest()[:16]
