#!/usr/bin/env python3
"""NCCL send/recv between GPU 0 and GPU 1 through torch.distributed: the baseline for
`fabric-bench-gpu --op nvlink --peer-gpu 1` (same machine, same run).

Rows, like that benchmark's:
  single   per size, a window of sends in flight (up to 64, 256 MiB at most) issued by rank 0
           and received by rank 1 (batch_isend_irecv), timed on rank 0 until its stream is done;
           and one send alone
  ping-pong  4 KiB rank 0 -> rank 1 -> rank 0: round trip p50, and half of it

Run: python3 bench/nccl_p2p.py [--iters 11]. Needs two GPUs; NVLink multicast stays off.
"""
import argparse
import os
import socket
import statistics
import time

for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
             ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[k] = v

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20, 1 << 30]
WINDOW_BYTES = 256 << 20


def window_of(n):
    return max(1, min(64, WINDOW_BYTES // n))


def worker(rank, port, iters, results):
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, device_id=torch.device("cuda", rank))
    buf = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    buf.fill_(rank + 1)
    peer = 1 - rank
    rows = []

    def ops(n, window):
        out = []
        for i in range(window):
            off = i * n if (i + 1) * n <= buf.numel() else 0
            t = buf[off:off + n]
            out.append(dist.P2POp(dist.isend if rank == 0 else dist.irecv, t, peer))
        return out

    def run(n, window):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for r in dist.batch_isend_irecv(ops(n, window)):
            r.wait()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    for n in SIZES:
        window = window_of(n)
        many, one = [], []
        for it in range(iters + 1):
            t_many = run(n, window)
            t_one = run(n, 1)
            if it:
                many.append(t_many)
                one.append(t_one)
        rows.append((n, window, statistics.median(many), statistics.median(one)))
    # Ping-pong, 4 KiB.
    small = buf[:4096]
    rtt = []
    for i in range(2200):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(small, 1)
            dist.recv(small, 1)
        else:
            dist.recv(small, 0)
            dist.send(small, 0)
        torch.cuda.synchronize()
        if i >= 200:
            rtt.append(time.perf_counter() - t0)
    if rank == 0:
        results.put((rows, statistics.median(rtt)))
    dist.barrier()
    dist.destroy_process_group()


def fmt_bytes(n):
    if n >= 1 << 30:
        return f"{n >> 30} GiB"
    if n >= 1 << 20:
        return f"{n >> 20} MiB"
    return f"{n >> 10} KiB"


def main():
    import torch
    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=11)
    args = ap.parse_args()
    if torch.cuda.device_count() < 2:
        print("nccl_p2p: needs two GPUs; this machine has", torch.cuda.device_count())
        return 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, args.iters, results)) for r in range(2)]
    for p in procs:
        p.start()
    rows, rtt = results.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    print(f"NCCL {torch.cuda.nccl.version()} send/recv, GPU 0 -> GPU 1, torch {torch.__version__},"
          f" medians of {args.iters} runs")
    print(f"{'single write':<14} {'window':>6} {'NCCL GB/s':>12} {'one: NCCL us':>13}")
    for n, window, many, one in rows:
        print(f"{fmt_bytes(n):<14} {window:>6} {n * window / many / 1e9:>12.2f} {one * 1e6:>13.1f}")
    print(f"ping-pong 4 KiB: RTT p50 {rtt * 1e6:.1f} us, one way (half) {rtt * 5e5:.1f} us")
    return 0 if all(p.exitcode == 0 for p in procs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
