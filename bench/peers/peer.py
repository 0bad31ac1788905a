"""One side of a two-process transfer benchmark, for the engines reached from Python: NIXL (its
FABRIC or UCX backend) and Mooncake's Transfer Engine. bench/peers/peers.py starts two of these,
an initiator and a target, and drives them with one JSON line per command on stdin; each command
is answered with one JSON line on stdout (everything else the libraries print goes to stderr).

Memory: one registration of two regions of `region` bytes each, `src` (the pattern a WRITE sends
or a READ fetches) and `dst` (where bytes land). The initiator WRITEs its src into the target's
dst, or READs the target's src into its own dst. Transfers are timed one at a time (one in
flight), from the post to the completion the initiator sees; a batch is one request of `count`
descriptors of `size` bytes each.

Commands:
  start {backend, name, region}   make the engine, register memory; answers its metadata
  connect {peer}                  the other side's start answer
  fill {region, nbytes, seed}     a pattern from `seed` into a region; answers its sha256
  digest {region, nbytes}         answers the sha256 of a region's first `nbytes`
  run {op, size, count, iters, warmup, max_s}
                                  warmup + iters timed transfers (stops early at max_s seconds);
                                  answers the latencies in microseconds
  ping {size, iters, warmup, max_s}
                                  the initiator's side of the notice round trip: a WRITE of
                                  `size` bytes with a notice to the target, then waits for the
                                  target's answer (the same, back); answers the round trips
  pong {max_s}                    the target's side: answers every notice until the initiator's
                                  "stop" notice and says how many it answered; sent without
                                  waiting for its answer, before the initiator's ping
  cpu                             answers this process's CPU seconds so far (all threads)
  quit
"""

import base64
import hashlib
import json
import os
import sys
import time

# Answers go to the stdout this process was given; whatever else writes to stdout (library
# loggers) goes to stderr.
ANSWERS = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr

import numpy as np  # noqa: E402

COMPLETION_TIMEOUT_S = 30.0


def pattern(nbytes, seed):
    """Deterministic bytes for one pass: the same seed gives the same bytes in both processes."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def sha256(view):
    return hashlib.sha256(view.tobytes()).hexdigest()


class Side:
    """The memory both adapters share: src and dst, one allocation."""

    def __init__(self, region):
        self.region = region
        self.memory = np.zeros(2 * region, dtype=np.uint8)
        self.regions = {"src": self.memory[:region], "dst": self.memory[region:]}

    def addr(self, name):
        return self.regions[name].ctypes.data

    def fill(self, region, nbytes, seed):
        self.regions[region][:nbytes] = pattern(nbytes, seed)
        return {"sha256": sha256(self.regions[region][:nbytes])}

    def digest(self, region, nbytes):
        return {"sha256": sha256(self.regions[region][:nbytes])}


class NixlSide(Side):
    """A NIXL agent with one backend, made as vLLM's NixlConnector makes it."""

    def __init__(self, name, region, backend):
        super().__init__(region)
        from nixl._api import nixl_agent, nixl_agent_config

        self.agent = nixl_agent(name, nixl_agent_config(backends=[backend]))
        self.backend = backend
        whole = [(self.memory.ctypes.data, self.memory.nbytes, 0, "")]
        self.reg = self.agent.register_memory(whole, "DRAM")
        self.peer_name = None
        self.peer_info = None

    def start_info(self):
        return {"metadata": base64.b64encode(self.agent.get_agent_metadata()).decode(),
                "src": self.addr("src"), "dst": self.addr("dst"),
                "backends": list(self.agent.backends)}

    def connect(self, peer):
        name = self.agent.add_remote_agent(base64.b64decode(peer["metadata"]))
        self.peer_name = name.decode() if isinstance(name, bytes) else name
        self.peer_info = peer
        return {"peer": self.peer_name}

    def _descs(self, base, size, count):
        return [(base + i * size, size, 0) for i in range(count)]

    def prepare(self, op, size, count):
        """One transfer handle, posted again for every timed transfer."""
        if op == "WRITE":
            local, remote = self.addr("src"), self.peer_info["dst"]
        else:
            local, remote = self.addr("dst"), self.peer_info["src"]
        local_d = self.agent.get_xfer_descs(self._descs(local, size, count), "DRAM")
        remote_d = self.agent.get_xfer_descs(self._descs(remote, size, count), "DRAM")
        return self.agent.initialize_xfer(op, local_d, remote_d, self.peer_name)

    def once(self, handle):
        self.finish(handle, self.agent.transfer(handle))

    def finish(self, handle, state):
        """Polls a posted transfer to its end, as vLLM's NixlConnector does."""
        end = time.monotonic() + COMPLETION_TIMEOUT_S
        while state == "PROC":
            state = self.agent.check_xfer_state(handle)
            if time.monotonic() > end:
                raise TimeoutError("transfer still in progress after "
                                   f"{COMPLETION_TIMEOUT_S:.0f} s")
        if state != "DONE":
            raise RuntimeError(f"transfer state {state}")

    def prepare_notice(self, size):
        """A WRITE of `size` bytes of src into the peer's dst, posted with a notice."""
        return self.prepare("WRITE", size, 1)

    def post_notice(self, handle, msg="n"):
        self.posted = self.agent.transfer(handle, notif_msg=msg.encode())

    def wait_posted(self, handle):
        self.finish(handle, self.posted)

    def notices(self):
        """The notices that arrived since the last call."""
        return [m.decode() for v in self.agent.get_new_notifs().values() for m in v]

    def release(self, handle):
        backend = self.agent.query_xfer_backend(handle)
        self.agent.release_xfer_handle(handle)
        if backend != self.backend:
            raise RuntimeError(f"NIXL ran it on {backend}, not {self.backend}")

    def close(self):
        self.agent.deregister_memory(self.reg)


