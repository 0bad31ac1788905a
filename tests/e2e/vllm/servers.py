"""Starting, watching and stopping `vllm serve` processes and the proxy for the e2e run.

Each server runs in its own process group (vLLM forks an engine core and workers), so stopping
it stops all of them; every wait is bounded, and a server that exits while being waited for is
reported with the end of its log instead of being waited on until a timeout.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 2.0) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read().decode()
    except (urllib.error.URLError, OSError, ValueError):
        return None


class ServerFailed(RuntimeError):
    pass


def role_cpus(role: str) -> list[int] | None:
    """The CPUs a prefill or a decode server runs on: each its own half of this machine's.

    Two vLLM servers on one small machine starve each other otherwise. A vLLM engine that
    holds blocks for a pull (the prefill, until the decode has read them or the lease runs
    out) steps with no work every millisecond, and its engine and worker processes spin on
    their shared-memory queue for a second after each message: on 2 cores the prefill then
    takes both, the decode's forward passes crawl, its reads come after the lease, and it
    reads blocks the prefill has already given back. On separate cores, as on separate
    hosts, each server keeps its own. None (no pinning) on a machine with one CPU.
    """
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2 or role not in ("prefill", "decode"):
        return None
    half = len(cpus) // 2
    return cpus[:half] if role == "prefill" else cpus[half:]


@dataclass
class Process:
    """One server: a command, its environment and log; started in a process group of its own."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    ready_url: str
    cpus: list[int] | None = None
    proc: subprocess.Popen | None = field(default=None, repr=False)

    def start(self) -> "Process":
        self.log.parent.mkdir(parents=True, exist_ok=True)
        argv = self.argv
        if self.cpus:
            argv = ["taskset", "-c", ",".join(map(str, self.cpus)), *argv]
        out = open(self.log, "ab")
        out.write(f"\n== {time.strftime('%H:%M:%S')} start: {' '.join(argv)}\n".encode())
        out.flush()
        self.proc = subprocess.Popen(
            argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
        out.close()
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds until ready_url answers; ServerFailed if the process exits or time runs out."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if not self.alive():
                raise ServerFailed(
                    f"{self.name} exited with {self.proc.returncode if self.proc else '?'} "
                    f"before it was ready; the end of {self.log}:\n{self.tail()}"
                )
            if http_get(self.ready_url, timeout=1.0) is not None:
                return time.monotonic() - t0
            time.sleep(0.5)
        raise ServerFailed(f"{self.name} not ready after {timeout_s:.0f} s; the end of "
                           f"{self.log}:\n{self.tail()}")

    def kill(self) -> None:
        """SIGKILL to the whole group at once: a crash, not a shutdown."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)

    def stop(self, grace_s: float = 20.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        # Whatever of the group is left (workers that outlive their parent) goes too.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def metrics(url: str) -> dict[str, float]:
    """A Prometheus text page as {'name{labels}': value}; {} if it cannot be read."""
    text = http_get(url, timeout=5.0) or ""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^(\S+?)(\{[^}]*\})?\s+(\S+)$", line)
        if m:
            try:
                out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
            except ValueError:
                pass
    return out


def metrics_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """after - before for every series of `after` (counters and histograms grow; a gauge's
    difference means nothing, so read gauges from a plain snapshot)."""
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def metric_sum(values: dict[str, float], name: str) -> float:
    """The sum of a metric over its label sets."""
    return sum(v for k, v in values.items() if k == name or k.startswith(name + "{"))


def histogram_quantile(values: dict[str, float], name: str, q: float) -> float | None:
    """The q-quantile of a Prometheus histogram, interpolated in its bucket (as PromQL does)."""
    buckets: list[tuple[float, float]] = []
    for k, v in values.items():
        m = re.match(re.escape(name) + r'_bucket\{.*le="([^"]+)".*\}$', k)
        if m:
            buckets.append((float("inf") if m.group(1) == "+Inf" else float(m.group(1)), v))
    buckets.sort()
    if not buckets or buckets[-1][1] == 0:
        return None
    rank = q * buckets[-1][1]
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if le == float("inf"):
                return prev_le
            if count == prev_count:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return None


def dump(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
