# The image the deploy/ manifests run: the gpufleet command (worker, detector), with the Slurm
# client of the cluster's release, or none:
#
#   docker build -t gpufleet .                              Slurm 22.05's client (the default)
#   docker build --build-arg SLURM_CLIENT=24.11 -t gpufleet .   24.11, or 26.05: your slurmctld's release
#   docker build --build-arg SLURM_CLIENT=none -t gpufleet .    no Slurm client and no munge
#
# Each release comes from the Debian suite that carries it (scripts/image-slurm-client.sh: 22.05
# bookworm, 24.11 trixie, 26.05 forky, pinned so that nothing else is taken from another suite);
# any other value fails the build, naming the choices. `none` is for a worker that reaches Slurm
# through slurmrestd (GPUFLEET_SLURM_BACKEND=rest, as on Slinky: docs/slinky.md) and for the
# detector, which runs no Slurm command.
FROM python:3.11-slim-trixie
ARG SLURM_CLIENT=22.05
LABEL io.gpufleet.slurm-client="${SLURM_CLIENT}"
COPY scripts/image-slurm-client.sh /usr/local/sbin/image-slurm-client.sh
RUN /usr/local/sbin/image-slurm-client.sh "${SLURM_CLIENT}" && rm /usr/local/sbin/image-slurm-client.sh
WORKDIR /app
COPY pyproject.toml setup.py README.md ./
COPY models models
COPY clients clients
COPY activities activities
COPY workflows workflows
COPY workers workers
COPY starters starters
COPY detector detector
COPY gateway gateway
RUN pip install --no-cache-dir .
# It runs as UID 10001, numeric so that Kubernetes' runAsNonRoot can check it; the code stays root's.
# MUNGE: Slurm's commands (slurm-client) ask a munged for their credentials over the socket
# /run/munge/munge.socket.2, and Slurm sees the caller's UID in them. The image ships no key and
# runs no munged: in Kubernetes the node's /run/munge is mounted over this directory (the node's
# munged holds the key); under docker-compose.temporal.yml the container starts its own munged, as
# this user, with a copy of the key from a secret (munged takes only a key owned by its own user
# and readable by no one else), and writes its seed and log in the home directory. An image
# without a Slurm client (SLURM_CLIENT=none) has no /run/munge.
# /app/.gpufleet is the default GPUFLEET_HOME, writable by the user.
RUN groupadd --gid 10001 gpufleet \
    && useradd --uid 10001 --gid 10001 --home-dir /home/gpufleet --create-home --shell /usr/sbin/nologin gpufleet \
    && install -d -o 10001 -g 10001 -m 0755 /app/.gpufleet \
    && if [ "${SLURM_CLIENT}" != none ]; then install -d -o 10001 -g 10001 -m 0755 /run/munge; fi
USER 10001:10001
ENTRYPOINT ["gpufleet"]
