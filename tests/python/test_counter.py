"""CompletionCounter: submissions with counter= are counted by the thread that ends them, with no
Python code and no GIL per transfer; the counter and the source registration outlive the
transfer whatever Python drops meanwhile."""

import gc
import sys
import time
import weakref

import numpy as np
import pytest

import fabric_lib
from conftest import TIMEOUT, open_engine_or_skip
from peer import make_config, pattern


@pytest.fixture(scope="module")
def pair(provider):
    """Two engines in this process."""
    with open_engine_or_skip(provider) as a, open_engine_or_skip(provider) as b:
        yield a, b


def caller_driven(provider):
    """An engine whose group 0 has no worker thread: its transfers stay in flight until
    progress() is called."""
    config = make_config(provider)
    config.groups[0].caller_progress = True
    try:
        return fabric_lib.TransferEngine(config)
    except fabric_lib.Unsupported as e:
        pytest.skip(f"provider {provider} not available here: {e}")


def drive_until(engine, done, what):
    deadline = time.monotonic() + TIMEOUT
    while not done():
        assert time.monotonic() < deadline, f"{what}: not reached while the group was driven"
        engine.progress()


def test_counter_counts_every_write_and_the_data_arrives(pair):
    a, b = pair
    chunk, n = 1024, 100
    src_array = pattern(chunk * n, seed=1)
    dst_array = np.zeros(chunk * n, dtype=np.uint8)
    src, dst = a.register(src_array), b.register(dst_array)
    counter = fabric_lib.CompletionCounter()
    assert (counter.done, counter.failed, counter.ended, counter.first_error) == (0, 0, 0, None)
    ids = [a.write(src, dst.descriptor, chunk, src_offset=i * chunk, dst_offset=i * chunk,
                   imm=101, counter=counter) for i in range(n)]
    assert all(type(i) is int for i in ids) and len(set(ids)) == n, "the transfer ids"
    assert counter.wait(n, TIMEOUT)
    assert (counter.done, counter.failed, counter.ended) == (n, 0, n)
    assert counter.first_error is None
    assert repr(counter) == f"CompletionCounter(done={n}, failed=0)"
    assert b.wait_imm(101, n, TIMEOUT)
    assert (dst_array == src_array).all()
    assert not counter.wait(n + 1, 0.05), "nothing more was submitted"


def test_every_submission_takes_a_counter(pair, provider):
    a, b = pair
    with open_engine_or_skip(provider) as c:
        c.set_receive_handler()
        src = a.register(pattern(8192, seed=2))
        dst_array = np.zeros(8192, dtype=np.uint8)
        dst = b.register(dst_array)
        group = a.add_peer_group([b.address])
        counter = fabric_lib.CompletionCounter()
        ids = [
            a.paged_write(src, dst.descriptor, 1024, [0, 1], [5, 6], imm=111, counter=counter),
            a.scatter(src, group, [(dst.descriptor, 512, 4096, 0)], imm=112, counter=counter),
            a.barrier(group, 113, counter=counter),
            a.imm_write(b.address, 114, counter=counter),
            a.send(c.address, b"counted", counter=counter),
        ]
        assert all(type(i) is int for i in ids), ids
        assert counter.wait(len(ids), TIMEOUT)
        assert (counter.done, counter.failed) == (len(ids), 0), counter
        for imm, arrivals in ((111, 2), (112, 1), (113, 1), (114, 1)):
            assert b.wait_imm(imm, arrivals, TIMEOUT), imm
        raw = src.obj
        assert (dst_array[5 * 1024:7 * 1024] == raw[:2 * 1024]).all()
        assert (dst_array[:512] == raw[4096:4608]).all()
        assert c.recv(TIMEOUT) == b"counted"
        a.remove_peer_group(group)


def test_counter_and_callbacks_together_are_refused(pair):
    a, b = pair
    src = a.register(np.ones(64, dtype=np.uint8))
    dst = b.register(np.zeros(64, dtype=np.uint8))
    counter = fabric_lib.CompletionCounter()
    for callbacks in ({"on_done": lambda: None}, {"on_error": lambda e: None}):
        with pytest.raises(ValueError, match="counter") as raised:
            a.write(src, dst.descriptor, imm=121, counter=counter, **callbacks)
        assert isinstance(raised.value, fabric_lib.InvalidArgument)
        with pytest.raises(fabric_lib.InvalidArgument):
            a.imm_write(b.address, 121, counter=counter, **callbacks)
    with pytest.raises(TypeError, match="CompletionCounter"):
        a.imm_write(b.address, 121, counter=3)
    assert not b.wait_imm(121, 1, 0.2), "a refused submission posted nothing"
    assert counter.ended == 0
    # A rejected submission is not counted either (no callback runs for it).
    with pytest.raises(fabric_lib.OutOfRange):
        a.write(src, dst.descriptor, 64, dst_offset=1, counter=counter)
    assert not counter.wait(1, 0.05)


def test_failures_are_counted_with_the_first_error(provider):
    cfg = make_config(provider)
    cfg.faults.enabled = True
    cfg.faults.fail_write = lambda seq: seq % 5 == 2
    with fabric_lib.TransferEngine(cfg) as faulty, open_engine_or_skip(provider) as b:
        src = faulty.register(np.ones(1 << 12, dtype=np.uint8))
        dst = b.register(np.zeros(1 << 12, dtype=np.uint8))
        counter = fabric_lib.CompletionCounter()
        for _ in range(20):
            faulty.write(src, dst.descriptor, imm=131, counter=counter)
        assert counter.wait(20, TIMEOUT)
        assert (counter.done, counter.failed, counter.ended) == (16, 4, 20), counter
        assert b.wait_imm(131, 16, TIMEOUT)
        error = counter.first_error
        assert isinstance(error, fabric_lib.ProviderError), repr(error)
        assert error.code == fabric_lib.ErrorCode.FABRIC and error.message == str(error)
        # The same class and message that a Transfer of the same failure raises.
        futures = [faulty.write(src, dst.descriptor) for _ in range(5)]  # seq 22 fails
        raised = [f.exception(TIMEOUT) for f in futures]
        failures = [e for e in raised if e is not None]
        assert len(failures) == 1
        assert type(failures[0]) is type(error) and str(failures[0]) == str(error)
        assert counter.first_error is not error, "a fresh exception each time"
        assert counter.ended == 20, "futures are not counted"


