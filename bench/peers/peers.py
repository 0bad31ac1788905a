"""fabric-lib beside its peer transfer engines: the same work, in one run, between two processes
over TCP loopback (127.0.0.1), one system after another. `make bench-peers` runs it through
bench/peers/run.sh.

Systems (one row each; one that cannot run is a row with its reason):
  fabric-bench       fabric-lib's engine, libfabric tcp provider, NIC lo (build/bin/fabric-bench)
  raw libfabric      fabric-bench's own baseline (fabric-bench-raw), the same sizes, in the same
                     run; it checks no bytes, so it stays out of the ratios' best
  NIXL FABRIC        fabric-lib through NIXL's Python API (the PyPI wheel), provider tcp, NIC lo
  NIXL UCX (tcp)     the wheel's own UCX backend, the same harness, UCX_TLS=tcp
  NIXL UCX (shm)     the same with UCX's own choice of transports: shared memory between the
                     two processes, not TCP; shown beside the others, left out of the ratios
  Mooncake TE        Mooncake's Transfer Engine (PyPI wheel), protocol tcp, P2PHANDSHAKE
  Mooncake TE bench  the wheel's transfer_engine_bench at its defaults (its own numbers, no
                     check of the bytes by us)

Work: WRITE and READ of single transfers of 4 KiB, 64 KiB, 1 MiB, 32 MiB, one in flight, and a
batch of 128 x 64 KiB as one request. The Python systems run bench/peers/peer.py twice (an
initiator, a target); every pass writes a fresh pattern at the source and compares its sha256
with the bytes where they landed. fabric-bench verifies its own passes (its "verified" key).
Throughput: bytes over the sum of the per-transfer latencies (post to completion, one in
flight); fabric-bench's: bytes over its pass's time, window 1 (a Python loop's gaps between
transfers count for no Python system).

Output: peers.json and peers.md in the output folder (default build/bench-peers).
"""

import argparse
import datetime
import json
import os
import platform
import re
import select
import shutil
import statistics
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
BATCH = (128, 64 * KIB)
ANSWER_TIMEOUT_S = 120.0
SYSTEMS = ("fabric-bench", "nixl-fabric", "nixl-ucx", "mooncake", "te-bench", "nixl-ucx-shm")


def human(n):
    return f"{n // MIB} MiB" if n >= MIB else f"{n // KIB} KiB"


def rows():
    """(key, op, size, count): the rows every system is asked for, in table order."""
    out = []
    for op in ("write", "read"):
        for size in SIZES:
            out.append((f"{op} {human(size)}", op, size, 1))
        out.append((f"{op} batch {BATCH[0]} x {human(BATCH[1])}", op, BATCH[1], BATCH[0]))
    return out


