"""fabric_lib.weights: RL weight push, trainer tensors written straight into inference tensors.

The inference side registers the tensors it owns, by name, with their layouts
(:class:`InferenceWeights`); each training rank describes its shards (:class:`TrainerWeights`).
The protocol is C++: the rendezvous through a fabric_lib registry and the schedule agreed by
sha256 (``fabric/weights/rendezvous.h``), the push's sender and receiver
(``fabric/weights/flow.h``). Python keeps what is torch's: the tensors, their registration, the
gathers over ``torch.distributed``. ``mode``: ``"flip"`` (two copies, the served one flips when
a version completes) or ``"in_place"`` (one copy; half-written after a failed push until a
version completes). docs/weights.md has the protocol.
"""

import asyncio
import concurrent.futures
import contextlib
import math
import time

import torch

from . import _fabric_lib as _ext
from ._fabric_lib import InvalidArgument, WeightSchedule

__all__ = ["InferenceWeights", "TrainerWeights", "Version", "WeightSchedule", "quantize_fp8",
           "quantize_fp8_many"]

# Fabric's dtype names -> the torch dtype a gather moves them as (e4m3 bytes as uint8).
_TORCH = {"u8": torch.uint8, "bf16": torch.bfloat16, "f16": torch.float16,
          "f32": torch.float32, "fp8_e4m3": torch.uint8}


class Version(concurrent.futures.Future):
    """A version being pushed (InferenceWeights.prepare): resolves to the version number once
    every byte of it landed, or raises PeerUnreachable / Timeout / Closed. ``await`` takes it
    too."""

    def __await__(self):
        return asyncio.wrap_future(self).__await__()


def _invalid(message):
    exc = InvalidArgument(message)
    exc.code, exc.message = _ext.ErrorCode.INVALID_ARGUMENT, message
    return exc


def quantize_fp8(src, block=128):
    """BF16 2-D tensor -> (e4m3 bytes as uint8, f32 scales [ceil(r/b), ceil(c/b)]): the CUDA
    kernel for a CUDA tensor (on the current stream), the C++ CPU reference otherwise."""
    return quantize_fp8_many([src], block)[0]


