#!/usr/bin/env python3
"""fabric_lib.ep dispatch and combine between GPUs, against NCCL all_to_all_single moving the same
payload bytes in the same run.

Shapes (DeepSeek-V3-like): hidden 7168, top-8 of 256 experts split over the ranks, fp8 e4m3
dispatch (one fp32 scale per 128 elements), bf16 combine; decode 128 tokens per rank, prefill
4096. Routing: uniform random top-k, the same for every iteration. Each timed operation starts
right after a one-element NCCL all-reduce on the stream (so the GPUs start together) and is
timed with CUDA events on the stream: fabric_lib.ep eagerly (Python launches each half) and
replayed from a CUDA graph (one graph per operation), NCCL eagerly. Reports p50/p99 in µs per
rank; a benchmark: it asserts nothing about times.

    python3 bench/ep_bench.py [--shapes decode,prefill] [--iters 200] [--json FILE]
                              [--gpus-per-node N --provider tcp --nics lo] [--devices 0,0]
                              [--proxy-memory auto|host|gpu]

--gpus-per-node N (default: all ranks on one node) sends every rank of another "node" through
the inter-node path (the ranks' proxies and engines of --provider on --nics), here between the
GPUs of one host: its figures are that path's cost on this host, not two nodes'. With it, the
proxies' counters (AllToAll.proxy_stats) give the time split of the eager rounds: per round the
proxy's posting, the writes' completion (engine and fabric) and the receive side's wait from the
counts to the last chunk; the send and receive halves are timed apart as well.

--deepep adds DeepEP's intranode kernels (a baseline built outside this tree by
tools/gpu/build_deepep.sh, imported from PYTHONPATH) on the same tokens, routing and weights:
"deepep dispatch" is its layout kernel and its dispatch of the fp8 tokens with their scales,
top-k indices and weights; "deepep combine" its combine of one bf16 row per received token.
DeepEP's combine takes the experts' outputs already reduced per token on each rank, so it moves
at most one row per (token, rank) pair where fabric_lib.ep moves one per (token, expert) pair:
fewer bytes, and the reduction over a rank's experts left to the caller. auto (the default):
the rows when deep_ep imports, one node only.

--devices lists each rank's GPU (default 0,1,...). Ranks sharing a GPU (0,0: the inter-node
path on a one-GPU machine) time-slice it, so their times are upper bounds; NCCL refuses two
ranks on one GPU, so then gloo aligns the ranks and the NCCL rows are left out.

Spawns one process per GPU itself (torch.multiprocessing, NCCL; NVLink multicast kept off).
"""

import argparse
import json
import os
import socket
import sys
from datetime import timedelta

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(NO_MULTICAST)

SHAPES = {"decode": 128, "prefill": 4096}
HIDDEN, TOP_K, EXPERTS = 7168, 8, 256


def percentiles(samples_ms):
    s = sorted(samples_ms)
    pick = lambda q: s[min(len(s) - 1, int(q * len(s)))] * 1000.0
    return {"p50_us": round(pick(0.50), 1), "p99_us": round(pick(0.99), 1), "n": len(s)}


def routing(rank, n, world):
    """Rank `rank`'s top-k indices (CPU), the same in every process."""
    import torch

    g = torch.Generator().manual_seed(1234 + rank)
    return torch.rand(n, EXPERTS, generator=g).topk(TOP_K, dim=1).indices


def split_bytes(idx_all, world, per_token, per_pair):
    """send[s][d]: dispatch payload bytes from s to d (a token once per destination rank);
    back[s][d]: combine bytes from d to s (one bf16 row per (token, expert) pair)."""
    L = EXPERTS // world
    send = [[0] * world for _ in range(world)]
    back = [[0] * world for _ in range(world)]
    for s, idx in enumerate(idx_all):
        ranks = idx // L
        for d in range(world):
            on_d = (ranks == d)
            send[s][d] = int(on_d.any(dim=1).sum()) * per_token
            back[s][d] = int(on_d.sum()) * per_pair
    return send, back


