"""Shared fixtures for the test suite, one section per layer under test."""

from __future__ import annotations

import os
import tempfile
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from filelock import ReadWriteLock

if TYPE_CHECKING:
    from engine.engine import Engine
    from engine.model import LoadedModel


# -- the suite's two workers (pytest-xdist): a test marked `alone` runs with the other idle --


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[
        None, object, object]:
    """Under pytest-xdist, each test (its fixtures' setup and teardown included) holds a
    read lock shared by the run's workers, and a test marked ``alone`` the write lock: it
    waits for the test the other worker is running, and that worker waits for it. Such a
    test compares real time between two phases of its own (a stream's gaps with and
    without a slow neighbour, the event loop's stalls), which the other worker's load
    would tilt; everything else runs two at a time. filelock's lock lets a waiting writer
    in before new readers (SQLite's pending lock), so an ``alone`` test waits for one
    test at most."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:  # one process (`-n 0`): nothing runs beside
        return (yield)
    lock = ReadWriteLock(Path(tempfile.gettempdir()) / f"streamscope-tests-{run}.db")
    hold = lock.write_lock() if item.get_closest_marker("alone") else lock.read_lock()
    with hold:
        return (yield)


# -- engine: tiny random models and engines that must end whole ----------------------------

# Enough steps to finish anything a test leaves in flight; more means the engine is stuck.
MAX_TEARDOWN_STEPS = 2_000


@pytest.fixture(scope="session")
def tiny_model() -> Callable[..., LoadedModel]:
    """``tiny_model(name, precision="float32")``: one shared LoadedModel per tiny model and
    precision (``engine.precision``), for Engines only.

    Using it sets torch to one thread for the rest of the session.

    An Engine switches its model to paged attention, so a reference run through the
    library's own attention must load a fresh model (``load_model``) instead.
    """
    import torch

    from engine.model import load_model

    # Tiny matrices: one intra-op thread is fastest, and on a busy small machine a
    # second one makes every step many times slower (threads waiting on each other).
    torch.set_num_threads(1)
    loaded: dict[tuple[str, str], LoadedModel] = {}

    def get(name: str, precision: str = "float32") -> LoadedModel:
        if (name, precision) not in loaded:
            loaded[name, precision] = load_model(name, "cpu", precision=precision)
        return loaded[name, precision]

    return get


@pytest.fixture(scope="session")
def embedded_model() -> LoadedModel:
    """The embedded SmolLM2 model (float32, from its converted copy), loaded once for the
    session's Engines: each load reads its 513 MiB copy again (seconds on a busy
    machine).

    As with ``tiny_model``, an Engine switches the model to paged attention, so a test
    that runs the library's own attention, or checks the load itself
    (``test_smoke_smollm2.py``, ``test_int4_linear.py``), loads its own.
    """
    from engine.model import load_model

    return load_model("smollm2", "cpu")


@pytest.fixture
def make_tiny_engine(tiny_model: Callable[..., LoadedModel]) -> Iterator[Callable[..., Engine]]:
    """``make_tiny_engine(model="tiny-gpt2", precision="float32", **options)``: an Engine
    checked at teardown.

    At teardown each engine is stepped until it has no work, and then its cache must be
    whole: every block free, nothing running or waiting. A test that leaves a sequence
    paused fails here, as it should: a paused sequence still holds its blocks.
    """
    from engine.engine import Engine

    engines: list[Engine] = []

    def make(model: str = "tiny-gpt2", precision: str = "float32", **options: Any) -> Engine:
        engine = Engine(tiny_model(model, precision), **options)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        for _ in range(MAX_TEARDOWN_STEPS):
            if not engine.has_work():
                break
            engine.step()
        engine.step()  # refresh the statistics snapshot
        stats = engine.statistics()
        assert (stats.blocks_free, stats.running, stats.waiting) == (stats.blocks_total, 0, 0)
        assert engine.allocator.num_free == engine.allocator.num_blocks
        assert not engine.scheduler.running
        assert not engine.scheduler.waiting


# == app: the real server over real HTTP (owned by the app's tests; see http_server.py) ==

if TYPE_CHECKING:
    from tests.http_server import RunningServer, StartServer


@pytest.fixture
async def start_server(
    tiny_model: Callable[[str], LoadedModel],
) -> AsyncIterator[StartServer]:
    """``await start_server(**settings)``: serve a new app on a loopback port.

    At teardown, before each server stops: no stream open, the engine holds nothing, its
    cache is whole and releases == admitted; after it stopped: the cache is whole.
    """
    from tests.http_server import open_servers

    async with open_servers(tiny_model("tiny-gpt2")) as start:
        yield start


@pytest.fixture
async def server(start_server: StartServer) -> RunningServer:
    """One app with the test settings (``http_server.TEST_SETTINGS``), ready."""
    return await start_server()


# == TLS: the app over HTTPS, for HTTP/2 (see tls.py and http_server.py) ==================

if TYPE_CHECKING:
    from tests.tls import Certificate


@pytest.fixture(scope="session")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> Certificate:
    """A throwaway self-signed certificate for localhost and 127.0.0.1 (``tls.py``)."""
    from tests.tls import make_certificate

    return make_certificate(tmp_path_factory.mktemp("tls"))


@pytest.fixture
async def start_tls(
    tiny_model: Callable[[str], LoadedModel], certificate: Certificate
) -> AsyncIterator[StartServer]:
    """``await start_tls(**options, **settings)``: ``start_server`` over TLS with
    ``certificate`` (ALPN ``h2`` and ``http/1.1``), with the same checks at teardown."""
    from tests.http_server import open_servers

    async with open_servers(tiny_model("tiny-gpt2"), certificate) as start:
        yield start
