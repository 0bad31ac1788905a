"""vLLM disaggregated prefill/decode over NIXL, end to end, on this machine's CPUs.

    python run_e2e.py --model DIR [--out build/e2e/vllm.json] [--runs single,FABRIC,UCX]
                      [--faults FABRIC]

Runs with the interpreter of the virtual environment vLLM and NIXL are installed in
(`make e2e-vllm` makes it). In order:

1. `single`: one `vllm serve` without a connector. Its greedy completions of every prompt
   (sent concurrently, then once more one at a time, which must agree) are the reference.
2. One disaggregated run per NIXL backend named in --runs (FABRIC, UCX): a prefill and a
   decode `vllm serve` with NixlConnector and `kv_connector_extra_config.backends: [name]`, and
   the proxy (proxy.py) in front. The same prompts, concurrently. Asserted: every completion
   identical token for token to the reference; the KV bytes the decode pulled (vLLM's NIXL
   telemetry and, for FABRIC, the plugin's own counters) equal to the blocks the prompts
   needed; no other NIXL backend created; the prefill's KV usage back to its idle level once
   the decode has the blocks.
3. The fault cases for the backends named in --faults (faults.py).

Writes one JSON (--out) with an entry per run and prints, last, one line
`vllm e2e: ...`. Exit status 0 when every run that could start passed; a run that could not
start (no FABRIC plugin in the environment's NIXL, say) is an entry `"skipped": reason`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prompts import make_prompts  # noqa: E402
from servers import (  # noqa: E402
    Process,
    ServerFailed,
    dump,
    free_port,
    histogram_quantile,
    metric_sum,
    metrics,
    metrics_delta,
    role_cpus,
)

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
MODEL_NAME = "tiny"


@dataclass
class Settings:
    python: str
    model: Path
    logs: Path
    prompts: list[list[int]]
    max_tokens: int
    block: int
    chunk: int
    max_len: int
    concurrency: int
    ready_timeout: float
    fabric_provider: str
    kv_lease_s: int
    layers: int = 0
    kv_bytes_per_token_layer: int = 0
    warmup: bool = True
    env: dict[str, str] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# Servers


def base_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        # A small KV cache per server (GiB): several servers share this machine's memory.
        VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        # Pinning OpenMP threads to cores fits one server per machine, not three on two cores.
        VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
        PYTHONUNBUFFERED="1",
    )
    return env


def vllm_argv(s: Settings, port: int, kv_config: dict | None) -> list[str]:
    # `vllm serve` reads its version from a distribution named vllm; the CPU build's is
    # vllm-cpu, so the server module is started directly (the same server and arguments).
    argv = [
        s.python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(s.model), "--served-model-name", MODEL_NAME,
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--enforce-eager",
        "--max-model-len", str(s.max_len), "--block-size", str(s.block),
        "--max-num-batched-tokens", str(s.chunk), "--enable-chunked-prefill",
        # Prefix caching would let a server reuse blocks across prompts: the KV accounting
        # below counts every block of every prompt once.
        "--no-enable-prefix-caching",
        "--seed", "0",
    ]
    if kv_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_config)]
    return argv


def start_vllm(s: Settings, name: str, kv_config: dict | None, extra_env: dict[str, str],
               role: str = "single") -> tuple[Process, int]:
    port = free_port()
    env = base_env()
    env.update(extra_env)
    p = Process(name, vllm_argv(s, port, kv_config), env, s.logs / f"{name}.log",
                f"http://127.0.0.1:{port}/v1/models", cpus=role_cpus(role)).start()
    return p, port


def start_proxy(s: Settings, name: str, prefill_port: int, decode_port: int
                ) -> tuple[Process, int]:
    port = free_port()
    p = Process(name, [s.python, str(HERE / "proxy.py"), "--port", str(port),
                       "--prefill", f"http://127.0.0.1:{prefill_port}",
                       "--decode", f"http://127.0.0.1:{decode_port}"],
                base_env(), s.logs / f"{name}.log", f"http://127.0.0.1:{port}/health").start()
    return p, port


def nixl_kv_config(s: Settings, backend: str, role: str) -> dict:
    return {
        "kv_connector": "NixlConnector",
        "kv_role": role,
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {"backends": [backend], "kv_lease_duration": s.kv_lease_s},
    }


# ---------------------------------------------------------------------------------------------
# Client


@dataclass
class Answer:
    tokens: list[int] | None
    ttft_s: float | None
    total_s: float
    error: str | None = None


async def complete(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int
                   ) -> Answer:
    body = {
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True, "stream": True,
    }
    t0 = time.monotonic()
    tokens: list[int] = []
    ttft = None
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                return Answer(None, None, time.monotonic() - t0,
                              f"HTTP {r.status}: {(await r.text())[:300]}")
            buf = b""
            done = False
            async for chunk in r.content.iter_any():
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    for line in event.decode().splitlines():
                        if line == "data: [DONE]":
                            done = True
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        data = json.loads(line[6:])
                        if "error" in data:
                            return Answer(None, ttft, time.monotonic() - t0, str(data["error"]))
                        for choice in data.get("choices", []):
                            ids = choice.get("token_ids") or []
                            if ids and ttft is None:
                                ttft = time.monotonic() - t0
                            tokens.extend(ids)
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return Answer(None, ttft, time.monotonic() - t0, f"{type(e).__name__}: {e}")
    if not done:
        return Answer(None, ttft, time.monotonic() - t0,
                      f"the stream ended after {len(tokens)} tokens without [DONE]")
    return Answer(tokens, ttft, time.monotonic() - t0)


async def complete_all(url: str, prompts: list[list[int]], max_tokens: int, concurrency: int,
                       timeout_s: float = 300.0) -> tuple[list[Answer], float]:
    sem = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def one(p: list[int]) -> Answer:
            async with sem:
                return await complete(session, url, p, max_tokens)

        t0 = time.monotonic()
        answers = await asyncio.gather(*(one(p) for p in prompts))
        return list(answers), time.monotonic() - t0


def run_requests(url: str, prompts: list[list[int]], max_tokens: int, concurrency: int
                 ) -> tuple[list[Answer], float]:
    return asyncio.run(complete_all(url, prompts, max_tokens, concurrency))


def percentile_ms(values: list[float], q: float) -> float | None:
    """q-th percentile (nearest rank) in milliseconds; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return round(1000.0 * ordered[rank - 1], 3)


