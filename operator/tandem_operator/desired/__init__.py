"""Desired state as data: pure functions from the PDCluster spec to the manifests the operator applies."""
