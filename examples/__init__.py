"""Trained examples on real data (``python -m examples.meanflow``, ``python -m examples.scm``)
and the DiT they share with ``benchmarks/e2e.py``."""
