"""One process: configuration, registration of every kind of memory, addresses and descriptors
as bytes, errors as typed exceptions, futures, immediates, info(), and two engines in one
process (fault injection)."""

import concurrent.futures
import datetime
import mmap
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import fabric_lib
from conftest import TIMEOUT, open_engine_or_skip, unraisable
from peer import make_config


@pytest.fixture(scope="module")
def pair(provider):
    """Two engines in this process."""
    with open_engine_or_skip(provider) as a, open_engine_or_skip(provider) as b:
        yield a, b


# --- configuration ------------------------------------------------------------------------------


def test_config_fields_and_keywords():
    c = fabric_lib.Config(provider="tcp", nics=["lo"], cpu=fabric_lib.GroupConfig.CPU_NONE,
                          spin_time=0.0001, peer_timeout=datetime.timedelta(seconds=2),
                          shard_min_bytes=1 << 20)
    assert c.provider == "tcp"
    assert c.groups[0].nics == ["lo"] and c.groups[0].cpu == -2
    assert c.spin_time == datetime.timedelta(microseconds=100)
    c.inflight_spin = datetime.timedelta(microseconds=5)
    assert c.inflight_spin == datetime.timedelta(microseconds=5)
    assert c.callback_spin is None and c.wait_spin is None  # auto: the engine picks
    c.wait_spin = 0.00005
    assert c.wait_spin == datetime.timedelta(microseconds=50)
    c.wait_spin = None
    assert c.wait_spin is None
    assert c.peer_timeout == datetime.timedelta(seconds=2)
    assert c.shard_min_bytes == 1 << 20
    c.groups[0].nics = ["lo", "lo"]  # edits the config, not a copy
    assert c.groups[0].nics == ["lo", "lo"]
    c.groups.append(fabric_lib.GroupConfig(nics=["lo"]))
    assert len(c.groups) == 2
    c.groups = [fabric_lib.GroupConfig(["shm"])]
    assert [g.nics for g in c.groups] == [["shm"]]
    c.close_timeout = 1
    assert c.close_timeout == datetime.timedelta(seconds=1)
    c.faults.enabled = True
    assert c.faults.enabled
    with pytest.raises(TypeError, match="no field 'spin'"):
        fabric_lib.Config(spin=1)
    with pytest.raises(fabric_lib.InvalidArgument):
        c.spin_time = -1.0
    with pytest.raises(TypeError):
        c.spin_time = "soon"


def test_cuda_ipc_mode_in_config_info_and_stats():
    c = fabric_lib.Config(provider="tcp", nics=["lo"], cpu=fabric_lib.GroupConfig.CPU_NONE)
    assert c.cuda_ipc == "auto"
    c.cuda_ipc = "off"
    assert c.cuda_ipc == "off"
    with pytest.raises(ValueError, match="'auto', 'on' or 'off'"):
        c.cuda_ipc = "yes"
    with fabric_lib.TransferEngine(c) as e:
        assert e.group_info().cuda_ipc == "off"
        g = e.stats().groups[0]
        assert g.cuda_ipc_transfers == 0 and g.cuda_ipc_bytes == 0
        assert g.host_mirror_bytes == 0


def test_shm_copy_threads_is_a_config_field_checked_at_creation():
    c = fabric_lib.Config(provider="shm", nics=["shm"], cpu=fabric_lib.GroupConfig.CPU_NONE)
    assert c.shm_copy_threads == 0
    c.shm_copy_threads = 4
    with fabric_lib.TransferEngine(c) as e:
        assert e.group_info().provider.startswith("shm")
    c.shm_copy_threads = 65
    with pytest.raises(fabric_lib.InvalidArgument, match="shm_copy_threads"):
        fabric_lib.TransferEngine(c)


def test_host_mirror_false_leaves_host_memory_as_it_is():
    """host_mirror=False concerns GPU memory on a staging group; host memory is registered on
    the NICs as always (rails, no mirror), and the keyword is checked like any other."""
    c = fabric_lib.Config(provider="tcp", nics=["lo"], cpu=fabric_lib.GroupConfig.CPU_NONE)
    with fabric_lib.TransferEngine(c) as e:
        buf = bytearray(8192)
        with e.register(buf, host_mirror=False) as reg:
            assert not reg.descriptor.ipc_only
            assert len(reg.descriptor.rails) == len(e.group_info().nics)
            assert e.stats().groups[0].host_mirror_bytes == 0
        with pytest.raises(TypeError):
            e.register(buf, host_mirror="no")


