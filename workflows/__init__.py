"""Temporal workflows: deterministic orchestration, no I/O."""