def deepep_ops(world, dev, x, scales, idx, w, expected_tokens):
    """DeepEP's dispatch and combine as ep_bench operations (see --deepep), and its buffer."""
    import torch
    import torch.distributed as dist

    import deep_ep

    hidden_bytes = HIDDEN * 2
    d_cfg = deep_ep.Buffer.get_dispatch_config(world)
    c_cfg = deep_ep.Buffer.get_combine_config(world)
    nvl = max(d_cfg.get_nvl_buffer_size_hint(hidden_bytes, world),
              c_cfg.get_nvl_buffer_size_hint(hidden_bytes, world))
    buf = deep_ep.Buffer(dist.group.WORLD, nvl, 0)
    topk = idx.to(torch.int64)
    state = {}

    def dispatch():
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, EXPERTS)
        recv, _, recv_w, _, handle, _ = buf.dispatch(
            (x, scales), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=w, config=d_cfg)
        state.update(rows=recv[0].shape[0], handle=handle, weights=recv_w)

    def combine():
        buf.combine(state["y"], state["handle"], topk_weights=state["weights"], config=c_cfg)

    dispatch()
    torch.cuda.synchronize(dev)
    if state["rows"] != expected_tokens:
        raise RuntimeError(f"DeepEP dispatch delivered {state['rows']} tokens, the routing sends "
                           f"{expected_tokens}")
    state["y"] = torch.randn(state["rows"], HIDDEN, device=dev).to(torch.bfloat16)
    combine()
    torch.cuda.synchronize(dev)
    return buf, {"deepep dispatch": [dispatch], "deepep combine": [combine]}