def test_gpu_copies_is_refused_without_a_gpu_naming_why():
    """gpu_copies=True asks this process's GPU to copy into host memory: without one (CI) it
    raises Unsupported saying so, and the memory registers plainly afterwards."""
    c = fabric_lib.Config(provider="tcp", nics=["lo"], cpu=fabric_lib.GroupConfig.CPU_NONE)
    with fabric_lib.TransferEngine(c) as e:
        if e.group_info().cuda:
            pytest.skip("this process has a CUDA device: tests/python/test_cuda.py covers it")
        buf = bytearray(8192)
        with pytest.raises(fabric_lib.Unsupported, match="gpu_copies.*(no CUDA device|without CUDA)"):
            e.register(buf, gpu_copies=True)
        with e.register(buf) as reg:
            assert not reg.descriptor.gpu_copies
        with pytest.raises(TypeError):
            e.register(buf, gpu_copies="yes")


def test_spins_in_effect_are_in_stats():
    import os
    c = fabric_lib.Config(provider="tcp", nics=["lo"], cpu=fabric_lib.GroupConfig.CPU_NONE)
    auto = datetime.timedelta(microseconds=50) if len(os.sched_getaffinity(0)) >= 8 \
        else datetime.timedelta(0)
    with fabric_lib.TransferEngine(c) as e:
        assert e.stats().callback_spin == auto and e.stats().wait_spin == auto
    c.wait_spin = datetime.timedelta(microseconds=30)
    with fabric_lib.TransferEngine(c) as e:
        assert e.stats().wait_spin == datetime.timedelta(microseconds=30)
        assert e.stats().callback_spin == auto


def test_env_overrides(monkeypatch):
    monkeypatch.setenv("FABRIC_PROVIDER", "shm")
    monkeypatch.setenv("FABRIC_NICS", "a,b")
    c = fabric_lib.Config()
    c.apply_env_overrides()
    assert c.provider == "shm" and c.groups[0].nics == ["a", "b"]
    monkeypatch.setenv("FABRIC_SPIN_US", "lots")
    with pytest.raises(fabric_lib.InvalidArgument, match="FABRIC_SPIN_US"):
        fabric_lib.Config().apply_env_overrides()


def test_absent_provider_raises_unsupported():
    with pytest.raises(fabric_lib.Unsupported):
        fabric_lib.TransferEngine(fabric_lib.Config(provider="no-such-provider"))


# --- errors -------------------------------------------------------------------------------------


def test_every_status_code_has_its_exception_class():
    builtin = {
        "INVALID_ARGUMENT": ValueError, "OUT_OF_RANGE": IndexError, "NOT_FOUND": LookupError,
        "UNSUPPORTED": NotImplementedError, "TIMEOUT": TimeoutError,
        "PEER_UNREACHABLE": ConnectionError, "INTERNAL": RuntimeError,
    }
    names = set()
    for name, code in fabric_lib.ErrorCode.__members__.items():
        cls = fabric_lib.error_class(code)
        assert issubclass(cls, fabric_lib.FabricError)
        if name == "OK":
            assert cls is fabric_lib.FabricError
            continue
        assert cls is not fabric_lib.FabricError, name
        assert getattr(fabric_lib, cls.__name__) is cls
        if name in builtin:
            assert issubclass(cls, builtin[name]), name
        names.add(cls.__name__)
    assert len(names) == 12
    assert fabric_lib.error_class(fabric_lib.ErrorCode.FABRIC) is fabric_lib.ProviderError


def test_raised_errors_carry_code_and_message_and_pickle():
    with pytest.raises(fabric_lib.InvalidArgument) as raised:
        fabric_lib.Address(b"garbage")
    e = raised.value
    assert e.code == fabric_lib.ErrorCode.INVALID_ARGUMENT
    assert e.message and str(e) == e.message and "Address" in e.message
    again = pickle.loads(pickle.dumps(e))
    assert type(again) is fabric_lib.InvalidArgument and again.code == e.code


# --- addresses and descriptors ------------------------------------------------------------------


