"""Throwaway store servers for tests and benchmarks, not part of the package.

Tests import them as ``servers.…`` (``tests/`` is on ``sys.path`` under pytest); a benchmark
run as ``python benchmarks/x.py`` puts ``tests/`` on ``sys.path`` first.
"""
