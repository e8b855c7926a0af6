"""Benchmarks of the router and the instant worker they measure it against."""
