"""Every operation between this process and a peer process, over tcp and over shm: data checked
byte for byte, immediates counted by the receiver, errors checked by type."""

import asyncio
import threading
import time

import numpy as np
import pytest
import torch

import fabric_lib
from conftest import TIMEOUT, Peer, unraisable
from peer import pattern


def test_single_writes_of_several_sizes(engine, peer):
    for i, (size, src_off, dst_off) in enumerate([(1, 0, 0), (4097, 3, 5), ((1 << 20) + 13, 7, 64)]):
        imm = 100 + i
        src = pattern(size + src_off, seed=i)
        reg = engine.register(src)
        dst = peer.call("alloc", f"single{i}", size + dst_off)
        peer.call("expect", imm, 1)
        t = engine.write(reg, dst, size, src_offset=src_off, dst_offset=dst_off, imm=imm)
        assert isinstance(t, fabric_lib.Transfer) and isinstance(t.id, int)
        assert t.result(TIMEOUT) is None
        assert peer.call("wait_expect", imm, TIMEOUT)
        got = peer.call("read", f"single{i}")
        assert got[dst_off:] == src[src_off:].tobytes(), f"a {size}-byte write"
        assert got[:dst_off] == bytes(dst_off), "bytes before the destination range changed"
        assert peer.call("imm_count", imm) == 1


def test_write_from_a_torch_tensor_defaults_to_the_whole_registration(engine, peer):
    src = torch.arange(1 << 16, dtype=torch.float32)
    reg = engine.register(src)
    assert reg.length == src.numel() * 4 and reg.device == "cpu"
    dst = peer.call("alloc", "tensor", reg.length)
    engine.write(reg, fabric_lib.RemoteMemory(dst), imm=200).wait(TIMEOUT)
    assert peer.call("wait_imm", 200, 1, TIMEOUT)
    assert peer.call("read", "tensor") == src.numpy().tobytes()


@pytest.mark.parametrize("index_kind", ["list", "numpy", "torch"])
def test_paged_writes_with_strides_and_offsets(engine, peer, index_kind):
    page, stride, pages, src_off, dst_off = 4096, 4096 + 128, 64, 64, 256
    imm = {"list": 300, "numpy": 301, "torch": 302}[index_kind]
    src = pattern(src_off + pages * stride, seed=imm)
    reg = engine.register(src)
    dst = peer.call("alloc", f"paged-{index_kind}", dst_off + pages * stride)
    rng = np.random.default_rng(imm)
    src_pages = rng.permutation(pages).astype(np.int32)
    dst_pages = rng.permutation(pages).astype(np.int64)
    as_kind = {
        "list": lambda a: [int(x) for x in a],
        "numpy": lambda a: a,
        "torch": lambda a: torch.from_numpy(a.copy()),
    }[index_kind]
    engine.paged_write(
        reg, dst, page, as_kind(src_pages), as_kind(dst_pages),
        src_stride=stride, src_offset=src_off, dst_stride=stride, dst_offset=dst_off, imm=imm,
    ).wait(TIMEOUT)
    assert peer.call("wait_imm", imm, pages, TIMEOUT), "one immediate per page"
    got = np.frombuffer(peer.call("read", f"paged-{index_kind}"), dtype=np.uint8)
    for s, d in zip(src_pages, dst_pages):
        a = src_off + int(s) * stride
        b = dst_off + int(d) * stride
        assert (got[b : b + page] == src[a : a + page]).all(), f"page {s} -> {d}"
        assert not got[b + page : b + stride].any(), "a gap between pages was written"
    assert not got[:dst_off].any()
    assert peer.call("imm_count", imm) == pages


def test_peer_writes_into_this_process_and_expectations_resolve(engine, peer):
    size = 1 << 20
    dst = torch.zeros(size, dtype=torch.uint8)
    reg = engine.register(dst)
    peer.call("alloc", "src-for-us", size, 7)
    reached = threading.Event()
    expectation = engine.expect_imm(400, 1, on_reached=reached.set)
    assert isinstance(expectation, fabric_lib.Expectation)
    peer.call("write", "src-for-us", bytes(reg.descriptor), size, 0, 0, 400)
    expectation.result(TIMEOUT)
    assert reached.is_set(), "on_reached runs before the future resolves"
    assert dst.numpy().tobytes() == pattern(size, 7).tobytes()


def test_await_writes_and_expectations_under_asyncio(engine, peer):
    src = pattern(1 << 16, seed=5)
    reg = engine.register(src)
    dst = peer.call("alloc", "async", 16 << 16)

    async def main():
        writes = [engine.write(reg, dst, dst_offset=i << 16, imm=500) for i in range(16)]
        assert await asyncio.gather(*writes) == [None] * 16
        peer_write = asyncio.get_running_loop().run_in_executor(
            None, peer.call, "imm_write", bytes(engine.address), 501, 3)
        await asyncio.wait_for(engine.expect_imm(501, 3), TIMEOUT)
        await peer_write

    asyncio.run(main())
    assert peer.call("wait_imm", 500, 16, TIMEOUT)
    assert peer.call("read", "async") == src.tobytes() * 16
    assert engine.imm_count(501) == 3


