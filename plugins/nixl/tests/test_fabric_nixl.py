"""The FABRIC NIXL plugin through NIXL's Python API: data, notifications, metrics, and bad input.

Run by tools/nixl/run_nixl_tests.sh against NIXL built from source (source .nixl/env.sh first to
run it by hand), and by tools/nixl/run_wheel_tests.sh against NIXL's Python wheel:

    FABRIC_PROVIDER=tcp python3 -m pytest -q plugins/nixl/tests/test_fabric_nixl.py

Every bad input must fail the request (an exception or "ERR") and leave the agent working: each
such test ends with a verified transfer on the same agent.
"""

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid

import pytest

torch = pytest.importorskip("torch")
nixl_api = pytest.importorskip(
    "nixl._api", reason="NIXL's Python module is not on PYTHONPATH (source .nixl/env.sh)")
nixl_agent, nixl_agent_config = nixl_api.nixl_agent, nixl_api.nixl_agent_config

BACKEND = "FABRIC"
DEADLINE_S = 30.0


def make_agent(params=None, name=None):
    agent = nixl_agent(name or str(uuid.uuid4()), nixl_agent_config(backends=[]))
    agent.create_backend(BACKEND, params or {})
    return agent


def connect(a, b):
    """a learns b's metadata; returns b's name as a knows it."""
    return a.add_remote_agent(b.get_agent_metadata())


