"""One-sided reads from Python: read() and paged_read(), futures, asyncio and counters, the
permission (remote_read), and bad input, on every provider present."""

import asyncio

import numpy as np
import pytest

import fabric_lib
from peer import make_config

TIMEOUT = 60


@pytest.fixture(scope="module")
def owner(provider):
    """A second engine in this process that owns the memory read."""
    with fabric_lib.TransferEngine(make_config(provider)) as e:
        yield e


def pattern(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.mark.parametrize("n", [0, 1, 4096, 65537, (1 << 20) + 3])
def test_read_brings_every_byte(engine, owner, n):
    src = pattern(n + 5, n)
    reg_src = owner.register(src, remote_read=True)
    assert reg_src.descriptor.readable
    dst = np.full(n + 9, 0xA5, np.uint8)
    reg_dst = engine.register(dst)
    assert engine.read(reg_dst, reg_src.descriptor, n, dst_offset=4, src_offset=5).result(TIMEOUT) is None
    assert np.array_equal(dst[4 : 4 + n], src[5 : 5 + n])
    assert (dst[:4] == 0xA5).all() and (dst[4 + n :] == 0xA5).all()


def test_read_defaults_to_the_rest_of_the_remote_region_and_takes_its_bytes(engine, owner):
    src = pattern(10000, 1)
    reg_src = owner.register(src, remote_read=True)
    dst = np.zeros(10000, np.uint8)
    reg_dst = engine.register(dst)
    engine.read(reg_dst, bytes(reg_src.descriptor), src_offset=100).result(TIMEOUT)
    assert np.array_equal(dst[:9900], src[100:])


def test_paged_read_and_counter(engine, owner):
    page = 4096
    src = pattern(page * 64, 2)
    reg_src = owner.register(src, remote_read=True)
    dst = np.zeros(page * 64, np.uint8)
    reg_dst = engine.register(dst)
    src_pages = np.arange(63, -1, -2, dtype=np.int64)  # 32 pages, reversed, odd ones
    dst_pages = list(range(32))
    counter = fabric_lib.CompletionCounter()
    engine.paged_read(reg_dst, reg_src.descriptor, page, src_pages, dst_pages, counter=counter)
    assert counter.wait(1, TIMEOUT)
    assert counter.done == 1
    for i, p in enumerate(src_pages):
        assert np.array_equal(dst[i * page : (i + 1) * page], src[p * page : (p + 1) * page])
    assert (dst[32 * page :] == 0).all()


def test_reads_are_awaitable(engine, owner):
    src = pattern(1 << 16, 3)
    reg_src = owner.register(src, remote_read=True)
    dst = np.zeros(1 << 16, np.uint8)
    reg_dst = engine.register(dst)

    async def pull():
        await asyncio.gather(
            *(
                asyncio.wrap_future(engine.read(reg_dst, reg_src.descriptor, 4096,
                                                dst_offset=i * 4096, src_offset=i * 4096))
                for i in range(16)
            )
        )

    asyncio.run(asyncio.wait_for(pull(), TIMEOUT))
    assert np.array_equal(dst, src)


def test_memory_not_registered_readable_is_refused_at_the_reader(engine, owner):
    src = pattern(4096, 4)
    reg_src = owner.register(src)  # remote_read off
    assert not reg_src.descriptor.readable
    dst = np.full(4096, 0xA5, np.uint8)
    reg_dst = engine.register(dst)
    with pytest.raises(fabric_lib.RemoteAccess, match="remote_read"):
        engine.read(reg_dst, reg_src.descriptor, 4096)
    assert (dst == 0xA5).all()


def test_bad_reads_raise_fabric_errors(engine, owner):
    src = pattern(4096, 5)
    reg_src = owner.register(src, remote_read=True)
    dst = np.zeros(1024, np.uint8)
    reg_dst = engine.register(dst)
    with pytest.raises(fabric_lib.OutOfRange):
        engine.read(reg_dst, reg_src.descriptor, 4096)  # more than dst holds
    with pytest.raises(fabric_lib.OutOfRange):
        engine.read(reg_dst, reg_src.descriptor, 16, src_offset=4090)
    with pytest.raises(fabric_lib.InvalidArgument, match="length"):
        engine.read(reg_dst, reg_src.descriptor, -1)
    with pytest.raises(fabric_lib.InvalidArgument, match="page_bytes"):
        engine.paged_read(reg_dst, reg_src.descriptor, 0, [0], [0])
    with pytest.raises(fabric_lib.InvalidArgument):
        engine.read(reg_dst, b"not a descriptor", 16)


def test_a_read_after_the_owner_unregistered_fails_with_remote_access(engine, owner):
    src = pattern(65536, 6)
    reg_src = owner.register(src, remote_read=True)
    stale = bytes(reg_src.descriptor)
    owner.unregister(reg_src)
    dst = np.full(65536, 0xA5, np.uint8)
    reg_dst = engine.register(dst)
    err = engine.read(reg_dst, stale).exception(TIMEOUT)
    assert isinstance(err, fabric_lib.RemoteAccess), repr(err)
    assert (dst == 0xA5).all()
