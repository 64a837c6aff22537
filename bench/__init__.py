"""Benchmarks on the simulated cluster (issue 6): `make bench` runs `python -m bench.run`."""