class MooncakeSide(Side):
    """Mooncake's Transfer Engine, tcp protocol, P2PHANDSHAKE metadata (no metadata server)."""

    def __init__(self, name, region):
        super().__init__(region)
        from mooncake.engine import TransferEngine

        self.name = name
        self.engine = TransferEngine()
        rc = self.engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise RuntimeError(f"TransferEngine.initialize returned {rc}")
        rc = self.engine.register_memory(self.memory.ctypes.data, self.memory.nbytes)
        if rc != 0:
            raise RuntimeError(f"register_memory returned {rc}")
        self.target = None
        self.peer_info = None

    def start_info(self):
        return {"hostname": f"127.0.0.1:{self.engine.get_rpc_port()}",
                "src": self.addr("src"), "dst": self.addr("dst")}

    def connect(self, peer):
        self.target = peer["hostname"]
        self.peer_info = peer
        return {"peer": self.target}

    def prepare(self, op, size, count):
        if op == "WRITE":
            local, remote = self.addr("src"), self.peer_info["dst"]
        else:
            local, remote = self.addr("dst"), self.peer_info["src"]
        return (op, size, count, local, remote)

    def once(self, handle):
        op, size, count, local, remote = handle
        e = self.engine
        if count == 1:
            fn = e.transfer_sync_write if op == "WRITE" else e.transfer_sync_read
            rc = fn(self.target, local, remote, size)
        else:
            fn = e.batch_transfer_sync_write if op == "WRITE" else e.batch_transfer_sync_read
            rc = fn(self.target, [local + i * size for i in range(count)],
                    [remote + i * size for i in range(count)], [size] * count)
        if rc != 0:
            raise RuntimeError(f"transfer returned {rc}")

    def prepare_notice(self, size):
        return (size, self.addr("src"), self.peer_info["dst"])

    def post_notice(self, handle, msg="n"):
        """transfer_sync returns once the bytes are written, the notice with them."""
        from mooncake.engine import TransferEngine, TransferNotify

        size, local, remote = handle
        rc = self.engine.transfer_sync(self.target, local, remote, size,
                                       TransferEngine.TransferOpcode.Write,
                                       TransferNotify(self.name, msg))
        if rc != 0:
            raise RuntimeError(f"transfer_sync with a notice returned {rc}")

    def wait_posted(self, handle):
        pass

    def notices(self):
        return [n.msg for n in self.engine.get_notifies()]

    def release(self, handle):
        pass

    def close(self):
        self.engine.unregister_memory(self.memory.ctypes.data)


