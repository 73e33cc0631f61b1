# The image the deploy/ manifests run: the gpufleet command (worker, detector) with the Slurm client.
FROM python:3.11-slim-bookworm
RUN apt-get update && apt-get install -y --no-install-recommends slurm-client munge \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY models models
COPY clients clients
COPY activities activities
COPY workflows workflows
COPY workers workers
COPY starters starters
COPY detector detector
RUN pip install --no-cache-dir .
ENTRYPOINT ["gpufleet"]
