"""Engine statistics (TransferEngine.stats()) and their Prometheus export (fabric_lib.metrics):
an HTTP endpoint served by prometheus_client is scraped before and after traffic, and the text
is parsed with prometheus_client's own parser."""

import gc
import http.server
import re
import threading
import urllib.request
from pathlib import Path

import pytest

import fabric_lib
from conftest import TIMEOUT, open_engine_or_skip

prometheus_client = pytest.importorskip(
    "prometheus_client", reason="python3-prometheus-client is not installed (make deps)")
from fabric_lib import metrics  # noqa: E402
from prometheus_client.exposition import MetricsHandler  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

WRITES = 20
SIZE = 64 * 1024
IMM = 0x5EED


@pytest.fixture(scope="module")
def pair(provider):
    with open_engine_or_skip(provider) as a, open_engine_or_skip(provider) as b:
        yield a, b


@pytest.fixture
def endpoint():
    """A private registry served over HTTP on a free port, as an application would serve it."""
    registry = prometheus_client.CollectorRegistry()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), MetricsHandler.factory(registry))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield registry, f"http://127.0.0.1:{server.server_address[1]}/metrics"
    finally:
        server.shutdown()
        server.server_close()


def scrape(url):
    """{(metric sample name, labels as a sorted tuple): value}."""
    with urllib.request.urlopen(url, timeout=TIMEOUT) as response:
        text = response.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sample(samples, name, **labels):
    return samples[(name, tuple(sorted(labels.items())))]


def test_stats_count_writes_messages_and_immediates(pair):
    a, b = pair
    before_a, before_b = a.stats(), b.stats()
    assert len(before_a.groups) == 1 and isinstance(before_a.groups[0], fabric_lib.GroupStats)
    src = a.register(bytearray(SIZE))
    dst = b.register(bytearray(SIZE))
    for _ in range(3):
        a.write(src, dst.descriptor, imm=IMM + 1).result(TIMEOUT)
    assert b.wait_imm(IMM + 1, 3, TIMEOUT)
    with pytest.raises(fabric_lib.OutOfRange):  # rejected: counts nothing
        a.write(src, dst.descriptor, length=SIZE + 1)
    after_a, after_b = a.stats(), b.stats()
    g0, g1 = before_a.groups[0], after_a.groups[0]
    assert g1.transfers_submitted - g0.transfers_submitted == 3
    assert g1.transfers_completed - g0.transfers_completed == 3
    assert g1.transfers_failed == g0.transfers_failed
    assert g1.bytes_submitted - g0.bytes_submitted == 3 * SIZE
    assert after_b.immediates_received - before_b.immediates_received == 3


def test_worker_counts_work_requests_errors_and_completion_times(pair):
    a, b = pair
    g0 = a.stats().groups[0]
    assert len(g0.nics) == 1 and isinstance(g0.nics[0], fabric_lib.NicStats)
    src = a.register(bytearray(SIZE))
    dst = b.register(bytearray(SIZE))
    for _ in range(4):
        a.write(src, dst.descriptor).result(TIMEOUT)
    gone = b.register(bytearray(SIZE))
    stale = gone.descriptor
    b.unregister(gone)
    with pytest.raises(fabric_lib.RemoteAccess):
        a.write(src, stale).result(TIMEOUT)
    g1 = a.stats().groups[0]

    def user_wrs(g):
        return sum(n.work_requests_posted for n in g.nics) - g.internal_work_requests_posted

    assert user_wrs(g1) - user_wrs(g0) >= 5  # four writes, the stale one (and its retries)
    assert g1.errors_by_code["RemoteAccess"] - g0.errors_by_code["RemoteAccess"] == 1
    assert sum(g1.completion_latency_us) - sum(g0.completion_latency_us) == 5
    assert len(g1.completion_latency_us) == 21
    assert g1.in_flight == 0
    assert g1.worker_passes > g0.worker_passes