def test_scatter_by_peer_and_by_bytes(engine, peer):
    src = pattern(3 << 20, seed=11)
    reg = engine.register(src)
    a = peer.call("alloc", "scatter-a", 2 << 20)
    b = peer.call("alloc", "scatter-b", 2 << 20)
    group = engine.add_peer_group([peer.address])
    for imm, sharding in [(600, fabric_lib.Sharding.BY_PEER), (601, fabric_lib.Sharding.BY_BYTES)]:
        peer.call("zero", "scatter-a")
        peer.call("zero", "scatter-b")
        targets = [
            fabric_lib.ScatterTarget(a, 1000, src_offset=0, dst_offset=10),
            (b, (1 << 20) + 7, 4096, 1),
            (a, 300, 2 << 20, 1 << 20),
        ]
        engine.scatter(reg, group, targets, imm=imm, sharding=sharding).wait(TIMEOUT)
        assert peer.call("wait_imm", imm, 3, TIMEOUT), "one immediate per target"
        got_a, got_b = peer.call("read", "scatter-a"), peer.call("read", "scatter-b")
        assert got_a[10:1010] == src[:1000].tobytes()
        assert got_b[1 : 1 + (1 << 20) + 7] == src[4096 : 4096 + (1 << 20) + 7].tobytes()
        assert got_a[1 << 20 : (1 << 20) + 300] == src[2 << 20 : (2 << 20) + 300].tobytes()
        assert peer.call("imm_count", imm) == 3
    engine.remove_peer_group(group)
    with pytest.raises(fabric_lib.NotFound):
        engine.barrier(group, 1)


def test_barrier_and_imm_only_writes(engine, peer):
    group = engine.add_peer_group([bytes(peer.address)])
    for round_ in range(1, 4):
        engine.barrier(group, 700).wait(TIMEOUT)
        assert peer.call("wait_imm", 700, round_, TIMEOUT)
    done = []
    transfers = [engine.imm_write(peer.address, 701, on_done=lambda: done.append(1)) for _ in range(50)]
    for t in transfers:
        t.wait(TIMEOUT)
    assert len(done) == 50
    assert peer.call("wait_imm", 701, 50, TIMEOUT)
    assert peer.call("imm_count", 700) == 3 and peer.call("imm_count", 701) == 50


def test_send_to_a_queue_and_receive_with_a_handler(engine, peer):
    # This process sends; the peer reads its queue with recv().
    peer.call("receive", 4096, 8)
    messages = [f"message {i} ".encode() + b"x" * i for i in range(20)]
    for m in messages:
        engine.send(peer.address, m).wait(TIMEOUT)
        assert peer.call("recv", TIMEOUT) == m  # one at a time: sends are not flow-controlled
    # The peer sends; a handler here collects.
    got, arrived = [], threading.Event()

    def on_message(m):
        got.append(m)
        if len(got) == 5:
            arrived.set()

    engine.set_receive_handler(on_message, buffer_bytes=4096, count=8)
    with pytest.raises(fabric_lib.AlreadyExists):
        engine.set_receive_handler(on_message)
    with pytest.raises(fabric_lib.NotFound):
        engine.recv(0.1)  # this group hands its messages to the handler
    for i in range(5):
        peer.call("send", bytes(engine.address), bytes([i]) * 100)
    assert arrived.wait(TIMEOUT)
    assert sorted(got) == [bytes([i]) * 100 for i in range(5)]
    with pytest.raises(fabric_lib.OutOfRange):
        engine.send(peer.address, bytes(70000))  # over max_message_bytes


def test_unexpected_immediates_reach_the_handler(engine, peer):
    seen, arrived = [], threading.Event()

    def handler(imm):
        seen.append(imm)
        arrived.set()

    engine.set_unexpected_imm_handler(handler)
    try:
        peer.call("imm_write", bytes(engine.address), 800)
        assert arrived.wait(TIMEOUT)
        assert seen == [800]
        assert engine.imm_count(800) == 1, "an unexpected immediate is still counted"
    finally:
        engine.set_unexpected_imm_handler(None)


