"""Quitting never waits on a load, and the status line tells of the decode step being
optimized in the background."""

from __future__ import annotations

import asyncio
import threading

from localllm.tui.app import ChatApp
from tests.tui.conftest import wait_until
from tests.tui.fakes import FakeEngine, fake_stats

SIZE = (120, 30)


async def test_ctrl_q_quits_at_once_while_the_model_loads() -> None:
    """The load is stuck (a first start building kernels takes minutes): ctrl+q ends the app
    at once, the loading thread is left behind, and what it builds afterwards is shut down,
    never used."""
    release = threading.Event()
    built: list[FakeEngine] = []
    loaders: list[threading.Thread] = []

    def factory(model, progress):  # noqa: ANN001, ANN202
        loaders.append(threading.current_thread())
        progress("optimizing for this CPU (first run only)", 0, 2)
        release.wait(timeout=60)
        built.append(FakeEngine())
        return built[-1]

    app = ChatApp(engine_factory=factory, probe=False)

    async def session() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: bool(loaders), what="the load to start")
            assert app.loading and "optimizing for this CPU" in app.status_text().plain
            await pilot.press("ctrl+q")

    try:
        await asyncio.wait_for(session(), timeout=15)  # the old thread worker held the exit until the load ended
        assert app.return_code == 0 and loaders[0].is_alive() and loaders[0].daemon
    finally:
        release.set()
    await asyncio.to_thread(loaders[0].join, 10)
    assert built and built[0].shut_down  # the app had gone: the engine was shut down, not kept


async def test_the_status_line_tells_of_the_background_optimization_and_its_end() -> None:
    engine = FakeEngine()
    engine._stats = fake_stats(compiling=True)
    app = ChatApp(engine_factory=lambda model, progress: engine, probe=False)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.engine is not None, what="the load")
        app.refresh_status()
        assert "optimizing for this CPU…" in app.status_text().plain
        engine._stats = fake_stats(compiling=False)
        app.refresh_status()
        assert "optimizing" not in app.status_text().plain
        await wait_until(pilot, lambda: any("Optimized for this CPU" in str(n.message) for n in app._notifications),
                         what="the notification")