def test_wait_times_out():
    counter = fabric_lib.CompletionCounter()
    assert counter.wait(0, 0) is True
    start = time.monotonic()
    assert counter.wait(1, 0.3) is False
    waited = time.monotonic() - start
    assert 0.25 <= waited < 5, waited
    assert repr(counter) == "CompletionCounter(done=0, failed=0)"


def test_counted_completions_take_no_gil(pair):
    """The counts move while this thread holds the GIL (a switch interval far longer than the
    wait keeps it here): nothing on the completion path waits for Python."""
    a, b = pair
    src = a.register(np.ones(4096, dtype=np.uint8))
    dst = b.register(np.zeros(4096, dtype=np.uint8))
    counter = fabric_lib.CompletionCounter()
    saved = sys.getswitchinterval()
    sys.setswitchinterval(60)
    try:
        for _ in range(20):
            a.write(src, dst.descriptor, counter=counter)
        deadline = time.monotonic() + 10
        while counter.ended < 20 and time.monotonic() < deadline:
            pass  # pure Python: the GIL stays with this thread
        ended = counter.ended
    finally:
        sys.setswitchinterval(saved)
    assert ended == 20 and counter.done == 20, counter


def test_dropping_the_counter_while_transfers_are_in_flight(pair, provider):
    _, b = pair
    with caller_driven(provider) as a:
        src = a.register(pattern(4096, seed=3))
        dst_array = np.zeros(4096, dtype=np.uint8)
        dst = b.register(dst_array)
        counter = fabric_lib.CompletionCounter()
        for _ in range(50):
            a.write(src, dst.descriptor, imm=141, counter=counter)
        del counter
        gc.collect()
        # Had the dropped counter been freed, one of these would likely take its memory, and
        # the 50 transfers would count into it.
        fresh = [fabric_lib.CompletionCounter() for _ in range(200)]
        drive_until(a, lambda: b.imm_count(141) >= 50, "50 arrivals")
        for _ in range(100):
            a.progress()
        assert [c.ended for c in fresh] == [0] * len(fresh)
        assert (dst_array == src.obj).all()
        again = fabric_lib.CompletionCounter()
        a.imm_write(b.address, 142, counter=again)
        drive_until(a, lambda: again.ended == 1, "a later counted transfer")
        assert again.done == 1


def test_counted_transfers_keep_their_source_registration(pair, provider):
    """The source Registration (and its object) outlives a counted transfer that Python
    dropped it under; it is released at the engine's next submission, or at close()."""
    _, b = pair
    dst_array = np.zeros(4096, dtype=np.uint8)
    dst = b.register(dst_array)
    with caller_driven(provider) as a:
        src_array = pattern(4096, seed=4)
        expected = src_array.copy()
        alive = weakref.ref(src_array)
        reg = a.register(src_array)
        del src_array
        counter = fabric_lib.CompletionCounter()
        a.write(reg, dst.descriptor, imm=151, counter=counter)
        del reg
        gc.collect()
        assert alive() is not None, "the transfer in flight holds its source"
        drive_until(a, lambda: counter.ended == 1, "the write")
        assert counter.done == 1 and b.wait_imm(151, 1, TIMEOUT)
        assert (dst_array == expected).all()
        gc.collect()
        assert alive() is not None, "released only at the next submission"
        a.imm_write(b.address, 152, counter=counter)
        gc.collect()
        assert alive() is None, "the next submission released the ended transfer's source"

        second = pattern(4096, seed=5)
        alive = weakref.ref(second)
        reg = a.register(second)
        del second
        a.write(reg, dst.descriptor, counter=counter)  # never driven: in flight until close
        del reg
        a.imm_write(b.address, 153, counter=counter)
        gc.collect()
        assert alive() is not None, "a submission does not release a running transfer's source"
    assert alive() is None, "close() released it"
    # close() drives the group's last passes: the write ends there, done or cancelled.
    assert counter.ended == 4, "the undriven transfers were counted at close"


def test_one_counter_over_two_engines(pair, provider):
    a, b = pair
    with open_engine_or_skip(provider) as c:
        half = 1 << 15
        dst_array = np.zeros(2 * half, dtype=np.uint8)
        dst = c.register(dst_array)
        from_a, from_b = a.register(pattern(half, seed=6)), b.register(pattern(half, seed=7))
        counter = fabric_lib.CompletionCounter()
        for i in range(30):
            a.write(from_a, dst.descriptor, 1024, src_offset=i * 1024, dst_offset=i * 1024,
                    imm=161, counter=counter)
        for i in range(20):
            b.write(from_b, dst.descriptor, 1024, src_offset=i * 1024,
                    dst_offset=half + i * 1024, imm=161, counter=counter)
        assert counter.wait(50, TIMEOUT)
        assert (counter.done, counter.failed) == (50, 0)
        assert c.wait_imm(161, 50, TIMEOUT)
        assert (dst_array[:30 * 1024] == from_a.obj[:30 * 1024]).all()
        assert (dst_array[half:half + 20 * 1024] == from_b.obj[:20 * 1024]).all()
