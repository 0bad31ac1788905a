"""Exchanging engine addresses and registration descriptors over torch.distributed.

The way LLM engines bootstrap: every rank already has a process group (gloo or NCCL), so each
rank all-gathers its address and descriptors as bytes and gets every rank's in rank order::

    dist.init_process_group("gloo", ...)
    engine = fabric_lib.TransferEngine(config)
    reg = engine.register(kv_cache)
    addresses = exchange_addresses(engine)        # list[Address], index = rank
    descriptors = exchange_descriptors(reg)       # list[RemoteMemory], index = rank

torch is imported when these run, not when fabric_lib is imported.
"""

from __future__ import annotations

from typing import Any, List, Optional, Union

from ._fabric_lib import Address, Registration, RemoteMemory, TransferEngine


def all_gather_bytes(data: bytes, group: Any = None, device: Any = None) -> List[bytes]:
    """All-gathers one bytes object per rank of `group` (default: the world) and returns them
    in rank order; lengths may differ between ranks. Collective: every rank of the group must
    call it. `device`: where the staging tensors live (default: the current CUDA device for an
    NCCL group, else the CPU)."""
    import torch
    import torch.distributed as dist

    if device is None:
        if dist.get_backend(group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
    world = dist.get_world_size(group)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    lengths = [int(s.item()) for s in sizes]
    buf = torch.zeros(max(max(lengths), 1), dtype=torch.uint8, device=device)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    gathered = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(gathered, buf, group=group)
    return [bytes(g[:n].cpu().numpy().tobytes()) for g, n in zip(gathered, lengths)]


def exchange_addresses(
    engine: TransferEngine, group: Any = None, device_group: int = 0
) -> List[Address]:
    """Every rank's engine address (of device group `device_group`), in rank order.
    Collective over `group`."""
    return [Address(b) for b in all_gather_bytes(bytes(engine.group_address(device_group)), group)]


def exchange_descriptors(
    memory: Union[Registration, RemoteMemory], group: Any = None
) -> List[RemoteMemory]:
    """Every rank's descriptor of its `memory` (a Registration or a RemoteMemory), in rank
    order. Collective over `group`."""
    desc = memory.descriptor if isinstance(memory, Registration) else memory
    return [RemoteMemory(b) for b in all_gather_bytes(bytes(desc), group)]