def test_address_and_descriptor_are_bytes_and_picklable(pair):
    a, b = pair
    addr = a.address
    data = bytes(addr)
    assert isinstance(data, bytes) and data == addr.to_bytes()
    assert fabric_lib.Address(data) == addr and hash(fabric_lib.Address(data)) == hash(addr)
    assert fabric_lib.Address.from_hex(addr.hex()) == addr
    assert pickle.loads(pickle.dumps(addr)) == addr
    assert addr != b.address and addr != data  # an Address never equals raw bytes
    assert addr.num_nics == 1 and addr.provider == a.group_info().provider
    reg = b.register(bytearray(4096))
    desc = reg.descriptor
    assert fabric_lib.RemoteMemory(bytes(desc)) == desc
    assert pickle.loads(pickle.dumps(desc)) == desc
    assert fabric_lib.RemoteMemory.from_hex(desc.hex()) == desc
    assert desc.length == len(desc) == 4096 and desc.owner == b.address
    assert len(desc.rails) == 1 and desc.base == reg.ptr
    with pytest.raises(fabric_lib.InvalidArgument):
        fabric_lib.RemoteMemory(data)  # an address is not a descriptor
    with pytest.raises(TypeError):
        fabric_lib.Address(12)


# --- registration -------------------------------------------------------------------------------


def test_register_every_kind_of_host_memory(pair):
    a, _ = pair
    arr = np.zeros((16, 256), dtype=np.float32)
    kinds = {
        "numpy": (arr, arr.nbytes, arr.ctypes.data),
        "numpy view": (arr[4:8], 4 * 256 * 4, arr[4:8].ctypes.data),
        "torch": (torch.zeros(100, dtype=torch.float64), 800, None),
        "torch view": (torch.zeros(10, 10)[2:5], 3 * 10 * 4, None),
        "bytearray": (bytearray(1000), 1000, None),
        "memoryview": (memoryview(bytearray(64)), 64, None),
        "mmap": (mmap.mmap(-1, 8192), 8192, None),
    }
    for kind, (obj, length, ptr) in kinds.items():
        reg = a.register(obj)
        assert reg.length == length, kind
        assert reg.obj is obj and reg.device == "cpu" and reg.registered
        if ptr is not None:
            assert reg.ptr == ptr, kind
        if isinstance(obj, torch.Tensor):
            assert reg.ptr == obj.data_ptr(), kind
        handle, desc = reg  # unpacks
        assert handle == reg.handle and desc == reg.descriptor
        reg.unregister()
        assert not reg.registered
    del reg  # the Registration holds the buffer export until it is collected
    kinds["mmap"][0].close()


def test_register_rejects_what_it_cannot_register(pair):
    a, _ = pair
    with pytest.raises(fabric_lib.InvalidArgument, match="read-only"):
        a.register(b"immutable bytes")
    ro = np.zeros(10)
    ro.flags.writeable = False
    with pytest.raises(fabric_lib.InvalidArgument, match="read-only"):
        a.register(ro)
    with pytest.raises(fabric_lib.InvalidArgument, match="not contiguous"):
        a.register(np.zeros((10, 10))[:, 3])
    with pytest.raises(fabric_lib.InvalidArgument, match="not contiguous"):
        a.register(torch.zeros(10, 10).t())
    with pytest.raises(fabric_lib.InvalidArgument, match="zero length"):
        a.register(np.zeros(0))
    with pytest.raises(TypeError, match="neither the buffer protocol nor DLPack"):
        a.register(object())
    with pytest.raises(fabric_lib.NotFound):
        a.register(bytearray(10), group=5)


@pytest.mark.skipif(not fabric_lib.HAS_CUDA or not torch.cuda.is_available(),
                    reason="needs fabric_lib built with CUDA and a CUDA device "
                    "(tests/python/test_cuda.py has the rest)")
def test_register_cuda_tensor(pair):  # pragma: no cover - needs the CUDA build and a GPU
    a, _ = pair
    reg = a.register(torch.zeros(1024, device="cuda"))
    assert reg.device == "cuda:0"
    assert reg.descriptor.staged


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_uvm_watchers_without_a_gpu_say_why():
    with pytest.raises(fabric_lib.Unsupported,
                       match="without CUDA|cudaGetDeviceCount|does not exist"):
        fabric_lib.UvmWatchers()


