"""The reconciler's wake-up flag and the hand-over from the Job index handler, and the
throttled credentials refresh of the API client."""

from __future__ import annotations

import asyncio
from typing import Any

from rtrl.kube.client import KubeClient, _ThrottledRefresh
from rtrl.kube.reconcile import Wakeup


def test_a_wakeup_hands_over_to_the_round_it_starts() -> None:
    async def scenario() -> None:
        flag = Wakeup()
        first = flag.set()
        assert flag.pending and flag.woken is not None
        assert flag.set() is first  # set twice before a round: the same round
        woken, round_ended = flag.take()
        assert round_ended is first and woken is not None and not flag.pending
        # set during that round: the next round's future, not this one's
        second = flag.set()
        assert second is not first and not first.done()
        round_ended.set_result(None)
        done, _ = await asyncio.wait([second], timeout=0.01)
        assert not done  # the next round has not run
        flag.close()  # the reconciler stops: nobody waits for a round that will not run
        assert second.done()

    asyncio.run(scenario())


def test_a_waiting_reconciler_resumes_when_set() -> None:
    async def scenario() -> None:
        flag = Wakeup()
        waiter = asyncio.create_task(flag.wait(5.0))
        await asyncio.sleep(0)
        flag.set()
        await asyncio.wait_for(waiter, 1.0)
        # already pending: returns at once
        await asyncio.wait_for(flag.wait(5.0), 0.1)

    asyncio.run(scenario())


class _Configuration:
    """The part of kubernetes.client.Configuration the refresh hook touches."""

    def __init__(self) -> None:
        self.calls = 0
        self.refresh_api_key_hook: Any = self.loader_hook

    def loader_hook(self, configuration: Any) -> None:
        # as kube_config's loader does: re-apply everything, and replace the hook
        self.calls += 1

        def fresh_closure(c: Any) -> None:
            self.loader_hook(c)

        configuration.refresh_api_key_hook = fresh_closure


class _Api:
    def __init__(self) -> None:
        self.configuration = _Configuration()


def test_the_credentials_refresh_runs_at_most_once_per_period(monkeypatch: Any) -> None:
    now = [100.0]
    monkeypatch.setattr("rtrl.kube.client.time.monotonic", lambda: now[0])
    api = _Api()
    KubeClient(api)  # type: ignore[arg-type]
    KubeClient(api)  # a second client on the same ApiClient does not wrap it twice
    conf = api.configuration
    hook = conf.refresh_api_key_hook
    assert isinstance(hook, _ThrottledRefresh) and not isinstance(hook.hook, _ThrottledRefresh)
    for _ in range(5):
        conf.refresh_api_key_hook(conf)
    assert conf.calls == 1
    now[0] += 1.5  # past the period: the loader's hook runs again, though it replaced itself
    conf.refresh_api_key_hook(conf)
    conf.refresh_api_key_hook(conf)
    assert conf.calls == 2
    assert conf.refresh_api_key_hook is hook
