"""Thin Kubernetes adapters: the pure request builders plus the few lines of I/O that send them."""
