"""Adapters: what carries a decision out (the Kubernetes client, the registry writer, pod and Service changes,
metrics)."""
