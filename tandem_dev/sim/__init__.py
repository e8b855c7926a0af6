"""Benchmarks and test helpers of the simulator."""