def make_side(backend, name, region):
    if backend == "mooncake":
        return MooncakeSide(name, region)
    return NixlSide(name, region, backend)


def run(side, op, size, count, iters, warmup, max_s):
    """warmup untimed transfers, then up to iters timed ones (fewer if max_s runs out)."""
    handle = side.prepare(op, size, count)
    try:
        for _ in range(warmup):
            side.once(handle)
        lat = []
        end = time.monotonic() + max_s
        for _ in range(iters):
            t0 = time.perf_counter_ns()
            side.once(handle)
            lat.append((time.perf_counter_ns() - t0) / 1000.0)
            if time.monotonic() > end:
                break
    finally:
        side.release(handle)
    return {"lat_us": lat}


def wait_notice(side, end):
    """The next notices (one or more), or TimeoutError at `end`."""
    while not (got := side.notices()):
        if time.monotonic() > end:
            raise TimeoutError("no notice within the time bound")
    return got


def ping(side, size, iters, warmup, max_s):
    """Round trips: a WRITE with a notice out, the target's answer (the same) back. The
    untimed ones stop at `warmup` or a fifth of max_s; the timed ones at `iters` or max_s,
    whichever comes first, but never fewer than 10."""
    handle = side.prepare_notice(size)
    lat = []
    try:
        start = time.monotonic()
        trips, timed = 0, False
        while len(lat) < iters:
            t0 = time.perf_counter_ns()
            # The initiator's own transfer is polled to its end first: a backend may send the
            # notice only as it progresses the transfer (NIXL's UCX does).
            side.post_notice(handle)
            side.wait_posted(handle)
            wait_notice(side, time.monotonic() + COMPLETION_TIMEOUT_S)
            trips += 1
            now = time.monotonic()
            if timed:
                lat.append((time.perf_counter_ns() - t0) / 1000.0)
                if len(lat) >= 10 and now - start > max_s:
                    break
            elif trips >= warmup or now - start > max_s / 5:
                timed = True
        side.post_notice(handle, "stop")  # the target stops answering
        side.wait_posted(handle)
    finally:
        side.release(handle)
    return {"lat_us": lat, "trips": trips}


def pong(side, max_s):
    """Answers each notice with a WRITE and a notice of its own until the initiator's "stop"
    (or max_s); says how many it answered."""
    handle = side.prepare_notice(8)
    answered = 0
    end = time.monotonic() + max_s
    try:
        while True:
            got = wait_notice(side, end)
            for msg in got:
                if msg == "stop":
                    return {"answered": answered}
                side.post_notice(handle)
                side.wait_posted(handle)
                answered += 1
    finally:
        side.release(handle)


def main():
    side = None
    for line in sys.stdin:
        cmd = json.loads(line)
        name = cmd.pop("cmd")
        try:
            if name == "start":
                side = make_side(cmd["backend"], cmd["name"], cmd["region"])
                answer = side.start_info()
            elif name == "connect":
                answer = side.connect(cmd["peer"])
            elif name == "fill":
                answer = side.fill(cmd["region"], cmd["nbytes"], cmd["seed"])
            elif name == "digest":
                answer = side.digest(cmd["region"], cmd["nbytes"])
            elif name == "run":
                answer = run(side, **cmd)
            elif name == "ping":
                answer = ping(side, **cmd)
            elif name == "pong":
                answer = pong(side, **cmd)
            elif name == "cpu":
                answer = {"cpu_s": time.process_time()}
            elif name == "quit":
                answer = {"bye": True}
            else:
                answer = {"error": f"unknown command {name}"}
        except Exception as e:  # noqa: BLE001 - the driver reports it in the row
            answer = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(answer), file=ANSWERS, flush=True)
        if name == "quit":
            ANSWERS.flush()
            # NIXL 1.4.0's UCX backend crashes in its exit handlers on a host without RDMA
            # devices: leave without them once the answer is out.
            os._exit(0)


if __name__ == "__main__":
    main()
