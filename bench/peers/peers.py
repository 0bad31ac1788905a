"""fabric-lib beside its peer transfer engines: the same work, in one run, between two processes
of this machine, one system after another, over TCP loopback (127.0.0.1) and over each system's
same-host path. `make bench-peers` runs it through bench/peers/run.sh.

Systems (one row each; one that cannot run is a row with its reason):
  fabric-bench       fabric-lib's engine (build/bin/fabric-bench), worker and progress modes;
                     tcp provider on NIC lo, and the engine's own shm transport
  raw libfabric      fabric-bench's baseline (fabric-bench-raw), run with its first mode: the
                     libfabric tcp and shm providers; it checks no bytes, so it stays out of the
                     ratios
  nixlbench FABRIC   NIXL's own benchmark over the FABRIC plugin, where a NIXL built from source
                     provides nixlbench (the wheel ships none): its own timing, bytes checked
                     (--check_consistency)
  NIXL FABRIC        fabric-lib through NIXL's Python API (the PyPI wheel), tcp and shm
  NIXL UCX           the wheel's own UCX backend, the same harness: UCX_TLS=tcp, and UCX's own
                     choice of transports (shared memory between two processes) as same-host
  Mooncake TE        Mooncake's Transfer Engine (PyPI wheel), protocol tcp, P2PHANDSHAKE; it has
                     no same-host transport for host memory (that row says so)
  Mooncake TE bench  the wheel's transfer_engine_bench at its own defaults (its own numbers)

Work: WRITE and READ of single transfers of 4 KiB, 64 KiB, 1 MiB, 32 MiB, one in flight;
batches of 128 x 64 KiB and 4096 x 4 KiB as one request; a notice round trip (an 8-byte WRITE
with a notice to the target, answered the same way; fabric-bench: an immediate each way). The
Python systems run bench/peers/peer.py twice (an initiator, a target); every pass writes a fresh
pattern at the source and compares its sha256 with the bytes where they landed. fabric-bench
verifies its own passes (its "verified" key). Throughput: bytes over the sum of the
per-transfer latencies (post to completion, one in flight); fabric-bench's: bytes over its
pass's time, window 1. CPU: user + system seconds of both processes over the transfers, per
10^9 bytes moved.

Output: peers.json, peers.md and peers.png in the output folder (default build/bench-peers).
"""

import argparse
import datetime
import json
import math
import os
import platform
import re
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PEER = HERE / "peer.py"
KIB = 1024
MIB = 1024 * KIB
SIZES = [4 * KIB, 64 * KIB, MIB, 32 * MIB]
BATCHES = [(128, 64 * KIB), (4096, 4 * KIB)]
NOTICE = "notice round trip"
NOTICE_BYTES = 8
ANSWER_TIMEOUT_S = 120.0
TRANSPORTS = {"tcp": "TCP loopback (127.0.0.1)",
              "same-host": "same host: each system's shared-memory path"}
SYSTEMS = ("fabric-bench", "nixlbench", "nixl-fabric", "nixl-ucx", "mooncake", "te-bench", "uccl")
GB = 1e9
GIB = float(1 << 30)


def human(n):
    return f"{n // MIB} MiB" if n >= MIB else f"{n // KIB} KiB"


def batch_key(op, count, size):
    return f"{op} batch {count} x {human(size)}"


# --rows: the transfer rows asked for (None: all of them).
SELECTED_ROWS = None


def rows():
    """(key, op, size, count): the transfer rows every system is asked for, in table order."""
    out = []
    for op in ("write", "read"):
        for size in SIZES:
            out.append((f"{op} {human(size)}", op, size, 1))
        for count, size in BATCHES:
            out.append((batch_key(op, count, size), op, size, count))
    return [r for r in out if SELECTED_ROWS is None or r[0] in SELECTED_ROWS]


