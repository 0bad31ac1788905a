"""fabric_lib.weights: RL weight push, trainer tensors written straight into inference tensors.

The inference side registers the tensors it owns, by name, with their layouts
(:class:`InferenceWeights`); each training rank describes its shards (:class:`TrainerWeights`).
Both publish their descriptions in a fabric_lib registry; every rank computes the static
schedule (``WeightSchedule``) and checks it by sha256 against training rank 0's. The protocol is
C++ (``fabric/weights/flow.h``): ``WeightSender`` waits for each inference rank's Ready,
projects into a registered staging ring (identity, concatenation, BF16 -> FP8 e4m3 with
128x128 block scales) and posts the writes in batches; ``WeightReceiver`` arms the immediate
count of a version, sends Ready, and completes or fails it (a training rank leaving the
registry: PeerUnreachable; ``timeout``: Timeout). Python keeps what is torch's: the tensors, the
registry, the gathers over ``torch.distributed``. ``mode``: ``"flip"`` (two copies, the served
one flips when a version completes) or ``"in_place"`` (one copy; half-written after a failed
push until a version completes). docs/weights.md has the protocol.
"""

import asyncio
import collections
import concurrent.futures
import contextlib
import hashlib
import time

import torch

from . import _fabric_lib as _ext
from ._fabric_lib import (
    Closed,
    InvalidArgument,
    Member,
    NotFound,
    Timeout,
    WeightSchedule,
)

__all__ = ["InferenceWeights", "TrainerWeights", "Version", "WeightSchedule", "quantize_fp8",
           "quantize_fp8_many", "fp8_reference"]

_DTYPES = {torch.uint8: "u8", torch.bfloat16: "bf16", torch.float16: "f16",
           torch.float32: "f32"}
_TORCH = dict({v: k for k, v in _DTYPES.items()}, fp8_e4m3=torch.uint8)  # e4m3 bytes as uint8
_ROLE_TRAINER = "weights-trainer"
_ROLE_INFERENCE = "weights-inference"
# Training rank 0's member "<group>.schedule": "trainers=<n> inference=<m> chunk_bytes=<c>
# bytes=<length> sha256=<digest>", what every rank computes the schedule from and checks it by.
_ROLE_SCHEDULE = "weights-schedule"
_HEADER_FIELDS = ("trainers", "inference", "chunk_bytes", "bytes", "sha256")


class Version(concurrent.futures.Future):
    """A version being pushed (InferenceWeights.prepare): resolves to the version number once
    every byte of it landed, or raises PeerUnreachable / Timeout / Closed. ``await`` takes it
    too."""

    def __await__(self):
        return asyncio.wrap_future(self).__await__()


def _error(cls, message):
    exc = cls(message)
    exc.code, exc.message = getattr(_ext.ErrorCode, _CODES[cls]), message
    return exc


_CODES = {InvalidArgument: "INVALID_ARGUMENT", Timeout: "TIMEOUT", Closed: "CLOSED",
          _ext.PeerUnreachable: "PEER_UNREACHABLE"}


def _dtype_name(dtype, what):
    if isinstance(dtype, str):
        return dtype
    if getattr(torch, "float8_e4m3fn", None) is not None and dtype == torch.float8_e4m3fn:
        return "fp8_e4m3"
    if dtype not in _DTYPES:
        raise _error(InvalidArgument, f"parameter '{what}': dtype {dtype} has no fabric name")
    return _DTYPES[dtype]


def _element_bytes(name):
    return {"u8": 1, "fp8_e4m3": 1, "bf16": 2, "f16": 2, "f32": 4}[name]


def _mine(members, group, role):
    return sorted((m for m in members if m.role == role and m.instance == group),
                  key=lambda m: m.tp_rank)


def _wait_members(registry, want, timeout, what):
    """Members until want(members) is true, polling; Timeout naming `what` (a string, or a
    function of the last members that says what is missing)."""
    deadline = time.monotonic() + timeout
    while True:
        members = registry.members()
        if want(members):
            return members
        if time.monotonic() > deadline:
            missing = what(members) if callable(what) else what
            raise _error(Timeout, f"weights: {missing} not in the registry after {timeout} s")
        time.sleep(0.02)


def _leave(registry, name):
    try:
        registry.leave(name)
    except NotFound:
        pass


def _compute(members, group, num_trainers, num_inference, chunk_bytes):
    """The schedule from the first `num_trainers` training and `num_inference` inference
    members of the group."""
    trainers = _mine(members, group, _ROLE_TRAINER)[:num_trainers]
    inference = _mine(members, group, _ROLE_INFERENCE)[:num_inference]
    return WeightSchedule.compute(
        [bytes.fromhex(m.data) for m in trainers],
        [_ext._weights_endpoint_layout(bytes.fromhex(m.data)) for m in inference], chunk_bytes)


