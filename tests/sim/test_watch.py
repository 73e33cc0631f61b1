"""The what-if's watch over the test server's clock, without a server: a clock that moves only
when nudged is a stall, and the run gives up on it; one that moves on its own is not."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest

from models.policy import Policy
from models.trace import Trace
from sim import whatif
from sim.activities import SimFleet
from sim.world import FleetSpec, World

START = datetime(2026, 12, 1, tzinfo=UTC)


class Clock:
    """What _watch asks of the environment: its time, and a sleep that moves it (the nudge)."""

    def __init__(self, *, runs: timedelta) -> None:
        self.now = START + timedelta(days=11)
        self.runs = runs  # how far it moves on its own between two looks
        self.nudges = 0

    async def get_current_time(self) -> datetime:
        self.now += self.runs
        return self.now

    async def sleep(self, duration: timedelta) -> None:
        self.nudges += 1
        self.now += duration


def fleets() -> list[tuple[str, SimFleet]]:
    world = World(FleetSpec(nodes=2))
    return [("example", SimFleet(cluster="whatif-p1-s0", world=world, policy=Policy(), start=START))]


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(whatif, "PROGRESS_SECONDS", 0.01)
    monkeypatch.setattr(whatif, "NUDGE_SECONDS", 0.03)
    monkeypatch.setattr(whatif, "STALL_SECONDS", 0.2)


async def test_a_clock_that_moves_only_when_nudged_is_given_up_on() -> None:
    clock = Clock(runs=timedelta(0))
    over = asyncio.Event()
    with pytest.raises(whatif.WhatIfError, match="stood still"):
        await asyncio.wait_for(
            whatif._watch(cast(Any, clock), fleets(), Trace(seconds=30 * 86400), lambda _: None, over), 5
        )
    assert clock.nudges >= 1


async def test_a_clock_that_moves_on_its_own_is_watched_until_the_end() -> None:
    clock = Clock(runs=timedelta(minutes=5))
    over = asyncio.Event()
    said: list[str] = []
    watch = asyncio.create_task(whatif._watch(cast(Any, clock), fleets(), Trace(seconds=30 * 86400), said.append, over))
    await asyncio.sleep(0.4)
    over.set()
    await asyncio.wait_for(watch, 5)
    assert clock.nudges == 0 and said


async def test_a_clock_that_keeps_only_the_walls_pace_is_given_up_on() -> None:
    """A server that stopped skipping time runs its timers in real time: seconds a look, where a
    month's simulation needs hours; that is a stall too."""
    clock = Clock(runs=timedelta(seconds=5))  # a look every 5 s, as the run looks
    over = asyncio.Event()
    with pytest.raises(whatif.WhatIfError, match="stood still"):
        await asyncio.wait_for(
            whatif._watch(cast(Any, clock), fleets(), Trace(seconds=30 * 86400), lambda _: None, over), 5
        )


async def test_a_busy_run_at_the_walls_pace_is_watched_until_the_end() -> None:
    """Many activities at one simulated instant: the clock keeps the wall's pace, but work is
    done between looks; that is no stall."""
    clock = Clock(runs=timedelta(seconds=5))
    cases = fleets()
    over = asyncio.Event()

    class Busy(Clock):
        async def get_current_time(self) -> datetime:
            cases[0][1].calls["claim_spare"] += 50  # the stand-ins at work between two looks
            return await super().get_current_time()

    busy = Busy(runs=clock.runs)
    watch = asyncio.create_task(whatif._watch(cast(Any, busy), cases, Trace(seconds=30 * 86400), lambda _: None, over))
    await asyncio.sleep(0.4)  # past STALL_SECONDS (0.2 s here)
    assert not watch.done()
    over.set()
    await asyncio.wait_for(watch, 5)
    assert busy.nudges == 0