def test_scrape_shows_counters_moving_under_traffic(pair, endpoint):
    a, b = pair
    registry, url = endpoint
    metrics.register(a, name="sender", registry=registry)
    metrics.register(b, name="receiver", registry=registry)
    with pytest.raises(ValueError):
        metrics.register(b, name="sender", registry=registry)  # a name names one engine
    src = a.register(bytearray(SIZE))
    dst = b.register(bytearray(SIZE))
    b.set_receive_handler(None)
    first = scrape(url)
    for name in ("sender", "receiver"):
        for metric, _, _ in metrics.GROUP_COUNTERS:
            assert (metric + "_total", (("engine", name), ("group", "0"))) in first
    assert sample(first, "fabric_nic_up", engine="sender", group="0",
                  nic=a.group_info().nics[0]) == 1.0
    # Host buffers: no staging mirror.
    assert sample(first, "fabric_host_mirror_bytes", engine="sender", group="0") == 0.0

    transfers = [a.write(src, dst.descriptor, imm=IMM) for _ in range(WRITES)]
    for t in transfers:
        t.result(TIMEOUT)
    assert b.wait_imm(IMM, WRITES, TIMEOUT)
    a.send(b.address, b"hello").result(TIMEOUT)
    assert b.recv(TIMEOUT) == b"hello"

    second = scrape(url)

    def moved(name, engine):
        return (sample(second, name, engine=engine, group="0") -
                sample(first, name, engine=engine, group="0"))

    assert moved("fabric_transfers_submitted_total", "sender") == WRITES
    assert moved("fabric_transfers_completed_total", "sender") == WRITES
    assert moved("fabric_transfers_failed_total", "sender") == 0
    assert moved("fabric_bytes_submitted_total", "sender") == WRITES * SIZE
    assert moved("fabric_messages_sent_total", "sender") == 1
    assert moved("fabric_messages_completed_total", "sender") == 1
    assert moved("fabric_messages_received_total", "receiver") == 1
    assert moved("fabric_transfers_submitted_total", "receiver") == 0
    imms = (sample(second, "fabric_immediates_received_total", engine="receiver") -
            sample(first, "fabric_immediates_received_total", engine="receiver"))
    assert imms == WRITES

    assert metrics.unregister(a, registry=registry)
    third = scrape(url)
    assert not any(dict(labels).get("engine") == "sender" for _, labels in third)


def test_a_closed_engine_releases_its_name(provider):
    """close() frees the engine's name at once (not when the object is collected): a new engine
    may take it, and the old one is not scraped."""
    registry = prometheus_client.CollectorRegistry()
    old = open_engine_or_skip(provider)  # held by the test: only close() may free the name
    metrics.register(old, name="prefill0", registry=registry)
    old.close()
    with open_engine_or_skip(provider) as new, open_engine_or_skip(provider) as third:
        collector = metrics.register(new, name="prefill0", registry=registry)
        assert collector.names() == ["prefill0"]
        families = {f.name: f for f in registry.collect()}
        engines = {s.labels["engine"] for s in families["fabric_transfers_submitted"].samples}
        assert engines == {"prefill0"}
        # Default names: never a live engine's, whatever was registered and closed before.
        others = prometheus_client.CollectorRegistry()
        with open_engine_or_skip(provider) as first:
            metrics.register(first, registry=others)  # engine0
            c = metrics.register(third, registry=others)  # engine1
            first.close()
            metrics.register(new, registry=others)  # not engine1 again
            assert len(c.names()) == len(set(c.names())) == 2, c.names()
    assert old.closed
    assert collector.names() == []


def test_a_new_registry_is_never_handed_a_collected_ones_collector(pair):
    """Registries made and dropped one after another (CPython reuses their ids): each scrape
    shows the engine."""
    a, _ = pair
    for i in range(100):
        registry = prometheus_client.CollectorRegistry()
        metrics.register(a, name="e", registry=registry)
        names = {family.name for family in registry.collect()}
        assert "fabric_nic_up" in names, f"registry {i}: the scrape showed {sorted(names)}"
        del registry
        gc.collect()


def exported_metric_names(engine):
    """The metric names a scrape of `engine` shows (counters with their _total)."""
    registry = prometheus_client.CollectorRegistry()
    metrics.register(engine, name="e", registry=registry)
    names = set()
    for family in registry.collect():
        names.add(family.name + ("_total" if family.type == "counter" else ""))
    return names


def documented_metric_names():
    doc = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
    if not doc.exists():
        pytest.skip(f"{doc} is not here (an installed package)")
    return set(re.findall(r"^\| `(fabric_\w+)` \|", doc.read_text(), re.M))


def test_metrics_md_lists_every_metric_exported(pair):
    a, _ = pair
    exported = exported_metric_names(a)
    documented = documented_metric_names()
    assert exported == documented, (
        f"exported, not in docs/metrics.md: {sorted(exported - documented)}; "
        f"in docs/metrics.md, not exported: {sorted(documented - exported)}")
    # The module's docstring lists them too.
    listed = set(re.findall(r"^\s+(fabric_\w+)\{", metrics.__doc__, re.M))
    assert listed == exported, sorted(listed ^ exported)