def _digest(schedule):
    data = schedule.encode()
    return len(data), hashlib.sha256(data).hexdigest()


def _publish_header(registry, group, schedule, chunk_bytes):
    length, digest = _digest(schedule)
    registry.join(Member(f"{group}.schedule", role=_ROLE_SCHEDULE, instance=group,
                         data=f"trainers={schedule.num_trainers} "
                              f"inference={schedule.num_inference} chunk_bytes={chunk_bytes} "
                              f"bytes={length} sha256={digest}"))


def _header(members, group):
    """The fields of the group's schedule header, or None when it is absent."""
    header = next((m for m in members if m.role == _ROLE_SCHEDULE and m.instance == group), None)
    if header is None:
        return None
    try:
        fields = dict(f.split("=", 1) for f in header.data.split())
        return {k: fields[k] if k == "sha256" else int(fields[k]) for k in _HEADER_FIELDS}
    except (KeyError, ValueError):
        raise _error(InvalidArgument, f"weights: the schedule header {header.name} is "
                     f"malformed: {header.data[:100]!r}") from None


def _agreed_schedule(registry, group, timeout):
    """Waits (up to `timeout`) for training rank 0's schedule header and the members it names,
    computes the schedule from them and checks it against the header's length and sha256
    (InvalidArgument naming both digests when this rank sees other members than rank 0 did)."""
    def missing(members):
        h = _header(members, group)
        if h is None:
            return f"the schedule header ({group}.schedule)"
        return (f"{h['trainers']} training and {h['inference']} inference ranks (found "
                f"{len(_mine(members, group, _ROLE_TRAINER))} and "
                f"{len(_mine(members, group, _ROLE_INFERENCE))})")

    def complete(members):
        h = _header(members, group)
        return h is not None and len(_mine(members, group, _ROLE_TRAINER)) >= h["trainers"] and \
            len(_mine(members, group, _ROLE_INFERENCE)) >= h["inference"]

    members = _wait_members(registry, complete, timeout, missing)
    h = _header(members, group)
    schedule = _compute(members, group, h["trainers"], h["inference"], h["chunk_bytes"])
    length, digest = _digest(schedule)
    if (length, digest) != (h["bytes"], h["sha256"]):
        raise _error(InvalidArgument, f"weights: the schedule computed here ({length} bytes, "
                     f"sha256 {digest[:16]}...) differs from training rank 0's ({h['bytes']} "
                     f"bytes, sha256 {h['sha256'][:16]}...): the ranks read different "
                     "descriptions from the registry")
    return schedule


