"""Test and benchmark instruments shared by ``tests/`` and ``benchmarks/`` (not shipped in the package)."""
