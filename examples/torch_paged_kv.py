"""Rank 0 moves 64 pages of a PyTorch KV cache into rank 1's cache with one paged write; rank 1
waits on the immediate counter. Run: /usr/bin/python3 examples/torch_paged_kv.py [tcp|shm]"""
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fabric_lib
from fabric_lib.distributed import exchange_descriptors

PAGES, PAGE_ELEMS, MOVED, IMM = 256, 4096, 64, 42


def run(rank, provider, store):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    nics = {"tcp": ["lo"], "shm": ["shm"]}[provider]
    engine = fabric_lib.TransferEngine(fabric_lib.Config(provider=provider, nics=nics))
    cache = torch.randn(PAGES, PAGE_ELEMS, generator=torch.Generator().manual_seed(0))
    kv = cache.clone() if rank == 0 else torch.zeros(PAGES, PAGE_ELEMS)
    reg = engine.register(kv)
    descriptors = exchange_descriptors(reg)  # an all_gather of the descriptors' bytes
    src_pages = torch.randperm(PAGES, generator=torch.Generator().manual_seed(1))[:MOVED]
    page_bytes = kv[0].numel() * kv.element_size()
    if rank == 0:  # page src_pages[i] of rank 0 lands as page i of rank 1
        engine.paged_write(reg, descriptors[1], page_bytes, src_pages, range(MOVED), imm=IMM).result()
    else:
        assert engine.wait_imm(IMM, MOVED, timeout=60), "the pages did not all arrive"
        assert torch.equal(kv[:MOVED], cache[src_pages]) and not kv[MOVED:].any()
        print(f"rank 1: {MOVED} pages of {page_bytes} bytes arrived over {provider}, verified")
    dist.barrier()  # rank 0 keeps its engine open until rank 1 has checked
    engine.close()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(run, args=(sys.argv[1] if len(sys.argv) > 1 else "tcp", f"{tmp}/store"), nprocs=2)
