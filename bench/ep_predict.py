#!/usr/bin/env python3
"""The written model of docs/moe.md ("A model of EP64 decode"): predicts fabric::ep's inter-node
dispatch and combine at EP64 on ConnectX-7 (8 nodes of 8 GPUs, one 400 Gbps NIC per GPU) for the
reference's decode shape (128 tokens per rank, hidden 7168 fp8 with fp32 scales, top-8 of 256
experts, bf16 combine), from per-part costs that bench/ep_bench.py measured on the inter-node
path, and sets it against the reference's 187.5 / 309.1 us and DeepEP's 173 / 314 us.

    ep_predict.py [--json ep_bench.json] [--nic-gbps 370] [--latency-us 5]

--json: an ep_bench.py run with --gpus-per-node (the proxies' counters and the halves' times);
without it the rates below are assumed. The routing is uniform random top-8 (the bytes per peer
come from sampling it, seeded). Two designs are predicted:
  - "now": staging and receive areas in pinned host memory (the kernels cross PCIe both ways),
    the proxy posting a round after the send kernel's last block, the receive kernel starting
    after every peer's flag: the parts add up, except the proxy's posting and the wire, which
    overlap (the first peer's bytes travel while the proxy posts the next);
  - "GPUDirect + chunked posting" (docs/moe.md, Not built yet): areas in GPU memory, the proxy
    posting each peer's chunk as the kernel finishes it: staging, posting and the wire overlap.
"""

import argparse
import json
import random

