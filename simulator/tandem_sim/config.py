"""Command line and environment of the simulated worker (mimics SGLang 0.5.23 ``launch_server``).

Every SGLang 0.5.23 flag is accepted (the table comes from the pinned wheel, see ``tandem.sglang_args``); a flag
SGLang does not have is an error. The ``--sim-*`` flags are the simulator's own knobs. The
``SGLANG_DISAGGREGATION_*`` / failed-session-probe environment variables are read here, once, so the rest of
the simulator never touches ``os.environ``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tandem.sglang_args import SGLANG_VERSION, add_sglang_flags
from tandem_sim.model.model import MIN_KV_BYTES
from tandem_sim.model.numerics import DETERMINISTIC_OVERHEAD, Numerics, decode_capture_sizes, default_decode_max_bs
from tandem_sim.model.profiles import DEFAULT_PROFILE, NO_LOAD, PROFILES, SimProfile
from tandem_sim.model.ranks import KVLayout, Topology, check_parallel_flags, layout_error
from tandem_sim.model.weights import LoadSettings, resolve_load

HICACHE_BACKENDS_SIMULATED = ("file", "mooncake")
# Mooncake 0.3.13's own RPC port range when ``MC_MIN_RPC_PORT``/``MC_MAX_RPC_PORT`` are unset or invalid.
MOONCAKE_DEFAULT_PORTS = (15000, 17000)
# Linux's default ``net.ipv4.ip_local_port_range``, when /proc does not say.
EPHEMERAL_PORTS = (32768, 60999)


def ephemeral_ports() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return EPHEMERAL_PORTS


def mooncake_range_valid(low: int, high: int, ephemeral: tuple[int, int]) -> bool:
    """Measured (mooncake-transfer-engine 0.3.13, config.cpp): a range below 1024, with min > max or touching the
    kernel's ephemeral ports logs "Invalid port range [min, max], falling back to default [15000, 17000]" and
    Mooncake uses the default."""
    return 1024 <= low <= high <= 65535 and (high < ephemeral[0] or low > ephemeral[1])


class ConfigError(ValueError):
    """A bad combination of flags (the message names the flag)."""


@dataclass(frozen=True)
class PdEnv:
    """SGLang's PD environment variables (names and defaults as SGLang 0.5.23 ``environ.py``)."""

    heartbeat_interval_s: float = 5.0
    heartbeat_max_failure: int = 2
    bootstrap_timeout_s: float = 300.0
    waiting_timeout_s: float = 300.0
    enable_failed_session_probe: bool = True
    probe_interval_s: float = 30.0
    probe_max_interval_s: float = 300.0
    failed_session_idle_timeout_s: float = 600.0
    test_failure_prob: float = 0.0
    health_check_timeout_s: float = 20.0  # SGLANG_HEALTH_CHECK_TIMEOUT (sglang/srt/entrypoints/http_server.py)
    health_generation: bool = True  # SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION: false makes /health a plain 200

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> PdEnv:
        def num(name: str, default: float) -> float:
            raw = env.get(name)
            return default if raw in (None, "") else float(raw)

        probe_raw = env.get("SGLANG_ENABLE_FAILED_SESSION_PROBE", "true").strip().lower()
        return cls(
            # SGLang clamps these: the heartbeat never runs more often than every 2 s, and needs >= 1 miss.
            heartbeat_interval_s=max(num("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL", 5.0), 2.0),
            heartbeat_max_failure=max(int(num("SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE", 2)), 1),
            bootstrap_timeout_s=num("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300),
            waiting_timeout_s=num("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300),
            enable_failed_session_probe=probe_raw in {"1", "true", "yes", "on"},
            probe_interval_s=num("SGLANG_FAILED_SESSION_PROBE_INTERVAL_S", 30.0),
            probe_max_interval_s=num("SGLANG_FAILED_SESSION_PROBE_MAX_INTERVAL_S", 300.0),
            failed_session_idle_timeout_s=num("SGLANG_FAILED_SESSION_IDLE_TIMEOUT_S", 600.0),
            test_failure_prob=num("SGLANG_TEST_DISAGG_FAILURE_PROB", 0.0),
            health_check_timeout_s=num("SGLANG_HEALTH_CHECK_TIMEOUT", 20.0),
            health_generation=env.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "true").lower()
            not in {"false", "0", "no", "n"},
        )


@dataclass(frozen=True)
class MooncakeEnv:
    """The Mooncake transfer engine's environment as SGLang 0.5.23 reads it.

    ``protocol``: ``MOONCAKE_PROTOCOL`` (SGLang's ``envs.MOONCAKE_PROTOCOL``, default ``rdma``), or ``tcp`` when
    ``MC_FORCE_TCP`` is set (Mooncake then installs its TCP transport whatever the protocol). ``ports``: the
    inclusive ``[MC_MIN_RPC_PORT, MC_MAX_RPC_PORT]`` every engine of the process picks its ports from.
    """

    protocol: str = "rdma"
    ports: tuple[int, int] = MOONCAKE_DEFAULT_PORTS

    @classmethod
    def from_env(cls, env: Mapping[str, str], ephemeral: tuple[int, int] = EPHEMERAL_PORTS) -> MooncakeEnv:
        force_tcp = env.get("MC_FORCE_TCP", "").strip().lower() in {"1", "true", "yes", "on"}
        protocol = "tcp" if force_tcp else (env.get("MOONCAKE_PROTOCOL") or "rdma").strip().lower()
        low = int(env.get("MC_MIN_RPC_PORT") or MOONCAKE_DEFAULT_PORTS[0])
        high = int(env.get("MC_MAX_RPC_PORT") or MOONCAKE_DEFAULT_PORTS[1])
        if not mooncake_range_valid(low, high, ephemeral):
            low, high = MOONCAKE_DEFAULT_PORTS
        return cls(protocol, (low, high))


@dataclass(frozen=True)
class SimConfig:
    """Everything the simulator acts on, resolved from flags and environment."""

    model_path: str
    served_model_name: str
    host: str
    port: int
    mode: str  # "null" (aggregated) | "prefill" | "decode"
    bootstrap_port: int
    tp_size: int
    attn_dp_size: int
    nnodes: int
    node_rank: int
    dist_init_addr: str | None
    dist_timeout_s: float
    kv_heads: int  # 0 = MLA (the latent row on every TP rank); else MHA heads split over the TP ranks
    mooncake: MooncakeEnv
    page_size: int
    max_total_tokens: int
    host_pool_tokens: int
    max_running_requests: int
    max_prefill_tokens: int
    chunked_prefill_size: int  # -1: no chunking
    radix_cache: bool  # prefix cache in prefill and aggregated workers (off with --disable-radix-cache)
    context_length: int
    offload: bool
    hicache_storage_backend: str | None
    hicache_file_dir: str | None  # shared L3 pages (file backend): decode offload writes, prefill reads/writes
    # prefill HiCache on the mooncake backend: the Store's env (tandem_sim.pd.mooncake_store), opened by every rank
    mooncake_store_env: Mapping[str, str] | None
    pd_ib_device: str  # the PD engine's device string (SGLang: "" under MC_FORCE_TCP=1)
    enable_metrics: bool
    profile: SimProfile  # step times (x 1.3435 with --enable-deterministic-inference)
    # --enable-deterministic-inference: batch-invariant kernels, so no batch-variant numerics (model/numerics.py)
    deterministic_inference: bool
    decode_cuda_graph_bs: tuple[int, ...]  # decode batch sizes are padded up to these (empty: no padding)
    kv_bytes_per_token: int
    seed: int
    inject_offload_race: bool
    transfer_failure_prob: float
    slow_health_s: float  # /health answers this much later while requests run (a health check queued under load)
    hang_after_s: float | None  # the schedulers stop this long after start (--sim-inject-hang-after-s)
    pd: PdEnv
    load: LoadSettings  # where the weights come from (model/weights.py)
    server_args: Mapping[str, Any]  # every SGLang flag's resolved value, shown in /server_info

    @property
    def topology(self) -> Topology:
        return Topology(self.tp_size, self.attn_dp_size, self.nnodes, self.node_rank)

    @property
    def kv_layout(self) -> KVLayout:
        return KVLayout(self.kv_bytes_per_token, self.kv_heads, self.topology.attn_tp_size)

    def numerics(self) -> Numerics:
        """The server's GPU numerics: batch-variant (SGLang's default) or batch-invariant."""
        return Numerics(self.deterministic_inference, self.decode_cuda_graph_bs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem sim",
        description=f"Simulated SGLang {SGLANG_VERSION} worker: accepts python -m sglang.launch_server flags.",
        allow_abbrev=False,
    )
    add_sglang_flags(parser)
    sim = parser.add_argument_group("simulator")
    sim.add_argument(
        "--sim-profile",
        choices=sorted(PROFILES),
        default=DEFAULT_PROFILE,
        help="timing constants of the simulated GPU (tandem_sim/model/profiles.py); the --sim-*-ms flags override them",
    )
    sim.add_argument("--sim-time-factor", type=float, default=None, help="multiply every simulated time by this")
    sim.add_argument("--sim-prefill-ms-per-token", type=float, default=None, help="prefill time per uncached token")
    sim.add_argument("--sim-inter-token-ms", type=float, default=None, help="decode step time, whatever the batch")
    sim.add_argument("--sim-decode-ms-per-seq", type=float, default=None, help="decode step time per running seq")
    sim.add_argument(
        "--sim-decode-ms-per-kv-token", type=float, default=None, help="decode step time per KV token attended"
    )
    sim.add_argument("--sim-kv-bytes-per-token", type=int, default=256, help=f"KV bytes per token (>= {MIN_KV_BYTES})")
    sim.add_argument("--sim-seed", type=int, default=0, help="simulated weights: changes KV bytes and text")
    sim.add_argument(
        "--sim-inject-offload-race",
        action="store_true",
        help="re-create SGLang's two decode-offload slot-reuse races (garbles output under load)",
    )
    sim.add_argument(
        "--sim-transfer-failure-prob",
        type=float,
        default=None,
        help="probability that a KV send fails (default: SGLANG_TEST_DISAGG_FAILURE_PROB or 0)",
    )
    sim.add_argument(
        "--sim-slow-health-s",
        type=float,
        default=0.0,
        help="while requests run, /health answers this much later (a scheduler stalled under load; SGLang's "
        "/health waits up to SGLANG_HEALTH_CHECK_TIMEOUT for any scheduler output, then answers 503)",
    )
    sim.add_argument(
        "--sim-inject-hang-after-s",
        type=float,
        default=None,
        help="every scheduler stops this many seconds after start (a hung GPU or collective): requests stay in "
        "flight, /metrics keeps serving, /health fails after SGLANG_HEALTH_CHECK_TIMEOUT (also POST "
        "/tandem/sim/faults {'hang': true})",
    )
    sim.add_argument(
        "--sim-load-phases",
        action="store_true",
        help="start-up takes the profile's load phases (model/weights.py: download or read or peer pull, JIT, "
        "CUDA graphs) x --sim-time-factor; without it they take no time (kimi-k2.6-h200 would take 1.5-10 min)",
    )
    sim.add_argument(
        "--sim-weight-mb",
        type=float,
        default=4.0,
        help="MiB of simulated weights per rank: the bytes a seed serves and a peer pulls over Mooncake "
        "(--load-format remote_instance); the profile's weight size sets the load time",
    )
    sim.add_argument("--sim-host-pool-tokens", type=int, default=None, help="host KV pool size (default 4x device)")
    sim.add_argument(
        "--sim-kv-heads",
        type=int,
        default=0,
        help="0 (default): MLA like Kimi K2.x/DeepSeek, every TP rank holds the whole KV row; N: MHA/GQA with N KV "
        "heads split over the attention-TP ranks",
    )
    return parser


def _positive(name: str, value: int) -> int:
    if value <= 0:
        raise ConfigError(f"{name} must be positive, got {value}")
    return value


def _profile(ns: argparse.Namespace) -> SimProfile:
    profile = PROFILES[str(ns.sim_profile)].with_overrides(
        time_factor=ns.sim_time_factor,
        prefill_ms_per_token=ns.sim_prefill_ms_per_token,
        decode_base_ms=ns.sim_inter_token_ms,
        decode_ms_per_seq=ns.sim_decode_ms_per_seq,
        decode_ms_per_kv_token=ns.sim_decode_ms_per_kv_token,
    )
    for flag, value in (
        ("--sim-time-factor", profile.time_factor),
        ("--sim-prefill-ms-per-token", profile.prefill_ms_per_token),
        ("--sim-inter-token-ms", profile.decode_base_ms),
        ("--sim-decode-ms-per-seq", profile.decode_ms_per_seq),
        ("--sim-decode-ms-per-kv-token", profile.decode_ms_per_kv_token),
    ):
        if value < 0:
            raise ConfigError(f"{flag} must be >= 0, got {value}")
    return profile


def _decode_cuda_graph_bs(ns: argparse.Namespace) -> tuple[int, ...]:
    """The decode CUDA-graph capture sizes SGLang 0.5.23 would use on an H200 (``memory_hook.py``:
    ``_handle_gpu_memory_settings``; ``cuda_graph_hook.py``: ``generate_decode_cuda_graph_batch_sizes``): a decode
    batch replays the smallest graph that holds it (``numerics.padded_batch_size``). No graphs or no padding: ()."""
    if ns.disable_cuda_graph or ns.disable_decode_cuda_graph or ns.disable_cuda_graph_padding:
        return ()
    if ns.cuda_graph_bs_decode:
        return tuple(sorted({int(bs) for bs in ns.cuda_graph_bs_decode}))
    max_bs = ns.cuda_graph_max_bs_decode
    if max_bs is None:
        max_bs = default_decode_max_bs(int(ns.tp_size), ns.max_running_requests)
    return decode_capture_sizes(int(max_bs), speculative=ns.speculative_algorithm is not None)


def _batching(ns: argparse.Namespace) -> tuple[int, int, int]:
    """``--max-running-requests``, ``--max-prefill-tokens``, ``--chunked-prefill-size`` (SGLang's defaults: 256
    here for the first, 16384, and 8192 for an H200-sized GPU, ``server_args._handle_gpu_memory_settings``)."""
    running = 256 if ns.max_running_requests is None else int(ns.max_running_requests)
    if running <= 0:
        raise ConfigError(f"--max-running-requests must be positive, got {running}")
    prefill = _positive("--max-prefill-tokens", int(ns.max_prefill_tokens))
    chunk = 8192 if ns.chunked_prefill_size is None else int(ns.chunked_prefill_size)
    if chunk == 0 or chunk < -1:
        raise ConfigError(f"--chunked-prefill-size must be positive or -1 (no chunking), got {chunk}")
    if chunk > prefill:
        raise ConfigError(
            f"--chunked-prefill-size {chunk} is larger than --max-prefill-tokens {prefill}: a chunk could never be "
            "scheduled in one prefill batch"
        )
    return running, prefill, chunk


def resolve(ns: argparse.Namespace, env: Mapping[str, str]) -> SimConfig:
    """Check flag combinations the way SGLang does for the flags the simulator acts on."""
    pd_env = PdEnv.from_env(env)
    mode = str(ns.disaggregation_mode)
    if ns.disaggregation_decode_enable_offload_kvcache:
        if mode != "decode":
            raise ConfigError("--disaggregation-decode-enable-offload-kvcache requires --disaggregation-mode decode")
        if ns.hicache_storage_backend is None:
            raise ConfigError("--disaggregation-decode-enable-offload-kvcache requires --hicache-storage-backend")
    if ns.hicache_storage_backend is not None and ns.hicache_storage_backend not in HICACHE_BACKENDS_SIMULATED:
        raise ConfigError(
            f"--hicache-storage-backend {ns.hicache_storage_backend}: the simulator implements "
            f"{', '.join(HICACHE_BACKENDS_SIMULATED)}"
        )
    if mode != "null" and ns.disaggregation_transfer_backend not in {"mooncake", "mooncake_tcp"}:
        raise ConfigError(
            f"--disaggregation-transfer-backend {ns.disaggregation_transfer_backend}: simulated: mooncake"
        )
    attn_dp, dp_size = int(ns.attn_dp_size), int(ns.dp_size)
    if ns.enable_dp_attention and attn_dp == 1:
        attn_dp, dp_size = dp_size, 1  # handle_deprecated_dp_attention: --dp-size N --enable-dp-attention
    nnodes = _positive("--nnodes", int(ns.nnodes))
    if not 0 <= int(ns.node_rank) < nnodes:
        raise ConfigError(f"--node-rank {ns.node_rank} must be in [0, {nnodes})")
    if nnodes > 1 and not ns.dist_init_addr:
        raise ConfigError("--nnodes > 1 requires --dist-init-addr")
    tp_size = int(ns.tp_size)
    if (refused := check_parallel_flags(tp_size, nnodes, attn_dp, dp_size)) is not None:
        raise ConfigError(refused)
    for flag, value in (("--dp-size", dp_size), ("--pp-size", int(ns.pp_size)), ("--attn-cp-size", ns.attn_cp_size)):
        if value not in (None, 1):
            raise ConfigError(f"{flag} {value}: the simulator runs tensor and attention-data parallelism only")
    if (
        bad_layout := layout_error(int(ns.sim_kv_bytes_per_token), int(ns.sim_kv_heads), tp_size // attn_dp)
    ) is not None:
        raise ConfigError(bad_layout)
    if ns.sim_kv_bytes_per_token < MIN_KV_BYTES:
        raise ConfigError(
            f"--sim-kv-bytes-per-token must be >= {MIN_KV_BYTES} (token id, position and the word's UTF-8 bytes "
            f"live in each token's KV), got {ns.sim_kv_bytes_per_token}"
        )
    page_size = _positive("--page-size", int(ns.page_size or 1))
    max_running, max_prefill, chunk = _batching(ns)
    profile = _profile(ns)
    if not ns.sim_load_phases:
        profile = replace(profile, load=NO_LOAD)
    deterministic = bool(ns.enable_deterministic_inference)
    if deterministic:  # batch-invariant kernels cost 34.35% (numerics.DETERMINISTIC_OVERHEAD)
        profile = replace(profile, overhead=DETERMINISTIC_OVERHEAD)
    max_total = _positive("--max-total-tokens", int(ns.max_total_tokens or 65536))
    max_total -= max_total % page_size
    context_length = int(ns.context_length or 32768)
    failure_prob = ns.sim_transfer_failure_prob
    if failure_prob is None:
        failure_prob = pd_env.test_failure_prob
    if not 0.0 <= failure_prob <= 1.0:
        raise ConfigError("--sim-transfer-failure-prob must be in [0, 1]")
    file_dir = None
    uses_l3 = bool(ns.disaggregation_decode_enable_offload_kvcache) or (
        mode == "prefill" and bool(ns.enable_hierarchical_cache)
    )
    if ns.hicache_storage_backend == "file" and uses_l3:
        file_dir = env.get("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR") or "/tmp/hicache"
    store_env = None
    if ns.hicache_storage_backend == "mooncake" and mode == "prefill" and ns.enable_hierarchical_cache:
        store_env = {k: v for k, v in env.items() if k.startswith(("MOONCAKE_", "LOCAL_HOSTNAME"))}
    server_args = {k: v for k, v in vars(ns).items() if not k.startswith("sim_")}
    server_args.update(attn_dp_size=attn_dp, dp_size=dp_size, page_size=page_size, max_total_tokens=max_total)
    server_args.update(max_running_requests=max_running, chunked_prefill_size=chunk)
    if ns.enable_dp_attention:
        server_args["enable_dp_attention"] = False  # resolved into attn_dp_size, as SGLang reports it
    server_args["context_length"] = context_length
    return SimConfig(
        model_path=str(ns.model_path),
        served_model_name=str(ns.served_model_name or ns.model_path),
        host=str(ns.host),
        port=int(ns.port),
        mode=mode,
        bootstrap_port=int(ns.disaggregation_bootstrap_port),
        tp_size=tp_size,
        attn_dp_size=attn_dp,
        nnodes=nnodes,
        node_rank=int(ns.node_rank),
        dist_init_addr=ns.dist_init_addr,
        dist_timeout_s=float(ns.dist_timeout or 600),  # None: torch.distributed's default (10 minutes)
        kv_heads=int(ns.sim_kv_heads),
        mooncake=MooncakeEnv.from_env(env, ephemeral_ports()),
        page_size=page_size,
        max_total_tokens=max_total,
        host_pool_tokens=int(ns.sim_host_pool_tokens or 4 * max_total),
        max_running_requests=max_running,
        max_prefill_tokens=max_prefill,
        chunked_prefill_size=chunk,
        radix_cache=not ns.disable_radix_cache,
        context_length=context_length,
        offload=bool(ns.disaggregation_decode_enable_offload_kvcache),
        hicache_storage_backend=ns.hicache_storage_backend,
        hicache_file_dir=file_dir,
        mooncake_store_env=store_env,
        pd_ib_device="" if env.get("MC_FORCE_TCP") == "1" else str(getattr(ns, "disaggregation_ib_device", "") or ""),
        enable_metrics=bool(ns.enable_metrics),
        profile=profile,
        deterministic_inference=deterministic,
        decode_cuda_graph_bs=_decode_cuda_graph_bs(ns),
        kv_bytes_per_token=int(ns.sim_kv_bytes_per_token),
        seed=int(ns.sim_seed),
        inject_offload_race=bool(ns.sim_inject_offload_race),
        transfer_failure_prob=float(failure_prob),
        slow_health_s=max(0.0, float(ns.sim_slow_health_s)),
        hang_after_s=None if ns.sim_inject_hang_after_s is None else max(0.0, float(ns.sim_inject_hang_after_s)),
        pd=pd_env,
        load=resolve_load(ns),
        server_args=server_args,
    )


def parse(argv: Sequence[str], env: Mapping[str, str] | None = None) -> SimConfig:
    """Parse ``argv`` (argparse exits with status 2 on unknown flags, as SGLang does)."""
    ns = build_parser().parse_args(list(argv))
    return resolve(ns, os.environ if env is None else env)
