"""A worker whose Slurm is simulated in memory (bench/simslurm.py), for ``make bench-scale``.

Everything else is the real worker: the same workflows and activities, the real Kubernetes
client over HTTP (against the lab's emulated API server), the real spare pool, the real
Temporal server. Only slurmctld is replaced, because ten thousand real ``slurmd`` daemons do
not run on one machine.

``python -m bench.simulated_worker --fleet FILE``: FILE is the JSON the bench writes
(``{"partition": ..., "training": [...], "spares": [...], "checkpoint_seconds": ...}``);
settings and Temporal's address come from the environment as for ``gpufleet worker``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

from bench.simslurm import SimulatedFleet, SimulatedSlurm
from models.settings import Settings
from starters.temporal import connect
from workers.main import Clients, build_clients, run_worker

log = logging.getLogger("gpufleet.worker")


def simulated_clients(settings: Settings, fleet: SimulatedFleet) -> Clients:
    """The worker's clients with the fleet's Slurm simulated: training nodes each running a job."""
    return build_clients(settings, slurm=fleet.slurm())


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.simulated_worker", description=__doc__.splitlines()[0])
    parser.add_argument("--fleet", type=Path, required=True, help="the fleet's JSON, as the scale bench writes it")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)
    settings = Settings()
    fleet = SimulatedFleet.model_validate_json(args.fleet.read_text(encoding="utf-8"))
    if fleet.partition != settings.partition:
        parser.error(f"the fleet's partition {fleet.partition!r} is not GPUFLEET_PARTITION {settings.partition!r}")
    clients = simulated_clients(settings, fleet)

    async def go() -> None:
        await run_worker(await connect(), settings, clients=clients)

    asyncio.run(go())
    slurm = clients.slurm
    if isinstance(slurm, SimulatedSlurm):
        log.info("simulated Slurm: %s; jobs running again: %d", slurm.counts, slurm.running_again())


if __name__ == "__main__":
    main()