def bench_shape(rank, world, name, n, iters, warmup, nodes, device, nccl, deepep):
    import torch
    import torch.distributed as dist

    from fabric_lib.ep import AllToAll

    dev = torch.device("cuda", device)
    fp8 = torch.float8_e4m3fn
    idx_all = [routing(r, n, world) for r in range(world)]
    idx = idx_all[rank].to(dev).contiguous()
    w = torch.rand(n, TOP_K, device=dev)
    x = (torch.randn(n, HIDDEN, device=dev) * 2).to(fp8)
    scales = torch.rand(n, HIDDEN // 128, device=dev) + 0.5
    a2a = AllToAll(num_experts=EXPERTS, hidden=HIDDEN, top_k=TOP_K, max_tokens_per_rank=n,
                   dtype=fp8, timeout=30.0, **nodes)
    got = a2a.dispatch(x, idx, w, scales=scales)
    y = torch.randn(a2a.max_recv_rows, HIDDEN, device=dev).to(torch.bfloat16)
    out = a2a.combine(y, idx, w)
    torch.cuda.synchronize()
    a2a.check()

    token_bytes = HIDDEN + 4 * (HIDDEN // 128)
    send, back = split_bytes(idx_all, world, token_bytes, 2 * HIDDEN)
    in_splits = send[rank]
    out_splits = [send[s][rank] for s in range(world)]
    nccl_in = torch.empty(sum(in_splits), dtype=torch.uint8, device=dev)
    nccl_out = torch.empty(sum(out_splits), dtype=torch.uint8, device=dev)
    back_in = [back[s][rank] for s in range(world)]  # this rank returns rows to each source
    back_out = back[rank]
    comb_in = torch.empty(sum(back_in), dtype=torch.uint8, device=dev)
    comb_out = torch.empty(sum(back_out), dtype=torch.uint8, device=dev)

    one = torch.ones(1, device=dev)

    def align():
        if nccl:
            dist.all_reduce(one)
        else:  # gloo: the GPU idle on both ranks, then a host barrier
            torch.cuda.synchronize(dev)
            dist.barrier()

    # Each operation is a list of steps; an event is recorded after each, so that the halves of
    # the eager calls are timed apart too.
    ops = {
        "ep dispatch (eager)": [lambda: a2a.dispatch_send(x, idx, w, scales=scales),
                                lambda: a2a.dispatch_recv(out=got)],
        "ep combine (eager)": [lambda: a2a.combine_send(y),
                               lambda: a2a.combine_recv(idx, w, out=out)],
        "nccl dispatch bytes": [lambda: dist.all_to_all_single(nccl_out, nccl_in, out_splits,
                                                               in_splits)],
        "nccl combine bytes": [lambda: dist.all_to_all_single(comb_out, comb_in, back_out,
                                                              back_in)],
    }
    # The same two operations replayed from CUDA graphs (captured after a warm-up round; each
    # capture keeps the dispatch/combine order, which replays continue).
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        a2a.dispatch(x, idx, w, scales=scales, out=got)
        a2a.combine(y, idx, w, out=out)
    torch.cuda.current_stream(dev).wait_stream(side)
    g_dispatch, g_combine = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g_dispatch):
        a2a.dispatch(x, idx, w, scales=scales, out=got)
    with torch.cuda.graph(g_combine):
        a2a.combine(y, idx, w, out=out)
    ops["ep dispatch (graph)"] = [g_dispatch.replay]
    ops["ep combine (graph)"] = [g_combine.replay]

    order = [("ep dispatch (eager)", "ep combine (eager)"),
             ("ep dispatch (graph)", "ep combine (graph)")]
    if nccl:
        order.append(("nccl dispatch bytes", "nccl combine bytes"))
    deepep_buffer = None
    if deepep:
        tokens_in = sum(send[s][rank] for s in range(world)) // token_bytes
        deepep_buffer, more = deepep_ops(world, dev, x, scales, idx, w, tokens_in)
        ops.update(more)
        order.append(("deepep dispatch", "deepep combine"))
    results = {}
    for pair in order:
        times = {k: [] for k in pair}
        # (A build without the counters, such as an older one measured beside this: no split.)
        before = a2a.proxy_stats() if hasattr(a2a, "proxy_stats") else None
        for i in range(warmup + iters):
            for k in pair:  # dispatch, then combine: the all-to-all's order
                events = [torch.cuda.Event(enable_timing=True) for _ in range(len(ops[k]) + 1)]
                align()
                events[0].record()
                for step, ev in zip(ops[k], events[1:]):
                    step()
                    ev.record()
                if i >= warmup:
                    times[k].append(events)
        torch.cuda.synchronize()
        a2a.check()
        for k, evs in times.items():
            results[k] = percentiles([e[0].elapsed_time(e[-1]) for e in evs])
            if len(evs[0]) == 3:
                results[k + " send half"] = percentiles([e[0].elapsed_time(e[1]) for e in evs])
                results[k + " recv half"] = percentiles([e[1].elapsed_time(e[2]) for e in evs])
        if pair[0] == "ep dispatch (eager)" and nodes and before is not None:
            results["proxy"] = proxy_split(before, a2a.proxy_stats())
    memory = getattr(a2a, "proxy_memory", "host" if nodes else "none")
    del deepep_buffer
    a2a.close()
    mb = lambda v: round(v / 1e6, 3)
    results["bytes"] = {"dispatch_sent_MB": mb(sum(in_splits)), "combine_sent_MB": mb(sum(back_in)),
                        "dispatch_payload_per_token": token_bytes, "proxy_memory": memory}
    return results


def proxy_split(before, after):
    """Per kind, the means per round (µs) of the proxy's counters between two proxy_stats()."""
    out = {}
    for kind in ("dispatch", "combine"):
        d = {k: after[kind][k] - before[kind][k] for k in after[kind]}
        sent, got = max(d["rounds_sent"], 1), max(d["rounds_received"], 1)
        out[kind] = {"rounds_sent": d["rounds_sent"], "rounds_received": d["rounds_received"],
                     "bytes_per_round": round(d["bytes_sent"] / sent),
                     "writes_per_round": round(d["writes_sent"] / sent, 2),
                     "post_us": round(d["post_ns"] / sent / 1e3, 2),
                     "complete_us": round(d["complete_ns"] / sent / 1e3, 2),
                     "receive_us": round(d["receive_ns"] / got / 1e3, 2)}
    return out


def worker(rank, world, port, args, queue):
    import torch
    import torch.distributed as dist

    os.environ.update(NO_MULTICAST)
    devices = args.device_list
    torch.cuda.set_device(devices[rank])
    nccl = len(set(devices)) == len(devices)
    dist.init_process_group("nccl" if nccl else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        report = {}
        nodes = {}
        if args.gpus_per_node:
            nodes = {"gpus_per_node": args.gpus_per_node, "provider": args.provider,
                     "nics": [n for n in args.nics.split(",") if n]}
            if args.proxy_memory != "auto":  # (builds before it had no such argument)
                nodes["proxy_memory"] = args.proxy_memory
        for name in args.shapes.split(","):
            report[name] = bench_shape(rank, world, name, SHAPES[name], args.iters, args.warmup,
                                       nodes, devices[rank], nccl, args.deepep_on)
        queue.put((rank, report))
    finally:
        dist.destroy_process_group()


def main():
    import torch
    import torch.multiprocessing as mp

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="decode,prefill")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--gpus-per-node", type=int, default=0,
                   help="ranks of one node (0: all); the others go through the proxies")
    p.add_argument("--provider", default="tcp", help="the proxies' engine provider")
    p.add_argument("--nics", default="lo", help="the proxies' NICs, comma-separated")
    p.add_argument("--proxy-memory", default="auto",
                   help="where the proxies' areas are: auto, host or gpu")
    p.add_argument("--deepep", choices=("auto", "on", "off"), default="auto",
                   help="DeepEP's rows: auto (when deep_ep imports, one node), on, off")
    p.add_argument("--devices", default="",
                   help="each rank's GPU, comma-separated (default 0,1,...; 0,0: one GPU)")
    args = p.parse_args()
    args.device_list = ([int(d) for d in args.devices.split(",")] if args.devices
                        else list(range(args.world)))
    if len(args.device_list) != args.world:
        p.error(f"--devices names {len(args.device_list)} GPUs for --world {args.world}")
    args.deepep_on = False
    if args.deepep != "off" and not args.gpus_per_node:
        try:
            import deep_ep  # noqa: F401

            args.deepep_on = True
        except ImportError as e:
            if args.deepep == "on":
                p.error(f"--deepep on: deep_ep does not import ({e}); tools/gpu/build_deepep.sh")
    elif args.deepep == "on":
        p.error("--deepep on: DeepEP's intranode kernels need one node (no --gpus-per-node)")
    if torch.cuda.device_count() <= max(args.device_list):
        print(f"needs GPU {max(args.device_list)}, torch sees {torch.cuda.device_count()}")
        return 77
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(worker, args=(args.world, port, args, queue), nprocs=args.world, join=True)
    reports = dict(queue.get() for _ in range(args.world))
    where = (f", {args.gpus_per_node} GPU(s) per node, proxies over {args.provider} "
             f"({args.nics})" if args.gpus_per_node else ", one node")
    print(f"# fabric_lib.ep vs NCCL all_to_all_single{' and DeepEP' if args.deepep_on else ''}, "
          f"{args.world} ranks on GPUs "
          f"{args.device_list}{where}, hidden {HIDDEN}, top-{TOP_K} of {EXPERTS} experts, fp8 "
          f"dispatch, bf16 combine, {args.iters} iterations")
    for shape in args.shapes.split(","):
        print(f"\n## {shape}: {SHAPES[shape]} tokens per rank; "
              f"bytes and the proxy's areas (rank 0): {reports[0][shape]['bytes']}\n")
        print("| operation | " + " | ".join(f"rank {r} p50 / p99 µs" for r in range(args.world))
              + " |")
        print("| --- |" + " ---: |" * args.world)
        for op in [k for k in reports[0][shape] if k not in ("bytes", "proxy")]:
            cells = [f"{reports[r][shape][op]['p50_us']} / {reports[r][shape][op]['p99_us']}"
                     for r in range(args.world)]
            print(f"| {op} | " + " | ".join(cells) + " |")
        if "proxy" in reports[0][shape]:
            print(f"\nproxy, per round and peer, eager rounds (µs; means):\n")
            print("| rank | kind | bytes | writes | post | complete | receive |")
            print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
            for r in range(args.world):
                for kind, v in reports[r][shape]["proxy"].items():
                    print(f"| {r} | {kind} | {v['bytes_per_round']} | {v['writes_per_round']} | "
                          f"{v['post_us']} | {v['complete_us']} | {v['receive_us']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world": args.world, "iters": args.iters, "devices": args.device_list,
                       "gpus_per_node": args.gpus_per_node or args.world,
                       "provider": args.provider if args.gpus_per_node else None,
                       "reports": reports}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
