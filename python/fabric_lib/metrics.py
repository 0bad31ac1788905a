"""Prometheus metrics of fabric_lib engines, through prometheus_client (Debian's
python3-prometheus-client), the way LLM servers export theirs: nothing is registered until
asked, and each scrape reads TransferEngine.stats() of every engine registered, so counting
costs nothing between scrapes.

    from prometheus_client import start_http_server
    from fabric_lib import metrics

    metrics.register(engine, name="prefill0")   # once per engine; REGISTRY by default
    start_http_server(9400)                     # the application's own endpoint

Metric names and labels (docs/metrics.md lists them with their meaning):

    fabric_transfers_submitted_total{engine,group}   one-sided transfers accepted
    fabric_transfers_completed_total{engine,group}   ... that completed
    fabric_transfers_failed_total{engine,group}      ... that failed
    fabric_bytes_submitted_total{engine,group}       payload bytes of accepted transfers
    fabric_messages_sent_total{engine,group}         messages accepted by send()
    fabric_messages_completed_total{engine,group}    ... that were delivered
    fabric_messages_failed_total{engine,group}       ... that failed
    fabric_messages_received_total{engine,group}     messages received
    fabric_cuda_ipc_transfers_total{engine,group}    transfers over the CUDA IPC path
    fabric_cuda_ipc_bytes_total{engine,group}        ... and their payload bytes
    fabric_internal_work_requests_total{engine,group}  work requests of the engine's own messages
    fabric_worker_passes_total{engine,group}         passes of the group's worker loop
    fabric_worker_sleeps_total{engine,group}         times the worker blocked with nothing to do
    fabric_worker_wakeups_total{engine,group}        times a submitter woke it
    fabric_immediates_received_total{engine}         immediates counted
    fabric_nic_up{engine,group,nic}                  1 while the NIC is up, 0 once marked down
    fabric_host_mirror_bytes{engine,group}           pinned host memory of staging mirrors

Labels stay bounded: `engine` is the name given to register() (one per engine), `group` a
device group index, `nic` one of a group's NICs; no label is made from peers, immediates or
transfer ids, whose number grows with traffic. An engine's name is released when it is closed
(or collected): a new engine may then be registered under it.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Iterator, Optional

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ._fabric_lib import Closed, TransferEngine

__all__ = ["EngineCollector", "GROUP_COUNTERS", "register", "unregister"]

# (metric name without _total, GroupStats field, help): one counter per field, per group.
GROUP_COUNTERS = [
    ("fabric_transfers_submitted", "transfers_submitted",
     "One-sided transfers (single, paged, scatter, barrier, imm-only) accepted by the engine."),
    ("fabric_transfers_completed", "transfers_completed", "Accepted transfers that completed."),
    ("fabric_transfers_failed", "transfers_failed", "Accepted transfers that failed."),
    ("fabric_bytes_submitted", "bytes_submitted", "Payload bytes of the accepted transfers."),
    ("fabric_messages_sent", "messages_sent", "Messages accepted by send()."),
    ("fabric_messages_completed", "messages_completed", "Sent messages that were delivered."),
    ("fabric_messages_failed", "messages_failed", "Sent messages that failed."),
    ("fabric_messages_received", "messages_received", "Messages received."),
    ("fabric_cuda_ipc_transfers", "cuda_ipc_transfers",
     "Accepted transfers with a destination written over the CUDA IPC path (same-host GPUs)."),
    ("fabric_cuda_ipc_bytes", "cuda_ipc_bytes", "Payload bytes the CUDA IPC path moved."),
    ("fabric_internal_work_requests", "internal_work_requests_posted",
     "Work requests of the engine's own messages (acknowledgments, fence notes, probes)."),
    ("fabric_worker_passes", "worker_passes", "Passes of the group's worker loop."),
    ("fabric_worker_sleeps", "worker_sleeps", "Times the worker blocked with nothing to do."),
    ("fabric_worker_wakeups", "worker_wakeups",
     "Times a submitter woke the sleeping worker (one eventfd write each)."),
]


def _open(ref: "weakref.ref[TransferEngine]") -> Optional[TransferEngine]:
    """The engine behind `ref` while it is open; None once it is closed or collected."""
    engine = ref()
    return engine if engine is not None and not engine.closed else None


class EngineCollector(Collector):
    """A prometheus_client collector reading the stats of the engines added to it. Engines are
    held weakly: one that is closed or garbage-collected drops out of the next scrape, and its
    name is free again at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._engines: dict[str, weakref.ref[TransferEngine]] = {}
        self._next_default = 0

    def add(self, engine: TransferEngine, name: Optional[str] = None) -> str:
        """Exports `engine` with the label engine=`name` (None: "engine<N>", N counting up past
        every name in use); returns the name. ValueError if the name is taken by another engine
        that is still open."""
        with self._lock:
            self._forget_closed()
            if name is None:
                while f"engine{self._next_default}" in self._engines:
                    self._next_default += 1
                name = f"engine{self._next_default}"
                self._next_default += 1
            old = self._engines.get(name)
            if old is not None and old() is not engine:
                raise ValueError(f"fabric_lib.metrics: engine name {name!r} is already exported")
            self._engines[name] = weakref.ref(engine)
            return name

    def _forget_closed(self) -> None:
        """Drops the engines closed or collected, and with them their names. Holding _lock."""
        for n in [n for n, ref in self._engines.items() if _open(ref) is None]:
            del self._engines[n]

    def remove(self, engine: TransferEngine) -> bool:
        """Stops exporting `engine`; whether it was exported."""
        with self._lock:
            names = [n for n, ref in self._engines.items() if ref() is engine]
            for n in names:
                del self._engines[n]
            return bool(names)

    def names(self) -> list[str]:
        """The names of the engines exported (those still open)."""
        with self._lock:
            self._forget_closed()
            return list(self._engines)

    def collect(self) -> Iterator[Any]:
        counters = {
            field: CounterMetricFamily(name, doc, labels=["engine", "group"])
            for name, field, doc in GROUP_COUNTERS
        }
        imms = CounterMetricFamily(
            "fabric_immediates_received", "Immediates counted by the engine (one per arrival).",
            labels=["engine"])
        nic_up = GaugeMetricFamily(
            "fabric_nic_up", "1 while the NIC is up, 0 while it is marked down (failover).",
            labels=["engine", "group", "nic"])
        mirrors = GaugeMetricFamily(
            "fabric_host_mirror_bytes",
            "Pinned host memory held by the staging mirrors of registered GPU memory.",
            labels=["engine", "group"])
        with self._lock:
            self._forget_closed()
            live = [(n, ref()) for n, ref in self._engines.items()]
        for name, engine in live:
            if engine is None or engine.closed:
                continue
            try:
                stats = engine.stats()
                infos = [(engine.group_info(g).nics, engine.nics_up(g))
                         for g in range(len(stats.groups))]
            except Closed:  # closed since the look above
                continue
            for g, gs in enumerate(stats.groups):
                for _, field, _ in GROUP_COUNTERS:
                    counters[field].add_metric([name, str(g)], getattr(gs, field))
                mirrors.add_metric([name, str(g)], float(gs.host_mirror_bytes))
                nics, nics_up = infos[g]
                for nic, up in zip(nics, nics_up):
                    nic_up.add_metric([name, str(g), nic], 1.0 if up else 0.0)
            imms.add_metric([name], stats.immediates_received)
        yield from counters.values()
        yield imms
        yield nic_up
        yield mirrors