@pytest.mark.skipif(fabric_lib.HAS_CUDA, reason="this build has CUDA")
def test_register_cuda_tensor_without_cuda_says_why(pair):
    class FakeCudaTensor:  # a DLPack exporter that claims to live on a GPU
        def __dlpack_device__(self):
            return (2, 0)

        def __dlpack__(self, stream=None):
            raise AssertionError("must not be exported")

    a, _ = pair
    with pytest.raises(fabric_lib.Unsupported, match="built with CUDA"):
        a.register(FakeCudaTensor())


def test_registration_lifetime(pair):
    a, b = pair
    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    with b.register(dst) as rd:
        desc = rd.descriptor
        assert rd.registered
    assert not rd.registered
    with pytest.raises(fabric_lib.NotFound):
        b.unregister(rd)
    rd = b.register(dst)
    rs = a.register(src)
    a.write(rs, rd.descriptor, imm=1).wait(TIMEOUT)
    assert b.wait_imm(1, 1, TIMEOUT)
    assert (dst == src).all()
    b.unregister(rd.handle)  # by handle also works
    with pytest.raises(fabric_lib.NotFound):
        a.unregister(b.register(bytearray(8)))  # another engine's registration
    assert desc != rd.descriptor


def test_register_ptr(pair):
    a, b = pair
    owner = np.zeros(4096, dtype=np.uint8)
    reg = b.register_ptr(owner.ctypes.data, 4096, owner=owner)
    assert reg.obj is owner and reg.length == 4096
    src = a.register(np.full(4096, 9, dtype=np.uint8))
    a.write(src, reg.descriptor, imm=2).wait(TIMEOUT)
    assert b.wait_imm(2, 1, TIMEOUT)
    assert (owner == 9).all()


# --- caller-driven progress ---------------------------------------------------------------------


def test_caller_progress_group_is_driven_by_progress(provider):
    """A group with no worker thread: futures complete, and callbacks run, on the thread that
    calls progress(); wait_imm drives it itself; progress() on a worker-thread group is False."""
    config = make_config(provider)
    config.groups[0].caller_progress = True
    assert config.groups[0].caller_progress
    with open_engine_or_skip(provider) as b:
        try:
            a = fabric_lib.TransferEngine(config)
        except fabric_lib.Unsupported as e:
            pytest.skip(f"provider {provider} not available here: {e}")
        with a:
            src = a.register(np.arange(1 << 16, dtype=np.uint32).view(np.uint8))
            dst_array = np.zeros(1 << 18, dtype=np.uint8)
            dst = b.register(dst_array)
            ran_on = []
            t = a.write(src, dst.descriptor, imm=61,
                        on_done=lambda: ran_on.append(threading.get_ident()))
            for _ in range(200000):
                if t.done():
                    break
                a.progress()
            assert t.done(), "the write did not complete while its group was driven"
            t.result(0)
            assert ran_on == [threading.get_ident()]
            assert b.wait_imm(61, 1, TIMEOUT)
            assert (dst_array == np.arange(1 << 16, dtype=np.uint32).view(np.uint8)).all()
            assert not b.progress(), "b has a worker thread"
            assert not a.progress(5), "no group 5"


def test_callbacks_on_worker_run_on_the_groups_worker_thread(provider):
    """Config.callbacks_on_worker: on_done runs on the worker thread (fabric-w0), and a call
    there that would wait for the worker raises InvalidArgument instead of deadlocking."""
    config = make_config(provider)
    config.callbacks_on_worker = True
    assert config.callbacks_on_worker
    with open_engine_or_skip(provider) as b:
        try:
            a = fabric_lib.TransferEngine(config)
        except fabric_lib.Unsupported as e:
            pytest.skip(f"provider {provider} not available here: {e}")
        with a:
            src = a.register(np.full(4096, 5, dtype=np.uint8))
            dst_array = np.zeros(4096, dtype=np.uint8)
            dst = b.register(dst_array)
            seen = {}

            def on_done():
                tid = threading.get_native_id()
                seen["thread"] = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
                try:
                    a.register(np.zeros(64, dtype=np.uint8))
                    seen["register"] = "returned"
                except fabric_lib.InvalidArgument as e:
                    seen["register"] = str(e)

            a.write(src, dst.descriptor, imm=62, on_done=on_done).result(TIMEOUT)
            assert b.wait_imm(62, 1, TIMEOUT)
            assert (dst_array == 5).all()
            assert seen["thread"] == "fabric-w0"
            assert "worker" in seen["register"], seen["register"]