def plan(size, count, scale):
    """Timed transfers per pass and untimed ones first: about the same bytes per row."""
    total = size * count
    iters = max(5, min(2000, int(64 * MIB * scale // total)))
    return iters, max(1, iters // 10)


class Peer:
    """A bench/peers/peer.py process: one JSON command in, one JSON answer out."""

    def __init__(self, name, env, log):
        self.name = name
        self.log = log
        self.proc = subprocess.Popen([sys.executable, str(PEER)], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=open(log, "w"), text=True)

    def call(self, cmd, **args):
        self.proc.stdin.write(json.dumps({"cmd": cmd, **args}) + "\n")
        self.proc.stdin.flush()
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


def summarize(lat_us, nbytes, passes, verified, errors):
    """One row: throughput from the sum of the latencies (one transfer in flight), p50."""
    if not lat_us:
        return {"ok": False, "error": "; ".join(errors) or "no transfers"}
    total_s = sum(lat_us) / 1e6
    return {
        "ok": verified == passes and not errors,
        "gbytes_s": nbytes * len(lat_us) / total_s / 1e9,
        "ops_s": len(lat_us) / total_s,
        "p50_us": statistics.median(lat_us),
        "transfers": len(lat_us),
        "passes": passes,
        "verified_passes": verified,
        **({"error": "; ".join(errors)} if errors else {}),
    }


def python_system(backend, env_extra, out, args, tag=None):
    """Two peer.py processes with one backend; every row, every pass verified."""
    env = dict(os.environ, **env_extra)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    tag = tag or backend.lower()
    region = max(max(SIZES), BATCH[0] * BATCH[1])
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
            nbytes = size * count
            iters, warmup = plan(size, count, args.scale)
            # WRITE: the initiator's src lands in the target's dst; READ: the target's src
            # lands in the initiator's dst.
            source, landing = (init, target) if op == "write" else (target, init)
            lat, verified, errors = [], 0, []
            for _ in range(args.passes):
                seed += 2
                try:
                    landing.call("fill", region="dst", nbytes=nbytes, seed=seed + 1)
                    want = source.call("fill", region="src", nbytes=nbytes, seed=seed)["sha256"]
                    got = init.call("run", op=op.upper(), size=size, count=count, iters=iters,
                                    warmup=warmup, max_s=args.row_seconds / args.passes)
                    lat += got["lat_us"]
                    if landing.call("digest", region="dst", nbytes=nbytes)["sha256"] == want:
                        verified += 1
                    else:
                        errors.append("bytes at the target differ from the pattern sent")
                except RuntimeError as e:
                    errors.append(str(e))
                    break
            results[key] = summarize(lat, nbytes, args.passes, verified, errors)
            print(f"  {key}: {fmt_cell(results[key])}", flush=True)
    except RuntimeError as e:
        return {"error": str(e)[:600], "env": env_extra}
    finally:
        init.close()
        target.close()
    return {"rows": results, "env": env_extra}


def fabric_bench(out, args):
    """fabric-bench over tcp/lo, window 1, with its raw libfabric baseline; two systems."""
    exe = Path(args.fabric_bench)
    if not exe.exists():
        why = f"{exe} not built (make build)"
        return {"error": why}, {"error": why}
    js = out / "fabric-bench.json"
    sizes = ",".join(f"{s // KIB}KiB" for s in SIZES)
    cmd = [str(exe), "--provider", "tcp", "--nic", "lo", "--op", "single,read,paged,paged-read",
           "--sizes", sizes, "--page-sizes", f"{BATCH[1] // KIB}KiB", "--pages", str(BATCH[0]),
           "--window", "1", "--iters", str(args.passes), "--warmup", "1",
           "--pass-mib", str(max(1, int(64 * args.scale))), "--mode", args.fabric_mode,
           "--baseline", "raw", "--json", str(js)]
    print("  " + " ".join(cmd), flush=True)
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=args.fabric_seconds)
    except subprocess.TimeoutExpired:
        why = f"fabric-bench ran past {args.fabric_seconds} s"
        return {"error": why}, {"error": why}
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "logs" / "fabric-bench.log").write_text(run.stdout + run.stderr)
    if not js.exists():
        why = f"fabric-bench exited {run.returncode}: {(run.stderr or run.stdout)[-400:]}"
        return {"error": why}, {"error": why}
    data = json.loads(js.read_text())
    ours, raw = {}, {}
    names = {"single": "write", "read": "read", "paged": "write", "paged-read": "read"}

    def key_of(r):
        op = names.get(r["op"])
        if op is None:
            return None
        if r["op"].startswith("paged"):
            if r.get("pages") != BATCH[0] or r.get("page_bytes") != BATCH[1]:
                return None
            return f"{op} batch {BATCH[0]} x {human(BATCH[1])}"
        return f"{op} {human(r['bytes'])}" if r["bytes"] in SIZES else None

    for r in data.get("results", []):
        k = key_of(r)
        if k is None or r.get("mops") is None:
            continue
        mops = r["mops"]
        if r["op"].startswith("paged"):
            mops /= BATCH[0]  # fabric-bench's paged Mops count pages; a row here is a request
        ours[k] = {"ok": bool(r.get("verified")), "gbytes_s": r["gbps"] / 8, "ops_s": mops * 1e6,
                   "p50_us": r["p50_us"], "passes": r.get("passes"),
                   **({"error": r["error"]} if "error" in r else {})}
        if not r.get("verified"):
            ours[k]["error"] = r.get("error", "not verified")
    for b in data.get("baselines", []):
        if b.get("name") != "raw":
            continue
        k = key_of(b)
        if k is None:
            continue
        if "error" in b or b.get("gbps") is None:
            raw[k] = {"ok": False, "error": b.get("error", "no result")}
            continue
        mops = b["mops"] / (BATCH[0] if b["op"].startswith("paged") else 1)
        raw[k] = {"ok": True, "gbytes_s": b["gbps"] / 8, "ops_s": mops * 1e6,
                  "p50_us": b["p50_us"], "passes": b.get("runs")}
    note = ("fabric-bench-raw checks no bytes and reports no latency for these rows: shown "
            "beside the others, left out of the ratios' best")
    return ({"rows": ours, "command": " ".join(cmd)},
            {"rows": raw, "command": " ".join(cmd) + " (its raw baseline)", "note": note,
             "no_ratio": True, "unchecked": True})


def mooncake_bench(out, args):
    """The wheel's transfer_engine_bench at its defaults, tcp, P2PHANDSHAKE; write and read."""
    exe = shutil.which("transfer_engine_bench", path=str(Path(sys.executable).parent))
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
    """A latency cell: raw libfabric's baseline reports none for these rows."""
    return "n/a" if v is None else f"{v:.0f} us"


def fmt_cell(c):
    if not c or not c.get("ok") and "gbytes_s" not in c:
        return "n/a"
    s = f"{c['gbytes_s']:.3f} GB/s, {c['ops_s']:.0f} op/s, p50 {us(c.get('p50_us'))}"
    return s + ("" if c.get("ok") else " (NOT VERIFIED)")


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


def markdown(report):
    """A row per system: GB/s with the ratio to the best verified system of each column; p50."""
    systems = report["systems"]
    lines = [f"# fabric-lib beside its peers, {report['date']}", "",
             f"Host {report['host']}, {report['cpus']} CPUs, TCP loopback, two processes, one "
             "transfer in flight; batch: one request of 128 descriptors. GB/s = 10^9 B/s. "
             "ratio: GB/s over the best verified system of the column (1.00 = best). Command: `"
             + report["command"] + "`.", ""]
    keys = [k for k, *_ in rows()]
    best = {}
    for k in keys:
        vals = [s["rows"][k]["gbytes_s"] for s in systems.values()
                if k in s.get("rows", {}) and s["rows"][k].get("ok") and not s.get("no_ratio")]
        best[k] = max(vals) if vals else None
    head = "| system | status | " + " | ".join(keys) + " |"
    rule = "| --- | --- |" + " ---: |" * len(keys)
    lines += ["GB/s and, in bold, the ratio to the column's best (in brackets: not in the ratios).",
              "", head, rule]
    for name, s in systems.items():
        cells = []
        for k in keys:
            c = s.get("rows", {}).get(k)
            if c is None or "gbytes_s" not in c:
                cells.append("n/a")
                continue
            r = c["gbytes_s"] / best[k] if best[k] else None
            cell = f"{c['gbytes_s']:.3f}"
            if not c.get("ok"):
                cell += " not verified"
            elif r is not None:
                cell += f" ({r:.2f})" if s.get("no_ratio") else f" **{r:.2f}**"
            cells.append(cell)
        lines.append(f"| {name} | {status(s)} | " + " | ".join(cells) + " |")
    lines += ["", "Latency p50, microseconds, post to completion of one transfer (batch: of the "
              "request).", "", head, rule]
    for name, s in systems.items():
        cells = [us(s.get("rows", {}).get(k, {}).get("p50_us")).replace(" us", "")
                 for k in keys]
        lines.append(f"| {name} | {status(s)} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Notes: systems that did not run, rows they could not give, caveats:")
    lines.append("")
    for name, s in systems.items():
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
    ap.add_argument("--passes", type=int, default=3, help="verified passes per row")
    ap.add_argument("--scale", type=float, default=1.0,
                    help="bytes per pass: 64 MiB x scale (capped at 2000 transfers)")
    ap.add_argument("--row-seconds", type=float, default=4.0, help="time bound per row")
    ap.add_argument("--fabric-seconds", type=int, default=300, help="time bound of fabric-bench")
    ap.add_argument("--fabric-bench", default=str(REPO / "build" / "bin" / "fabric-bench"),
                    help="the fabric-bench to run (fabric-bench-raw beside it)")
    ap.add_argument("--fabric-mode", default="worker", help="fabric-bench --mode")
    ap.add_argument("--te-seconds", type=int, default=10,
                    help="transfer_engine_bench --duration (its default: 10)")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    chosen = args.systems.split(",")
    fabric_env = {"FABRIC_PROVIDER": "tcp", "FABRIC_NICS": "lo", "FABRIC_NIXL_PROVIDER": "tcp",
                  "FABRIC_NIXL_NICS": "lo"}
    systems = {}
    t0 = time.monotonic()
    if "fabric-bench" in chosen:
        print("== fabric-bench (and raw libfabric)", flush=True)
        systems["fabric-bench tcp"], systems["raw libfabric tcp"] = fabric_bench(out, args)
    if "nixl-fabric" in chosen:
        print("== NIXL FABRIC", flush=True)
        systems["NIXL FABRIC (tcp)"] = python_system("FABRIC", fabric_env, out, args)
    if "nixl-ucx" in chosen:
        print("== NIXL UCX", flush=True)
        # UCX_TLS=tcp: left to itself, UCX moves bytes between two processes of one host
        # through shared memory (posix, cma), not TCP; that run is its own row below.
        systems["NIXL UCX (tcp)"] = python_system(
            "UCX", {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}, out, args)
    if "nixl-ucx-shm" in chosen:
        print("== NIXL UCX, UCX's own choice of transports (shared memory)", flush=True)
        s = python_system("UCX", {}, out, args, tag="ucx-default")
        s["note"] = ("UCX's defaults: shared memory between the two processes, not TCP; "
                     "not in the ratios")
        s["no_ratio"] = True
        systems["NIXL UCX (defaults, shm)"] = s
    if "mooncake" in chosen:
        print("== Mooncake TE (tcp)", flush=True)
        try:
            import mooncake.engine  # noqa: F401
            systems["Mooncake TE (tcp)"] = python_system("mooncake", {}, out, args)
        except ImportError as e:
            systems["Mooncake TE (tcp)"] = {"error": f"import mooncake.engine: {e}"}
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(), "cpus": os.cpu_count(), "python": sys.version.split()[0],
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "rows": [k for k, *_ in rows()], "systems": systems,
    }
    if "te-bench" in chosen:
        print("== Mooncake transfer_engine_bench (defaults)", flush=True)
        report["mooncake_tool"] = mooncake_bench(out, args)
    for name, s in systems.items():
        if "error" in s:
            print(f"  {name}: did not run: {s['error']}")
    report["seconds"] = round(time.monotonic() - t0, 1)
    (out / "peers.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "peers.md").write_text(markdown(report))
    print((out / "peers.md").read_text())
    print(f"wrote {out / 'peers.json'} and {out / 'peers.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
