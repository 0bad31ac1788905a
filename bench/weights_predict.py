"""The written model of docs/weights.md ("A model of the 1T push"): predicts the reference's
Kimi-K2 push (1.0e12 parameters, 256 BF16 training GPUs as FSDP 16 x PP 2 x EP 8, 128 FP8
inference GPUs as 4 replicas of EP 32, one 400 Gbps NIC per GPU) from the projection rate and
the per-submission posting cost that bench/weights_bench.py measured, and sets a broadcast
design against it.

    weights_predict.py [--json weights_bench.json] [--gather-s 0.518]

Without --json it uses --project-gbs and --post-us. The gather term is not modelled: it is the
reference's own measurement (full_tensor on the critical path), unless --gather-s says otherwise.
"""

import argparse
import json

GB = 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="bench/weights_bench.py --json output")
    ap.add_argument("--params", type=float, default=1.0e12)
    ap.add_argument("--trainers", type=int, default=256)
    ap.add_argument("--inference", type=int, default=128)
    ap.add_argument("--inference-ep", type=int, default=32)
    ap.add_argument("--nic-gbps", type=float, default=400.0, help="per GPU, each direction")
    ap.add_argument("--writes-per-rank", type=int, default=1144, help="the reference's count")
    ap.add_argument("--gather-s", type=float, default=0.518)
    ap.add_argument("--project-gbs", type=float, default=2000.0,
                    help="BF16 bytes projected per second per GPU (without --json)")
    ap.add_argument("--post-us", type=float, default=20.0, help="per submission (without --json)")
    args = ap.parse_args()
    source = "assumed"
    if args.json:
        with open(args.json) as f:
            row = json.load(f)[0]  # the CUDA IPC phase: the projection runs on the GPU there
        push = row["push"]
        if "project_only_s" in row:  # every projection timed alone on an otherwise idle GPU
            args.project_gbs = row["train_bytes"] / row["project_only_s"] / GB
        else:  # projected bytes out are FP8 (1 B) for most of the model: BF16 in about twice
            args.project_gbs = 2 * push["bytes"] / push["project"] / GB
        args.post_us = push["post"] / max(1, push["writes"]) * 1e6
        source = f"measured ({args.json})"
    nic = args.nic_gbps / 8 * GB  # bytes/s per GPU
    replicas = args.inference // args.inference_ep
    written = replicas * args.params  # FP8: one byte per parameter into every replica
    per_receiver = args.params / args.inference_ep
    per_sender = written / args.trainers
    t_recv, t_send = per_receiver / nic, per_sender / nic
    t_project = 2 * per_sender / (args.project_gbs * GB)
    t_post = args.writes_per_rank * args.post_us * 1e-6
    t_p2p = args.gather_s + max(t_recv, t_send, t_project + t_post)
    # Broadcast: every inference GPU receives every tensor whole (then keeps its slice).
    t_bcast = args.params / nic
    print(f"rates ({source}): projection {args.project_gbs:.0f} GB/s of BF16 per GPU, "
          f"{args.post_us:.1f} us per submission; NIC {nic / GB:.0f} GB/s per GPU")
    print(f"bytes: {written / GB:.0f} GB written per push, {per_sender / GB:.1f} GB sent per "
          f"training GPU, {per_receiver / GB:.1f} GB received per inference GPU")
    print(f"point-to-point push: gather {args.gather_s:.3f} s (reference) + max(receive "
          f"{t_recv:.3f}, send {t_send:.3f}, project {t_project:.3f} + post {t_post:.3f}) = "
          f"{t_p2p:.2f} s   (reference: 1.3 s)")
    print(f"broadcast design: each inference GPU receives the whole model, {args.params / GB:.0f}"
          f" GB at {nic / GB:.0f} GB/s = {t_bcast:.1f} s ({t_bcast / t_recv:.0f}x the bytes of "
          f"its own shard; checkpoint-engine measured 16 s)")


if __name__ == "__main__":
    main()