# ---------------------------------------------------------------------------------------------
# Runs


def model_shape(model: Path) -> tuple[int, int]:
    """(layers, KV bytes per token per layer) of the model folder, float32 K and V."""
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"], 2 * cfg["num_key_value_heads"] * head_dim * 4


def expected_kv_bytes(s: Settings) -> int:
    """What the decode must pull: every block holding a prompt token, in every layer. vLLM's
    NIXL connector reads whole blocks, the last one partly filled included."""
    blocks = sum(math.ceil(len(p) / s.block) for p in s.prompts)
    return blocks * s.block * s.layers * s.kv_bytes_per_token_layer


def run_single(s: Settings) -> dict:
    server, port = start_vllm(s, "single", None, {})
    try:
        ready = server.wait_ready(s.ready_timeout)
        url = f"http://127.0.0.1:{port}"
        answers, wall = run_requests(url, s.prompts, s.max_tokens, s.concurrency)
        failed = [i for i, a in enumerate(answers) if a.tokens is None]
        if failed:
            raise AssertionError(f"single instance: {len(failed)} requests failed, first: "
                                 f"{answers[failed[0]].error}")
        again, _ = run_requests(url, s.prompts, s.max_tokens, 1)
        differ = [i for i, (a, b) in enumerate(zip(answers, again)) if a.tokens != b.tokens]
        if differ:
            raise AssertionError(
                f"the single instance disagrees with itself on {len(differ)} prompts "
                f"(concurrent against one at a time, first prompt {differ[0]}): greedy decoding "
                "of this model is not deterministic here, so no comparison can hold")
        return {
            "connector": None, "backend": None, "requests": len(answers),
            "ready_s": round(ready, 1), "reference": [a.tokens for a in answers],
            **timings(answers, wall),
        }
    finally:
        server.stop()


