"""Benchmarks of the operator."""
