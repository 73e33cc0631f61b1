"""The local fleet lab: real Slurm daemons, an emulated Kubernetes API, a spare pool, example jobs."""
