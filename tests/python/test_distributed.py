"""fabric_lib.distributed over a two-rank torch.distributed (gloo) group, and the example that
bootstraps with it."""

import multiprocessing
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TIMEOUT

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torch_paged_kv.py"


def rank_main(rank, store, results):
    import torch.distributed as dist

    import fabric_lib
    from fabric_lib.distributed import all_gather_bytes, exchange_addresses, exchange_descriptors
    from peer import make_config

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        gathered = all_gather_bytes(b"" if rank == 0 else b"rank one says hello" * 100)
        with fabric_lib.TransferEngine(make_config("tcp")) as engine:
            addresses = exchange_addresses(engine)
            reg = engine.register(bytearray(4096 * (rank + 1)))
            descriptors = exchange_descriptors(reg)
            results.put((rank, gathered, [bytes(a) for a in addresses], bytes(engine.address),
                         [d.length for d in descriptors], descriptors[rank] == reg.descriptor))
            dist.barrier()
    finally:
        dist.destroy_process_group()


def test_all_gather_bytes_and_exchanges(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, tmp_path / "store", results)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = dict((r[0], r[1:]) for r in (results.get(timeout=TIMEOUT) for _ in procs))
    finally:
        for p in procs:
            p.join(TIMEOUT)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    for rank in (0, 1):
        gathered, addresses, own, lengths, own_descriptor = got[rank]
        assert gathered == [b"", b"rank one says hello" * 100], "rank order, lengths kept"
        assert addresses == [got[0][2], got[1][2]] and addresses[rank] == own
        assert lengths == [4096, 8192] and own_descriptor


@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_example_moves_tensor_pages(provider):
    assert len(EXAMPLE.read_text().splitlines()) < 40, "the example stays under 40 lines"
    run = subprocess.run([sys.executable, str(EXAMPLE), provider], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"rank 1: 64 pages of 16384 bytes arrived over {provider}, verified" in run.stdout
