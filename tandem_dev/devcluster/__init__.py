"""The real Kubernetes test control plane: etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok
fake GPU nodes on loopback (``DevCluster``), plus the pod runner that serves simulated SGLang pods (``PodRunner``).
Binaries come from ``scripts/build-k8s.sh``."""