def timings(answers: list[Answer], wall: float) -> dict:
    ttfts = [a.ttft_s for a in answers if a.ttft_s is not None]
    out_tokens = sum(len(a.tokens or []) for a in answers)
    return {
        "ttft_ms_p50": percentile_ms(ttfts, 50),
        "ttft_ms_p90": percentile_ms(ttfts, 90),
        "output_tokens_per_s": round(out_tokens / wall, 1) if wall > 0 else None,
        "wall_s": round(wall, 2),
    }


def backend_env(s: Settings, backend: str, metrics_port: int | None) -> dict[str, str]:
    env = {}
    if backend == "FABRIC":
        env.update(FABRIC_PROVIDER=s.fabric_provider)
        if s.fabric_provider == "tcp":
            env.update(FABRIC_NICS="lo")
        if metrics_port is not None:
            env["FABRIC_NIXL_METRICS_PORT"] = str(metrics_port)
    return env


def instantiated_backends(log_text: str) -> set[str]:
    """The NIXL backends an agent of this server created, from NIXL's log line for each."""
    found = set()
    for line in log_text.splitlines():
        if "Backend " in line and " was instantiated" in line:
            found.add(line.split("Backend ", 1)[1].split(" ", 1)[0])
    return found


def wait_kv_idle(url: str, idle: float, timeout_s: float) -> tuple[bool, float, float]:
    """Waits until the server's KV usage is back at `idle`; (reached, usage, seconds)."""
    t0 = time.monotonic()
    usage = float("nan")
    while time.monotonic() - t0 < timeout_s:
        usage = metric_sum(metrics(url + "/metrics"), "vllm:kv_cache_usage_perc")
        if usage <= idle + 1e-9:
            return True, usage, time.monotonic() - t0
        time.sleep(0.5)
    return False, usage, time.monotonic() - t0


