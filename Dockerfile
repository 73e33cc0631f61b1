# The image the deploy/ manifests run: the gpufleet command (worker, detector) with the Slurm client.
FROM python:3.11-slim-bookworm
RUN apt-get update && apt-get install -y --no-install-recommends slurm-client munge \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml setup.py README.md ./
COPY models models
COPY clients clients
COPY activities activities
COPY workflows workflows
COPY workers workers
COPY starters starters
COPY detector detector
RUN pip install --no-cache-dir .
# It runs as UID 10001, numeric so that Kubernetes' runAsNonRoot can check it; the code stays root's.
# MUNGE: Slurm's commands (slurm-client) ask a munged for their credentials over the socket
# /run/munge/munge.socket.2, and Slurm sees the caller's UID in them. The image ships no key and
# runs no munged: in Kubernetes the node's /run/munge is mounted over this directory (the node's
# munged holds the key); under docker-compose.temporal.yml the container starts its own munged, as
# this user, with a copy of the key from a secret (munged takes only a key owned by its own user
# and readable by no one else), and writes its seed and log in the home directory.
# /app/.gpufleet is the default GPUFLEET_HOME, writable by the user.
RUN groupadd --gid 10001 gpufleet \
    && useradd --uid 10001 --gid 10001 --home-dir /home/gpufleet --create-home --shell /usr/sbin/nologin gpufleet \
    && install -d -o 10001 -g 10001 -m 0755 /run/munge /app/.gpufleet
USER 10001:10001
ENTRYPOINT ["gpufleet"]
