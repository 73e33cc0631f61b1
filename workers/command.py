"""The ``gpufleet`` console script: ``health-check`` at once, every other command through workers.entry.

Slurm runs ``gpufleet health-check`` before and after every job: it must not pay the second that
importing gpufleet's command tree (Temporal, Kubernetes, pydantic) takes, so it is dispatched here
before anything else is imported.
"""

from __future__ import annotations

import sys


def main() -> None:
    if sys.argv[1:2] == ["health-check"]:
        from detector.healthcheck import main as health_check

        sys.exit(health_check(sys.argv[2:]))
    from workers.entry import main as everything

    everything()


if __name__ == "__main__":
    main()