# --- futures and immediates ---------------------------------------------------------------------


def test_transfers_are_concurrent_futures(pair):
    a, b = pair
    src = a.register(np.ones(1 << 16, dtype=np.uint8))
    dst = b.register(np.zeros(1 << 16, dtype=np.uint8))
    done = threading.Event()
    t = a.write(src, dst.descriptor, imm=3, on_done=done.set)
    assert isinstance(t, concurrent.futures.Future)
    assert not t.cancel(), "a posted transfer cannot be cancelled"
    for f in concurrent.futures.as_completed([t, b.expect_imm(3, 1)], timeout=TIMEOUT):
        assert f.result() is None
    assert done.is_set()
    assert t.id is not None and "finished" in repr(t)


def test_expectations_claim_arrivals_and_can_be_cancelled(pair):
    a, b = pair
    for _ in range(3):
        a.imm_write(b.address, 5)
    assert b.wait_imm(5, 3, TIMEOUT) and b.imm_count(5) == 3
    b.expect_imm(5, 2).result(TIMEOUT)  # arrivals before the expectation count
    second = b.expect_imm(5, 2)  # one unclaimed arrival: pending
    with pytest.raises(fabric_lib.AlreadyExists):
        b.expect_imm(5, 1)
    with pytest.raises(concurrent.futures.TimeoutError):
        second.result(0.2)
    a.imm_write(b.address, 5)
    second.result(TIMEOUT)
    assert b.imm_count(5) == 4
    with pytest.raises(fabric_lib.InvalidArgument):
        b.expect_imm(6, 0)
    pending = b.expect_imm(6, 1, on_reached=lambda: pytest.fail("a cancelled expectation ran"))
    assert pending.cancel() and pending.cancelled()
    with pytest.raises(fabric_lib.NotFound):
        b.cancel_expect_imm(6)
    again = b.expect_imm(6, 1)
    b.cancel_expect_imm(6)
    assert again.cancelled()
    third = b.expect_imm(6, 10)
    b.reset_imm(6)
    assert third.cancelled(), "reset_imm forgets the expectation"
    assert not b.wait_imm(7, 1, 0.05), "wait_imm returns False when it times out"


def test_recv_without_messages_times_out(provider):
    with open_engine_or_skip(provider) as e:
        with pytest.raises(fabric_lib.NotFound):
            e.recv(0.1)  # no receive pool yet
        e.set_receive_handler()
        with pytest.raises(fabric_lib.Timeout):
            e.recv(0.1)


def test_scatter_to_two_engines_and_barrier(pair, provider):
    a, b = pair
    with open_engine_or_skip(provider) as c:
        src = a.register(np.arange(1 << 16, dtype=np.uint16))
        db = b.register(np.zeros(1 << 16, dtype=np.uint8))
        dc = c.register(np.zeros(1 << 16, dtype=np.uint8))
        group = a.add_peer_group([b.address, bytes(c.address)])
        a.scatter(src, group, [(db.descriptor, 1000), (dc.descriptor, 5000, 100, 7)], imm=40).wait(TIMEOUT)
        assert b.wait_imm(40, 1, TIMEOUT) and c.wait_imm(40, 1, TIMEOUT)
        raw = src.obj.view(np.uint8)
        assert (db.obj[:1000] == raw[:1000]).all() and (dc.obj[7:5007] == raw[100:5100]).all()
        a.barrier(group, 41).wait(TIMEOUT)
        assert b.wait_imm(41, 1, TIMEOUT) and c.wait_imm(41, 1, TIMEOUT)
        with pytest.raises(fabric_lib.InvalidArgument):
            a.add_peer_group([])


def test_close_in_a_callback_is_refused_and_engines_close_on_exit(pair, provider):
    a, b = pair
    e = open_engine_or_skip(provider)
    with unraisable() as seen:
        e.imm_write(b.address, 50, on_done=e.close).wait(TIMEOUT)
    assert [type(u.exc_value) for u in seen] == [fabric_lib.InvalidArgument]
    assert "close() cannot be called from a callback" in str(seen[0].exc_value)
    assert not e.closed
    e.close()
    with pytest.raises(fabric_lib.Closed):
        e.register(bytearray(10))
    with pytest.raises(fabric_lib.Closed):
        e.expect_imm(1, 1)
    pending = b.expect_imm(51, 1)
    b2 = open_engine_or_skip(provider)
    pending2 = b2.expect_imm(51, 1)
    del b2  # dropping the engine closes it; its expectations fail
    with pytest.raises(fabric_lib.Cancelled):
        pending2.result(TIMEOUT)
    assert not pending.done()
    b.cancel_expect_imm(51)


