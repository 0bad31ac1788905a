"""The small model of the weight-push tests and the training process that pushes it.

Both sides build their descriptions from MODEL; the trainer's weights for version v are
pseudo-random (seeded by name and v), so the test process computes what every inference tensor
must hold after push v with plain PyTorch (reference()).
"""

import time
import zlib

import torch

# Training parameters: name -> (shape, dtype).
TRAINING = {
    "embed": ((64, 48), torch.bfloat16),
    "q": ((32, 48), torch.bfloat16),
    "k": ((16, 48), torch.bfloat16),
    "v": ((16, 48), torch.bfloat16),
    "o": ((48, 32), torch.bfloat16),
    "up": ((301, 135), torch.bfloat16),  # an odd byte count in FP8: ring alignment
    "gate": ((130, 135), torch.bfloat16),  # fused with up in FP8: tiles straddle the seam
    "norm": ((48,), torch.float32),
    "big": ((512, 1024), torch.bfloat16),
}


def training_tensor(name, version, device="cpu"):
    shape, dtype = TRAINING[name]
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) * 1000 + version)
    t = torch.randn(shape, generator=g) * 0.05
    if name == "up":  # outliers and tiny values: scales differ per tile, subnormals appear
        t[::37, ::11] *= 300.0
        t[5, :] *= 1e-5
        t[128:256, 0:128] = 0.0  # an all-zero tile
    return t.to(dtype).to(device)


def inference_layout():
    """(name, kwargs for InferenceWeights.add, local shape, dtype) of the one inference rank:
    whole tensors, a fused QKV, a row-style slice of o (strided writes), FP8 up + scales, a
    fused FP8 gate/up + scales (the concatenation quantised)."""
    return [
        ("embed", dict(), (64, 48), torch.bfloat16),
        ("qkv", dict(projection="concat", sources=["q", "k", "v"], concat_dim=0),
         (64, 48), torch.bfloat16),
        ("o", dict(shape=(48, 32), dim=1, start=8), (48, 16), torch.bfloat16),
        ("up", dict(projection="fp8_quantize", dtype="fp8_e4m3"), (301, 135), torch.uint8),
        ("up.scale", dict(projection="fp8_scale", sources=["up"]), (3, 2), torch.float32),
        ("gate_up", dict(projection="fp8_quantize", sources=["gate", "up"], concat_dim=0,
                         dtype="fp8_e4m3"), (431, 135), torch.uint8),
        ("gate_up.scale", dict(projection="fp8_scale", sources=["gate", "up"], concat_dim=0),
         (4, 2), torch.float32),
        ("norm", dict(), (48,), torch.float32),
        ("big", dict(), (512, 1024), torch.bfloat16),
    ]


def reference(version, quantize):
    """What each inference tensor holds after push `version` (quantize: the FP8 reference)."""
    t = {n: training_tensor(n, version) for n in TRAINING}
    q, s = quantize(t["up"])
    fused_q, fused_s = quantize(torch.cat([t["gate"], t["up"]], 0))
    return {
        "embed": t["embed"],
        "qkv": torch.cat([t["q"], t["k"], t["v"]], 0),
        "o": t["o"][:, 8:24].contiguous(),
        "up": q,
        "up.scale": s,
        "gate_up": fused_q,
        "gate_up.scale": fused_s,
        "norm": t["norm"],
        "big": t["big"],
    }


def shard_of(name, full, rank, world):
    """Rank `rank`'s FSDP shard (dim-0 chunk) of `full` and its box."""
    rows = full.shape[0]
    start, stop = rows * rank // world, rows * (rank + 1) // world
    box = [(start, stop - start)] + [(0, d) for d in full.shape[1:]]
    return full[start:stop].clone(), box


def stage_of(name, stages):
    """The pipeline stage holding training parameter `name` (TRAINING's order cut in
    `stages` runs: the sources of each projection stay on one stage)."""
    return list(TRAINING).index(name) * stages // len(TRAINING)