def run_disaggregated(s: Settings, backend: str, reference: list[list[int]]) -> dict:
    entry: dict = {"connector": "NixlConnector", "backend": backend}
    name = backend.lower()
    fabric_ports = {"prefill": free_port(), "decode": free_port()} if backend == "FABRIC" else {}
    procs: list[Process] = []
    try:
        prefill, p_port = start_vllm(
            s, f"{name}-prefill", nixl_kv_config(s, backend, "kv_producer"),
            {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
             **backend_env(s, backend, fabric_ports.get("prefill"))}, role="prefill")
        procs.append(prefill)
        decode, d_port = start_vllm(
            s, f"{name}-decode", nixl_kv_config(s, backend, "kv_consumer"),
            {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
             **backend_env(s, backend, fabric_ports.get("decode"))}, role="decode")
        procs.append(decode)
        proxy, x_port = start_proxy(s, f"{name}-proxy", p_port, d_port)
        procs.append(proxy)
        entry["ready_s"] = round(max(prefill.wait_ready(s.ready_timeout),
                                     decode.wait_ready(s.ready_timeout)), 1)
        proxy.wait_ready(30)
        p_url, d_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
        idle = metric_sum(metrics(p_url + "/metrics"), "vllm:kv_cache_usage_perc")
        p_before = metrics(p_url + "/metrics")
        # One request first, alone: the decode's first pull from a prefill makes the NIXL
        # handshake (metadata over vLLM's side channel, with a 5 s receive timeout), which a
        # loaded 2-core machine can miss while 8 requests' prefills run. The batch below is what
        # is measured and counted; the warm-up's KV is left out of the counts by difference.
        if s.warmup:
            warm, _ = run_requests(f"http://127.0.0.1:{x_port}", s.prompts[:1], s.max_tokens, 1)
            entry["warmup"] = "identical" if warm[0].tokens == reference[0] else (
                warm[0].error or "differs")
        d_before = metrics(d_url + "/metrics")
        f_before = (metrics(f"http://127.0.0.1:{fabric_ports['decode']}/metrics")
                    if backend == "FABRIC" else {})

        answers, wall = run_requests(f"http://127.0.0.1:{x_port}", s.prompts, s.max_tokens,
                                     s.concurrency)
        errors = [a.error for a in answers if a.tokens is None]
        identical = sum(1 for a, ref in zip(answers, reference) if a.tokens == ref)
        entry.update(requests=len(answers), identical=identical, failed=len(errors),
                     **timings(answers, wall))
        problems = []
        if errors:
            problems.append(f"{len(errors)} requests failed, first: {errors[0]}")
        if identical != len(answers):
            first = next(i for i, (a, r) in enumerate(zip(answers, reference)) if a.tokens != r)
            problems.append(
                f"{len(answers) - identical} completions differ from the single instance's, "
                f"first prompt {first} ({len(s.prompts[first])} tokens): "
                f"{answers[first].tokens} != {reference[first]}")

        d_metrics = metrics_delta(d_before, metrics(d_url + "/metrics"))
        expected = expected_kv_bytes(s)
        vllm_bytes = int(metric_sum(d_metrics, "vllm:nixl_bytes_transferred_sum"))
        entry.update(kv_bytes_expected=expected, kv_bytes=vllm_bytes,
                     transfers=int(metric_sum(d_metrics, "vllm:nixl_xfer_time_seconds_count")),
                     failed_transfers=int(metric_sum(d_metrics,
                                                     "vllm:nixl_num_failed_transfers_total")))
        p50 = histogram_quantile(d_metrics, "vllm:nixl_xfer_time_seconds", 0.5)
        count = metric_sum(d_metrics, "vllm:nixl_xfer_time_seconds_count")
        entry["transfer_ms_p50"] = round(1000 * p50, 3) if p50 is not None else None
        entry["transfer_ms_mean"] = (
            round(1000 * metric_sum(d_metrics, "vllm:nixl_xfer_time_seconds_sum") / count, 3)
            if count else None)
        if vllm_bytes != expected:
            problems.append(f"the decode pulled {vllm_bytes} bytes by vLLM's NIXL telemetry; "
                            f"the prompts' blocks hold {expected}")
        if backend == "FABRIC":
            fabric = metrics_delta(
                f_before, metrics(f"http://127.0.0.1:{fabric_ports['decode']}/metrics"))
            got = int(metric_sum(fabric, "fabric_bytes_submitted_total"))
            entry["fabric_bytes"] = got
            if got != expected:
                problems.append(f"the decode's FABRIC engine counted {got} bytes "
                                f"(fabric_bytes_submitted_total); the prompts' blocks hold "
                                f"{expected}")
        for proc in (prefill, decode):
            made = instantiated_backends(proc.log.read_text(errors="replace"))
            entry.setdefault("backends_created", {})[proc.name] = sorted(made)
            if made != {backend}:
                problems.append(f"{proc.name} created NIXL backends {sorted(made)}, not just "
                                f"{backend}")
        freed, usage, waited = wait_kv_idle(p_url, idle, timeout_s=2.0 * s.kv_lease_s)
        # Blocks the prefill gave back because its lease ran out, not because the decode said it
        # had read them (vLLM counts them on the prefill): a decode that reads after that reads
        # blocks that may hold another prompt's KV. With each server on its own cores every
        # read here takes milliseconds against a lease of seconds, so any is a failure.
        expired = int(metric_sum(metrics_delta(p_before, metrics(p_url + "/metrics")),
                                 "vllm:nixl_num_kv_expired_reqs_total"))
        entry["prefill_kv_expired"] = expired
        if expired:
            problems.append(f"the prefill released {expired} requests' blocks because their "
                            f"{s.kv_lease_s} s lease ran out before the decode read them")
        entry.update(prefill_kv_idle=idle, prefill_kv_after=usage,
                     prefill_kv_freed_s=round(waited, 1))
        if not freed:
            problems.append(f"the prefill's KV usage is {usage:.4f} {waited:.0f} s after the "
                            f"run, idle was {idle:.4f}: blocks held after the decode had them")
        if problems:
            entry["problems"] = problems
        return entry
    finally:
        for p in reversed(procs):
            p.stop()


