"""The outside world (Slurm, Kubernetes, spare pools, notifiers) behind small Protocols."""
