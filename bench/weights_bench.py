"""RL weight push between two GPUs of one host (tools/gpu/run_weights.sh runs it there).

A synthetic MoE model shaped like Qwen3-235B-A22B (hidden 4096, 64 query and 4 KV heads of 128,
128 experts of intermediate 1536 per layer, stacked per layer unless --per-expert), cut to
--layers layers (5: 24.9 GB of BF16), lives
on GPU 0 in a training process; an inference process on GPU 1 holds it in its inference layout
(fused QKV; experts as FP8 e4m3 with 128x128 block scales unless --no-fp8) in two copies (flip
mode). In one run, on the same bytes:

  push        fabric_lib.weights (gather = identity: one trainer) over the engine's CUDA IPC
              path: seconds per stage, GB/s of projected bytes, the inference side's
              prepare -> complete time; a sample of parameters verified by checksum
  bound       the projected bytes copied GPU 0 -> GPU 1 by torch's copy_ (cudaMemcpyPeerAsync)
              in 1 GiB pieces
  broadcast   torch.distributed.broadcast over NCCL, one call per projected tensor (the tensors
              projected beforehand, untimed): the common baseline
  staged      the fabric path through host memory (Config.cuda_ipc = "off") over each of
              --staged-providers, on a smaller model (--staged-layers, --staged-experts)

--devices 0,0 puts both processes on one GPU (a rehearsal where only one is lent: no NCCL row,
the bound a copy within the GPU, and the two processes time-slice it).

Medians of --iters. NCCL_NVLS_ENABLE=0 in every process. Prints a table; --json writes it.
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import fabric_lib  # noqa: E402
import fabric_lib.weights as fw  # noqa: E402

GB = 1e9


def model(layers, experts, hidden, inter, q_heads, kv_heads, head_dim, fp8, stacked):
    """(training params {name: shape}, inference layout [(name, add kwargs, shape, dtype)]).
    stacked: each layer's experts as one [experts x rows, cols] tensor per matrix (the fused-MoE
    layout; 128-row tiles never straddle two experts, so the FP8 bytes are the per-expert
    ones); otherwise one parameter per expert matrix (thousands of small parameters)."""
    train, layout = {}, []
    bf16, u8, f32 = torch.bfloat16, torch.uint8, torch.float32
    for layer in range(layers):
        p = f"l{layer}."
        q, kv = q_heads * head_dim, kv_heads * head_dim
        train.update({p + "q": (q, hidden), p + "k": (kv, hidden), p + "v": (kv, hidden),
                      p + "o": (hidden, q), p + "norm1": (hidden,), p + "norm2": (hidden,),
                      p + "router": (experts, hidden)})
        layout += [(p + "qkv", dict(projection="concat", sources=[p + "q", p + "k", p + "v"]),
                    (q + 2 * kv, hidden), bf16)]
        layout += [(p + n, {}, train[p + n], bf16) for n in ("o", "norm1", "norm2", "router")]
        mats = (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter)))
        if stacked:
            expert_params = [(f"{p}experts.{n}", (experts * r, c)) for n, (r, c) in mats]
        else:
            expert_params = [(f"{p}e{e}.{n}", shape) for e in range(experts) for n, shape in mats]
        for name, shape in expert_params:
            train[name] = shape
            if not fp8:
                layout.append((name, {}, shape, bf16))
                continue
            tiles = ((shape[0] + 127) // 128, (shape[1] + 127) // 128)
            layout.append((name, dict(projection="fp8_quantize", dtype="fp8_e4m3"), shape, u8))
            layout.append((name + ".scale", dict(projection="fp8_scale", sources=[name]),
                           tiles, f32))
    return train, layout


def nbytes(shape, dtype):
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=dtype).element_size()


def checksum(t):
    """A position-weighted sum of the tensor's bytes (equal tensors, equal sums)."""
    b = t.contiguous().view(torch.uint8).view(-1).to(torch.int64)
    w = torch.arange(b.numel(), device=b.device, dtype=torch.int64) % 65521 + 1
    return int((b * w).sum())


def gpu_indices(args):
    """The trainer's and the inference side's GPU indices (--devices)."""
    return tuple(int(d) for d in args.devices.split(","))


def devices(args):
    """The two --devices (GPU 0 and GPU 1 by default), or the CPU twice with --cpu (a smoke run
    of this script anywhere)."""
    return ("cpu", "cpu") if args.cpu else tuple(f"cuda:{d}" for d in gpu_indices(args))


def one_gpu(args):
    """Both sides on one GPU (--devices 0,0): two processes time-slice it, NCCL refuses two
    ranks on one device, and the bound is a copy within that GPU's memory."""
    return not args.cpu and len(set(gpu_indices(args))) == 1


