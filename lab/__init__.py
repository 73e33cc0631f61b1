"""The local fleet lab: real Slurm daemons, an emulated Kubernetes API, a spare pool, example jobs."""

# What the gpufleet command falls back on in a checkout, where neither an option nor a GPUFLEET_*
# setting says (entry point group gpufleet.cli_defaults): the lab's own cluster, and its
# cluster-creation backend. The worker never takes these: the lab sets GPUFLEET_CLUSTER for its own.
CLI_DEFAULTS = {"cluster": "lab", "cluster_backend": "lab"}
