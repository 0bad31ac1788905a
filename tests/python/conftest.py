"""Fixtures of the fabric_lib tests: providers present here, engines, and peer processes.

Import path: `make test-python` puts <build>/python first on PYTHONPATH (the package as built);
after `pip install .` the installed package is used.
"""

import contextlib
import multiprocessing
import sys
from pathlib import Path

import pytest

import fabric_lib

sys.path.insert(0, str(Path(__file__).parent))
from peer import make_config  # noqa: E402

BACKENDS = ["tcp", "shm"]
TIMEOUT = 60  # seconds: generous, for a loaded two-core machine


def pytest_report_header(config):
    return f"fabric_lib {fabric_lib.__version__} from {Path(fabric_lib.__file__).parent}"


# Feature markers (docs/testing.md, "Tests by feature"): `pytest -m weights` runs every test of
# the weight push. A module's tests carry its features; a test run over a provider carries the
# provider's name too (shm, tcp).
FEATURES_BY_MODULE = {
    "test_ep": ["ep"],
    "test_examples_moe": ["ep"],
    "test_weights": ["weights"],
    "test_weights_schedule": ["weights"],
    "test_kv": ["kv"],
    "test_reads": ["reads"],
    "test_cuda": ["cuda_ipc", "staged", "gpu"],
    "test_metrics": ["metrics"],
    "test_signals": ["signals"],
    "test_corrupt_bytes": ["bad_input"],
    "test_arguments": ["bad_input"],
    "test_text": ["bad_input"],
}
FEATURE_MARKERS = sorted({m for ms in FEATURES_BY_MODULE.values() for m in ms} | set(BACKENDS))


def pytest_configure(config):
    for marker in FEATURE_MARKERS:
        config.addinivalue_line("markers", f"{marker}: tests of the {marker} feature")


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
        for marker in FEATURES_BY_MODULE.get(module, []):
            item.add_marker(marker)
        callspec = getattr(item, "callspec", None)
        provider = callspec.params.get("provider") if callspec else None
        if provider in BACKENDS:
            item.add_marker(provider)


def open_engine_or_skip(provider, **fields):
    try:
        return fabric_lib.TransferEngine(make_config(provider, **fields))
    except fabric_lib.Unsupported as e:
        pytest.skip(f"provider {provider} not available here: {e}")


class Peer:
    """Another process with its own engine (tests/python/peer.py), driven over a pipe."""

    def __init__(self, provider):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, provider), daemon=True)
        self.process.start()
        child.close()
        self._reply(TIMEOUT)
        self.address = fabric_lib.Address(self.call("address"))

    def _reply(self, timeout):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"the peer process did not answer within {timeout} s")
        reply = self.conn.recv()
        if reply[0] == "error":
            cls = getattr(fabric_lib, reply[1], None)
            if not (isinstance(cls, type) and issubclass(cls, BaseException)):
                cls = RuntimeError
            raise cls(f"in the peer: {reply[2]}")
        return reply[1]

    def call(self, method, *args, timeout=TIMEOUT):
        self.conn.send((method, args))
        return self._reply(timeout)

    def kill(self):
        self.process.kill()
        self.process.join(10)

    def close(self):
        if self.process.is_alive():
            try:
                self.call("exit", timeout=20)
            except (OSError, EOFError, TimeoutError):
                pass
            self.process.join(10)
        if self.process.is_alive():
            self.kill()


def _serve(conn, provider):
    sys.path.insert(0, str(Path(__file__).parent))
    import peer

    peer.serve(conn, provider)


@pytest.fixture(scope="module", params=BACKENDS)
def provider(request):
    """Each provider present on this machine; an absent one is a visible skip."""
    engine = open_engine_or_skip(request.param)
    engine.close()
    return request.param


@pytest.fixture(scope="module")
def engine(provider):
    """This process's engine, shared by the tests of a module."""
    with fabric_lib.TransferEngine(make_config(provider)) as e:
        yield e


@pytest.fixture(scope="module")
def peer(provider):
    """A peer process with its own engine, shared by the tests of a module."""
    p = Peer(provider)
    yield p
    p.close()


@contextlib.contextmanager
def unraisable():
    """Collects what sys.unraisablehook receives (exceptions raised by user callbacks) inside
    the block. (pytest installs its own hook for each test phase, so a fixture cannot.)"""
    seen = []
    saved = sys.unraisablehook
    sys.unraisablehook = seen.append
    try:
        yield seen
    finally:
        sys.unraisablehook = saved