def quantize_fp8_many(sources, block=128):
    """quantize_fp8 of each BF16 2-D tensor of `sources`: for CUDA tensors the kernel runs over
    them in few launches (64 matrices a launch, on the current stream), which costs far less
    than a launch each when they are many and small. Returns [(e4m3 uint8, f32 scales)].
    InvalidArgument for a source that is not a 2-D bf16 tensor."""
    sources = [s.contiguous() for s in sources]
    outs = [(torch.empty(s.shape, dtype=torch.uint8, device=s.device),
             torch.empty([-(-n // block) for n in s.shape], dtype=torch.float32, device=s.device))
            for s in sources]
    streams = {str(s.device): torch.cuda.current_stream(s.device).cuda_stream
               for s in sources if s.is_cuda}
    _ext._weights_quantize_fp8_tensors([(s, q, sc) for s, (q, sc) in zip(sources, outs)], block,
                                       streams)
    return outs


class InferenceWeights:
    """An inference rank's parameters, written by training ranks on the schedule.

    ``add`` each tensor (the rank's local slice, contiguous, its memory registered with
    `engine`, no copy), then ``publish``. Per version: ``prepare(version)`` returns a
    concurrent.futures.Future that resolves to the version once every byte of it landed (or
    fails with PeerUnreachable / Timeout), and tells the training ranks where to write; in
    ``"flip"`` mode, ``tensors()`` keeps returning the last complete version until then.
    It counts immediates ``imm_base + n`` (n counts prepares, never reused) and must own that
    range on its engine; it installs no handler on the engine, and takes `registry`'s watch
    (a fabric_lib LocalRegistry, FileRegistry or EtcdRegistry).
    ``host_mirror=False``: CUDA tensors are registered without a pinned host mirror (no pinned
    memory the size of the model), so only training ranks on this host reach them, over CUDA
    IPC; a push from another host then fails with Unsupported at its trainer.
    """

    def __init__(self, engine, rank, registry, *, group="weights", mode="flip",
                 imm_base=0xA0000000, timeout=30.0, host_mirror=True):
        if mode not in ("flip", "in_place"):
            raise _invalid(f"mode must be 'flip' or 'in_place', not {mode!r}")
        self.engine, self.rank, self.registry = engine, rank, registry
        self.group, self.mode, self.timeout = group, mode, timeout
        self.host_mirror = host_mirror
        self._receiver = _ext.WeightReceiver(engine, rank, flip=mode == "flip",
                                             imm_base=imm_base, timeout=timeout)
        self._copies = {}  # name -> [tensor per copy]
        self._places = []  # per add: [(region index, byte offset) per copy]
        self._regions = []  # Registration: arenas and tensors registered alone
        self._arenas = []  # (start address, end address, region index)
        self._on_version = []
        self._keep = []  # the arenas' tensors, alive as long as their registrations

    # --- setup ---

    def add(self, name, tensor, *, shape=None, dim=None, start=0, projection="identity",
            sources=(), concat_dim=0, block=128, dtype=None, spare=None):
        """Registers `tensor` as this rank's part of parameter `name`: all of it (dim None) or
        the range [start, start + tensor.shape[dim]) of dimension `dim` of the global `shape`.
        `projection`: "identity", "concat" (of `sources` along `concat_dim`), "fp8_quantize"
        (dtype "fp8_e4m3" in a uint8 tensor) or "fp8_scale" (f32): of the one source, or of
        the concatenation of several along `concat_dim` (a fused FP8 gate/up).
        In flip mode `spare` is the second copy (allocated like `tensor` when None; ignored in
        place). InvalidArgument naming the parameter for a non-contiguous tensor, or one whose
        element size or element count does not match the declared dtype and slice."""
        self._receiver.add(name, tensor, shape, dim, start, projection, list(sources),
                           concat_dim, block, dtype)
        copies = [tensor]
        if self.mode == "flip":
            copies.append(torch.empty_like(tensor) if spare is None else spare)
        self._copies[name] = copies
        self._places.append([self._locate(c) for c in copies])

    def add_arena(self, buffer):
        """Registers `buffer` (a contiguous tensor) once; tensors added later that lie inside
        it are written through this one registration (one memory region instead of one per
        tensor: fewer registrations, and for GPU memory one staging mirror, not thousands)."""
        reg = self.engine.register(buffer, host_mirror=self.host_mirror)
        start = buffer.data_ptr()
        self._arenas.append((start, start + buffer.numel() * buffer.element_size(),
                             len(self._regions)))
        self._regions.append(reg)
        self._keep.append(buffer)

    def _locate(self, tensor):
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        for lo, hi, index in self._arenas:
            if lo <= start and end <= hi:
                return index, start - lo
        self._regions.append(self.engine.register(tensor, host_mirror=self.host_mirror))
        return len(self._regions) - 1, 0

    def publish(self):
        """Publishes this rank's layout and registrations, and watches the training ranks."""
        self._receiver.publish(self.registry, self.group, [r.descriptor for r in self._regions],
                               self._places)

    def close(self):
        """Fails a pending version with Closed and leaves the registry (the tensors and their
        registrations stay as they are until dropped). Also on leaving a `with` block."""
        self._receiver.close()
        self._receiver.withdraw(self.registry, self.group)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def on_version(self, callback):
        """callback(version) runs (engine callback thread) each time a version completes."""
        self._on_version.append(callback)

    # --- serving ---

    @property
    def version(self):
        """The last complete version (None before the first)."""
        return self._receiver.version

    @property
    def schedule(self):
        """The schedule agreed at the first prepare (None before)."""
        return self._receiver.schedule

    @property
    def copies(self):
        """Copies of each parameter this mode keeps (2 for flip, 1 in place): the memory cost."""
        return 2 if self.mode == "flip" else 1

    def tensors(self):
        """{name: tensor} of the last complete version. In place, raises InvalidArgument after
        a failed push (the tensors are half-written) until a version completes."""
        if self._receiver.half_written:
            raise _invalid("in-place weights are half-written: the last push failed")
        active = self._receiver.active_copy
        return {n: c[active] for n, c in self._copies.items()}

    def __getitem__(self, name):
        return self.tensors()[name]

    @property
    def progress(self):
        """(version, writes landed, writes expected) of the pending version, or None."""
        return self._receiver.progress

    # --- a version ---

    def prepare(self, version):
        """Arms the immediate count of `version` and tells every training rank (found in the
        registry) to write it; returns a Version (a Future, also awaitable). The first call
        blocks until training rank 0's schedule header and every rank it names are in the
        registry (up to `timeout`), and computes the schedule. In place, stop serving until
        the Version resolves."""
        future = Version()

        def complete(v):
            for cb in self._on_version:
                cb(v)
            future.set_result(v)

        self._receiver.prepare_version(version, complete, lambda v, exc: future.set_exception(exc))
        return future


class TrainerWeights:
    """A training rank's side of the push.

    ``add`` each local shard (its box of the global tensor), ``publish``, then ``connect``
    once (waits for every rank in the registry; every rank computes the schedule, rank 0
    publishes its digest), then ``push(version)`` after each step. With ``world > 1`` the
    shards are gathered with ``torch.distributed`` (the default process group unless
    `process_group`; point-to-point sends, so a GPU-tensor trainer needs NCCL): a rank
    scheduled to write a parameter receives the other shards of its replica, and only those;
    every rank calls ``push`` for every version. Takes the engine's receive handler.
    ``max_temp_bytes`` bounds the staging memory of projected tensors (allocated on `device`).
    ``host_mirror=False``: that staging memory, on a GPU, gets no pinned host mirror; only
    inference ranks on this host are reached then (over CUDA IPC).
    """

    def __init__(self, engine, rank, world, registry, *, group="weights", num_nics=1,
                 max_temp_bytes=256 << 20, chunk_bytes=64 << 20, device="cpu",
                 process_group=None, timeout=30.0, host_mirror=True):
        self.engine, self.rank, self.world, self.registry = engine, rank, world, registry
        self.group, self.num_nics, self.timeout = group, num_nics, timeout
        self.chunk_bytes, self.process_group = chunk_bytes, process_group
        self._shards = {}  # name -> (tensor, shape, box, replica)
        self._sources = None  # the shards' tensors as push() last told the sender
        self._ring = torch.empty(max_temp_bytes, dtype=torch.uint8, device=device)
        self._ring_reg = engine.register(self._ring, host_mirror=host_mirror)
        self._sender = _ext.WeightSender(engine, rank, num_nics, timeout)
        self.schedule = None

    def close(self):
        """Leaves the registry (and withdraws the schedule's header, on rank 0). Also on
        leaving a `with` block; a push in progress is not interrupted."""
        self._sender.withdraw(self.registry, self.group)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def add(self, name, shard, *, shape=None, box=None, replica=0):
        """This rank's shard of training parameter `name`: box = [(start, length)] per dim of
        the global `shape` (None: the whole tensor)."""
        shape = list(shard.shape) if shape is None else [int(s) for s in shape]
        box = [] if box is None else [(int(s), int(n)) for s, n in box]
        self._shards[name] = (shard, shape, box, replica)
        self._sources = None

    def publish(self):
        """Publishes this rank's shards (their names, dtypes, shapes and boxes)."""
        self._sender.publish(self.registry, self.group, self.world, [
            (n, str(t.dtype), shape, box, rep) for n, (t, shape, box, rep) in self._shards.items()])

    def connect(self, num_inference):
        """Waits for `world` training and `num_inference` inference ranks in the registry and
        computes the schedule (raising its error naming the parameter); rank 0 publishes its
        digest, the others check theirs against it. Returns the schedule."""
        self.schedule = self._sender.connect_registry(
            self.registry, self.group, self.world, num_inference, self.chunk_bytes, self.timeout,
            self._ring_reg, self._ring.data_ptr(), self._ring.numel(), self._ring.is_cuda)
        return self.schedule

    def _global_rank(self, rank):
        import torch.distributed as dist
        if self.process_group is None:
            return rank
        get = getattr(dist, "get_global_rank", None) or dist.distributed_c10d._get_global_rank
        return get(self.process_group, rank)

    def _gather_start(self, index, k, stats, current):
        """Starts gathering source `k` of projected parameter `index` as WeightSender.gather
        says (asynchronous sends and receives of its shards); returns a function that waits for
        them and returns the whole tensor where this rank needs it (taken from `current`, what
        the parameter before gathered, where the plan says so; else its own shard, or None)."""
        param = self.schedule.params[index]
        name, step = param.sources[k], self._sender.gather(index, k)
        shard, _, box_of, _ = self._shards.get(name, (None, None, None, None))
        result = current[name] if step.reuse else shard
        sends, recvs = step.sends, step.recvs
        if not sends and not recvs:
            return lambda: result
        shape, dtype = param.source_shapes[k], _TORCH[param.source_dtypes[k]]
        import torch.distributed as dist
        device = self._ring.device
        # As bytes: every backend sends uint8 (gloo has no bfloat16).
        mine = shard.contiguous().view(-1).view(torch.uint8)
        size = torch.empty((), dtype=dtype).element_size()
        bufs = [torch.empty(_box_numel(box, shape) * size, dtype=torch.uint8, device=device)
                for _, box in recvs]
        stats["gather_bytes"] += sum(b.numel() for b in bufs)
        ops = [(dist.isend, mine, to) for to, _ in sends]
        ops += [(dist.irecv, buf, frm) for (frm, _), buf in zip(recvs, bufs)]
        if dist.get_backend(self.process_group) == "nccl":  # sends and receives in one group
            works = dist.batch_isend_irecv([dist.P2POp(op, t, self._global_rank(peer),
                                                       self.process_group)
                                            for op, t, peer in ops])
        else:
            works = [op(t, self._global_rank(peer), group=self.process_group)
                     for op, t, peer in ops]

        def finish():
            for w in works:
                w.wait()
            if not recvs:
                return result
            full = torch.empty(shape, dtype=dtype, device=device)
            for box, t in [(box_of, mine)] + [(box, b) for (_, box), b in zip(recvs, bufs)]:
                region = full[tuple(slice(s, s + ln) for s, ln in _full_box(box, shape))]
                region.copy_(t.view(dtype).view(region.shape))
            return full

        return finish

    def push(self, version, on_param=None):
        """Writes `version` of every parameter this rank is scheduled to send, once each target
        inference rank has prepared it. Blocks until every write completed; returns seconds per
        stage {'wait_ready', 'gather', 'project', 'post', 'wait_ring' (waiting for room in the
        staging ring), 'drain', 'total'}, the bytes, the bytes received from other training
        ranks ('gather_bytes'), the submissions ('writes': a scatter or a paged write counts
        once) and the staging high-water mark ('temp_high_water'). Projections are enqueued
        back to back and their writes posted in batches of about max_temp_bytes / 4 (one stream
        synchronisation per batch), all in C++ when this rank holds every parameter whole.
        on_param(name) runs after each parameter's writes are posted (progress; tests)."""
        t0 = time.perf_counter()
        cuda = self._ring.is_cuda
        stream = torch.cuda.current_stream(self._ring.device).cuda_stream if cuda else 0
        self._sender.set_on_param(on_param)
        try:  # the ring's device is current: the projections run there
            with torch.cuda.device(self._ring.device) if cuda else contextlib.nullcontext():
                push = self._push_whole if self.world == 1 else self._push_gathered
                stats = push(version, stream)
        finally:
            self._sender.set_on_param(None)
        stats["total"] = time.perf_counter() - t0
        return stats

    def _push_whole(self, version, stream):
        """One call into C++ with a data pointer per training parameter (their names, sizes
        and sides told once after each add)."""
        if self._sources is None:
            tensors = [t for t, _, _, _ in self._shards.values()]
            self._sender.set_sources(list(self._shards), [t.numel() * t.element_size()
                                                          for t in tensors],
                                     [t.is_cuda for t in tensors])
            self._sources = tensors
        # Non-contiguous shards are copied (alive until the push returns).
        tensors = [t if t.is_contiguous() else t.contiguous() for t in self._sources]
        stats = self._sender.push(version, [t.data_ptr() for t in tensors], stream)
        stats.update(gather=0.0, gather_bytes=0)
        return stats

    def _push_gathered(self, version, stream):
        """Every rank walks every parameter in the same order, so that the two ends of each of
        the gather's sends meet; the next parameter's gather is in flight while this one is
        projected and posted; only the ranks scheduled to send a parameter project and write
        it."""
        self._sender.begin(version, stream)
        gather, stats = 0.0, dict(gather_bytes=0)
        order, params = self._sender.order, self.schedule.params

        def start(k, current):
            if k >= len(order):
                return {}
            return {s: self._gather_start(order[k], i, stats, current)
                    for i, s in enumerate(params[order[k]].sources)}

        following = start(0, {})
        for k, index in enumerate(order):
            t = time.perf_counter()
            current = {s: finish() for s, finish in following.items()}
            full = [current[s] for s in params[index].sources]
            following = start(k + 1, current)
            gather += time.perf_counter() - t
            if self._sender.sends(index):
                full = [f.contiguous() for f in full]
                self._sender.stage(index, [(f.data_ptr(), f.numel() * f.element_size(), f.is_cuda)
                                           for f in full])
        out = self._sender.finish()
        out.update(gather=gather, gather_bytes=stats["gather_bytes"])
        return out


def _full_box(box, shape):
    return box if box else [(0, s) for s in shape]


def _box_numel(box, shape):
    return math.prod(ln for _, ln in _full_box(box, shape))