def test_rejected_submissions_raise_typed_errors(engine, peer):
    src = np.zeros(4096, dtype=np.uint8)
    reg = engine.register(src)
    dst = fabric_lib.RemoteMemory(peer.call("alloc", "small", 4096))
    with pytest.raises(fabric_lib.OutOfRange, match="exceeds"):
        engine.write(reg, dst, 4096, dst_offset=1)
    with pytest.raises(IndexError):  # OutOfRange is also an IndexError
        engine.write(reg, dst, 4096, src_offset=1)
    with pytest.raises(fabric_lib.OutOfRange):
        engine.paged_write(reg, dst, 1024, [0, 3], [0, 4])
    with pytest.raises(fabric_lib.InvalidArgument):
        engine.paged_write(reg, dst, 1024, [0], [0, 1])  # page lists of different lengths
    with pytest.raises(fabric_lib.OutOfRange, match=r"src_pages\[1\] = -1"):
        engine.paged_write(reg, dst, 1024, np.array([0, -1]), [0, 1])
    with pytest.raises(fabric_lib.InvalidArgument, match="integers"):
        engine.paged_write(reg, dst, 1024, np.array([0.0, 1.0]), [0, 1])
    with pytest.raises(fabric_lib.InvalidArgument):
        engine.write(reg, b"not a descriptor", 1)
    with pytest.raises(fabric_lib.InvalidArgument):
        engine.write(reg, dst, 1, routing=fabric_lib.Routing.pinned(5))
    with pytest.raises(fabric_lib.InvalidArgument, match="imm"):
        engine.write(reg, dst, 1, imm=-1)
    with pytest.raises(fabric_lib.NotFound):
        engine.write(fabric_lib.MemoryHandle(12345), dst, 1)
    with pytest.raises(fabric_lib.InvalidArgument):
        engine.write(fabric_lib.MemoryHandle(12345), dst)  # a handle has no length to default to
    with pytest.raises(fabric_lib.InvalidArgument):
        engine.imm_write(peer.address, 1, nic=3)
    handle = reg.handle
    reg.unregister()
    with pytest.raises(fabric_lib.NotFound):
        engine.write(handle, dst, 1)
    with pytest.raises(fabric_lib.NotFound):
        reg.unregister()


def test_write_to_unregistered_remote_memory_fails_with_remote_access(engine, peer):
    if not engine.group_info().delivery_complete:
        pytest.skip(f"{engine.group_info().provider} completes writes before the target checks "
                    "the key (no delivery-complete), so a stale key is not reported")
    reg = engine.register(np.ones(4096, dtype=np.uint8))
    stale = peer.call("alloc", "stale", 4096)
    peer.call("unregister", "stale")
    errors = []
    t = engine.write(reg, stale, 64, imm=900, on_error=errors.append)
    with pytest.raises(fabric_lib.RemoteAccess) as raised:
        t.result(TIMEOUT)
    assert raised.value.code == fabric_lib.ErrorCode.REMOTE_ACCESS
    assert errors == [raised.value], "on_error got the exception the future raises"
    assert peer.call("imm_count", 900) == 0


def test_write_to_a_dead_peer_fails_with_peer_unreachable(provider):
    doomed = Peer(provider)
    try:
        dst = doomed.call("alloc", "dst", 1 << 20)
        with fabric_lib.TransferEngine(__import__("peer").make_config(provider, peer_timeout=2.0)) as e:
            reg = e.register(np.ones(1 << 20, dtype=np.uint8))
            e.write(reg, dst, imm=1).wait(TIMEOUT)  # connected
            doomed.kill()
            with pytest.raises(fabric_lib.PeerUnreachable):
                for _ in range(20):  # the first writes may still be buffered by the kernel
                    e.write(reg, dst, imm=1).result(TIMEOUT)
    finally:
        doomed.kill()


def test_callback_exceptions_are_reported_and_never_stop_the_engine(engine, peer):
    def broken(*args):
        raise ValueError("user bug")

    with unraisable() as seen:
        first = engine.imm_write(peer.address, 1000, on_done=broken)
        first.wait(TIMEOUT)  # the future still resolves
        second = engine.imm_write(peer.address, 1000)
        second.wait(TIMEOUT)
        engine.set_unexpected_imm_handler(broken)
        try:
            peer.call("imm_write", bytes(engine.address), 1001)
            assert engine.wait_imm(1001, 1, TIMEOUT)
            deadline = time.monotonic() + TIMEOUT
            while len(seen) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            engine.set_unexpected_imm_handler(None)
    assert peer.call("wait_imm", 1000, 2, TIMEOUT)
    assert [type(u.exc_value) for u in seen] == [ValueError, ValueError]
    assert all(u.object is broken for u in seen)


def test_close_with_transfers_in_flight_completes_each_once(provider, peer):
    from peer import make_config

    e = fabric_lib.TransferEngine(make_config(provider))
    reg = e.register(np.ones(1 << 20, dtype=np.uint8))
    dst = peer.call("alloc", "inflight", 1 << 20)
    calls = []
    transfers = [
        e.write(reg, dst, on_done=lambda: calls.append("done"), on_error=lambda x: calls.append(x))
        for _ in range(200)
    ]
    e.close()
    assert e.closed
    assert len(calls) == 200, "close() returns after every callback ran, once each"
    for t in transfers:
        assert t.done()
        if t.exception() is not None:
            assert isinstance(t.exception(), fabric_lib.Cancelled)
    with pytest.raises(fabric_lib.Closed):
        e.write(reg, dst)
    e.close()  # idempotent