def sync(args):
    if not args.cpu:
        for d in set(gpu_indices(args)):
            torch.cuda.synchronize(d)


def config(provider, cuda_ipc):
    nics = {"tcp": ["lo"], "shm": ["shm"]}[provider]
    return fabric_lib.Config(provider=provider, nics=nics, cuda_ipc=cuda_ipc)


def start(args, rank, provider, cuda_ipc, directory, nccl):
    """A bench process: its GPU, NCCL (or gloo) when the baselines run, engine, registry."""
    if not args.cpu:
        torch.cuda.set_device(gpu_indices(args)[rank])
    if nccl:
        dist.init_process_group("gloo" if args.cpu else "nccl", init_method=nccl, rank=rank,
                                world_size=2)
    engine = fabric_lib.TransferEngine(config(provider, cuda_ipc))
    return engine, fabric_lib.FileRegistry(directory, poll_interval=0.1)


def project(weights, name, kwargs):
    """The projected tensors of inference parameter `name`, computed outside the push (an FP8
    weight gives its bytes and its scales; its scale parameter gives nothing)."""
    kind = kwargs.get("projection", "identity")
    if kind == "concat":
        return [torch.cat([weights[s] for s in kwargs["sources"]], 0)]
    if kind == "fp8_quantize":
        return list(fw.quantize_fp8(weights[name]))
    if kind == "fp8_scale":
        return []
    return [weights[name]]


def trainer_main(conn, args, shape_args, provider, cuda_ipc, directory, group, nccl):
    dev0, dev1 = devices(args)
    engine, registry = start(args, 0, provider, cuda_ipc, directory, nccl)
    train, layout = model(*shape_args)
    trainer = fw.TrainerWeights(engine, 0, 1, registry, group=group, device=dev0,
                                max_temp_bytes=int(args.max_temp_gib * (1 << 30)), timeout=120.0)
    g = torch.Generator(device=dev0).manual_seed(1)
    weights = {n: (torch.randn(s, generator=g, device=dev0) * 0.02).to(torch.bfloat16)
               for n, s in train.items()}
    for n, t in weights.items():
        trainer.add(n, t)
    trainer.publish()
    conn.send(sum(t.numel() * 2 for t in weights.values()))
    trainer.connect(1)
    conn.send("connected")
    results = {}
    while True:
        cmd, arg = conn.recv()
        if cmd == "push":
            sync(args)
            if args.profile and arg == args.iters + 1:  # the last push, under cProfile
                import cProfile
                import pstats
                profile = cProfile.Profile()
                results = profile.runcall(trainer.push, arg)
                with open(args.profile, "a") as f:
                    f.write(f"== trainer.push, {provider} cuda_ipc={cuda_ipc}\n")
                    pstats.Stats(profile, stream=f).sort_stats("tottime").print_stats(25)
            else:
                results = trainer.push(arg)
            conn.send(results)
        elif cmd == "checksums":  # the projection, computed here independently of the push
            out = {}
            for name, kwargs, shape, dtype in layout:
                if name in arg and kwargs.get("projection") == "fp8_scale":
                    out[name] = checksum(fw.quantize_fp8(weights[kwargs["sources"][0]])[1])
                elif name in arg:
                    out[name] = checksum(project(weights, name, kwargs)[0])
            conn.send(out)
        elif cmd == "project":  # every projection alone, no writes: the GPU's projection rate
            sync(args)
            times = []
            for _ in range(args.iters):
                t = time.perf_counter()
                fp8 = []  # quantised together, as the push does (quantize_fp8_many)
                for name, kwargs, _, _ in layout:
                    if kwargs.get("projection") == "fp8_quantize":
                        fp8.append(weights[name])
                    else:
                        project(weights, name, kwargs)
                fw.quantize_fp8_many(fp8)
                sync(args)
                times.append(time.perf_counter() - t)
            conn.send(times)
        elif cmd == "bound":  # cudaMemcpyPeerAsync of `arg` bytes in 1 GiB pieces
            piece = min(arg, 1 << 30)
            a = torch.empty(piece, dtype=torch.uint8, device=dev0)
            b = torch.empty(piece, dtype=torch.uint8, device=dev1)
            b.copy_(a)
            sync(args)
            times = []
            for _ in range(args.iters):
                t = time.perf_counter()
                left = arg
                while left > 0:
                    n = min(piece, left)
                    b[:n].copy_(a[:n], non_blocking=True)
                    left -= n
                sync(args)
                times.append(time.perf_counter() - t)
            del a, b
            conn.send(times)
        elif cmd == "broadcast":
            projected = [t for name, kwargs, _, _ in layout for t in project(weights, name, kwargs)]
            sync(args)
            times = []
            for _ in range(args.iters + 1):
                dist.barrier()
                t = time.perf_counter()
                for x in projected:
                    dist.broadcast(x.view(-1).view(torch.uint8), src=0)  # bytes: gloo lacks bf16
                sync(args)
                times.append(time.perf_counter() - t)
            del projected
            conn.send(times[1:])
        elif cmd == "exit":
            engine.close()
            conn.send("bye")
            return


