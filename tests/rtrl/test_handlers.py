"""What rtrl.handlers changes in kopf (1.45, pinned) for scale: kopf holds each listed
object's first event until every index handler has seen the initial listing, and the
readiness check it waits on must stay linear in the objects listed (10,000 Checkpoints took
it over 10 minutes: bench/scale.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from kopf._cogs.aiokits import aiotoggles

import rtrl.handlers  # noqa: F401  (applies the change to kopf's ToggleSet)

OBJECTS = 400


def test_index_readiness_wakes_the_waiting_workers_once_not_per_object() -> None:
    """As kopf's watcher and workers do: a toggle per listed object, dropped once the object
    is indexed, after which its worker waits for the whole set; the set is evaluated a few
    times per object, not once per object for every worker already waiting."""
    evaluations = 0

    def every(states: Iterable[bool]) -> bool:
        nonlocal evaluations
        evaluations += 1
        return all(states)

    async def scenario() -> None:
        readiness = aiotoggles.ToggleSet(every)
        listing = await readiness.make_toggle(name="the listing")  # until it has ended
        toggles = [await readiness.make_toggle(name=f"object {k}") for k in range(OBJECTS)]

        async def worker(toggle: aiotoggles.Toggle) -> None:
            await readiness.drop_toggle(toggle)  # indexed
            await readiness.wait_for(True)  # every other object too

        workers = []
        for toggle in toggles:  # the listing's objects arrive one by one
            workers.append(asyncio.create_task(worker(toggle)))
            for _ in range(3):  # it is indexed, and the workers woken meanwhile look again
                await asyncio.sleep(0)
        assert len(readiness) == 1
        assert not any(w.done() for w in workers)
        await listing.turn_to(True)
        await asyncio.wait_for(asyncio.gather(*workers), 10)

    asyncio.run(scenario())
    assert evaluations < 10 * OBJECTS, evaluations