def wait_state(agent, handle, deadline_s=DEADLINE_S):
    """Polls a transfer to its end: "DONE", "ERR", "TIMEOUT", or the name of the exception NIXL
    raised (nixlRemoteDisconnectError, ...)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            state = agent.check_xfer_state(handle)
        except Exception as e:  # noqa: BLE001 - NIXL raises a status-named exception
            return type(e).__name__
        if state != "PROC":
            return state
        time.sleep(0.001)
    return "TIMEOUT"


def wait_notif(agent, sender, deadline_s=DEADLINE_S):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        notifs = agent.get_new_notifs()
        if notifs.get(sender):
            return notifs[sender]
        time.sleep(0.001)
    return []


def verified_write(src_agent, dst_agent, dst_name_at_src, size=1 << 16, fill=7):
    """A WRITE from src_agent into dst_agent, checked byte for byte at the destination."""
    src = torch.full((size,), fill, dtype=torch.uint8)
    dst = torch.zeros((size,), dtype=torch.uint8)
    src_reg = src_agent.register_memory(src)
    dst_reg = dst_agent.register_memory(dst)
    connect(src_agent, dst_agent)
    handle = src_agent.initialize_xfer(
        "WRITE",
        src_agent.get_xfer_descs(src),
        dst_agent.get_xfer_descs(dst),
        dst_name_at_src,
        b"verified",
    )
    try:
        state = src_agent.transfer(handle)
        if state == "PROC":
            state = wait_state(src_agent, handle)
        assert state == "DONE"
        assert wait_notif(dst_agent, src_agent.name) == [b"verified"]
        assert torch.equal(dst, src)
    finally:
        src_agent.release_xfer_handle(handle)
        src_agent.deregister_memory(src_reg)
        dst_agent.deregister_memory(dst_reg)
        # NIXL refuses to reload a peer's metadata that describes an address it already holds
        # with another blob (a later registration at the same address): forget the peer.
        src_agent.remove_remote_agent(dst_name_at_src)


@pytest.fixture
def pair():
    """Two agents; a test connects them once its memory is registered (the metadata a peer loads
    lists the registrations made before it was taken)."""
    return make_agent(), make_agent()


# --- data and notifications -------------------------------------------------------------------


@pytest.mark.parametrize("op", ["WRITE", "READ"])
@pytest.mark.parametrize("size,count", [(40, 64), (4096, 8), (1 << 20, 4), (8 << 20, 1)])
def test_transfer_lands_before_its_notification(pair, op, size, count):
    a, b = pair
    local = torch.randint(0, 255, (count, size), dtype=torch.uint8)
    remote = torch.randint(0, 255, (count, size), dtype=torch.uint8)
    local_before, remote_before = local.clone(), remote.clone()
    la, rb = a.register_memory(local), b.register_memory(remote)
    connect(a, b)
    handle = a.initialize_xfer(
        op,
        a.get_xfer_descs([local[i] for i in range(count)]),
        b.get_xfer_descs([remote[i] for i in range(count)]),
        b.name,
        b"landed",
    )
    state = a.transfer(handle)
    # The target checks the bytes the moment the notification is seen: they must be there.
    notifs = wait_notif(b, a.name)
    assert notifs == [b"landed"]
    if op == "WRITE":
        assert torch.equal(remote, local_before)
    else:
        assert torch.equal(remote, remote_before)
    if state == "PROC":
        state = wait_state(a, handle)
    assert state == "DONE"
    if op == "READ":
        assert torch.equal(local, remote_before)
    a.release_xfer_handle(handle)
    a.deregister_memory(la)
    b.deregister_memory(rb)


def test_local_transfer_within_one_agent():
    a = make_agent()
    src = torch.arange(0, 1 << 16, dtype=torch.int32)
    dst = torch.zeros_like(src)
    regs = a.register_memory([src, dst])
    for op, local, remote in (("WRITE", src, dst), ("READ", dst, src)):
        dst.zero_() if op == "WRITE" else None
        handle = a.initialize_xfer(op, a.get_xfer_descs(local), a.get_xfer_descs(remote), a.name)
        state = a.transfer(handle)
        if state == "PROC":
            state = wait_state(a, handle)
        assert state == "DONE", op
        assert torch.equal(src, dst), op
        a.release_xfer_handle(handle)
    a.send_notif(a.name, b"self")
    assert wait_notif(a, a.name) == [b"self"]
    a.deregister_memory(regs)


def test_repost_and_many_notifications(pair):
    a, b = pair
    src = torch.ones((1 << 12,), dtype=torch.uint8)
    dst = torch.zeros((1 << 12,), dtype=torch.uint8)
    ra, rb = a.register_memory(src), b.register_memory(dst)
    connect(a, b)
    handle = a.initialize_xfer("WRITE", a.get_xfer_descs(src), b.get_xfer_descs(dst), b.name)
    got = []
    for i in range(50):
        state = a.transfer(handle, f"n{i}".encode())
        if state == "PROC":
            state = wait_state(a, handle)
        assert state == "DONE"
    end = time.monotonic() + DEADLINE_S
    while len(got) < 50 and time.monotonic() < end:
        got += b.get_new_notifs().get(a.name, [])
    assert sorted(got) == sorted(f"n{i}".encode() for i in range(50))
    a.release_xfer_handle(handle)
    a.deregister_memory(ra)
    b.deregister_memory(rb)


def test_caller_driven_progress():
    """progress=caller: no engine threads; each engine moves only inside checkXfer and getNotifs
    of its agent. b's side is driven by a thread that collects its notifications."""
    import threading

    a, b = make_agent({"progress": "caller"}), make_agent({"progress": "caller"})
    size = 1 << 20
    src = torch.randint(0, 255, (size,), dtype=torch.uint8)
    dst = torch.zeros((size,), dtype=torch.uint8)
    ra, rb = a.register_memory(src), b.register_memory(dst)
    connect(a, b)
    got, stop = [], threading.Event()

    def drive_b():
        while not stop.is_set():
            got.extend(b.get_new_notifs().get(a.name, []))

    t = threading.Thread(target=drive_b)
    t.start()
    try:
        for op in ("WRITE", "READ"):
            handle = a.initialize_xfer(op, a.get_xfer_descs(src), b.get_xfer_descs(dst), b.name,
                                       op.encode())
            state = a.transfer(handle)
            if state == "PROC":
                state = wait_state(a, handle)
            assert state == "DONE", op
            assert torch.equal(src, dst), op
            a.release_xfer_handle(handle)
            dst[:] = torch.randint(0, 255, (size,), dtype=torch.uint8) if op == "WRITE" else dst
            if op == "WRITE":
                src.zero_()
        end = time.monotonic() + DEADLINE_S
        while len(got) < 2 and time.monotonic() < end:
            time.sleep(0.01)
        assert got == [b"WRITE", b"READ"]
    finally:
        stop.set()
        t.join()
    a.deregister_memory(ra)
    b.deregister_memory(rb)


# --- metrics ----------------------------------------------------------------------------------


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, value = line.rsplit(" ", 1)
        values[name] = float(value)
    return values


def test_prometheus_metrics_count_the_transfers():
    port = free_port()
    a = make_agent({"metrics_port": str(port)}, name="metrics_a")
    b = make_agent()
    key = 'fabric_transfers_completed_total{engine="metrics_a",group="0"}'
    before = scrape(port)[key]
    for _ in range(3):
        verified_write(a, b, b.name)
    assert scrape(port)[key] - before == 3
    assert scrape(port)['fabric_messages_completed_total{engine="metrics_a",group="0"}'] >= 3


# --- bad input --------------------------------------------------------------------------------


def test_unknown_agent_fails_the_request(pair):
    a, b = pair
    t = torch.zeros((4096,), dtype=torch.uint8)
    reg = a.register_memory(t)
    connect(a, b)
    with pytest.raises(Exception):
        a.initialize_xfer("WRITE", a.get_xfer_descs(t), a.get_xfer_descs(t), "no_such_agent")
    with pytest.raises(Exception):
        a.send_notif("no_such_agent", b"x")
    a.deregister_memory(reg)
    verified_write(a, b, b.name)


