"""The gpufleet command: start, signal and query workflows."""