def inference_main(conn, args, shape_args, provider, cuda_ipc, directory, group, nccl):
    _, dev1 = devices(args)
    engine, registry = start(args, 1, provider, cuda_ipc, directory, nccl)
    _, layout = model(*shape_args)
    inf = fw.InferenceWeights(engine, 0, registry, group=group, mode="flip", timeout=120.0)
    total = sum(nbytes(s, d) + 256 for _, _, s, d in layout)
    arenas = [torch.zeros(total, dtype=torch.uint8, device=dev1) for _ in range(2)]
    for a in arenas:
        inf.add_arena(a)
    at = 0
    for name, kwargs, shape, dtype in layout:
        n = nbytes(shape, dtype)
        views = [a[at : at + n].view(dtype).view(shape) for a in arenas]
        inf.add(name, views[0], spare=views[1], **kwargs)
        at += (n + 255) // 256 * 256
    inf.publish()
    conn.send(total)
    while True:
        cmd, arg = conn.recv()
        if cmd == "prepare":
            t = time.perf_counter()
            future = inf.prepare(arg)
            conn.send("armed")
            future.result(120)
            conn.send(time.perf_counter() - t)
        elif cmd == "checksums":
            tensors = inf.tensors()
            conn.send({n: checksum(tensors[n]) for n in arg})
        elif cmd == "broadcast":
            recv = []
            tensors = inf.tensors()
            for name, kwargs, shape, dtype in layout:
                if kwargs.get("projection") != "fp8_scale":
                    recv.append(tensors[name])
                if kwargs.get("projection") == "fp8_quantize":
                    recv.append(tensors[name + ".scale"])
            for _ in range(args.iters + 1):
                dist.barrier()
                for x in recv:
                    dist.broadcast(x.view(-1).view(torch.uint8), src=0)  # bytes: gloo lacks bf16
                sync(args)
            conn.send("done")
        elif cmd == "exit":
            engine.close()
            conn.send("bye")
            return