def test_close_in_each_kind_of_engine_callback_is_an_invalid_argument(pair, provider):
    """close() (or leaving a `with` block) inside on_done, on_error, an expectation's
    on_reached, the receive handler or the unexpected-immediate handler raises InvalidArgument
    (a FabricError and a ValueError) saying why, and leaves the engine open."""
    a, b = pair
    e = open_engine_or_skip(provider)
    caught = []

    def closing(*_):
        try:
            e.close()
        except BaseException as exc:  # noqa: BLE001 - what close() raised is the point
            caught.append(exc)
        try:
            e.__exit__(None, None, None)
        except BaseException as exc:  # noqa: BLE001
            caught.append(exc)

    e.imm_write(b.address, 52, on_done=closing).wait(TIMEOUT)
    src = e.register(np.ones(64, np.uint8))
    dst = b.register(np.zeros(64, np.uint8))
    stale = bytes(dst.descriptor)
    dst.unregister()
    failed = e.write(src, stale, 16, on_error=closing)
    assert isinstance(failed.exception(TIMEOUT), fabric_lib.FabricError)
    e.expect_imm(54, 1, closing)
    b.imm_write(e.address, 54).wait(TIMEOUT)
    assert e.wait_imm(54, 1, TIMEOUT)
    e.set_unexpected_imm_handler(closing)
    b.imm_write(e.address, 55).wait(TIMEOUT)
    assert e.wait_imm(55, 1, TIMEOUT)
    e.set_receive_handler(closing)
    b.send(e.address, b"close?").wait(TIMEOUT)
    deadline = time.monotonic() + TIMEOUT
    while len(caught) < 10 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(caught) == 10, caught  # two from each of the five callbacks
    for exc in caught:
        assert type(exc) is fabric_lib.InvalidArgument, repr(exc)
        assert isinstance(exc, ValueError) and exc.code == fabric_lib.ErrorCode.INVALID_ARGUMENT
        assert "TransferEngine.close() cannot be called from a callback" in str(exc)
    assert not e.closed
    e.close()
    assert e.closed


def test_close_in_a_fault_hook_is_an_invalid_argument(provider):
    """FaultConfig.fail_write runs on the worker: close() there is refused like in any other
    callback of the module (InvalidArgument), and the write goes on."""
    caught, engines = [], []

    def hook(sequence):
        try:
            engines[0].close()
        except BaseException as exc:  # noqa: BLE001 - what close() raised is the point
            caught.append(exc)
        return False

    cfg = make_config(provider)
    cfg.faults.enabled = True
    cfg.faults.fail_write = hook
    with fabric_lib.TransferEngine(cfg) as e, open_engine_or_skip(provider) as b:
        engines.append(e)
        src = e.register(np.ones(64, np.uint8))
        dst = b.register(np.zeros(64, np.uint8))
        e.write(src, dst.descriptor, 64).result(TIMEOUT)
        assert dst.obj.all() and not e.closed
    assert caught and all(type(x) is fabric_lib.InvalidArgument for x in caught), caught
    assert "TransferEngine.close() cannot be called from a callback" in str(caught[0])


def test_fault_injection_fails_chosen_writes(provider):
    cfg = make_config(provider)
    cfg.faults.enabled = True
    cfg.faults.fail_write = lambda seq: seq % 5 == 2
    assert cfg.faults.fail_write(2) is True
    with fabric_lib.TransferEngine(cfg) as faulty, open_engine_or_skip(provider) as b:
        src = faulty.register(np.ones(1 << 12, dtype=np.uint8))
        dst = b.register(np.zeros(1 << 12, dtype=np.uint8))
        transfers = [faulty.write(src, dst.descriptor, imm=8) for _ in range(20)]
        failed = 0
        for t in transfers:
            try:
                t.result(TIMEOUT)
            except fabric_lib.ProviderError as e:
                assert e.code == fabric_lib.ErrorCode.FABRIC
                failed += 1
        assert failed == 4
        assert b.wait_imm(8, 16, TIMEOUT)