def serve_trainer(conn, provider, directory, max_temp_bytes, rank=0, world=1, init=None,
                  device="cpu", num_nics=1, stages=1, replicas=1):
    """A training process, driven over `conn`: one rank holding every parameter whole, or
    rank `rank` of `world` ranks (torch.distributed over gloo, `init` a file://) split into
    `stages` pipeline stages or `replicas` HSDP replicas, each holding its parameters as
    FSDP shards over its ranks; its tensors and staging on `device`; its engine's group with
    `num_nics` NICs."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import fabric_lib
    import fabric_lib.weights as fw
    from peer import make_config

    try:
        if world > 1:
            import torch.distributed as dist

            dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        config = make_config(provider)
        config.groups[0].nics = list(config.groups[0].nics) * num_nics
        engine = fabric_lib.TransferEngine(config)
        registry = fabric_lib.FileRegistry(directory, lease_ttl=3.0, poll_interval=0.1)
        trainer = fw.TrainerWeights(engine, rank, world, registry, max_temp_bytes=max_temp_bytes,
                                    chunk_bytes=256 << 10, timeout=20.0, device=device,
                                    num_nics=num_nics)
        weights = {}
        per_stage = world // stages // replicas  # FSDP ranks of one stage or replica
        for n in TRAINING:
            if stage_of(n, stages) != rank // per_stage % stages:
                continue
            full = training_tensor(n, 0, device)
            if world == 1:
                weights[n] = full
                trainer.add(n, full)
            else:
                weights[n], box = shard_of(n, full, rank % per_stage, per_stage)
                trainer.add(n, weights[n], shape=full.shape, box=box,
                            replica=rank // per_stage // stages)
        trainer.publish()
    except Exception as e:
        conn.send(("error", type(e).__name__, str(e)))
        return
    conn.send(("ok", None))
    while True:
        method, args = conn.recv()
        try:
            if method == "exit":
                engine.close()
                conn.send(("ok", None))
                return
            if method == "connect":
                entries = trainer.connect(*args).entries(rank)
                assert {e.nic for e in entries} == set(range(num_nics)), "a NIC has no entries"
                conn.send(("ok", len(entries)))
            elif method == "sends":  # the projected parameters this rank writes
                names = {trainer.schedule.params[e.param].name
                         for e in trainer.schedule.entries(rank)}
                conn.send(("ok", sorted(names)))
            elif method == "push":  # a training step (new values in place), then the push
                version, pause = args
                for n, t in weights.items():
                    full = training_tensor(n, version, device)
                    t.copy_(full if world == 1 else shard_of(n, full, rank % per_stage,
                                                             per_stage)[0])
                stall = (lambda name: time.sleep(pause)) if pause else None
                conn.send(("ok", trainer.push(version, on_param=stall)))
        except Exception as e:
            conn.send(("error", type(e).__name__, str(e)))


def serve_inference(conn, provider, directory):
    """An inference process (flip mode, the layout above), driven over `conn`: "prepare"
    answers once the version is armed, "wait" once it completed."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import fabric_lib
    import fabric_lib.weights as fw
    from peer import make_config

    engine = fabric_lib.TransferEngine(make_config(provider))
    registry = fabric_lib.FileRegistry(directory, lease_ttl=3.0, poll_interval=0.1)
    inf = fw.InferenceWeights(engine, 0, registry, timeout=20.0)
    for name, kwargs, shape, dtype in inference_layout():
        inf.add(name, torch.zeros(shape, dtype=dtype), **kwargs)
    inf.publish()
    conn.send(("ok", None))
    pending = None
    while True:
        method, args = conn.recv()
        try:
            if method == "prepare":
                pending = inf.prepare(*args)
                conn.send(("ok", None))
            elif method == "wait":
                conn.send(("ok", pending.result(20.0)))
        except Exception as e:
            conn.send(("error", type(e).__name__, str(e)))
