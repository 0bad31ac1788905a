"""VRAM to VRAM between two processes through NIXL and the FABRIC plugin, verified (one GPU).

    python3 plugins/nixl/tests/vram_two_process.py            # after sourcing .nixl/env.sh

Starts a target process (this file with --target), exchanges NIXL metadata through files, and:
  1. WRITE  initiator VRAM -> target VRAM, with a notification; the target checks every byte
            the moment the notification is seen, and reports back
  2. WRITE  initiator DRAM -> target VRAM, the same
  3. READ   target VRAM -> initiator VRAM: verified, or refused with a NIXL error naming why
            (the engine cannot read GPU memory it reaches only through a host mirror or CUDA
            IPC yet: docs/nixl.md); never a crash or a hang
Exit 0 when 1 and 2 are verified and 3 is verified or cleanly refused. FABRIC_PROVIDER picks the
engine's provider (tcp, shm); on one host the engine's CUDA IPC path carries GPU-to-GPU writes.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
import uuid

import torch

from nixl._api import nixl_agent, nixl_agent_config

SIZE = 64 << 20
DEADLINE_S = 60.0
DEVICE = "cuda:0"  # --device cpu: the same exchange over DRAM, to check this script anywhere


def agent(name):
    a = nixl_agent(name, nixl_agent_config(backends=[]))
    a.create_backend("FABRIC", {})
    return a


def wait_file(path):
    end = time.monotonic() + DEADLINE_S
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise TimeoutError(f"no {path} after {DEADLINE_S} s")
        time.sleep(0.02)
    with open(path, "rb") as f:
        return f.read()


def put_file(path, data):
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.rename(path + ".tmp", path)


def wait_notif(a, want):
    """The sender and message of the first notification starting with `want`."""
    end = time.monotonic() + DEADLINE_S
    while time.monotonic() < end:
        for sender, msgs in a.get_new_notifs().items():
            for m in msgs:
                if m.startswith(want):
                    return sender, m
        time.sleep(0.001)
    raise TimeoutError(f"no notification {want!r}")


def sync():
    if DEVICE != "cpu":
        torch.cuda.synchronize()


def pattern(seed, device):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, 255, (SIZE,), dtype=torch.uint8, generator=g).to(device)


def target(workdir):
    a = agent("target")
    vram = torch.zeros((SIZE,), dtype=torch.uint8, device=DEVICE)
    reg = a.register_memory(vram)
    put_file(os.path.join(workdir, "target.md"), a.get_agent_metadata())
    put_file(os.path.join(workdir, "target.ptr"), str(vram.data_ptr()).encode())
    a.add_remote_agent(wait_file(os.path.join(workdir, "initiator.md")))
    for step, seed in ((b"vram-write", 1), (b"dram-write", 2)):
        sender, _ = wait_notif(a, step)
        sync()
        ok = torch.equal(vram, pattern(seed, DEVICE))
        print(f"target: {step.decode()} from {sender}: {'verified' if ok else 'WRONG BYTES'}",
              flush=True)
        a.send_notif(sender, step + (b":ok" if ok else b":bad"))
    vram.copy_(pattern(3, DEVICE))
    sync()
    a.send_notif("initiator", b"read-ready")
    wait_notif(a, b"read-finished")
    a.deregister_memory(reg)
    return 0


def initiator(workdir):
    a = agent("initiator")
    vram = pattern(1, DEVICE)
    dram = pattern(2, "cpu")
    back = torch.zeros((SIZE,), dtype=torch.uint8, device=DEVICE)
    regs = [a.register_memory(vram), a.register_memory(dram), a.register_memory(back)]
    put_file(os.path.join(workdir, "initiator.md"), a.get_agent_metadata())
    name = a.add_remote_agent(wait_file(os.path.join(workdir, "target.md")))
    remote_ptr = int(wait_file(os.path.join(workdir, "target.ptr")))
    remote = a.get_xfer_descs([(remote_ptr, SIZE, 0)], "DRAM" if DEVICE == "cpu" else "VRAM")
    failures = 0

    def run(op, local, notif):
        h = a.initialize_xfer(op, a.get_xfer_descs(local), remote, name, notif)
        state = a.transfer(h)
        end = time.monotonic() + DEADLINE_S
        while state == "PROC" and time.monotonic() < end:
            state = a.check_xfer_state(h)
        a.release_xfer_handle(h)
        return state

    for step, local in ((b"vram-write", vram), (b"dram-write", dram)):
        try:
            state = run("WRITE", local, step)
        except Exception as e:  # noqa: BLE001
            state = f"{type(e).__name__}: {e}"
        if state != "DONE":
            print(f"initiator: {step.decode()}: {state}", flush=True)
            failures += 1
            continue
        _, reply = wait_notif(a, step + b":")
        ok = reply == step + b":ok"
        print(f"initiator: {step.decode()}: DONE, "
              f"{'verified by the target' if ok else 'WRONG BYTES at the target'}", flush=True)
        failures += 0 if ok else 1
    wait_notif(a, b"read-ready")
    try:
        state = run("READ", back, b"read")
        if state == "DONE":
            sync()
            ok = torch.equal(back, pattern(3, DEVICE))
            print(f"initiator: vram-read: DONE, {'verified' if ok else 'WRONG BYTES'}", flush=True)
            failures += 0 if ok else 1
        else:
            print(f"initiator: vram-read: {state}", flush=True)
            failures += 1
    except Exception as e:  # noqa: BLE001 - a clean refusal is an accepted outcome
        print(f"initiator: vram-read refused: {type(e).__name__} (see the NIXL log for why)",
              flush=True)
    a.send_notif(name, b"read-finished")
    for r in regs:
        a.deregister_memory(r)
    return 1 if failures else 0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--target", metavar="WORKDIR")
    p.add_argument("--device", default="cuda:0")
    args = p.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE != "cpu" and not torch.cuda.is_available():
        print("SKIPPED: no CUDA device", flush=True)
        return 77
    if args.target:
        return target(args.target)
    with tempfile.TemporaryDirectory(prefix=f"nixl-vram-{uuid.uuid4().hex[:6]}-") as workdir:
        peer = subprocess.Popen(
            [sys.executable, __file__, "--target", workdir, "--device", DEVICE])
        try:
            rc = initiator(workdir)
        finally:
            try:
                peer_rc = peer.wait(timeout=DEADLINE_S)
            except subprocess.TimeoutExpired:
                peer.kill()
                peer_rc = -1
        print(f"initiator exit {rc}, target exit {peer_rc}", flush=True)
        return 0 if rc == 0 and peer_rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
