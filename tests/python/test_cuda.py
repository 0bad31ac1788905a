"""CUDA tensors between two processes, through the engine's CUDA IPC path (same host, GPU to
GPU) where both sides are CUDA memory and the staged path (pinned host mirrors) otherwise:
every operation with GPU memory on one or both sides, data checked on the device, immediates
counted only once the data is in GPU memory. Skipped without a CUDA build and a CUDA device."""

import asyncio
import threading
import time

import numpy as np
import pytest
import torch

import fabric_lib
from conftest import TIMEOUT, unraisable
from peer import pattern

pytestmark = pytest.mark.skipif(
    not fabric_lib.HAS_CUDA or not torch.cuda.is_available(),
    reason="needs fabric_lib built with CUDA and a CUDA device (CI has neither a GPU nor "
    "Debian's CUDA torch); the staged path itself is tested in CI by the C++ suite Staged.*",
)


def cuda_pattern(size, seed):
    return torch.from_numpy(pattern(size, seed)).to("cuda")


def test_cuda_tensor_registration_takes_the_groups_gpu_path(engine):
    t = torch.zeros(4096, dtype=torch.uint8, device="cuda")
    with engine.register(t) as reg:
        assert reg.device == "cuda:0"
        assert reg.descriptor.staged == (engine.group_info().gpu_memory == "staged")
        assert reg.length == 4096
    with engine.register(torch.zeros(4096, dtype=torch.uint8).pin_memory()) as pinned:
        assert not pinned.descriptor.staged, "pinned host memory is reachable directly"


def test_cuda_tensors_take_the_cuda_ipc_path_with_no_code_change(engine, peer):
    """The peer is another process on this host: GPU to GPU goes over CUDA IPC (the peer copies
    from this process's exported tensor), unless the engine's Config.cuda_ipc is off."""
    assert engine.group_info().cuda_ipc in ("auto", "on", "off")
    before = engine.stats().groups[0].cuda_ipc_transfers
    src = cuda_pattern(1 << 20, seed=11)
    reg = engine.register(src)
    dst = peer.call("alloc_cuda", "ipc", 1 << 20)
    engine.write(reg, dst, 1 << 20, imm=1500).wait(TIMEOUT)
    assert peer.call("wait_imm", 1500, 1, TIMEOUT)
    assert peer.call("read", "ipc") == src.cpu().numpy().tobytes()
    after = engine.stats().groups[0]
    expected = 0 if engine.group_info().cuda_ipc == "off" else 1
    assert after.cuda_ipc_transfers - before == expected
    if expected:
        assert after.cuda_ipc_bytes >= 1 << 20


def test_tensors_without_a_host_mirror_move_over_cuda_ipc_only(engine, peer):
    """host_mirror=False: no pinned mirror (the gauge stays), the descriptor has no rails, GPU to
    GPU works over CUDA IPC, and a write that would need the fabric is refused."""
    if engine.group_info().cuda_ipc == "off" or engine.group_info().gpu_memory != "staged":
        pytest.skip("needs the CUDA IPC path on and a group that stages GPU memory")
    before = engine.stats().groups[0].host_mirror_bytes
    src = cuda_pattern(1 << 20, seed=13)
    reg = engine.register(src, host_mirror=False)
    assert reg.descriptor.ipc_only and reg.descriptor.rails == []
    assert engine.stats().groups[0].host_mirror_bytes == before
    dst = peer.call("alloc_cuda", "nomirror", 1 << 20, None, False)
    assert fabric_lib.RemoteMemory(dst).ipc_only
    engine.write(reg, dst, 1 << 20, imm=1600).wait(TIMEOUT)
    assert peer.call("wait_imm", 1600, 1, TIMEOUT)
    assert peer.call("read", "nomirror") == src.cpu().numpy().tobytes()
    host = peer.call("alloc", "nomirror_host", 4096)
    with pytest.raises(fabric_lib.Unsupported, match="without a host mirror"):
        engine.write(reg, host, 4096)
    with engine.register(np.zeros(4096, dtype=np.uint8)) as host_src:
        with pytest.raises(fabric_lib.Unsupported, match="destination was registered without"):
            engine.write(host_src, dst, 4096)


