#!/usr/bin/python3
"""Draws bench/peers/peers.py's JSON: GB/s of every system at every transfer row, one panel per
transport (TCP loopback, same host), bars grouped by row, log scale. A failed or missing cell
has no bar; raw libfabric (which checks no bytes) is drawn hatched.

    /usr/bin/python3 bench/peers/plot_peers.py peers.json peers.png

Needs Debian's python3-matplotlib (make bench-deps).
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

TITLES = {"tcp": "TCP loopback", "same-host": "same host (shared memory)"}


def main(src, dst):
    report = json.load(open(src))
    keys = [k for k in report["rows"] if not k.startswith("notice")]
    transports = [t for t in TITLES if any(s["transport"] == t for s in report["systems"].values())]
    fig, axes = plt.subplots(len(transports), 1, figsize=(15, 5.5 * len(transports)),
                             squeeze=False)
    for ax, transport in zip(axes[:, 0], transports):
        systems = {n: s for n, s in report["systems"].items()
                   if s["transport"] == transport and s.get("rows")}
        width = 0.8 / max(1, len(systems))
        for i, (name, s) in enumerate(systems.items()):
            xs, ys = [], []
            for j, k in enumerate(keys):
                c = s["rows"].get(k, {})
                if c.get("ok") and c.get("gbytes_s"):
                    xs.append(j - 0.4 + (i + 0.5) * width)
                    ys.append(c["gbytes_s"])
            ax.bar(xs, ys, width, label=name, hatch="//" if s.get("unchecked") else None)
        ax.set_yscale("log")
        ax.set_xticks(range(len(keys)))
        ax.set_xticklabels(keys, rotation=25, ha="right", fontsize=8)
        ax.set_ylabel("GB/s (10^9 B/s)")
        ax.set_title(f"{TITLES[transport]}: {report['host']}, {report['cpus']} CPUs, commit "
                     f"{report.get('commit')}, {report['date'][:10]}")
        ax.grid(axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    print(f"plot: {dst}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