HIDDEN, TOP_K, EXPERTS, TOKENS = 7168, 8, 256, 128
ENTRY = 80 + HIDDEN + 4 * (HIDDEN // 128)  # metadata (16-rounded), fp8 token, fp32 scales
ROW = 2 * HIDDEN                             # a bf16 combine row
GB = 1e9


def routing_bytes(world, per_node, seed=7):
    """Rank 0's bytes to and from the ranks of other nodes, per kind, and its busiest peer's."""
    rng = random.Random(seed)
    L = EXPERTS // world
    entries = [[0] * world for _ in range(world)]  # [s][d]: tokens s sends d
    rows = [[0] * world for _ in range(world)]     # [s][d]: (token, slot) pairs of s on d
    for s in range(world):
        for _ in range(TOKENS):
            ranks = [e // L for e in rng.sample(range(EXPERTS), TOP_K)]
            for d in set(ranks):
                entries[s][d] += 1
            for d in ranks:
                rows[s][d] += 1
    remote = [r for r in range(world) if r // per_node != 0]
    out = {
        "peers": len(remote),
        "dispatch_out": sum(entries[0][d] for d in remote) * ENTRY,
        "dispatch_in": sum(entries[s][0] for s in remote) * ENTRY,
        # combine: rank 0 returns rows of the tokens it received; receives rows for its tokens.
        "combine_out": sum(rows[s][0] for s in remote) * (ROW + 4),
        "combine_in": sum(rows[0][d] for d in remote) * (ROW + 4),
        # the first version: every (token, slot) up to the highest token with a row, per peer
        "combine_in_before": len(remote) * TOKENS * TOP_K * ROW,
    }
    return out


def measured(path):
    """Per-part costs from an ep_bench.py --json run across nodes (rank 0's decode row)."""
    with open(path) as f:
        run = json.load(f)
    shape = run["reports"]["0"]["decode"] if "0" in run["reports"] else run["reports"][0]["decode"]
    proxy = shape["proxy"]
    us = lambda k: shape[k]["p50_us"]
    # The send halves stage their bytes into pinned host memory over PCIe (rank 0 also writes
    # its own share into its GPU, counted as if staged: a slight overestimate of the rate's cost).
    d_bytes = proxy["dispatch"]["bytes_per_round"]
    c_bytes = proxy["combine"]["bytes_per_round"]
    return {
        "source": f"measured ({path}, rank 0, p50)",
        "stage_gbs_dispatch": d_bytes / (us("ep dispatch (eager) send half") * 1e-6) / GB,
        "stage_gbs_combine": c_bytes / (us("ep combine (eager) send half") * 1e-6) / GB,
        # Posting costs per write (a round here has more chunks than one at EP64 would).
        "post_us": sum(proxy[k]["post_us"] for k in proxy) / sum(proxy[k]["writes_per_round"]
                                                                  for k in proxy),
        # The flag's own cost: dispatch's counts-to-flag time (a small round, so little data
        # trails the counts; combine's here also holds its megabytes arriving, which the model
        # counts as wire time).
        "receive_us": proxy["dispatch"]["receive_us"],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="bench/ep_bench.py --json output, a run across nodes")
    ap.add_argument("--world", type=int, default=64)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--nic-gbps", type=float, default=370.0,
                    help="per GPU, each direction: the paper's paged-write rate on ConnectX-7 (many "
                    "writes in flight), of the 400 Gbps link")
    ap.add_argument("--latency-us", type=float, default=5.0,
                    help="one RDMA write's one-way latency (assumed)")
    ap.add_argument("--pcie-gbs", type=float, default=40.0,
                    help="staging rate over PCIe without --json (assumed)")
    ap.add_argument("--post-us", type=float, default=None,
                    help="per write posted (default 0.5, assumed; with --json, the run's own "
                    "unless given: fabric-bench-ep-proxy measures it without a GPU)")
    ap.add_argument("--receive-us", type=float, default=2.0,
                    help="the receiving proxy's counts-to-flag time (assumed)")
    ap.add_argument("--hbm-gbs", type=float, default=3000.0, help="a kernel's GPU-memory rate")
    ap.add_argument("--chunk-bytes", type=int, default=1 << 20, help="ProxyOptions::chunk_bytes")
    args = ap.parse_args()
    rates = {"source": "assumed", "stage_gbs_dispatch": args.pcie_gbs,
             "stage_gbs_combine": args.pcie_gbs,
             "post_us": 0.5 if args.post_us is None else args.post_us,
             "receive_us": args.receive_us}
    if args.json:
        rates = measured(args.json)
        if args.post_us is not None:
            rates["post_us"] = args.post_us
            rates["source"] += f", post {args.post_us} us per write given"
    b = routing_bytes(args.world, args.gpus_per_node)
    nic = args.nic_gbps / 8 * GB
    t = lambda nbytes, gbs: nbytes / (gbs * GB) * 1e6  # us
    print(f"rates ({rates['source']}): staging {rates['stage_gbs_dispatch']:.1f} GB/s (dispatch), "
          f"{rates['stage_gbs_combine']:.1f} GB/s (combine); post {rates['post_us']:.2f} us per "
          f"write; receive {rates['receive_us']:.2f} us; NIC {nic / GB:.0f} GB/s; "
          f"latency {args.latency_us} us (assumed)")
    print(f"EP{args.world}, {args.gpus_per_node} GPUs a node, rank 0: {b['peers']} peers on "
          f"other nodes; dispatch {b['dispatch_out'] / 1e6:.2f} MB out, "
          f"{b['dispatch_in'] / 1e6:.2f} MB in; combine {b['combine_out'] / 1e6:.2f} MB out, "
          f"{b['combine_in'] / 1e6:.2f} MB in (the first, non-compact version: "
          f"{b['combine_in_before'] / 1e6:.1f} MB in)\n")
    print("| kind | design | stage | post | wire | receive | read | total us | reference | DeepEP |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    ref = {"dispatch": (187.5, 173.0), "combine": (309.1, 314.0)}
    result = {}
    for kind in ("dispatch", "combine"):
        out_b, in_b = b[kind + "_out"], b[kind + "_in"]
        pcie = rates["stage_gbs_" + kind]
        # A peer's round: its counts write (a combine's with its rows' slot ids), then its bytes
        # in chunks.
        per_peer = max(out_b // b["peers"], 1)
        writes = 1 + (per_peer + args.chunk_bytes - 1) // args.chunk_bytes
        post = b["peers"] * writes * rates["post_us"]
        wire = t(max(out_b, in_b), nic / GB) + args.latency_us
        now = {"stage": t(out_b, pcie), "post": post, "wire": wire,
               "receive": rates["receive_us"], "read": t(in_b, pcie)}
        now_total = now["stage"] + max(now["post"], now["wire"]) + now["receive"] + now["read"]
        gd = {"stage": t(out_b, args.hbm_gbs), "post": post, "wire": wire,
              "receive": rates["receive_us"], "read": t(in_b, args.hbm_gbs)}
        gd_total = max(gd["stage"], gd["post"], gd["wire"]) + gd["receive"] + gd["read"]
        for name, parts, total in (("now (host staging)", now, now_total),
                                   ("GPUDirect + chunked posting", gd, gd_total)):
            print(f"| {kind} | {name} | {parts['stage']:.1f} | {parts['post']:.1f} | "
                  f"{parts['wire']:.1f} | {parts['receive']:.1f} | {parts['read']:.1f} | "
                  f"{total:.0f} | {ref[kind][0]} | {ref[kind][1]} |")
        result[kind] = {"now_us": round(now_total, 1), "gpudirect_us": round(gd_total, 1)}
    print("\n(stage: the send kernel writing its bytes for other nodes; post: the proxy posting "
          "every peer's round, serially; wire: the larger of the bytes out and in at the NIC's "
          "rate, plus one latency; receive: the receiving proxy's counts to flag; read: the "
          "receive kernel reading what arrived. 'now' adds stage, max(post, wire), receive and "
          "read; the GPUDirect design overlaps stage, post and wire.)")
    return result


if __name__ == "__main__":
    main()