@pytest.mark.parametrize("size", [4097, 32 << 20])
def test_cuda_tensor_into_host_memory_registered_for_gpu_copies(engine, peer, size):
    """gpu_copies=True at the peer: its GPU copies this process's CUDA tensor into its host
    memory over CUDA IPC (counted as a CUDA IPC transfer), the immediate after the bytes; a host
    source into the same memory keeps the fabric."""
    if engine.group_info().cuda_ipc == "off":
        pytest.skip("needs the CUDA IPC path on")
    dst = peer.call("alloc", f"gpucopies{size}", size + 64, None, True)
    assert fabric_lib.RemoteMemory(dst).gpu_copies
    src = cuda_pattern(size, seed=size + 1)
    before = engine.stats().groups[0].cuda_ipc_transfers
    with engine.register(src) as reg:
        peer.call("expect", 1700, 1)
        engine.write(reg, dst, size, dst_offset=64, imm=1700).wait(TIMEOUT)
        assert peer.call("wait_expect", 1700, TIMEOUT)
    got = peer.call("read", f"gpucopies{size}")
    assert got[64:] == src.cpu().numpy().tobytes() and got[:64] == bytes(64)
    assert engine.stats().groups[0].cuda_ipc_transfers == before + 1
    with engine.register(pattern(4096, 9)) as host_src:
        engine.write(host_src, dst, 4096).wait(TIMEOUT)
    assert peer.call("read", f"gpucopies{size}")[:4096] == pattern(4096, 9).tobytes()
    assert engine.stats().groups[0].cuda_ipc_transfers == before + 1


def test_gpu_copies_of_pinned_and_twice_registered_host_memory(engine, peer):
    """gpu_copies on memory torch already page-locked (used as it is), on one array registered
    twice (the page-lock shared: unregistering one keeps the other's), and on a range that
    overlaps it (refused, naming the overlap). The peer's CUDA tensor is copied into each."""
    if engine.group_info().cuda_ipc == "off":
        pytest.skip("needs the CUDA IPC path on")
    n = 1 << 20
    peer.call("alloc_cuda", "gcsrc", n, 41)
    want = pattern(n, 41).tobytes()
    pinned = torch.zeros(n, dtype=torch.uint8).pin_memory()
    with engine.register(pinned, gpu_copies=True) as reg:
        assert reg.descriptor.gpu_copies
        peer.call("write", "gcsrc", bytes(reg.descriptor), n, 0, 0, 1800)
        assert engine.wait_imm(1800, 1, TIMEOUT)
        assert pinned.numpy().tobytes() == want
    host = np.zeros(n, dtype=np.uint8)
    first = engine.register(host, gpu_copies=True)
    second = engine.register(host, gpu_copies=True)
    with pytest.raises(fabric_lib.InvalidArgument, match="overlap"):
        engine.register(host[4096:], gpu_copies=True)
    first.unregister()
    peer.call("write", "gcsrc", bytes(second.descriptor), n, 0, 0, 1801)
    assert engine.wait_imm(1801, 1, TIMEOUT)
    assert host.tobytes() == want
    second.unregister()
    with engine.register(host, gpu_copies=True) as again:  # locked afresh after both went
        assert again.descriptor.gpu_copies


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