# By registry, held weakly: keyed by id() instead, a registry created after another was collected
# could reuse its id and be handed the dead registry's collector, never registered with it (a
# scrape of the new one then showed nothing).
_collectors: "weakref.WeakKeyDictionary[CollectorRegistry, EngineCollector]" = (
    weakref.WeakKeyDictionary())
_collectors_lock = threading.Lock()


def register(
    engine: TransferEngine,
    name: Optional[str] = None,
    registry: Optional[CollectorRegistry] = None,
) -> EngineCollector:
    """Exports `engine`'s stats to `registry` (prometheus_client's REGISTRY by default) under
    the label engine=`name` (default: "engine<N>", N counting up past every name in use). The name is the
    engine's until it is closed, collected or unregistered: another open engine under it is
    a ValueError. The registry's collector is created and registered on the first call;
    returns it."""
    registry = REGISTRY if registry is None else registry
    with _collectors_lock:
        collector = _collectors.get(registry)
        if collector is None:
            collector = EngineCollector()
            registry.register(collector)
            _collectors[registry] = collector
    collector.add(engine, name)
    return collector


def unregister(engine: TransferEngine, registry: Optional[CollectorRegistry] = None) -> bool:
    """Stops exporting `engine` to `registry`; whether it was exported there."""
    registry = REGISTRY if registry is None else registry
    with _collectors_lock:
        collector = _collectors.get(registry)
    return collector is not None and collector.remove(engine)
