"""One MoE layer end to end with fabric_lib.ep, checked against a dense PyTorch reference.

Each rank (one process per GPU) routes its own tokens (linear -> softmax -> top-4 of 16 experts,
weights renormalised), dispatches them to the ranks that hold their experts, runs its local
experts (one matmul W_e [hidden, hidden] each) over the rows it received, and combines the
outputs back into its tokens' order. The reference computes the same layer densely on the
rank's own tokens. Needs fabric_lib built with CUDA and a GPU per rank (or one GPU for both:
--devices 0,0). Run (PYTHONPATH=build/python):

    python3 examples/moe_layer.py                         # 2 ranks on GPUs 0 and 1, bf16
    python3 examples/moe_layer.py --devices 0,0           # both ranks on one GPU
    python3 examples/moe_layer.py --two-nodes --dtype fp8 # the inter-node path, fp8 dispatch

See docs/moe.md ("Example").
"""

import argparse
import os
import socket
import sys
from datetime import timedelta

# Never NVLink multicast: on a shared host it can take the GPUs out of service. Set before torch
# starts and inherited by the spawned ranks.
os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
                  NVSHMEM_DISABLE_NVLS="1")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TOKENS, HIDDEN, EXPERTS, TOP_K = 128, 1024, 16, 4  # per rank; 16 experts split over the ranks
BLOCK = 128  # fp8 tokens carry one fp32 scale per 128 elements


def make_layer(hidden, experts, device):
    """The router [hidden, experts] and expert weights [experts, hidden, hidden], bf16. Seeded:
    every rank builds the same layer (a real model would load its checkpoint shard)."""
    g = torch.Generator().manual_seed(0)
    router = torch.randn(hidden, experts, generator=g) / hidden ** 0.5
    w = torch.randn(experts, hidden, hidden, generator=g) / hidden ** 0.5
    return router.to(device, torch.bfloat16), w.to(device, torch.bfloat16)


def route(x, router, top_k):
    """Top-k experts per token (int64) and their softmax weights renormalised to sum 1 (fp32)."""
    probs = torch.softmax((x @ router).float(), dim=-1)
    weights, idx = probs.topk(top_k, dim=-1)
    return idx.contiguous(), (weights / weights.sum(-1, keepdim=True)).contiguous()


