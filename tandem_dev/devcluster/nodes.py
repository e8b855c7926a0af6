"""Fake GPU nodes as Node manifests (pure data). kwok manages every node carrying ``KWOK_ANNOTATION``."""

from __future__ import annotations

import ipaddress
from typing import Any

from tandem_dev.devcluster.config import DevClusterConfig

KWOK_ANNOTATION = ("kwok.x-k8s.io/node", "fake")
GPU_RESOURCE = "nvidia.com/gpu"
RDMA_RESOURCE = "rdma/ib"
BLOCK_LABEL = "topology.tandem.dev/block"
NODE_PREFIX = "gpu-node-"


def node_name(index: int) -> str:
    return f"{NODE_PREFIX}{index:03d}"


def node_ip(config: DevClusterConfig, index: int) -> str:
    return str(ipaddress.ip_address(config.node_ip_base) + index)


def fake_node(config: DevClusterConfig, index: int) -> dict[str, Any]:
    """One 8-GPU node (by default) in block ``index // nodes_per_block``.

    Capacity is set in the created object's status; kwok's node-initialize stage keeps what is there.
    """
    name = node_name(index)
    resources = {
        "cpu": "192",
        "memory": "2Ti",
        "pods": "110",
        "ephemeral-storage": "10Ti",
        GPU_RESOURCE: str(config.gpus_per_node),
        RDMA_RESOURCE: str(config.rdma_per_node),
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {KWOK_ANNOTATION[0]: KWOK_ANNOTATION[1], "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                BLOCK_LABEL: f"block-{index // config.nodes_per_block}",
                "nvidia.com/gpu.product": config.gpu_product,
                "nvidia.com/gpu.count": str(config.gpus_per_node),
            },
        },
        "spec": {},
        "status": {
            "allocatable": resources,
            "capacity": resources,
            "addresses": [
                {"type": "InternalIP", "address": node_ip(config, index)},
                {"type": "Hostname", "address": name},
            ],
        },
    }


def fake_nodes(config: DevClusterConfig) -> list[dict[str, Any]]:
    return [fake_node(config, i) for i in range(config.nodes)]