def available_backends(python: str) -> tuple[list[str], str]:
    """NIXL's plugin list as the environment's agent sees it, and a message if it fails."""
    code = ("from nixl._api import nixl_agent, nixl_agent_config\n"
            "plugins = nixl_agent('probe', nixl_agent_config(backends=[])).get_plugin_list()\n"
            "print('plugins:', ' '.join(plugins))\n")
    r = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120,
                       env=base_env())
    if r.returncode != 0:
        return [], f"NIXL does not import in {python}: {r.stderr.strip()[-500:]}"
    for line in r.stdout.splitlines():
        if line.startswith("plugins:"):
            return line.split()[1:], ""
    return [], f"NIXL's agent in {python} listed no plugins: {r.stdout.strip()[-300:]}"


def git_commit() -> str:
    r = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                       capture_output=True, text=True)
    return r.stdout.strip() or "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=REPO / "build/e2e/vllm.json")
    ap.add_argument("--logs", type=Path, default=None, help="server logs (default: beside --out)")
    ap.add_argument("--runs", default="single,FABRIC,UCX")
    ap.add_argument("--faults", default="FABRIC", help="backends to run the fault cases on")
    ap.add_argument("--fault-cases", default="decode-dies,prefill-dies,plugin-missing")
    ap.add_argument("--fabric-skip-reason", default="",
                    help="why the FABRIC plugin was not built, when it was not")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=32,
                    help="KV block size in tokens (the CPU attention backend takes multiples of 32)")
    ap.add_argument("--chunk", type=int, default=256, help="the servers' max-num-batched-tokens")
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("--fabric-provider", default="tcp")
    ap.add_argument("--no-warmup", action="store_true",
                    help="no lone request before each measured batch")
    ap.add_argument("--kv-lease", type=int, default=12,
                    help="kv_lease_duration (s): how long a prefill keeps blocks nobody fetched")
    args = ap.parse_args()

    layers, per_token = model_shape(args.model)
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    s = Settings(
        python=sys.executable, model=args.model,
        logs=args.logs or args.out.parent / "logs",
        prompts=make_prompts(args.prompts, vocab, args.block_size, args.chunk,
                             args.max_len - args.max_tokens + 48),
        max_tokens=args.max_tokens, block=args.block_size, chunk=args.chunk,
        max_len=args.max_len, concurrency=args.concurrency, ready_timeout=args.ready_timeout,
        fabric_provider=args.fabric_provider, kv_lease_s=args.kv_lease,
        layers=layers, kv_bytes_per_token_layer=per_token, warmup=not args.no_warmup,
    )
    # The servers' IPC sockets and temporary files: a server killed by a fault case leaves its
    # sockets behind, so they go into one folder of the run, removed at its end.
    run_tmp = tempfile.mkdtemp(prefix="vllm-e2e-")
    os.environ.update(TMPDIR=run_tmp, VLLM_RPC_BASE_PATH=run_tmp)
    try:
        return run(args, s)
    finally:
        shutil.rmtree(run_tmp, ignore_errors=True)