def test_unregistered_memory_fails_the_request(pair):
    a, b = pair
    src = torch.ones((4096,), dtype=torch.uint8)  # never registered
    dst = torch.zeros((4096,), dtype=torch.uint8)
    reg = b.register_memory(dst)
    connect(a, b)
    with pytest.raises(Exception):
        a.initialize_xfer("WRITE", a.get_xfer_descs(src), b.get_xfer_descs(dst), b.name)
    b.deregister_memory(reg)
    verified_write(a, b, b.name)


def test_descriptor_outside_a_registration_fails_the_request(pair):
    a, b = pair
    src = torch.ones((8192,), dtype=torch.uint8)
    dst = torch.zeros((8192,), dtype=torch.uint8)
    ra = a.register_memory(src)
    rb = b.register_memory(dst[:4096])  # only the first half
    connect(a, b)
    remote = b.get_xfer_descs([(dst.data_ptr() + 2048, 4096, 0)], "DRAM")  # crosses its end
    with pytest.raises(Exception):
        h = a.initialize_xfer("WRITE", a.get_xfer_descs([(src.data_ptr(), 4096, 0)], "DRAM"),
                              remote, b.name)
        assert wait_state(a, h) != "DONE"
    assert torch.count_nonzero(dst) == 0
    a.deregister_memory(ra)
    b.deregister_memory(rb)
    verified_write(a, b, b.name)


def test_corrupt_metadata_is_refused(pair):
    a, b = pair
    connect(a, b)
    md = bytearray(b.get_agent_metadata())
    for i in range(len(md) // 2, len(md)):
        md[i] ^= 0x5A
    with pytest.raises(Exception):
        a.add_remote_agent(bytes(md))
    verified_write(a, b, b.name)


def test_release_mid_flight(pair):
    a, b = pair
    size = 64 << 20
    src = torch.ones((size,), dtype=torch.uint8)
    dst = torch.zeros((size,), dtype=torch.uint8)
    ra, rb = a.register_memory(src), b.register_memory(dst)
    connect(a, b)
    handle = a.initialize_xfer("WRITE", a.get_xfer_descs(src), b.get_xfer_descs(dst), b.name,
                               b"released")
    a.transfer(handle)
    a.release_xfer_handle(handle)  # in flight, most likely: its notification is not sent
    a.deregister_memory(ra)  # waits for the write still reading src
    time.sleep(0.2)
    assert b.get_new_notifs().get(a.name, []) in ([], [b"released"])
    b.deregister_memory(rb)
    verified_write(a, b, b.name)


PEER = r"""
import sys, time, torch
from nixl._api import nixl_agent, nixl_agent_config
agent = nixl_agent("doomed_peer", nixl_agent_config(backends=[]))
agent.create_backend("FABRIC", {})
buf = torch.zeros((256 << 20,), dtype=torch.uint8)
agent.register_memory(buf)
with open(sys.argv[1] + ".tmp", "wb") as f:
    f.write(agent.get_agent_metadata())
    f.write(buf.data_ptr().to_bytes(8, "little"))
import os
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(600)
"""


@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_peer_that_dies_mid_transfer_fails_the_request(op):
    a = make_agent({"peer_timeout_ms": "3000"})
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "md")
        peer = subprocess.Popen([sys.executable, "-c", PEER, path])
        try:
            end = time.monotonic() + DEADLINE_S
            while not os.path.exists(path) and time.monotonic() < end:
                time.sleep(0.05)
            blob = open(path, "rb").read()
            md, base = blob[:-8], int.from_bytes(blob[-8:], "little")
            name = a.add_remote_agent(md)
            size = 256 << 20
            local = torch.zeros((size,), dtype=torch.uint8)
            reg = a.register_memory(local)
            handle = a.initialize_xfer(op, a.get_xfer_descs(local),
                                       a.get_xfer_descs([(base, size, 0)], "DRAM"), name, b"x")
            states = []
            for i in range(20):  # repost; the peer is killed while the third is in flight
                try:
                    state = a.transfer(handle)
                except Exception as e:  # noqa: BLE001
                    state = type(e).__name__
                if i == 2:
                    peer.kill()
                if state == "PROC":
                    state = wait_state(a, handle)
                states.append(state)
                if state != "DONE":
                    break
            print("states:", states)
            assert states[-1] != "DONE" and states[-1] != "TIMEOUT", states
            assert len(states) <= 4, states  # the one in flight, or the next, failed
        finally:
            peer.kill()
            peer.wait()
        a.release_xfer_handle(handle)
        a.deregister_memory(reg)
    # The agent still works.
    b = make_agent()
    verified_write(a, b, b.name)
