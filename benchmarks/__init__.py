"""Microbenchmarks: one module per subject, a shared runner (``python -m benchmarks [SUBJECT ...]``)."""