# --- info ---------------------------------------------------------------------------------------


def test_info_mirrors_fabric_info():
    report = fabric_lib.info()
    assert isinstance(report, dict)
    assert set(report) == {"libfabric", "auto_provider", "providers", "verbs_built", "verbs", "nics",
                           "gpus", "paths", "allowed_cpus", "cuda_built", "cuda_device", "engine"}
    assert [p["name"] for p in report["providers"]] == ["tcp", "shm", "efa", "verbs"]
    tcp = report["providers"][0]
    assert tcp["present"] and any(d["nic"] == "lo" for d in tcp["domains"])
    assert report["engine"]["ok"] and report["engine"]["nics"] == ["lo"]
    fabric_lib.Address.from_hex(report["engine"]["address_hex"])
    text = str(report)
    assert text.startswith("libfabric ") and "TransferEngine on provider tcp, NIC(s) lo:" in text
    absent = fabric_lib.info(provider="no-such-provider", engine=True)
    assert not absent["engine"]["ok"] and absent["engine"]["error"]
    assert fabric_lib.info(engine=False)["engine"] is None
    with pytest.raises(fabric_lib.InvalidArgument):
        fabric_lib.info(cpu="sometimes")


def test_waits_release_the_gil(pair):
    """Another Python thread runs while this one waits in the engine: in the middle of the
    wait, not only at its edges (a thread switch just before or after a wait that holds the GIL
    would let it run there)."""
    a, b = pair
    ran_at, stop = [], threading.Event()

    def tick():
        while not stop.is_set():
            ran_at.append(time.monotonic())
            time.sleep(0.01)  # wakes up to the GIL: it cannot go on while a wait holds it

    t = threading.Thread(target=tick)
    t.start()
    try:
        for wait in (lambda: b.wait_imm(12345, 1, 0.5),
                     lambda: b.expect_imm(12346, 1).exception(0.5),
                     lambda: fabric_lib.CompletionCounter().wait(1, 0.5)):
            start = time.monotonic()
            try:
                wait()
            except concurrent.futures.TimeoutError:
                pass
            end = time.monotonic()
            assert any(start + 0.1 < r < end - 0.1 for r in ran_at), \
                "the other thread did not run during the wait"
    finally:
        stop.set()
        t.join()
        b.cancel_expect_imm(12346)


def test_interpreter_exit_with_engines_open(provider):
    """Engines left open, with transfers, expectations and handlers pending, close at exit."""
    script = f"""
import numpy as np, fabric_lib, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from peer import make_config
a = fabric_lib.TransferEngine(make_config({provider!r}))
b = fabric_lib.TransferEngine(make_config({provider!r}))
src = a.register(np.ones(1 << 20, dtype=np.uint8))
dst = b.register(np.zeros(1 << 20, dtype=np.uint8))
pending = b.expect_imm(1, 1000)
b.set_unexpected_imm_handler(lambda imm: None)
b.set_receive_handler(lambda m: None)
transfers = [a.write(src, dst.descriptor, imm=2, on_done=lambda: None) for _ in range(100)]
print("exiting", flush=True)
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=TIMEOUT)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "exiting\n"


def test_libfabric_is_loaded_only_by_what_uses_it():
    """libfabric.so.1 is loaded when a libfabric domain is opened or info() lists providers,
    not at import or by shm engines and their writes (loading it costs Debian's processes about
    0.2 s: libinfinipath's clock calibration)."""
    script = f"""
import numpy as np, fabric_lib, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from peer import make_config
def loaded():
    return "libfabric.so" in open("/proc/self/maps").read()
print("import", loaded())
a = fabric_lib.TransferEngine(make_config("shm"))
b = fabric_lib.TransferEngine(make_config("shm"))
src = a.register(np.ones(1 << 16, dtype=np.uint8))
dst_buf = np.zeros(1 << 16, dtype=np.uint8)
dst = b.register(dst_buf)
a.write(src, dst.descriptor, imm=7).wait(10)
assert dst_buf.min() == 1
print("shm", loaded())
c = fabric_lib.TransferEngine(make_config("tcp"))
print("tcp", loaded())
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=TIMEOUT)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[:3] == ["import False", "shm False", "tcp True"]
