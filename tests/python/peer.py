"""The other process of the two-process tests: an engine driven over a multiprocessing pipe.

serve() runs in a spawned process. Each request is (method, args); each reply is ("ok", value)
or ("error", exception class name, message), so the test process re-raises the same type.
"""

import numpy as np

import fabric_lib


def make_config(provider, **fields):
    """A config for tests on this machine: loopback NICs, no pinning, short idle spin (two
    cores), bounded close and peer timeouts (as tests/support/test_support.h)."""
    nics = {"tcp": ["lo"], "shm": ["shm"]}[provider]
    config = fabric_lib.Config(
        provider=provider,
        nics=nics,
        cpu=fabric_lib.GroupConfig.CPU_NONE,
        spin_time=50e-6,
        idle_sleep=50e-6,
        close_timeout=3.0,
        peer_timeout=3.0,
    )
    for name, value in fields.items():
        setattr(config, name, value)
    return config


def pattern(size, seed):
    """`size` pseudo-random bytes, the same in every process for the same seed."""
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


class PeerServer:
    def __init__(self, provider):
        self.engine = fabric_lib.TransferEngine(make_config(provider))
        self.buffers = {}  # name -> (array, Registration)
        self.expectations = {}

    def address(self):
        return bytes(self.engine.address)

    def alloc(self, name, size, seed=None, gpu_copies=False):
        array = pattern(size, seed) if seed is not None else np.zeros(size, dtype=np.uint8)
        reg = self.engine.register(array, gpu_copies=gpu_copies)
        self.buffers[name] = (array, reg)
        return bytes(reg.descriptor)

    def alloc_cuda(self, name, size, seed=None, host_mirror=True, remote_read=False):
        """A CUDA tensor of `size` bytes (the pattern of `seed`, or zeros), registered (readable
        by peers with remote_read)."""
        import torch

        host = pattern(size, seed) if seed is not None else np.zeros(size, dtype=np.uint8)
        tensor = torch.from_numpy(host).to("cuda")
        reg = self.engine.register(tensor, host_mirror=host_mirror, remote_read=remote_read)
        self.buffers[name] = (tensor, reg)
        return bytes(reg.descriptor)

    def read(self, name, offset=0, length=None):
        array = self.buffers[name][0]
        if not isinstance(array, np.ndarray):  # a CUDA tensor
            array = array.cpu().numpy()
        end = len(array) if length is None else offset + length
        return array[offset:end].tobytes()

    def zero(self, name):
        self.buffers[name][0][:] = 0

    def unregister(self, name):
        self.buffers[name][1].unregister()

    def expect(self, imm, count):
        self.expectations[imm] = self.engine.expect_imm(imm, count)

    def wait_expect(self, imm, timeout):
        self.expectations.pop(imm).result(timeout)
        return True

    def wait_imm(self, imm, total, timeout):
        return self.engine.wait_imm(imm, total, timeout)

    def imm_count(self, imm):
        return self.engine.imm_count(imm)

    def write(self, name, dst, length, src_offset=0, dst_offset=0, imm=None):
        reg = self.buffers[name][1]
        self.engine.write(
            reg, dst, length, src_offset=src_offset, dst_offset=dst_offset, imm=imm
        ).result(60)

    def imm_write(self, peer, imm, times=1):
        for t in [self.engine.imm_write(peer, imm) for _ in range(times)]:
            t.result(60)

    def receive(self, buffer_bytes, count):
        self.engine.set_receive_handler(buffer_bytes=buffer_bytes, count=count)

    def recv(self, timeout):
        return self.engine.recv(timeout)

    def send(self, peer, message):
        self.engine.send(peer, message).result(60)


def serve(conn, provider):
    try:
        server = PeerServer(provider)
    except Exception as e:  # reported to the test, which skips or fails
        conn.send(("error", type(e).__name__, str(e)))
        return
    conn.send(("ok", None))
    while True:
        method, args = conn.recv()
        if method == "exit":
            server.engine.close()
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", getattr(server, method)(*args)))
        except Exception as e:
            conn.send(("error", type(e).__name__, str(e)))
