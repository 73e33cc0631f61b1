"""The ``gpufleet`` console script: the starter commands plus ``worker`` (and ``lab``).

This is the composition root: it alone may see every room, so it lives with the workers.
"""

from __future__ import annotations

import logging
import os
import sys

from models.policy import PolicyError
from models.settings import Settings
from starters.cli import app, fail, run_async
from starters.temporal import connect


@app.command()
def worker() -> None:
    """Run a worker on task queue 'gpufleet' (settings from GPUFLEET_* and Temporal env-config)."""
    from workers.main import run_worker

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = Settings()

    async def go() -> None:
        client = await connect()
        await run_worker(client, settings)

    try:
        run_async(go())
    except PolicyError as exc:
        fail(f"policy file: {exc}")
    except KeyboardInterrupt:
        pass


def main() -> None:
    from detector.cli import detect

    app.command()(detect)
    try:
        from lab.cli import lab_app
    except ImportError:  # the lab extra (kmock) is not installed: no lab commands
        pass
    else:
        app.add_typer(lab_app, name="lab")
    try:
        app()
    except SystemExit as exc:
        exit_now(exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1))
    exit_now(0)


def exit_now(code: int) -> None:
    """Leave without interpreter teardown.

    The Temporal client's Rust threads can outlive the event loop, and CPython's finalisation
    then aborts the process (SIGABRT, "PyGILState_Release: thread state ... must be current")
    after the command has done its work: temporalio/sdk-python issue 300.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