@pytest.mark.parametrize("size", [1, 4097, (1 << 20) + 13, 32 << 20])
def test_read_a_peers_cuda_tensor_into_a_cuda_tensor_and_into_host_memory(engine, peer, size):
    """The peer's CUDA tensor, registered readable, read into a CUDA tensor here (over CUDA IPC,
    or staged at both ends with cuda_ipc off) and into host memory (staged at the peer's end)."""
    src = peer.call("alloc_cuda", "readable", size + 3, size, True, True)
    want = pattern(size + 3, size)[3:].tobytes()
    before = engine.stats().groups[0].cuda_ipc_transfers
    dst = torch.zeros(size, dtype=torch.uint8, device="cuda")
    with engine.register(dst) as reg:
        assert engine.read(reg, src, size, src_offset=3).result(TIMEOUT) is None
        assert dst.cpu().numpy().tobytes() == want
    expected = 0 if engine.group_info().cuda_ipc == "off" else 1
    assert engine.stats().groups[0].cuda_ipc_transfers - before == expected
    host = np.zeros(size, np.uint8)
    with engine.register(host) as reg:
        assert engine.read(reg, src, size, src_offset=3).result(TIMEOUT) is None
        assert host.tobytes() == want
    peer.call("unregister", "readable")


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


def test_watcher_sees_stream_bumps_in_order_and_stops_when_told():
    seen = []
    done = threading.Event()

    def on_change(old, new):
        seen.append((old, new))
        if new >= 3:
            done.set()
            return False  # stop watching
        return True

    with fabric_lib.UvmWatchers() as pool:
        w = pool.watch(on_change)
        assert pool.live == 1
        stream = torch.cuda.Stream()
        for v in (1, 2, 3):
            torch.cuda._sleep(1_000_000)  # ~a millisecond of GPU work before each bump
            pool.bump(w, v, stream=stream)
        assert done.wait(TIMEOUT)
        assert [n for _, n in seen][-1] == 3 and all(o < n for o, n in seen)
        assert seen[0][0] == 0
        assert pool.live == 0, "returning False released the word"


def test_watcher_callback_errors_are_reported_and_watching_goes_on():
    calls = []

    def broken(old, new):
        calls.append(new)
        if new == 1:
            raise RuntimeError("boom")
        return True

    with unraisable() as reported, fabric_lib.UvmWatchers() as pool:
        w = pool.watch(broken)
        pool.bump(w, 1)
        torch.cuda.synchronize()
        deadline = time.monotonic() + TIMEOUT
        while not calls and time.monotonic() < deadline:
            time.sleep(0.001)
        pool.bump(w, 2)
        torch.cuda.synchronize()
        while 2 not in calls and time.monotonic() < deadline:
            time.sleep(0.001)
        assert calls == [1, 2]
        assert any("boom" in str(r.exc_value) for r in reported)


# The layer pipeline: a stream "computes" each layer of a CUDA tensor, bumps the watcher, and
# the callback ships that layer to the peer's GPU while the next layer computes.
def test_layer_pipeline_ships_each_layer_when_the_gpu_bumps_the_watcher(engine, peer):
    layers, layer_bytes = 8, 1 << 20
    kv = torch.zeros(layers * layer_bytes, dtype=torch.uint8, device="cuda")
    reg = engine.register(kv)
    dst = peer.call("alloc_cuda", "pipeline", layers * layer_bytes)
    transfers = []

    def ship(old, new):
        for layer in range(old, new):
            off = layer * layer_bytes
            transfers.append(engine.write(reg, dst, layer_bytes, src_offset=off, dst_offset=off,
                                          imm=6000))
        return new < layers

    with fabric_lib.UvmWatchers() as pool:
        w = pool.watch(ship)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            for layer in range(layers):
                kv[layer * layer_bytes : (layer + 1) * layer_bytes].fill_(layer + 1)
                pool.bump(w, layer + 1, stream=stream)
        assert peer.call("wait_imm", 6000, layers, TIMEOUT), "every layer arrived"
    for t in transfers:
        t.wait(TIMEOUT)
    got = np.frombuffer(peer.call("read", "pipeline"), dtype=np.uint8)
    for layer in range(layers):
        assert (got[layer * layer_bytes : (layer + 1) * layer_bytes] == layer + 1).all(), layer