def quantize_fp8(x):
    """bf16 [n, hidden] -> fp8 e4m3 [n, hidden] and fp32 scales [n, hidden / 128] (per block)."""
    blocks = x.float().view(x.shape[0], x.shape[1] // BLOCK, BLOCK)
    scales = blocks.abs().amax(-1).clamp(min=1e-6) / 448.0  # 448: e4m3's largest value
    q = (blocks / scales.unsqueeze(-1)).to(torch.float8_e4m3fn)
    return q.view(x.shape), scales.contiguous()


def dequantize(q, scales):
    blocks = q.float().view(q.shape[0], q.shape[1] // BLOCK, BLOCK)  # (0 rows allowed)
    return (blocks * scales.unsqueeze(-1)).view(q.shape).to(torch.bfloat16)


def reference(x, idx, weights, expert_w):
    """The layer densely: out[t] = sum_k weights[t, k] * (x[t] @ W[idx[t, k]]), fp32, bf16."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(expert_w.shape[0]):
        w_e = (weights * (idx == e)).sum(-1, keepdim=True)  # token t's weight for expert e
        out += w_e * (x @ expert_w[e]).float()
    return out.to(torch.bfloat16)


def rank_main(rank, args, port):
    import fabric_lib.ep

    world, fp8 = len(args.devices), args.dtype == "fp8"
    torch.cuda.set_device(args.devices[rank])
    # The process group only carries the buffers' handles at creation (all_gather_object).
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    router, expert_w = make_layer(HIDDEN, EXPERTS, "cuda")
    g = torch.Generator().manual_seed(1 + rank)  # each rank its own tokens
    x = torch.randn(TOKENS, HIDDEN, generator=g).to("cuda", torch.bfloat16)
    idx, weights = route(x, router, TOP_K)

    # Collective: every rank creates it. --two-nodes makes each GPU its own node, so every byte
    # goes through the ranks' host proxies over the tcp provider (on loopback here).
    nodes = dict(gpus_per_node=1, provider="tcp", nics=["lo"]) if args.two_nodes else {}
    a2a = fabric_lib.ep.AllToAll(num_experts=EXPERTS, hidden=HIDDEN, top_k=TOP_K,
                                 max_tokens_per_rank=TOKENS,
                                 dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16, **nodes)
    L = a2a.num_local_experts  # this rank holds experts [rank * L, (rank + 1) * L)

    # Dispatch: the send half stores the tokens into their experts' ranks; the receive half waits
    # for every rank's tokens and lays out one row per (token, local expert), grouped by expert.
    # Independent work (shared experts, attention of another micro-batch) could go in between.
    if fp8:
        tokens, scales = quantize_fp8(x)
        a2a.dispatch_send(tokens, idx, weights, scales=scales)
    else:
        a2a.dispatch_send(x, idx, weights)
    got = a2a.dispatch_recv()

    # The experts: local expert e's rows are [expert_offsets[e], expert_offsets[e + 1]). Read on
    # the host here for clarity; a grouped GEMM would read the offsets on the GPU. An fp8 GEMM
    # would take tokens and scales directly; here they are dequantised to bf16 first.
    expert_out = torch.empty(a2a.max_recv_rows, HIDDEN, dtype=torch.bfloat16, device="cuda")
    offsets = got.expert_offsets.tolist()
    for e in range(L):
        rows = slice(offsets[e], offsets[e + 1])
        t = dequantize(got.tokens[rows], got.scales[rows]) if fp8 else got.tokens[rows]
        expert_out[rows] = t @ expert_w[rank * L + e]  # unweighted: combine applies the weights

    # Combine: each row goes home; the token's rank sums its top-k rows weighted (fp32 -> bf16).
    a2a.combine_send(expert_out)
    out = a2a.combine_recv(idx, weights)
    torch.cuda.synchronize()
    a2a.check()  # raises what a kernel recorded (a peer's timeout, say)

    # The reference on the tokens as they were sent (fp8: after the same quantisation).
    x_sent = dequantize(tokens, scales) if fp8 else x
    ref = reference(x_sent, idx, weights, expert_w)
    err = (out.float() - ref.float()).abs()
    ok = bool((err <= 2e-2 + 2e-2 * ref.float().abs()).all())
    print(f"rank {rank}: {offsets[-1]} rows for experts {rank * L}..{(rank + 1) * L - 1}, "
          f"max |out - ref| = {err.max().item():.4f} (max |ref| {ref.abs().max().item():.2f}), "
          f"{'OK' if ok else 'MISMATCH'}", flush=True)
    a2a.close()  # collective: waits for every rank, then frees the buffers
    dist.destroy_process_group()
    if not ok:
        sys.exit(1)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", default="0,1", help="GPU of each rank (0,0: one GPU for both)")
    p.add_argument("--two-nodes", action="store_true",
                   help="every GPU its own node: the inter-node (proxy) path over tcp")
    p.add_argument("--dtype", choices=["bf16", "fp8"], default="bf16",
                   help="dispatch dtype (fp8: e4m3 with per-128 scales); combine is bf16")
    args = p.parse_args()
    args.devices = [int(d) for d in args.devices.split(",")]
    import fabric_lib

    if not fabric_lib.HAS_CUDA or torch.cuda.device_count() <= max(args.devices):
        sys.exit(f"needs fabric_lib built with CUDA (HAS_CUDA={fabric_lib.HAS_CUDA}) and GPUs "
                 f"{args.devices} (torch sees {torch.cuda.device_count()})")
    if args.dtype == "fp8" and not hasattr(torch, "float8_e4m3fn"):
        sys.exit(f"torch {torch.__version__} has no float8_e4m3fn")
    with socket.socket() as s:  # a free port for the ranks' process group
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.spawn(rank_main, args=(args, port), nprocs=len(args.devices))
    except Exception as e:  # a rank raised or exited non-zero (its output says why)
        sys.exit(f"FAILED: {e}")
    print("OK")


if __name__ == "__main__":
    main()
