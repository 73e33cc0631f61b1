"""The gpufleet services that stand between people or detectors and Temporal."""
