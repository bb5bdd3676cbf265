"""Benchmarks, experiments and the load generator: commands, not tests."""
