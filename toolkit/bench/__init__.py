"""Benchmarks: ``python -m toolkit.bench {formats,...}``. Speed targets are checked here, never in unit tests."""
