"""Benchmarks run from a source checkout (``python -m benchmarks.e2e``)."""
