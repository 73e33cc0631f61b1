"""Benchmarks: `make bench`, `make bench-scale`, the parser's figures, and the simulated Slurm and
worker the scale bench runs. It may import anything (the lab too); nothing in production imports it."""