def run(args: argparse.Namespace, s: Settings) -> int:
    runs = [r for r in args.runs.split(",") if r]
    result: dict = {
        "commit": git_commit(), "date": time.strftime("%Y-%m-%d"), "host": platform.node(),
        "cpus": os.cpu_count(), "model": str(args.model), "prompts": len(s.prompts),
        "prompt_tokens": [len(p) for p in s.prompts], "max_tokens": s.max_tokens,
        "block_size": s.block, "chunk": s.chunk, "runs": [], "faults": [],
    }
    failed = False
    plugins, nixl_error = available_backends(s.python)
    result["nixl_plugins"] = plugins

    def skip_reason(backend: str) -> str:
        if nixl_error:
            return nixl_error
        if backend in plugins:
            return ""
        if backend == "FABRIC":
            return (args.fabric_skip_reason or "NIXL's plugin list has no FABRIC: build and "
                    "install the plugin (tools/nixl/build_wheel_plugin.sh) or set "
                    "NIXL_PLUGIN_DIR to the folder holding libplugin_FABRIC.so")
        return f"NIXL's plugin list has no {backend} ({' '.join(plugins)})"

    print(f"vllm e2e: {len(s.prompts)} prompts of {min(map(len, s.prompts))}-"
          f"{max(map(len, s.prompts))} tokens, block {s.block}, chunk {s.chunk}; NIXL plugins: "
          f"{' '.join(plugins) or nixl_error}", flush=True)
    reference = None
    try:
        t0 = time.monotonic()
        single = run_single(s)
        reference = single.pop("reference")
        result["single"] = single
        print(f"  single instance: {single['requests']} completions, ready in "
              f"{single['ready_s']} s, TTFT p50 {single['ttft_ms_p50']} ms "
              f"({time.monotonic() - t0:.0f} s)", flush=True)
    except (ServerFailed, AssertionError) as e:
        result["single"] = {"error": str(e)}
        print(f"  single instance FAILED: {e}", flush=True)
        failed = True

    for backend in (r for r in runs if r != "single"):
        reason = skip_reason(backend)
        if reason:
            result["runs"].append({"connector": "NixlConnector", "backend": backend,
                                   "skipped": reason})
            print(f"  NixlConnector+{backend}: SKIPPED: {reason}", flush=True)
            continue
        if reference is None:
            result["runs"].append({"connector": "NixlConnector", "backend": backend,
                                   "skipped": "no reference: the single instance failed"})
            continue
        t0 = time.monotonic()
        try:
            entry = run_disaggregated(s, backend, reference)
        except ServerFailed as e:
            entry = {"connector": "NixlConnector", "backend": backend, "problems": [str(e)]}
        result["runs"].append(entry)
        verdict = "FAILED" if entry.get("problems") else "passed"
        failed |= bool(entry.get("problems"))
        print(f"  NixlConnector+{backend}: {verdict}: {entry.get('identical', 0)}/"
              f"{entry.get('requests', 0)} identical, KV {entry.get('kv_bytes')} bytes "
              f"(expected {entry.get('kv_bytes_expected')}), TTFT p50 {entry.get('ttft_ms_p50')}"
              f" ms, transfer p50 {entry.get('transfer_ms_p50')} ms, "
              f"{entry.get('prefill_kv_expired')} prefills released by lease expiry "
              f"({time.monotonic() - t0:.0f} s)", flush=True)
        for problem in entry.get("problems", []):
            print(f"    {problem}", flush=True)

    fault_backends = [b for b in args.faults.split(",") if b]
    if fault_backends and reference is not None:
        from faults import run_faults

        for backend in fault_backends:
            reason = skip_reason(backend)
            if reason:
                result["faults"].append({"backend": backend, "skipped": reason})
                print(f"  faults over {backend}: SKIPPED: {reason}", flush=True)
                continue
            for case in run_faults(s, backend, reference, args.fault_cases.split(",")):
                result["faults"].append(case)
                failed |= bool(case.get("problems"))
                verdict = "FAILED" if case.get("problems") else "passed"
                print(f"  fault {case['case']} over {backend}: {verdict}: {case.get('summary')}",
                      flush=True)
                for problem in case.get("problems", []):
                    print(f"    {problem}", flush=True)

    dump(args.out, result)
    ran = [r for r in result["runs"] if "skipped" not in r]
    skipped = [r for r in result["runs"] if "skipped" in r]
    parts = [f"{r.get('identical', 0)}/{r.get('requests', 0)} identical over {r['backend']}"
             for r in ran]
    parts += [f"{r['backend']} skipped ({r['skipped'][:120]})" for r in skipped]
    print(f"vllm e2e: {'; '.join(parts) or 'no disaggregated run'}; "
          f"{'FAILED' if failed else 'passed'} ({args.out})")
    return 1 if failed else 0


if __name__ == "__main__":
    # faults.py imports this module by name: let it find this one, not a second copy.
    sys.modules.setdefault("run_e2e", sys.modules["__main__"])
    raise SystemExit(main())