def quantize_fp8(src, block=128):
    """BF16 2-D tensor -> (e4m3 bytes as uint8, f32 scales [ceil(r/b), ceil(c/b)]): the CUDA
    kernel for a CUDA tensor (on the current stream), the C++ CPU reference otherwise."""
    rows, cols = src.shape
    out = torch.empty((rows, cols), dtype=torch.uint8, device=src.device)
    scales = torch.empty(((rows + block - 1) // block, (cols + block - 1) // block),
                         dtype=torch.float32, device=src.device)
    _quantize_into(src, out, scales, block)
    return out, scales


def quantize_fp8_many(sources, block=128):
    """quantize_fp8 of each BF16 2-D tensor of `sources`: for CUDA tensors the kernel runs over
    them in few launches (64 matrices a launch, on the current stream), which costs far less
    than a launch each when they are many and small. Returns [(e4m3 uint8, f32 scales)]."""
    outs = []
    for src in sources:
        rows, cols = src.shape
        outs.append((torch.empty((rows, cols), dtype=torch.uint8, device=src.device),
                     torch.empty(((rows + block - 1) // block, (cols + block - 1) // block),
                                 dtype=torch.float32, device=src.device)))
    _quantize_many([(s, q, sc) for s, (q, sc) in zip(sources, outs)], block)
    return outs


def _quantize_many(jobs, block):
    """[(bf16 source, e4m3 out, f32 scales)] quantised: CUDA ones grouped (sources made
    contiguous; sizes, dtypes and devices checked here, since the kernel takes pointers), CPU
    ones one by one."""
    cuda_jobs = collections.defaultdict(list)  # device -> [(source kept alive, pointers...)]
    for src, out, scales in jobs:
        if not src.is_cuda:
            _quantize_into(src, out, scales, block)
            continue
        src = src.contiguous()
        rows, cols = src.shape
        tiles = ((rows + block - 1) // block) * ((cols + block - 1) // block)
        if (src.dtype != torch.bfloat16 or out.device != src.device
                or scales.device != src.device or not out.is_contiguous()
                or not scales.is_contiguous() or out.numel() * out.element_size() != rows * cols
                or scales.numel() * scales.element_size() != tiles * 4):
            raise _error(InvalidArgument,
                         "quantize_fp8: a bf16 source on the GPU of its out and scales, sized "
                         "rows x cols bytes and one f32 per tile")
        cuda_jobs[src.device].append((src, (src.data_ptr(), rows, cols, out.data_ptr(),
                                            scales.data_ptr())))
    for device, group in cuda_jobs.items():
        stream = torch.cuda.current_stream(device).cuda_stream
        _ext._weights_quantize_fp8_many([j for _, j in group], block, stream)


def _quantize_into(src, out, scales, block):
    src = src.contiguous()
    stream = torch.cuda.current_stream(src.device).cuda_stream if src.is_cuda else 0
    _ext._weights_quantize_fp8(src.view(torch.int16), src.shape[0], src.shape[1], out, scales,
                              block, stream)


def fp8_reference(src, block=128):
    """The same quantisation in plain PyTorch ops (no fabric code): the tests' reference.
    Returns (e4m3 bits as uint8, f32 scales)."""
    x = src.float()
    rows, cols = x.shape
    tr, tc = (rows + block - 1) // block, (cols + block - 1) // block
    padded = torch.zeros(tr * block, tc * block)
    padded[:rows, :cols] = x.abs()
    amax = padded.view(tr, block, tc, block).amax(dim=(1, 3))
    scales = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    per_elem = scales.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    q = (x / per_elem).clamp(-448.0, 448.0)
    a = q.abs()
    # e4m3: exponent bias 7, 3 mantissa bits, subnormals below 2^-6 in steps of 2^-9.
    _, e = torch.frexp(a)  # a = m * 2^e, m in [0.5, 1)
    step_exp = torch.clamp(e - 1, min=-6) - 3
    r = torch.round(a * torch.pow(2.0, -step_exp.float())) * torch.pow(2.0, step_exp.float())
    _, e2 = torch.frexp(r)
    normal = r >= 2.0 ** -6
    exp_field = torch.where(normal, e2 - 1 + 7, torch.zeros_like(e2))
    mant = torch.where(normal, (r / torch.pow(2.0, (e2 - 1).float()) - 1.0) * 8.0, r * 512.0)
    bits = exp_field * 8 + mant.round().to(torch.int64)
    sign = torch.signbit(q).to(torch.int64) * 128
    return (bits + sign).to(torch.uint8), scales


class InferenceWeights:
    """An inference rank's parameters, written by training ranks on the schedule.

    ``add`` each tensor (the rank's local slice, contiguous, its memory registered with
    `engine`, no copy), then ``publish``. Per version: ``prepare(version)`` returns a
    concurrent.futures.Future that resolves to the version once every byte of it landed (or
    fails with PeerUnreachable / Timeout), and tells the training ranks where to write; in
    ``"flip"`` mode, ``tensors()`` keeps returning the last complete version until then.
    It counts immediates ``imm_base + n`` (n counts prepares, never reused) and must own that
    range on its engine; it installs no handler on the engine.
    ``host_mirror=False``: CUDA tensors are registered without a pinned host mirror (no pinned
    memory the size of the model), so only training ranks on this host reach them, over CUDA
    IPC; a push from another host then fails with Unsupported at its trainer.
    """

    def __init__(self, engine, rank, registry, *, group="weights", mode="flip",
                 imm_base=0xA0000000, timeout=30.0, host_mirror=True):
        if mode not in ("flip", "in_place"):
            raise _error(InvalidArgument, f"mode must be 'flip' or 'in_place', not {mode!r}")
        self.engine, self.rank, self.registry = engine, rank, registry
        self.group, self.mode, self.timeout = group, mode, timeout
        self.host_mirror = host_mirror
        self._receiver = _ext.WeightReceiver(engine, rank, flip=mode == "flip",
                                             imm_base=imm_base, timeout=timeout)
        self._params = []  # the tuples of _weights_encode_inference
        self._copies = {}  # name -> [tensor per copy]
        self._regions = []  # Registration: arenas and tensors registered alone
        self._arenas = []  # (start address, end address, region index)
        self._where = {}  # name -> [(region index, byte offset) per copy]
        self._schedule = None
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
        def bad(what):
            return _error(InvalidArgument, f"parameter '{name}': {what}")
        if not tensor.is_contiguous():
            raise bad("the tensor must be contiguous")
        dtype = _dtype_name(dtype if dtype is not None else tensor.dtype, name)
        shape = list(tensor.shape) if shape is None else [int(s) for s in shape]
        if dim is None:
            d, length, local = -1, 0, _numel(shape)
        else:
            d, length = dim, tensor.shape[dim]
            local = _numel(shape) // max(1, shape[dim]) * length
        if tensor.element_size() != _element_bytes(dtype):
            raise bad(f"a {tensor.dtype} tensor cannot hold {dtype} elements")
        if tensor.numel() != local:
            raise bad(f"the tensor has {tensor.numel()} elements, its slice of {shape} has "
                      f"{local}")
        self._params.append((name, dtype, shape, d, start, length, projection, list(sources),
                             concat_dim, block))
        copies = [tensor]
        if self.mode == "flip":
            copies.append(torch.empty_like(tensor) if spare is None else spare)
        self._copies[name] = copies
        self._where[name] = [self._locate(c) for c in copies]

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
        layout = _ext._weights_encode_inference(self.rank, self._params)
        endpoint = _ext._weights_encode_endpoint(
            layout, [r.descriptor for r in self._regions], [self._where[p[0]] for p in self._params])
        self.registry.join(Member(f"{self.group}.i{self.rank}", role=_ROLE_INFERENCE,
                                  instance=self.group, tp_rank=self.rank,
                                  address=bytes(self.engine.address).hex(), data=endpoint.hex()))
        self.registry.watch(self._on_member)

    def close(self):
        """Fails a pending version with Closed and leaves the registry (the tensors and their
        registrations stay as they are until dropped). Also on leaving a `with` block."""
        self._receiver.close()
        _leave(self.registry, f"{self.group}.i{self.rank}")

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
    def copies(self):
        """Copies of each parameter this mode keeps (2 for flip, 1 in place): the memory cost."""
        return 2 if self.mode == "flip" else 1

    def tensors(self):
        """{name: tensor} of the last complete version. In place, raises InvalidArgument after
        a failed push (the tensors are half-written) until a version completes."""
        if self._receiver.half_written:
            raise _error(InvalidArgument,
                         "in-place weights are half-written: the last push failed")
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
        if self._schedule is None:
            self._schedule = _agreed_schedule(self.registry, self.group, self.timeout)
        trainers = _mine(self.registry.members(), self.group, _ROLE_TRAINER)
        if len(trainers) < self._schedule.num_trainers:
            raise _error(_ext.PeerUnreachable,
                         f"version {version}: {len(trainers)} of "
                         f"{self._schedule.num_trainers} training ranks are in the registry")
        future = Version()

        def complete(v):
            for cb in self._on_version:
                cb(v)
            future.set_result(v)

        self._receiver.prepare(version, self._schedule.writes_into(self.rank),
                               [(m.tp_rank, m.name, bytes.fromhex(m.address)) for m in trainers],
                               complete, lambda v, exc: future.set_exception(exc))
        return future

    def _on_member(self, joined, member):
        if not joined and member.role == _ROLE_TRAINER and member.instance == self.group:
            self._receiver.fail_trainer(member.name)


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
        _leave(self.registry, f"{self.group}.t{self.rank}")
        if self.rank == 0:
            _leave(self.registry, f"{self.group}.schedule")

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
        desc = _ext._weights_encode_trainer(self.rank, self.num_nics, [
            (n, _dtype_name(t.dtype, n), shape, box, rep)
            for n, (t, shape, box, rep) in self._shards.items()])
        self.registry.join(Member(f"{self.group}.t{self.rank}", role=_ROLE_TRAINER,
                                  instance=self.group, tp_size=self.world, tp_rank=self.rank,
                                  address=bytes(self.engine.address).hex(), data=desc.hex()))

    def connect(self, num_inference):
        """Waits for `world` training and `num_inference` inference ranks in the registry and
        computes the schedule (raising its error naming the parameter); rank 0 publishes its
        digest, the others check theirs against it. Returns the schedule."""
        members = _wait_members(
            self.registry, lambda ms: len(_mine(ms, self.group, _ROLE_TRAINER)) >= self.world and
            len(_mine(ms, self.group, _ROLE_INFERENCE)) >= num_inference, self.timeout,
            "every rank")
        if self.rank == 0:
            schedule = _compute(members, self.group, self.world, num_inference, self.chunk_bytes)
            _publish_header(self.registry, self.group, schedule, self.chunk_bytes)
        else:
            schedule = _agreed_schedule(self.registry, self.group, self.timeout)
            members = self.registry.members()
        inference = _mine(members, self.group, _ROLE_INFERENCE)[:schedule.num_inference]
        self._sender.connect(schedule, [bytes.fromhex(m.data) for m in inference],
                             [bytes.fromhex(m.address) for m in inference], self._ring_reg,
                             self._ring.data_ptr(), self._ring.numel(), self._ring.is_cuda)
        self.schedule = schedule
        if self.world > 1:  # who sends which shard to whom, from every rank's description
            self._sender.plan_gathers([bytes.fromhex(m.data) for m in
                                       _mine(members, self.group, _ROLE_TRAINER)[:self.world]])
        return schedule

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


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def _full_box(box, shape):
    return box if box else [(0, s) for s in shape]


def _box_numel(box, shape):
    return _numel([ln for _, ln in _full_box(box, shape)])
