#!/usr/bin/env python3
"""Prints the issue-16 rows of a tools/gpu/run_latency.sh output folder, one line per build and
round: time inside submit() per single 4 KiB write and per page (paged 4 KiB x 100), single
4 KiB, 64 KiB, 256 KiB and 1 MiB ours/raw, imm round trip p50 (ours / raw) and imm rate
ours/raw, and per scatter target.
    python3 tools/gpu/summarize_latency.py OUT_FOLDER"""
import glob
import json
import os
import sys


def row(results, op, size=None):
    for r in results:
        if r["op"] == op and (size is None or r["bytes"] == size):
            return r
    return None


def raw(baselines, op, size=None):
    for b in baselines:
        if b["name"] == "raw" and b["op"] == op and (size is None or b["bytes"] == size):
            return b
    return None


def ratio(a, b, key):
    if a is None or b is None or not a.get(key) or not b.get(key):
        return "-"
    return f"{a[key] / b[key]:.2f}"


def main(folder):
    print("| file | post us single 4 KiB | post us per page | single 4 KiB ours/raw "
          "| 64 KiB | 256 KiB | 1 MiB | imm RTT p50 ours / raw us | imm rate ours/raw |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        if "scatter" in path:
            continue
        d = json.load(open(path))
        res, base = d["results"], d.get("baselines", [])
        s4, s64, imm = row(res, "single", 4096), row(res, "single", 65536), row(res, "imm")
        r4, r64, rimm = raw(base, "single", 4096), raw(base, "single", 65536), raw(base, "imm")
        s256, s1m = row(res, "single", 262144), row(res, "single", 1048576)
        r256, r1m = raw(base, "single", 262144), raw(base, "single", 1048576)
        paged = row(res, "paged")
        post = f"{s4['post_us']:.2f}" if s4 else "-"
        page = f"{paged['post_us']:.3f}" if paged else "-"
        rtt = "-"
        if imm:
            rtt = f"{imm['p50_us']:.1f} / " + (f"{rimm['p50_us']:.1f}" if rimm else "-")
        print(f"| {os.path.basename(path)} | {post} | {page} | {ratio(s4, r4, 'gbps')} | "
              f"{ratio(s64, r64, 'gbps')} | {ratio(s256, r256, 'gbps')} | "
              f"{ratio(s1m, r1m, 'gbps')} | {rtt} | {ratio(imm, rimm, 'mops')} |")
    for path in sorted(glob.glob(os.path.join(folder, "*scatter*.json"))):
        d = json.load(open(path))
        s = row(d["results"], "scatter")
        if s:
            print(f"{os.path.basename(path)}: {s['peers']} peers, post us per target "
                  f"{s['post_us']:.3f}, so {s['post_us'] * s['peers']:.1f} us per scatter")


if __name__ == "__main__":
    main(sys.argv[1])
