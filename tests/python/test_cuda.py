"""CUDA tensors between two processes, through the engine's staged path (pinned host mirrors):
every operation with GPU memory on one or both sides, data checked on the device, immediates
counted only once the data is in GPU memory. Skipped without a CUDA build and a CUDA device."""

import asyncio

import numpy as np
import pytest
import torch

import fabric_lib
from conftest import TIMEOUT
from peer import pattern

pytestmark = pytest.mark.skipif(
    not fabric_lib.HAS_CUDA or not torch.cuda.is_available(),
    reason="needs fabric_lib built with CUDA and a CUDA device (CI has neither a GPU nor "
    "Debian's CUDA torch); the staged path itself is tested in CI by the C++ suite Staged.*",
)


def cuda_pattern(size, seed):
    return torch.from_numpy(pattern(size, seed)).to("cuda")


def test_cuda_tensor_registration_is_staged(engine):
    t = torch.zeros(4096, dtype=torch.uint8, device="cuda")
    with engine.register(t) as reg:
        assert reg.device == "cuda:0"
        assert reg.descriptor.staged
        assert reg.length == 4096
    with engine.register(torch.zeros(4096, dtype=torch.uint8).pin_memory()) as pinned:
        assert not pinned.descriptor.staged, "pinned host memory is reachable directly"


@pytest.mark.parametrize("size", [1, 4097, (1 << 20) + 13, 32 << 20])
def test_single_write_gpu_to_gpu(engine, peer, size):
    imm = 1000 + size % 997
    src = cuda_pattern(size + 8, seed=size)
    reg = engine.register(src)
    dst = peer.call("alloc_cuda", f"g2g{size}", size)
    peer.call("expect", imm, 1)
    engine.write(reg, dst, size, src_offset=8, imm=imm).wait(TIMEOUT)
    assert peer.call("wait_expect", imm, TIMEOUT)
    assert peer.call("read", f"g2g{size}") == src[8:].cpu().numpy().tobytes()
    assert peer.call("imm_count", imm) == 1


def test_paged_write_gpu_to_gpu_with_index_tensors(engine, peer):
    page, stride, pages = 65536, 65536 + 128, 64
    src = cuda_pattern(pages * stride, seed=5)
    reg = engine.register(src)
    dst = peer.call("alloc_cuda", "paged", pages * stride)
    rng = np.random.default_rng(5)
    sp = torch.from_numpy(rng.permutation(pages).astype(np.int32))
    dp = torch.from_numpy(rng.permutation(pages).astype(np.int64))
    engine.paged_write(reg, dst, page, sp, dp, src_stride=stride, dst_stride=stride,
                       imm=2000).wait(TIMEOUT)
    assert peer.call("wait_imm", 2000, pages, TIMEOUT)
    got = np.frombuffer(peer.call("read", "paged"), dtype=np.uint8)
    want = src.cpu().numpy()
    for s, d in zip(sp.tolist(), dp.tolist()):
        assert (got[d * stride : d * stride + page] == want[s * stride : s * stride + page]).all()
    assert peer.call("imm_count", 2000) == pages


def test_peer_writes_host_memory_into_a_local_cuda_tensor(engine, peer):
    size = 3 << 20
    dst = torch.zeros(size, dtype=torch.uint8, device="cuda")
    reg = engine.register(dst)
    expectation = engine.expect_imm(3000, 1)
    peer.call("alloc", "host-src", size, 7)
    peer.call("write", "host-src", bytes(reg.descriptor), size, 0, 0, 3000)
    expectation.result(TIMEOUT)
    # Counted only after the copy into the GPU: the tensor already holds the bytes.
    assert dst.cpu().numpy().tobytes() == pattern(size, 7).tobytes()


def test_cuda_to_host_and_scatter_to_a_cuda_peer(engine, peer):
    n = (1 << 20) + 3
    src = cuda_pattern(2 * n, seed=9)
    reg = engine.register(src)
    host_dst = peer.call("alloc", "host-dst", n)
    cuda_dst = peer.call("alloc_cuda", "cuda-dst", n)
    engine.write(reg, host_dst, n, imm=4000).wait(TIMEOUT)
    assert peer.call("wait_imm", 4000, 1, TIMEOUT)
    assert peer.call("read", "host-dst") == src[:n].cpu().numpy().tobytes()
    group = engine.add_peer_group([peer.address])
    engine.scatter(reg, group, [fabric_lib.ScatterTarget(fabric_lib.RemoteMemory(cuda_dst), n,
                                                         src_offset=n)],
                   imm=4001, sharding=fabric_lib.Sharding.BY_BYTES).wait(TIMEOUT)
    assert peer.call("wait_imm", 4001, 1, TIMEOUT)
    assert peer.call("read", "cuda-dst") == src[n:].cpu().numpy().tobytes()


def test_await_a_write_between_gpus(engine, peer):
    src = cuda_pattern(1 << 20, seed=11)
    reg = engine.register(src)
    dst = peer.call("alloc_cuda", "awaited", 1 << 20)

    async def main():
        await engine.write(reg, dst, imm=5000)

    asyncio.run(main())
    assert peer.call("wait_imm", 5000, 1, TIMEOUT)
    assert peer.call("read", "awaited") == src.cpu().numpy().tobytes()