def run_phase(args, shape_args, provider, cuda_ipc, group, with_baselines):
    ctx = mp.get_context("spawn")
    directory = tempfile.mkdtemp(prefix="fabric-weights-", dir="/dev/shm")
    # NCCL's broadcast needs two GPUs: with both sides on one there is no process group.
    nccl = f"file://{directory}/nccl-init" if with_baselines and not one_gpu(args) else None
    pipes, procs = [], []
    for target in (trainer_main, inference_main):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=target, args=(child, args, shape_args, provider, cuda_ipc,
                                              directory, group, nccl))
        p.start()
        pipes.append(parent)
        procs.append(p)
    tr, inf = pipes
    out = {"provider": provider, "cuda_ipc": cuda_ipc}
    try:
        out["train_bytes"] = tr.recv()
        out["inference_bytes_per_copy"] = inf.recv()
        t = time.perf_counter()
        assert tr.recv() == "connected"
        out["connect_s"] = time.perf_counter() - t
        pushes, completes = [], []
        for version in range(1, args.iters + 2):  # the first is a warm-up
            inf.send(("prepare", version))
            assert inf.recv() == "armed"
            tr.send(("push", version))
            stats = tr.recv()
            completes.append(inf.recv())
            pushes.append(stats)
        out["warmup"] = pushes[0]
        timed = pushes[1:]
        out["push"] = {k: statistics.median(s[k] for s in timed) for k in timed[0]}
        out["complete_s"] = statistics.median(completes[1:])
        _, layout = model(*shape_args)
        sample = [layout[i][0] for i in sorted({0, 1, 5, len(layout) // 2, len(layout) - 1,
                                                len(layout) - 2})]
        tr.send(("checksums", sample))
        want = tr.recv()
        inf.send(("checksums", sample))
        got = inf.recv()
        out["verified"] = [n for n in sample if want[n] == got[n]]
        out["mismatched"] = [n for n in sample if want[n] != got[n]]
        if with_baselines:
            tr.send(("project", None))
            out["project_only_s"] = statistics.median(tr.recv())
            tr.send(("bound", int(out["push"]["bytes"])))
            out["bound_s"] = statistics.median(tr.recv())
            if nccl:
                tr.send(("broadcast", None))
                inf.send(("broadcast", None))
                out["broadcast_s"] = statistics.median(tr.recv())
                inf.recv()
        for p in pipes:
            p.send(("exit", None))
            p.recv()
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        shutil.rmtree(directory, ignore_errors=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=1536)
    ap.add_argument("--q-heads", type=int, default=64)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--no-fp8", action="store_true")
    ap.add_argument("--per-expert", action="store_true",
                    help="one parameter per expert matrix instead of one stacked per layer")
    ap.add_argument("--provider", default="shm", help="the engines' transport for messages")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--max-temp-gib", type=float, default=2.0)
    ap.add_argument("--staged-providers", default="shm tcp")
    ap.add_argument("--staged-layers", type=int, default=1)
    ap.add_argument("--staged-experts", type=int, default=8)
    ap.add_argument("--json")
    ap.add_argument("--profile", help="append a cProfile of the trainer's last push to this file "
                    "(that push's times are then not representative; the medians include it)")
    ap.add_argument("--devices", default="0,1",
                    help="the trainer's GPU and the inference side's, e.g. 0,1; 0,0 puts both on "
                         "one GPU (no NCCL row; the bound is a copy within that GPU)")
    ap.add_argument("--cpu", action="store_true",
                    help="both processes on the CPU, gloo for the broadcast: a smoke run")
    args = ap.parse_args()
    if not args.cpu and torch.cuda.device_count() <= max(gpu_indices(args)):
        print(f"weights_bench.py: --devices {args.devices} needs "
              f"{max(gpu_indices(args)) + 1} GPUs; this machine has {torch.cuda.device_count()}")
        return 2
    fp8 = not args.no_fp8
    shape = (args.layers, args.experts, args.hidden, args.inter, args.q_heads, args.kv_heads,
             args.head_dim, fp8, not args.per_expert)
    rows = [run_phase(args, shape, args.provider, "auto", "ipc", True)]
    small = (args.staged_layers, args.staged_experts) + shape[2:]
    for provider in args.staged_providers.split():
        rows.append(run_phase(args, small, provider, "off", "staged-" + provider, False))
    print(f"model: {args.layers} layers x {args.experts} experts "
          f"({'per-expert parameters' if args.per_expert else 'stacked per layer'}), "
          f"{rows[0]['train_bytes'] / GB:.2f} GB BF16 on {devices(args)[0]}; inference layout "
          f"{'FP8 experts' if fp8 else 'BF16'}, {rows[0]['inference_bytes_per_copy'] / GB:.2f} "
          f"GB per copy x 2 (flip) on {devices(args)[1]}; iters {args.iters} (medians)")
    if one_gpu(args):
        print(f"both sides on {devices(args)[0]}: two processes time-slice the GPU; the bound is "
              "a copy within its memory, and NCCL's broadcast (two ranks on one GPU) is not run")
    for r in rows:
        p = r["push"]
        gbs = p["bytes"] / p["total"] / GB
        line = (f"{r['provider']:>4} cuda_ipc={r['cuda_ipc']:<4} push {p['total'] * 1e3:8.1f} ms "
                f"{gbs:7.1f} GB/s  (project {p['project'] * 1e3:.1f}, post {p['post'] * 1e3:.1f}, "
                f"wait_ring {p.get('wait_ring', 0) * 1e3:.1f}, drain {p['drain'] * 1e3:.1f}, wait_ready {p['wait_ready'] * 1e3:.1f} ms; "
                f"inference prepare->complete {r['complete_s'] * 1e3:.1f} ms; temp high-water "
                f"{p['temp_high_water'] / GB:.2f} GB; {p['writes']:.0f} submissions, "
                f"{p['post'] / max(1, p['writes']) * 1e6:.1f} us each)  verified "
                f"{len(r['verified'])}/{len(r['verified']) + len(r['mismatched'])}")
        print(line)
        if "project_only_s" in r:
            print(f"     projection alone (every parameter, no writes) "
                  f"{r['project_only_s'] * 1e3:8.1f} ms {r['train_bytes'] / r['project_only_s'] / GB:7.1f}"
                  f" GB/s of BF16 in")
        if "bound_s" in r:
            b = p["bytes"] / r["bound_s"] / GB
            what = "copy within the GPU" if one_gpu(args) else "cudaMemcpyPeerAsync"
            print(f"     bound ({what}, same bytes) {r['bound_s'] * 1e3:8.1f} ms "
                  f"{b:7.1f} GB/s; push / bound = {gbs / b:.2f}")
        if "broadcast_s" in r:
            c = p["bytes"] / r["broadcast_s"] / GB
            print(f"     NCCL broadcast per tensor (pre-projected) {r['broadcast_s'] * 1e3:8.1f} ms"
                  f" {c:7.1f} GB/s; push / broadcast = {gbs / c:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(not r["mismatched"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