def plan(size, count, scale):
    """Timed transfers per pass and untimed ones first: about the same bytes per row."""
    total = size * count
    iters = max(5, min(2000, int(64 * MIB * scale // total)))
    return iters, max(1, iters // 10)


def percentile(values, p):
    """Nearest rank, p in [0, 100]; None for no values."""
    if not values:
        return None
    v = sorted(values)
    return v[max(1, math.ceil(p / 100 * len(v))) - 1]


class Peer:
    """A bench/peers/peer.py process: one JSON command in, one JSON answer out."""

    def __init__(self, name, env, log):
        self.name = name
        self.log = log
        self.proc = subprocess.Popen([sys.executable, str(PEER)], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=open(log, "w"), text=True)

    def call(self, cmd, **args):
        self.send(cmd, **args)
        return self.answer(cmd)

    def send(self, cmd, **args):
        """A command whose answer is read later (answer()), while the other peer works."""
        self.proc.stdin.write(json.dumps({"cmd": cmd, **args}) + "\n")
        self.proc.stdin.flush()

    def answer(self, cmd):
        ready, _, _ = select.select([self.proc.stdout], [], [], ANSWER_TIMEOUT_S)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            tail = Path(self.log).read_text(errors="replace")[-1500:]
            raise RuntimeError(f"{self.name}: no answer to {cmd} (log {self.log}): {tail}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"{self.name} {cmd}: {answer['error']}")
        return answer

    def close(self):
        try:
            if self.proc.poll() is None:
                self.call("quit")
        except Exception:  # noqa: BLE001 - it is killed below anyway
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def summarize(lat_us, nbytes, passes, verified, errors, cpu_s=None, moved=0):
    """One row: throughput from the sum of the latencies (one transfer in flight), p50, p99,
    and CPU seconds of both sides per 10^9 bytes moved."""
    if not lat_us:
        return {"ok": False, "error": "; ".join(errors) or "no transfers"}
    total_s = sum(lat_us) / 1e6
    out = {
        "ok": verified == passes and not errors,
        "p50_us": percentile(lat_us, 50),
        "p99_us": percentile(lat_us, 99),
        "transfers": len(lat_us),
        "passes": passes,
        "verified_passes": verified,
    }
    if nbytes:
        out["gbytes_s"] = nbytes * len(lat_us) / total_s / GB
        out["ops_s"] = len(lat_us) / total_s
        if cpu_s is not None and moved:
            out["cpu_s_per_gb"] = cpu_s / (moved / GB)
    if errors:
        out["error"] = "; ".join(errors)
    return out


def cpu_of(*peers):
    return sum(p.call("cpu")["cpu_s"] for p in peers)


def checked_passes(args, source, landing, nbytes, seed, timed):
    """args.passes passes of timed() (it returns latencies), each after a fresh pattern at
    the source and followed by the comparison of the bytes where they landed."""
    lat, verified, errors = [], 0, []
    for k in range(args.passes):
        try:
            landing.call("fill", region="dst", nbytes=nbytes, seed=seed + 2 * k + 1)
            want = source.call("fill", region="src", nbytes=nbytes, seed=seed + 2 * k)["sha256"]
            lat += timed()
            if landing.call("digest", region="dst", nbytes=nbytes)["sha256"] == want:
                verified += 1
            else:
                errors.append("bytes at the target differ from the pattern sent")
        except RuntimeError as e:
            errors.append(str(e))
            break
    return lat, verified, errors


def transfer_row(init, target, op, size, count, args, seed):
    """One row's passes: transfers timed, CPU of both sides counted, the landing checked."""
    nbytes = size * count
    iters, warmup = plan(size, count, args.scale)
    # WRITE: the initiator's src lands in the target's dst; READ: the target's src lands in
    # the initiator's dst.
    source, landing = (init, target) if op == "write" else (target, init)
    cost = {"cpu": 0.0, "moved": 0}

    def timed():
        cpu0 = cpu_of(init, target)
        got = init.call("run", op=op.upper(), size=size, count=count, iters=iters,
                        warmup=warmup, max_s=args.row_seconds / args.passes)
        cost["cpu"] += cpu_of(init, target) - cpu0
        cost["moved"] += nbytes * (warmup + len(got["lat_us"]))
        return got["lat_us"]

    lat, verified, errors = checked_passes(args, source, landing, nbytes, seed, timed)
    return summarize(lat, nbytes, args.passes, verified, errors, cost["cpu"], cost["moved"])


def notice_row(init, target, args, seed):
    """The notice round trip: the target answers each notice (pong) while the initiator
    times them (ping); the last WRITE's bytes are checked at the target."""
    bound = args.row_seconds / args.passes

    def timed():
        target.send("pong", max_s=bound + 60)
        got = init.call("ping", size=NOTICE_BYTES, iters=2000, warmup=200, max_s=bound)
        answered = target.answer("pong")["answered"]
        if answered != got["trips"]:
            raise RuntimeError(f"the target answered {answered} notices, the initiator "
                               f"counted {got['trips']}")
        return got["lat_us"]

    lat, verified, errors = checked_passes(args, init, target, NOTICE_BYTES, seed, timed)
    return summarize(lat, 0, args.passes, verified, errors)


def fabric_plugin_missing():
    """Why NIXL's wheel would not find the FABRIC plugin, or None when it would."""
    import importlib.util

    folders = [Path(d) for d in os.environ.get("NIXL_PLUGIN_DIR", "").split(":") if d]
    for name in ("nixl_cu13", "nixl_cu12"):
        spec = importlib.util.find_spec(name)
        if spec and spec.origin and not os.environ.get("NIXL_PLUGIN_DIR"):
            folders.append(Path(spec.origin).parents[1] / f".{name}.mesonpy.libs" / "plugins")
    if any((f / "libplugin_FABRIC.so").exists() for f in folders):
        return None
    return ("no libplugin_FABRIC.so where NIXL's wheel looks ("
            + ", ".join(str(f) for f in folders) + "): it is built for the wheel from NIXL's "
            "headers (tools/nixl/build_wheel_plugin.sh; docs/nixl.md says how to fetch them)")


def python_system(backend, env_extra, out, args, tag, transport):
    """Two peer.py processes with one backend; every row, every pass verified."""
    # numpy (the patterns, the digests) runs single-threaded: OpenBLAS's idle threads would
    # otherwise spin beside every system's engine.
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", **env_extra)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    region = max(max(SIZES), *(c * s for c, s in BATCHES))
    init = Peer(f"{tag}-initiator", env, logs / f"{tag}-initiator.log")
    target = Peer(f"{tag}-target", env, logs / f"{tag}-target.log")
    results = {}
    try:
        ti = init.call("start", backend=backend, name=f"{tag}-initiator", region=region)
        tt = target.call("start", backend=backend, name=f"{tag}-target", region=region)
        init.call("connect", peer=tt)
        target.call("connect", peer=ti)
        seed = 1
        for key, op, size, count in rows():
            seed += 2 * args.passes
            results[key] = transfer_row(init, target, op, size, count, args, seed)
            print(f"  {key}: {fmt_cell(results[key])}", flush=True)
        results[NOTICE] = notice_row(init, target, args, seed + 2 * args.passes)
        print(f"  {NOTICE}: {fmt_cell(results[NOTICE])}", flush=True)
    except RuntimeError as e:
        return {"transport": transport, "error": str(e)[:600], "env": env_extra}
    finally:
        init.close()
        target.close()
    return {"transport": transport, "rows": results, "env": env_extra}


def fabric_key(r):
    """The row of ours a fabric-bench result or baseline entry is, or None."""
    op = {"single": "write", "read": "read", "paged": "write", "paged-read": "read"}.get(r["op"])
    if r["op"] == "imm":
        return NOTICE
    if op is None:
        return None
    if r["op"].startswith("paged"):
        shape = (r.get("pages"), r.get("page_bytes"))
        return batch_key(op, *shape) if shape in BATCHES else None
    return f"{op} {human(r['bytes'])}" if r["bytes"] in SIZES else None


def fabric_cell(r, ours):
    """A fabric-bench JSON entry as a row cell; paged Mops count pages, a row a request."""
    cell = {"p50_us": r.get("p50_us"), "p99_us": r.get("p99_us"),
            "passes": r.get("passes", r.get("runs"))}
    if r["op"] != "imm":
        pages = r.get("pages") if r["op"].startswith("paged") else 1
        cell["gbytes_s"] = r["gbps"] / 8
        cell["ops_s"] = r["mops"] * 1e6 / pages
        if r.get("cpu_s_per_gib") is not None:
            cell["cpu_s_per_gb"] = r["cpu_s_per_gib"] * GB / GIB
    if ours:
        cell["ok"] = bool(r.get("verified"))
        if not cell["ok"]:
            cell["error"] = r.get("error", "not verified")
    else:
        cell["ok"] = "error" not in r
        if "error" in r:
            cell["error"] = r["error"]
    return cell


def fabric_bench(out, args, provider, mode, transport, with_raw):
    """fabric-bench, window 1, and (with_raw) its raw libfabric baseline, which is the same
    whatever the mode; two systems, the second None without it."""
    exe = Path(args.fabric_bench)
    if not exe.exists():
        why = f"{exe} not built (make build)"
        return {"transport": transport, "error": why}, {"transport": transport, "error": why}
    tag = f"fabric-bench-{provider}-{mode}"
    js = out / f"{tag}.json"
    nic = "shm" if provider == "shm" else "lo"
    cmd = [str(exe), "--provider", provider, "--nic", nic,
           "--op", "single,read,paged,paged-read,imm",
           "--sizes", ",".join(f"{s // KIB}KiB" for s in SIZES),
           "--page-sizes", ",".join(sorted({f"{s // KIB}KiB" for _, s in BATCHES})),
           "--pages", ",".join(sorted({str(c) for c, _ in BATCHES})),
           "--window", "1", "--iters", str(args.passes), "--warmup", "1",
           "--pass-mib", str(max(1, int(64 * args.scale))), "--mode", mode,
           "--baseline", "raw" if with_raw else "none", "--json", str(js)]
    print("  " + " ".join(cmd), flush=True)
    failed = None
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=args.fabric_seconds)
        (out / "logs").mkdir(parents=True, exist_ok=True)
        (out / "logs" / f"{tag}.log").write_text(run.stdout + run.stderr)
        if not js.exists():
            failed = f"fabric-bench exited {run.returncode}: {(run.stderr or run.stdout)[-400:]}"
    except subprocess.TimeoutExpired:
        failed = f"fabric-bench ran past {args.fabric_seconds} s"
    if failed:
        return {"transport": transport, "error": failed}, {"transport": transport, "error": failed}
    data = json.loads(js.read_text())
    ours = {k: fabric_cell(r, True) for r in data.get("results", [])
            if (k := fabric_key(r)) and r.get("mops") is not None}
    if not with_raw:
        return {"transport": transport, "rows": ours, "command": " ".join(cmd)}, None
    raw = {k: fabric_cell(b, False) for b in data.get("baselines", [])
           if b.get("name") == "raw" and (k := fabric_key(b))
           and (b.get("mops") is not None or "error" in b)}
    note = (f"fabric-bench-raw (libfabric {provider} provider) checks no bytes and gives no "
            "latency for transfer rows: shown beside the others, out of the ratios")
    return ({"transport": transport, "rows": ours, "command": " ".join(cmd)},
            {"transport": transport, "rows": raw, "note": note, "no_ratio": True,
             "unchecked": True, "command": " ".join(cmd) + " (its raw baseline)"})


def nixlbench(out, args, provider, transport):
    """NIXL's own benchmark over the FABRIC plugin: two processes, ASIO runtime, every row of
    ours (one request of `count` descriptors an iteration), bytes checked."""
    exe = Path(args.nixlbench) if args.nixlbench else None
    env_sh = REPO / ".nixl" / "env.sh"
    if exe is None or not exe.exists() or not env_sh.exists():
        return {"transport": transport, "error": (
            "no nixlbench: NIXL's wheel ships none; tools/nixl/build_nixl.sh builds NIXL and "
            "nixlbench from source (about 25 minutes on 2 cores), then --nixlbench PATH")}
    # nixlbench's libraries (libnixl, Abseil, the plugin folder): env.sh's exports.
    shell = subprocess.run(["bash", "-c", f"source {env_sh} && env -0"], capture_output=True)
    env = dict(kv.split("=", 1) for kv in shell.stdout.decode().split("\0") if "=" in kv)
    env.update(FABRIC_PROVIDER=provider, FABRIC_NICS="shm" if provider == "shm" else "lo")
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    results, port = {}, 21000 + os.getpid() % 1000
    for key, op, size, count in rows():
        iters, warmup = plan(size, count, args.scale)
        port += 1
        argv = [str(exe), "--backend", "FABRIC", "--runtime_type", "ASIO", "--asio_port",
                str(port), "--op_type", op.upper(), "--start_block_size", str(size),
                "--max_block_size", str(size), "--start_batch_size", str(count),
                "--max_batch_size", str(count), "--num_iter", str(iters), "--warmup_iter",
                str(warmup), "--large_blk_iter_ftr", "1", "--check_consistency",
                "--total_buffer_size", str(max(1 << 30, 2 * size * count))]
        tag = f"nixlbench-{provider}-{op}-{size}-{count}"
        with open(logs / f"{tag}-target.log", "w") as tlog:
            tproc = subprocess.Popen(argv, env=env, cwd=out, stdout=tlog,
                                     stderr=subprocess.STDOUT)
            time.sleep(0.5)
            try:
                run = subprocess.run(argv, env=env, cwd=out, capture_output=True, text=True,
                                     timeout=120)
                text = run.stdout + run.stderr
            except subprocess.TimeoutExpired:
                text = "ran past 120 s"
            try:
                tproc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                tproc.kill()
                tproc.wait()
        (logs / f"{tag}-initiator.log").write_text(text)
        both = text + (logs / f"{tag}-target.log").read_text(errors="replace")
        m = re.search(rf"^\s*{size}\s+{count}\s+([0-9.]+)\s+([0-9.]+)\s", both, re.M)
        if m is None or re.search(r"consistency check failed|inconsistent", both, re.I):
            said = [ln for ln in both.splitlines() if re.search(r"error|fail", ln, re.I)]
            results[key] = {"ok": False, "error": (" | ".join(said[-2:]) or "no result line")
                            [-300:] + f" (logs/{tag}-*.log)"}
        else:
            gbs = float(m.group(1))
            results[key] = {"ok": True, "gbytes_s": gbs, "ops_s": gbs * GB / (size * count),
                            "p50_us": None, "avg_us": float(m.group(2))}
        print(f"  {key}: {fmt_cell(results[key])}", flush=True)
    return {"transport": transport, "rows": results, "env": {"FABRIC_PROVIDER": provider},
            "note": "nixlbench's own GB/s (its timing: a request posted and polled to its end, "
            "iterations back to back); its avg latency in the JSON; no notice row",
            "command": " ".join(argv[:1] + ["..."])}


def uccl_system(transport):
    """UCCL's P2P engine: a row saying whether it loads here, and why not."""
    try:
        import uccl  # noqa: F401
    except ImportError:
        return {"transport": transport, "error": (
            f"uccl is not installed for this Python ({sys.version.split()[0]}): the newest "
            "uccl on PyPI, 0.1.1, is a CPython 3.12+ wheel (cp312-abi3, manylinux_2_35) that "
            "needs a CUDA GPU (it links libcuda.so.1 and libcudart.so.12); tools/gpu/peers.sh "
            "carries it to a GPU host")}
    try:
        from uccl import p2p  # noqa: F401
    except Exception as e:  # noqa: BLE001 - whatever it raises is the row's reason
        return {"transport": transport, "error": f"import uccl.p2p: {type(e).__name__}: {e}"}
    return {"transport": transport, "error": (
        "uccl.p2p imports here, but bench/peers has no UCCL adapter yet: its Endpoint API "
        "(connect/accept, reg, write/read with a remote descriptor) is not driven by peer.py")}


def mooncake_bench(out, args):
    """The wheel's transfer_engine_bench at its defaults, tcp, P2PHANDSHAKE; write and read."""
    exe = shutil.which("transfer_engine_bench", path=os.pathsep.join(
        [str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    if exe is None:
        return {"error": "the Mooncake wheel installed no transfer_engine_bench"}
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    common = ["--protocol=tcp", "--metadata_server=P2PHANDSHAKE", "--logtostderr"]
    results = {}
    for op in ("write", "read"):
        tlog = open(logs / f"te-bench-target-{op}.log", "w")
        target = subprocess.Popen([exe, "--mode=target", "--local_server_name=127.0.0.1:17601",
                                   *common], stdout=tlog, stderr=subprocess.STDOUT)
        try:
            # With P2PHANDSHAKE the target listens on a port of its own choosing, which it logs.
            segment, end = None, time.monotonic() + 15
            while segment is None and time.monotonic() < end and target.poll() is None:
                time.sleep(0.2)
                m = re.search(r"P2P handshake, listening on (\S+)",
                              (logs / f"te-bench-target-{op}.log").read_text(errors="replace"))
                segment = m.group(1) if m else None
            if segment is None:
                results[op] = {"ok": False, "error": "the target logged no handshake port"}
                continue
            cmd = [exe, "--mode=initiator", f"--operation={op}",
                   "--local_server_name=127.0.0.1:17602", f"--segment_id={segment}",
                   f"--duration={args.te_seconds}", *common]
            run = subprocess.run(cmd, capture_output=True, text=True,
                                 timeout=args.te_seconds + 60)
            text = run.stdout + run.stderr
            (logs / f"te-bench-initiator-{op}.log").write_text(text)
            m = re.search(r"Test completed:.*throughput\s+([0-9.]+)\s*(\S+)", text, re.I)
            if run.returncode != 0 or not m:
                said = [ln for ln in text.splitlines()
                        if re.search(r"FAILED|error|fail|Unable", ln, re.I)]
                results[op] = {"ok": False, "error": f"exit {run.returncode}: "
                               + " | ".join(said[-3:])[-400:]
                               + f" (log: logs/te-bench-initiator-{op}.log)"}
            else:
                results[op] = {"ok": True, "throughput": float(m.group(1)), "unit": m.group(2),
                               "command": " ".join(cmd),
                               "line": m.group(0)[len("Test completed: "):]}
        except subprocess.TimeoutExpired:
            results[op] = {"ok": False, "error": "ran past its time bound"}
        finally:
            target.terminate()
            try:
                target.wait(timeout=10)
            except subprocess.TimeoutExpired:
                target.kill()
                target.wait()
            tlog.close()
    return {"tool": results}


def us(v):
    """A latency cell: raw libfabric's baseline reports none for transfer rows."""
    return "n/a" if v is None else f"{v:.1f} us" if v < 100 else f"{v:.0f} us"


def fmt_cell(c):
    if not c or "p50_us" not in c and "gbytes_s" not in c:
        return "n/a: " + first_line(c.get("error", "no result"))[:200] if c else "n/a"
    if "gbytes_s" in c:
        s = f"{c['gbytes_s']:.3f} GB/s, {c['ops_s']:.0f} op/s, p50 {us(c.get('p50_us'))}"
        if c.get("cpu_s_per_gb") is not None:
            s += f", {c['cpu_s_per_gb']:.2f} CPU s/GB"
    else:
        s = f"p50 {us(c.get('p50_us'))}, p99 {us(c.get('p99_us'))}"
    return s + ("" if c.get("ok") else " (FAILED: " + first_line(c.get("error", ""))[:200] + ")")


def first_line(text):
    """An error as one table-friendly line (the JSON keeps it whole)."""
    return " ".join(str(text).split())[:300]


def status(system):
    """A system's status cell: ran, or why it did not (the notes say more)."""
    if "error" in system:
        return "did not run: " + first_line(system["error"])[:120]
    bad = [k for k, c in system.get("rows", {}).items() if not c.get("ok")]
    if bad:
        return f"ran; {len(bad)} row(s) failed"
    return "ran, bytes not checked" if system.get("unchecked") else "ran, all verified"


def column_best(systems, key, field, pick):
    """The best verified value of a column among the systems in the ratios, or None."""
    vals = [s["rows"][key][field] for s in systems.values()
            if key in s.get("rows", {}) and s["rows"][key].get("ok") and not s.get("no_ratio")
            and s["rows"][key].get(field) is not None]
    return pick(vals) if vals else None


def table(systems, keys, field, pick, fmt):
    """A system x row table of one field; bold: the ratio to the column's best (brackets:
    a system out of the ratios)."""
    lines = ["| system | status | " + " | ".join(keys) + " |",
             "| --- | --- |" + " ---: |" * len(keys)]
    best = {k: column_best(systems, k, field, pick) for k in keys}
    for name, s in systems.items():
        cells = []
        for k in keys:
            c = s.get("rows", {}).get(k)
            if c is None or c.get(field) is None:
                cells.append("n/a")
                continue
            cell = fmt(c[field])
            if not c.get("ok"):
                cell += " failed"
            elif best[k]:
                r = c[field] / best[k]
                cell += f" ({r:.2f})" if s.get("no_ratio") else f" **{r:.2f}**"
            cells.append(cell)
        lines.append(f"| {name} | {status(s)} | " + " | ".join(cells) + " |")
    return lines


def markdown(report):
    """Per transport: GB/s, latency, CPU per GB and the notice round trip, a row a system."""
    lines = [f"# fabric-lib beside its peers, {report['date']}", "",
             f"Host {report['host']}, {report['cpus']} CPUs, commit {report.get('commit', '?')}; "
             "two processes, one transfer in flight; a batch is one request of its "
             "descriptors. GB/s = 10^9 B/s. Ratio: over the best verified system of the column "
             "(GB/s: 1.00 = fastest; latency and CPU: 1.00 = lowest). Command: `"
             + report["command"] + "`.", ""]
    keys = [k for k, *_ in rows()]
    for transport, title in TRANSPORTS.items():
        systems = {n: s for n, s in report["systems"].items() if s["transport"] == transport}
        if not systems:
            continue
        lines += [f"## {title}", "", "Throughput, GB/s:", ""]
        lines += table(systems, keys, "gbytes_s", max, lambda v: f"{v:.3f}")
        lines += ["", "Latency p50, microseconds, post to completion of one transfer (a "
                  "batch: of its request):", ""]
        lines += table(systems, keys, "p50_us", min, lambda v: f"{v:.0f}" if v >= 100
                       else f"{v:.1f}")
        lines += ["", "CPU seconds per GB moved, both processes (user + system):", ""]
        lines += table(systems, keys, "cpu_s_per_gb", min, lambda v: f"{v:.2f}")
        lines += ["", f"Notice round trip ({NOTICE_BYTES}-byte WRITE with a notice, answered "
                  "the same way; fabric-bench: an immediate-only write each way), "
                  "microseconds:", ""]
        p50 = table(systems, [NOTICE], "p50_us", min, lambda v: f"{v:.1f}")
        p99 = table(systems, [NOTICE], "p99_us", min, lambda v: f"{v:.1f}")
        lines += ["| system | status | p50 | p99 |", "| --- | --- | ---: | ---: |"]
        lines += [a + " " + b.split("|")[-2].strip() + " |" for a, b in zip(p50[2:], p99[2:])]
        lines.append("")
    lines += ["## Notes", "", "Systems that did not run, rows they could not give, caveats:", ""]
    for name, s in report["systems"].items():
        if "error" in s:
            lines.append(f"- **{name}**: did not run: {first_line(s['error'])}")
        for k, c in s.get("rows", {}).items():
            if not c.get("ok"):
                lines.append(f"- **{name}**, {k}: {first_line(c.get('error', 'not verified'))}")
        if s.get("note"):
            lines.append(f"- **{name}**: {s['note']}")
        if s.get("env"):
            env = " ".join(f"{k}={v}" for k, v in s["env"].items())
            lines.append(f"- **{name}**: environment `{env}`")
        if s.get("command"):
            lines.append(f"- **{name}**: `{s['command']}`")
    tool = report.get("mooncake_tool", {})
    if tool:
        lines += ["", "Mooncake's transfer_engine_bench at its defaults (its own workload and "
                  "numbers; the bytes are not checked by us), not in the ratios:", ""]
        for op, r in tool.get("tool", {}).items():
            lines.append(f"- {op}: " + (f"{r['line']}" if r.get("ok") else f"failed: {r['error']}"))
        if "error" in tool:
            lines.append(f"- {tool['error']}")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default=str(REPO / "build" / "bench-peers"))
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help="comma-separated subset (raw libfabric comes with fabric-bench)")
    ap.add_argument("--transports", default=",".join(TRANSPORTS),
                    help="tcp, same-host or both (comma-separated)")
    ap.add_argument("--passes", type=int, default=3, help="verified passes per row")
    ap.add_argument("--scale", type=float, default=1.0,
                    help="bytes per pass: 64 MiB x scale (capped at 2000 transfers)")
    ap.add_argument("--row-seconds", type=float, default=3.0, help="time bound per row")
    ap.add_argument("--fabric-seconds", type=int, default=300, help="time bound of fabric-bench")
    ap.add_argument("--fabric-bench", default=str(REPO / "build" / "bin" / "fabric-bench"),
                    help="the fabric-bench to run (fabric-bench-raw beside it)")
    ap.add_argument("--fabric-modes", default="worker,progress",
                    help="fabric-bench --mode values, each a row")
    ap.add_argument("--nixlbench", default=str(REPO / ".nixl" / "nixlbench-build" / "nixlbench"),
                    help="nixlbench of a NIXL source build (tools/nixl/build_nixl.sh)")
    ap.add_argument("--te-seconds", type=int, default=10,
                    help="transfer_engine_bench --duration (its default: 10)")
    ap.add_argument("--rows", help="comma-separated transfer rows, e.g. 'write 4 KiB,read 1 MiB' "
                    "(default: all; the notice round trip always runs)")
    args = ap.parse_args()
    if args.rows:
        global SELECTED_ROWS
        every = [k for k, *_ in rows()]
        SELECTED_ROWS = set(args.rows.split(","))
        if SELECTED_ROWS - set(every):
            ap.error(f"unknown rows: {', '.join(sorted(SELECTED_ROWS - set(every)))}; rows are: "
                     + ", ".join(every))
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    chosen = args.systems.split(",")
    transports = args.transports.split(",")
    unknown = [t for t in transports if t not in TRANSPORTS] + [
        s for s in chosen if s not in SYSTEMS]
    if unknown:
        ap.error(f"unknown system or transport: {', '.join(unknown)}")
    modes = args.fabric_modes.split(",")
    systems = {}
    t0 = time.monotonic()
    for transport in transports:
        provider = "tcp" if transport == "tcp" else "shm"
        print(f"== {TRANSPORTS[transport]}", flush=True)
        if "fabric-bench" in chosen:
            for mode in modes:
                raw_key = f"raw libfabric ({provider})"
                print(f"== fabric-bench {mode} ({provider})"
                      + ("" if raw_key in systems else " and raw libfabric"), flush=True)
                ours, raw = fabric_bench(out, args, provider, mode, transport,
                                         with_raw=raw_key not in systems)
                systems[f"fabric-bench {mode} ({provider})"] = ours
                if raw is not None:
                    systems[raw_key] = raw
        if "nixlbench" in chosen:
            print(f"== nixlbench FABRIC ({provider})", flush=True)
            systems[f"nixlbench FABRIC ({provider})"] = nixlbench(out, args, provider, transport)
        if "nixl-fabric" in chosen:
            print(f"== NIXL FABRIC ({provider})", flush=True)
            nic = "shm" if provider == "shm" else "lo"
            env = {"FABRIC_NIXL_PROVIDER": provider, "FABRIC_NIXL_NICS": nic}
            missing = fabric_plugin_missing()
            systems[f"NIXL FABRIC ({provider})"] = python_system(
                "FABRIC", env, out, args, f"fabric-{provider}", transport) if missing is None \
                else {"transport": transport, "error": missing, "env": env}
        if "nixl-ucx" in chosen:
            if transport == "tcp":
                print("== NIXL UCX (tcp)", flush=True)
                # Left to itself, UCX moves bytes between two processes of one host through
                # shared memory (posix, cma), not TCP: that run is the same-host row.
                systems["NIXL UCX (tcp)"] = python_system(
                    "UCX", {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}, out, args, "ucx-tcp",
                    transport)
            else:
                print("== NIXL UCX, UCX's own choice of transports (shared memory)", flush=True)
                s = python_system("UCX", {}, out, args, "ucx-default", transport)
                s["note"] = "UCX's defaults: shared memory (posix, cma) between the processes"
                systems["NIXL UCX (defaults: shm)"] = s
        if "mooncake" in chosen:
            if transport == "tcp":
                print("== Mooncake TE (tcp)", flush=True)
                try:
                    import mooncake.engine  # noqa: F401
                    # At the wheel's default queue depth its TCP lanes reject a request of
                    # 4096 descriptors ("TCP lane queue-full") and the engine fails every
                    # transfer after it (-1): the depth is raised for that row.
                    s = python_system("mooncake", {"MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "8192"},
                                      out, args, "mooncake-tcp", transport)
                    s["note"] = ("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER=8192: at the wheel's "
                                 "default its TCP lanes reject the 4096-descriptor batch (queue "
                                 "full) and every later transfer of the engine returns -1")
                    systems["Mooncake TE (tcp)"] = s
                except ImportError as e:
                    systems["Mooncake TE (tcp)"] = {"transport": transport,
                                                    "error": f"import mooncake.engine: {e}"}
            else:
                systems["Mooncake TE (same host)"] = {"transport": transport, "error": (
                    "no same-host transport for host memory: the wheel's protocols are tcp, "
                    "rdma and accelerator links (nvlink, nvlink_intra, hip, ascend, ...); "
                    "initialize() with protocol 'shm' falls back to its TcpTransport")}
        if "uccl" in chosen and transport == "tcp":
            print("== UCCL P2P", flush=True)
            systems["UCCL P2P"] = uccl_system(transport)
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(), "cpus": os.cpu_count(), "python": sys.version.split()[0],
        "commit": subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                 capture_output=True, text=True).stdout.strip() or None,
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "rows": [k for k, *_ in rows()] + [NOTICE], "systems": systems,
    }
    if "te-bench" in chosen and "tcp" in transports:
        print("== Mooncake transfer_engine_bench (defaults)", flush=True)
        report["mooncake_tool"] = mooncake_bench(out, args)
    for name, s in systems.items():
        if "error" in s:
            print(f"  {name}: did not run: {s['error']}")
    report["seconds"] = round(time.monotonic() - t0, 1)
    (out / "peers.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "peers.md").write_text(markdown(report))
    print((out / "peers.md").read_text())
    # The plot needs matplotlib: Debian's (make bench-deps), or this interpreter's where it has it.
    python = next((py for py in (sys.executable, "/usr/bin/python3") if subprocess.run(
        [py, "-c", "import matplotlib"], capture_output=True).returncode == 0), None)
    plot = subprocess.run([python, str(HERE / "plot_peers.py"), str(out / "peers.json"),
                           str(out / "peers.png")], capture_output=True, text=True) if python \
        else subprocess.CompletedProcess([], 1, "", "no matplotlib: no plot (make bench-deps)\n")
    print(plot.stdout + plot.stderr, end="")
    print(f"wrote {out / 'peers.json'}, {out / 'peers.md'}"
          + (f" and {out / 'peers.png'}" if plot.returncode == 0 else " (no plot)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
