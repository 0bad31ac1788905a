#!/usr/bin/python3
"""Draws fabric-bench's JSON as Gbps against message size: ours and the baselines.

    /usr/bin/python3 bench/plot_results.py RESULTS.json OUT.png

Left: single writes (x: bytes per write), with raw libfabric, UCX put/tag and the iperf3 TCP
ceiling. Right: paged writes (x: page size), one line per pages-per-transfer, with raw
libfabric and UCX put at the page size. Reads, where the run has them (--op read, paged-read),
join each panel with raw libfabric's fi_read. Needs Debian's python3-matplotlib.
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

STYLE = {
    "ours": dict(color="tab:blue", marker="o", linewidth=2),
    "raw": dict(color="tab:orange", marker="s", linestyle="--"),
    "ucx_put_bw": dict(color="tab:green", marker="^", linestyle=":"),
    "ucx_tag_bw": dict(color="tab:red", marker="v", linestyle=":"),
    "ours read": dict(color="tab:purple", marker="o", linewidth=2),
    "raw read": dict(color="tab:brown", marker="s", linestyle="--"),
}
LABEL = {
    "ours": "fabric-lib",
    "raw": "raw libfabric",
    "ucx_put_bw": "UCX ucp_put_bw",
    "ucx_tag_bw": "UCX tag_bw",
    "ours read": "fabric-lib reads",
    "raw read": "raw libfabric fi_read",
}


def size_label(n):
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def series(points):
    points = sorted((x, y) for x, y in points if y is not None)
    return [p[0] for p in points], [p[1] for p in points]


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: plot_results.py RESULTS.json OUT.png")
    with open(sys.argv[1]) as f:
        data = json.load(f)
    results = data.get("results", [])
    baselines = data.get("baselines", [])

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    ticks = {left: set(), right: set()}

    def draw(ax, xs, ys, **kw):
        ax.plot(xs, ys, **kw)
        ticks[ax].update(int(x) for x in xs)

    # Single writes.
    ours = [(r["bytes"], r["gbps"]) for r in results if r["op"] == "single"]
    if ours:
        xs, ys = series(ours)
        draw(left, xs, ys, label=LABEL["ours"], **STYLE["ours"])
    for name in ("raw", "ucx_put_bw", "ucx_tag_bw"):
        pts = [(b["bytes"], b["gbps"]) for b in baselines if b["op"] == "single" and b["name"] == name]
        if pts:
            xs, ys = series(pts)
            if xs:
                draw(left, xs, ys, label=LABEL[name], **STYLE[name])
    for b in baselines:
        if b["name"] == "iperf3" and b.get("gbps") is not None:
            left.axhline(b["gbps"], color="gray", linestyle="-.", label="iperf3 TCP stream")
    # Single reads, with raw fi_read.
    reads = [(r["bytes"], r["gbps"]) for r in results if r["op"] == "read"]
    if reads:
        xs, ys = series(reads)
        draw(left, xs, ys, label=LABEL["ours read"], **STYLE["ours read"])
        pts = [(b["bytes"], b["gbps"]) for b in baselines if b["op"] == "read" and b["name"] == "raw"]
        xs, ys = series(pts)
        if xs:
            draw(left, xs, ys, label=LABEL["raw read"], **STYLE["raw read"])
    left.set_title("single writes (with an immediate) and reads" if reads else
                   "single writes with an immediate")
    left.set_xlabel("bytes per write or read" if reads else "bytes per write")

    # Paged writes: one line per pages-per-transfer.
    for pages in sorted({r["pages"] for r in results if r["op"] == "paged"}):
        pts = [(r["page_bytes"], r["gbps"]) for r in results if r["op"] == "paged" and r["pages"] == pages]
        xs, ys = series(pts)
        style = dict(STYLE["ours"])
        if pages != min(r["pages"] for r in results if r["op"] == "paged"):
            style.update(marker="D", linestyle="-.")
        draw(right, xs, ys, label=f"fabric-lib, {pages} pages", **style)
    for name in ("raw", "ucx_put_bw"):
        best = {}
        for b in baselines:
            if b["op"] == "paged" and b["name"] == name and b.get("gbps") is not None:
                best[b["page_bytes"]] = max(best.get(b["page_bytes"], 0), b["gbps"])
        if best:
            xs, ys = series(best.items())
            draw(right, xs, ys, label=f"{LABEL[name]} (one write per page)", **STYLE[name])
    # Paged reads: one line per pages-per-transfer, with raw fi_read (one read per page).
    read_pages = sorted({r["pages"] for r in results if r["op"] == "paged-read"})
    for pages in read_pages:
        pts = [(r["page_bytes"], r["gbps"]) for r in results
               if r["op"] == "paged-read" and r["pages"] == pages]
        xs, ys = series(pts)
        style = dict(STYLE["ours read"])
        if pages != read_pages[0]:
            style.update(marker="D", linestyle="-.")
        draw(right, xs, ys, label=f"fabric-lib reads, {pages} pages", **style)
    best = {}
    for b in baselines:
        if b["op"] == "paged-read" and b["name"] == "raw" and b.get("gbps") is not None:
            best[b["page_bytes"]] = max(best.get(b["page_bytes"], 0), b["gbps"])
    if best:
        xs, ys = series(best.items())
        draw(right, xs, ys, label=f"{LABEL['raw read']} (one read per page)", **STYLE["raw read"])
    right.set_title("paged writes and reads (stride = page + 128 B)" if read_pages else
                    "paged writes (stride = page + 128 B, an immediate per page)")
    right.set_xlabel("page size")

    for ax in (left, right):
        xs = sorted(ticks[ax])
        if not xs:
            ax.set_visible(False)
            continue
        ax.set_xscale("log", base=2)
        shown = xs if len(xs) <= 9 else xs[:: (len(xs) + 8) // 9]
        ax.set_xticks(shown)
        ax.set_xticklabels([size_label(t) for t in shown], rotation=30)
        ax.set_ylabel("Gbit/s")
        # A baseline far above ours (UCX put over posix is a copy into mapped memory, without
        # notifying the target) would flatten every other line: then a log scale.
        ours = [y for line in ax.get_lines() if line.get_label().startswith("fabric-lib")
                for y in line.get_ydata()]
        top = max((y for line in ax.get_lines() for y in line.get_ydata()), default=0)
        if ours and min(ours) > 0 and top > 4 * max(ours):
            ax.set_yscale("log")
        else:
            ax.set_ylim(bottom=0)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"fabric-bench: {data.get('provider', '?')} on {data.get('host', '?')}")
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=110)


if __name__ == "__main__":
    main()
