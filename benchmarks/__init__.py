"""Probes and one-off GPU benchmarks, run from the repository root as
``python -m benchmarks.NAME``; ``benchmarks.common`` holds their shared scaffolding."""
