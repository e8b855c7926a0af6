"""Security contexts and minimum resource requests of the worker pods. Pure.

The bar is the chart's (non-root, read-only root, no capabilities, RuntimeDefault seccomp), with what SGLang on
GPUs and RDMA needs, each exception named here and in operator/README.md ("Worker pod hardening"):

* ``IPC_LOCK`` is the one capability kept: Mooncake and NCCL register (pin) GPU and host memory with the RDMA NIC
  (``ibv_reg_mr``), which needs more locked memory than ``RLIMIT_MEMLOCK`` allows an unprivileged process.
* The root filesystem stays writable and the user stays the image's (root in ``lmsysorg/sglang``): SGLang, torch
  Inductor, Triton, DeepGEMM, FlashInfer and Hugging Face write caches under ``$HOME`` and ``/tmp`` at run time,
  not all of them relocatable, and the host-path caches (``jitCache``, ``model.weightCache``) are created by the
  kubelet as root. Without capabilities that root cannot read or write files of other users, load modules, change
  the network or trace processes.
* ``transfer.rdmaResource`` unset with ``protocol: rdma`` mounts the host's ``/dev/infiniband``, which a container
  can open only when privileged; an RDMA device plugin (``rdmaResource``) avoids it and is recommended.
"""

from __future__ import annotations

from typing import Any

RDMA_CAPABILITY = "IPC_LOCK"
# Requests a worker gets when its role names none: never BestEffort (first to be evicted under memory pressure).
MIN_REQUESTS = {"cpu": "1", "memory": "4Gi"}


def pod_security_context() -> dict[str, Any]:
    return {"seccompProfile": {"type": "RuntimeDefault"}}


def worker_security_context(privileged: bool) -> dict[str, Any]:
    """The SGLang container: every capability dropped but ``IPC_LOCK``; ``privileged`` only for host InfiniBand
    devices without a device plugin (the API server rejects privileged with ``allowPrivilegeEscalation: false``)."""
    capabilities = {"drop": ["ALL"], "add": [RDMA_CAPABILITY]}
    if privileged:
        return {"privileged": True, "capabilities": capabilities}
    return {"allowPrivilegeEscalation": False, "capabilities": capabilities}


def init_security_context() -> dict[str, Any]:
    """Init containers (the weight prefetch) need no capability at all."""
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def with_min_requests(requests: dict[str, str], limits: dict[str, str]) -> dict[str, str]:
    """The role's requests, with ``MIN_REQUESTS`` for the CPU or memory it names neither a request nor a limit
    for (a limit alone makes the API server default the request to it)."""
    floor = {name: value for name, value in MIN_REQUESTS.items() if name not in limits}
    return {**floor, **requests}
