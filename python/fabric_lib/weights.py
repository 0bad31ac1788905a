"""fabric_lib.weights: RL weight push, trainer tensors written straight into inference tensors.

The inference side registers the tensors it already owns, by name, with their layouts
(:class:`InferenceWeights`); each training rank describes its shards (:class:`TrainerWeights`).
Both publish their descriptions in a fabric_lib registry (``FileRegistry``, ``EtcdRegistry``,
``LocalRegistry``); training rank 0 computes the static schedule once (the C++
``fabric::weights::compute_schedule``, through ``WeightSchedule``) and publishes its bytes in
chunks (registry members of at most 512 KiB of hex each: etcd refuses larger requests), which
every other rank reassembles, checks against their sha256 and decodes. Each push then runs, per
parameter: gather (``torch.distributed`` all-gather of the shards when the trainer is sharded;
the tensor itself when one rank holds it whole), project into a bounded staging buffer
(identity, concatenation, BF16 -> FP8 e4m3 with 128x128 block scales), and one-sided writes
with an immediate into the inference tensors' registered memory. An inference rank learns that
version N is complete when it has counted ``schedule.writes_into(rank)`` immediates of the value
it chose for N.

Two ways to never expose a half-written model (``mode``):

- ``"flip"``: every parameter has two registered copies; a push writes into the copy not being
  served and the serving copy flips when the version is complete. Costs one more copy of the
  rank's parameters (2x parameter memory). A failed push leaves the served copy untouched.
- ``"in_place"``: one copy; the caller pauses serving between :meth:`InferenceWeights.prepare`
  and the version's completion. No extra memory; a failed push leaves the tensors half-written,
  so :meth:`InferenceWeights.tensors` raises until a later version completes.

Failures: a training rank that leaves the registry (a SIGKILLed process leaves a FileRegistry
within its poll interval) while a version is pending fails that version with PeerUnreachable;
a version not complete within ``timeout`` fails with Timeout. docs/weights.md has the protocol.

Threads: ``prepare`` and ``push`` block the calling thread only as documented on each;
completion callbacks run on the engine's callback thread, failure callbacks on the registry's
or a timer thread.
"""

import asyncio
import collections
import concurrent.futures
import hashlib
import struct
import threading
import time

import torch

from . import _fabric_lib as _ext
from ._fabric_lib import (
    Closed,
    InvalidArgument,
    Member,
    NotFound,
    PeerUnreachable,
    RemoteMemory,
    Routing,
    Timeout,
    WeightSchedule,
)

__all__ = ["InferenceWeights", "TrainerWeights", "Version", "WeightSchedule", "quantize_fp8",
           "quantize_fp8_many",
           "fp8_reference"]

_DTYPES = {
    torch.uint8: "u8",
    torch.bfloat16: "bf16",
    torch.float16: "f16",
    torch.float32: "f32",
}
_TORCH = {"u8": torch.uint8, "bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32,
          "fp8_e4m3": torch.uint8}  # torch without float8 holds e4m3 bytes as uint8
_READY = struct.Struct("<4sQIIB")  # tag, version, imm, inference rank, copy
_READY_TAG = b"FWRD"
_ROLE_TRAINER = "weights-trainer"
_ROLE_INFERENCE = "weights-inference"
_ROLE_SCHEDULE = "weights-schedule"  # the header: chunks=<n> bytes=<length> sha256=<digest>
_ROLE_SCHEDULE_CHUNK = "weights-schedule-chunk"  # tp_rank = index; data "<digest> <hex>"
# Hex characters of the schedule per chunk member: the member stays far below etcd's default
# request limit (1.5 MiB), whatever the schedule's size.
_SCHEDULE_CHUNK_CHARS = 512 << 10


class Version(concurrent.futures.Future):
    """A version being pushed (InferenceWeights.prepare): resolves to the version number once
    every byte of it landed, or raises PeerUnreachable / Timeout / Closed. ``await`` takes it
    too."""

    def __await__(self):
        return asyncio.wrap_future(self).__await__()


def _error(cls, code, message):
    exc = cls(message)
    exc.code, exc.message = code, message
    return exc


def _dtype_name(dtype, what):
    if isinstance(dtype, str):
        return dtype
    if getattr(torch, "float8_e4m3fn", None) is not None and dtype == torch.float8_e4m3fn:
        return "fp8_e4m3"
    if dtype not in _DTYPES:
        raise _error(InvalidArgument, _ext.ErrorCode.INVALID_ARGUMENT,
                     f"parameter '{what}': dtype {dtype} has no fabric name")
    return _DTYPES[dtype]


def _element_bytes(name):
    return {"u8": 1, "fp8_e4m3": 1, "bf16": 2, "f16": 2, "f32": 4}[name]


def _pack(chunks):
    return b"".join(struct.pack("<I", len(c)) + c for c in chunks)


def _unpack(data):
    out, at = [], 0
    while at < len(data):
        (n,) = struct.unpack_from("<I", data, at)
        out.append(data[at + 4 : at + 4 + n])
        at += 4 + n
    return out


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
            raise _error(Timeout, _ext.ErrorCode.TIMEOUT, f"weights: {missing} not in the "
                         f"registry after {timeout} s")
        time.sleep(0.02)


def _publish_schedule(registry, group, schedule, previous=()):
    """Publishes the schedule's bytes as hex in chunk members ``<group>.schedule.<i>`` (at most
    _SCHEDULE_CHUNK_CHARS characters of hex each, after the digest), then the header
    ``<group>.schedule`` that names their count, the bytes' length and sha256; leaves the
    members of `previous` not published again. Returns the members' names, header first."""
    data = schedule.encode()
    text, digest = data.hex(), hashlib.sha256(data).hexdigest()
    pieces = [text[at : at + _SCHEDULE_CHUNK_CHARS]
              for at in range(0, len(text), _SCHEDULE_CHUNK_CHARS)]
    names = [f"{group}.schedule"] + [f"{group}.schedule.{i}" for i in range(len(pieces))]
    for i, piece in enumerate(pieces):
        registry.join(Member(names[i + 1], role=_ROLE_SCHEDULE_CHUNK, instance=group,
                             tp_size=len(pieces), tp_rank=i, data=f"{digest} {piece}"))
    registry.join(Member(names[0], role=_ROLE_SCHEDULE, instance=group,
                         data=f"chunks={len(pieces)} bytes={len(data)} sha256={digest}"))
    for name in set(previous) - set(names):
        _leave(registry, name)
    return names


def _schedule_header(members, group):
    """(chunks, bytes, sha256) of the group's schedule header, or None when it is absent."""
    header = next((m for m in members if m.role == _ROLE_SCHEDULE and m.instance == group), None)
    if header is None:
        return None
    try:
        fields = dict(f.split("=", 1) for f in header.data.split())
        return int(fields["chunks"]), int(fields["bytes"]), fields["sha256"]
    except (KeyError, ValueError):
        raise _error(InvalidArgument, _ext.ErrorCode.INVALID_ARGUMENT,
                     f"weights: the schedule header {header.name} is malformed: "
                     f"{header.data[:100]!r}") from None


def _schedule_chunks(members, group):
    """{index: (sha256, hex)} of the group's schedule chunks in the registry."""
    out = {}
    for m in members:
        if m.role == _ROLE_SCHEDULE_CHUNK and m.instance == group:
            digest, _, text = m.data.partition(" ")
            out[m.tp_rank] = (digest, text)
    return out


def _read_schedule(registry, group, timeout):
    """Waits (up to `timeout`) for the schedule header and every chunk it names (chunks of
    another schedule, with another sha256, do not count), reassembles and decodes the bytes.
    Timeout naming the header, or the chunks missing or of another schedule; InvalidArgument
    when the bytes' length or sha256 differs from the header's."""
    def complete(members):
        header = _schedule_header(members, group)
        if header is None:
            return False
        chunks = _schedule_chunks(members, group)
        return all(chunks.get(i, ("",))[0] == header[2] for i in range(header[0]))

    def missing(members):
        header = _schedule_header(members, group)
        if header is None:
            return f"the schedule header ({group}.schedule)"
        count, _, digest = header
        chunks = _schedule_chunks(members, group)
        wanted = [i for i in range(count) if chunks.get(i, ("",))[0] != digest]
        other = sorted({chunks[i][0][:16] for i in wanted if i in chunks})
        text = f"chunks {wanted} of {count} of the schedule sha256 {digest[:16]}..."
        if other:  # a schedule published again while this reader looked
            held = [i for i in wanted if i in chunks]
            text += f" (chunks {held} there are of another schedule: sha256 {', '.join(other)}...)"
        return text

    members = _wait_members(registry, complete, timeout, missing)
    count, length, digest = _schedule_header(members, group)
    chunks = _schedule_chunks(members, group)
    data = bytearray()
    for i in range(count):
        try:
            data += bytes.fromhex(chunks[i][1])
        except ValueError:
            raise _error(InvalidArgument, _ext.ErrorCode.INVALID_ARGUMENT,
                         f"weights: schedule chunk {i} of {count} is not hex") from None
    if len(data) != length:
        raise _error(InvalidArgument, _ext.ErrorCode.INVALID_ARGUMENT,
                     f"weights: the schedule's {count} chunks hold {len(data)} bytes, its "
                     f"header says {length}")
    if hashlib.sha256(data).hexdigest() != digest:
        raise _error(InvalidArgument, _ext.ErrorCode.INVALID_ARGUMENT,
                     f"weights: the schedule's {count} chunks do not match its sha256 "
                     f"{digest[:16]}... (a chunk was altered)")
    return WeightSchedule.decode(bytes(data))


def _leave(registry, name):
    try:
        registry.leave(name)
    except NotFound:
        pass


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
            raise _error(InvalidArgument, _ext.ErrorCode.INVALID_ARGUMENT,
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


class _Param:
    def __init__(self, name, dtype, shape, dim, start, length, kind, sources, concat_dim, block):
        self.name, self.dtype, self.shape = name, dtype, [int(s) for s in shape]
        self.dim, self.start, self.length = dim, start, length
        self.kind, self.sources = kind, list(sources)
        self.concat_dim, self.block = concat_dim, block

    def as_tuple(self):
        return (self.name, self.dtype, self.shape, self.dim, self.start, self.length, self.kind,
                self.sources, self.concat_dim, self.block)


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
            raise _error(InvalidArgument, _ext.ErrorCode.INVALID_ARGUMENT,
                         f"mode must be 'flip' or 'in_place', not {mode!r}")
        self.engine, self.rank, self.registry = engine, rank, registry
        self.group, self.mode, self.timeout = group, mode, timeout
        self.host_mirror = host_mirror
        self._imm_base, self._seq = imm_base, 0
        self._params = []  # _Param
        self._copies = {}  # name -> [tensor per copy]
        self._regions = []  # Registration: arenas and tensors registered alone
        self._arenas = []  # (start address, end address, region index)
        self._where = {}  # name -> [(region index, byte offset) per copy]
        self._lock = threading.Lock()
        self._active = 0
        self._version = None
        self._dirty = False  # in_place: a push failed part way
        self._pending = None  # (version, imm, copy, future, timer)
        self._schedule = None
        self._on_version = []
        self._trainers = {}  # member name -> address (bytes)
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
            return _error(InvalidArgument, _ext.ErrorCode.INVALID_ARGUMENT,
                          f"parameter '{name}': {what}")
        if not tensor.is_contiguous():
            raise bad("the tensor must be contiguous")
        dtype = _dtype_name(dtype if dtype is not None else tensor.dtype, name)
        shape = list(tensor.shape) if shape is None else list(shape)
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
        self._params.append(_Param(name, dtype, shape, d, start, length, projection,
                                   sources, concat_dim, block))
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
        desc = _ext._weights_encode_inference(self.rank, [p.as_tuple() for p in self._params])
        # The layout, the regions' descriptors, then (region, offset) of each copy of each
        # parameter, in the layout's order.
        chunks = [desc, struct.pack("<I", len(self._regions))]
        chunks += [bytes(r.descriptor) for r in self._regions]
        for p in self._params:
            chunks += [struct.pack("<IQ", *w) for w in self._where[p.name]]
        self.registry.join(Member(f"{self.group}.i{self.rank}", role=_ROLE_INFERENCE,
                                  instance=self.group, tp_rank=self.rank,
                                  address=bytes(self.engine.address).hex(),
                                  data=_pack(chunks).hex()))
        self.registry.watch(self._on_member)

    def close(self):
        """Fails a pending version with Closed and leaves the registry (the tensors and their
        registrations stay as they are until dropped). Also on leaving a `with` block."""
        pending = self._pending
        if pending is not None:
            self._fail(pending[0], _error(Closed, _ext.ErrorCode.CLOSED,
                                          f"version {pending[0]}: InferenceWeights closed"))
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
        return self._version

    @property
    def copies(self):
        """Copies of each parameter this mode keeps (2 for flip, 1 in place): the memory cost."""
        return 2 if self.mode == "flip" else 1

    def tensors(self):
        """{name: tensor} of the last complete version. In place, raises InvalidArgument after
        a failed push (the tensors are half-written) until a version completes."""
        with self._lock:
            if self._dirty:
                raise _error(InvalidArgument, _ext.ErrorCode.INVALID_ARGUMENT,
                             "in-place weights are half-written: the last push failed")
            return {n: c[self._active] for n, c in self._copies.items()}

    def __getitem__(self, name):
        return self.tensors()[name]

    @property
    def progress(self):
        """(version, writes landed, writes expected) of the pending version, or None."""
        pending = self._pending
        if pending is None:
            return None
        return pending[0], self.engine.imm_count(pending[1]), self._expected

    # --- a version ---

    def prepare(self, version):
        """Arms the immediate count of `version` and tells every training rank (found in the
        registry) to write it; returns a Version (a Future, also awaitable). Blocks until the
        schedule is in the registry (up to `timeout`). In place, stop serving until the Version
        resolves."""
        if self._schedule is None:
            self._schedule = _read_schedule(self.registry, self.group, self.timeout)
        trainers = [m for m in self.registry.members()
                    if m.role == _ROLE_TRAINER and m.instance == self.group]
        future = Version()
        with self._lock:
            if self._pending is not None:
                raise _error(InvalidArgument, _ext.ErrorCode.INVALID_ARGUMENT,
                             f"version {self._pending[0]} is still pending")
            if len(trainers) < self._schedule.num_trainers:
                raise _error(PeerUnreachable, _ext.ErrorCode.PEER_UNREACHABLE,
                             f"version {version}: {len(trainers)} of "
                             f"{self._schedule.num_trainers} training ranks are in the registry")
            imm = self._imm_base + self._seq
            self._seq += 1
            copy = 1 - self._active if self.mode == "flip" else 0
            timer = threading.Timer(self.timeout, self._fail, (version, _error(
                Timeout, _ext.ErrorCode.TIMEOUT,
                f"version {version} not complete after {self.timeout} s")))
            timer.daemon = True
            self._pending = (version, imm, copy, future, timer)
            self._trainers = {m.name: bytes.fromhex(m.address) for m in trainers}
        count = self._schedule.writes_into(self.rank)
        self._expected = count
        if count == 0:
            self._complete(version)
            return future
        self.engine.reset_imm(imm)
        self.engine.expect_imm(imm, count, on_reached=lambda: self._complete(version))
        timer.start()
        message = _READY.pack(_READY_TAG, version, imm, self.rank, copy)
        for address in self._trainers.values():
            self.engine.send(address, message)
        return future

    def _complete(self, version):
        with self._lock:
            if self._pending is None or self._pending[0] != version:
                return
            _, _, copy, future, timer = self._pending
            self._pending = None
            self._active, self._version, self._dirty = copy, version, False
        timer.cancel()
        for cb in self._on_version:
            cb(version)
        future.set_result(version)

    def _fail(self, version, exc):
        with self._lock:
            if self._pending is None or self._pending[0] != version:
                return
            _, imm, _, future, timer = self._pending
            self._pending = None
            if self.mode == "in_place":
                self._dirty = True
        timer.cancel()
        try:
            self.engine.cancel_expect_imm(imm)
        except NotFound:
            pass
        future.set_exception(exc)

    def _on_member(self, joined, member):
        if joined or member.role != _ROLE_TRAINER or member.instance != self.group:
            return
        pending = self._pending
        if pending is not None and member.name in self._trainers:
            self._fail(pending[0], _error(
                PeerUnreachable, _ext.ErrorCode.PEER_UNREACHABLE,
                f"version {pending[0]}: training rank {member.tp_rank} ({member.name}) left "
                "the registry before the version was complete"))


class _Ring:
    """The staging buffer: projected tensors taken first in, first out; a range is reused only
    once every write from it has completed."""

    def __init__(self, engine, size, device, host_mirror=True):
        self.buffer = torch.empty(size, dtype=torch.uint8, device=device)
        self.reg = engine.register(self.buffer, host_mirror=host_mirror)
        self.size, self.head = size, 0
        self.live = collections.deque()  # (start, end, [Transfer])
        self.high_water = 0
        self.held = 0  # bytes of the live ranges
        self.before_wait = None  # posts what was staged but not written yet (push sets it)
        self.wait_s = 0.0  # seconds take() waited for older ranges' writes to complete

    def take(self, n, name, timeout):
        if n > self.size:
            raise _error(InvalidArgument, _ext.ErrorCode.INVALID_ARGUMENT,
                         f"parameter '{name}': its projection needs {n} bytes, more than "
                         f"max_temp_bytes ({self.size})")
        while True:
            start = _align(self.head)
            start = start if start + n <= self.size else 0
            if not self._overlaps(start, n):
                break
            # The oldest range's writes must be posted to be waited on. Only when they are not
            # (its transfer list is empty until then): flushing before every wait once the ring
            # had filled posted one parameter at a time (1514 submissions and stream syncs in a
            # push of 1920 expert matrices, against 18 with the experts stacked).
            if self.before_wait is not None and not self.live[0][2]:
                self.before_wait()
            t = time.perf_counter()
            self.release_oldest(timeout)
            self.wait_s += time.perf_counter() - t
        self.head = start + n
        return start

    def _overlaps(self, start, n):
        """Whether [start, start + n) meets a live range. Ranges are taken in address order and
        wrap to 0 at most once among the live ones (a second wrap would have passed the oldest),
        so only two can be met first: the oldest, and after a wrap the one taken at 0. (A scan of
        every live range made each take cost 90 us with 300 of them.)"""
        if not self.live:
            return False
        s0, e0, _ = self.live[0]
        if start == _align(self.head) and start + n <= self.size:
            return start < e0 and s0 < start + n
        # Back to 0: a live range taken at 0 since the last wrap, or the oldest reaching down.
        return self.live[-1][0] < s0 or s0 < start + n

    def release_oldest(self, timeout):
        s, e, transfers = self.live.popleft()
        self.held -= e - s
        for t in transfers:
            t.result(timeout)

    def hold(self, start, n, transfers):
        self.live.append((start, start + n, transfers))
        self.held += n
        self.high_water = max(self.high_water, self.held)

    def drain(self, timeout):
        while self.live:
            self.release_oldest(timeout)


class TrainerWeights:
    """A training rank's side of the push.

    ``add`` each local shard (its box of the global tensor), ``publish``, then ``connect``
    once (waits for every rank in the registry; rank 0 computes and publishes the schedule),
    then ``push(version)`` after each step. With ``world > 1`` the shards are gathered with
    ``torch.distributed`` (the default process group unless `process_group`; point-to-point
    sends, so a GPU-tensor trainer needs NCCL): a rank scheduled to write a parameter receives
    the other shards of its replica, and only those; every rank calls ``push`` for every
    version. Takes the engine's receive handler.
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
        self._ring = _Ring(engine, max_temp_bytes, device, host_mirror)
        self._ready = {}  # version -> {inference rank: (imm, copy)}
        self._cond = threading.Condition()
        self._boxes = None  # all ranks' {name: (box, replica, shape)} for the gather
        self.schedule = None
        self._schedule_members = []  # rank 0: the schedule's header and chunks it published
        engine.set_receive_handler(self._on_message)

    def close(self):
        """Leaves the registry (and withdraws the schedule's header and every chunk, on rank
        0). Also on leaving a `with` block; a push in progress is not interrupted."""
        _leave(self.registry, f"{self.group}.t{self.rank}")
        for name in self._schedule_members:
            _leave(self.registry, name)
        self._schedule_members = []

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

    def publish(self):
        desc = _ext._weights_encode_trainer(self.rank, self.num_nics, [
            (n, _dtype_name(t.dtype, n), shape, box, rep)
            for n, (t, shape, box, rep) in self._shards.items()])
        self._desc = desc
        self.registry.join(Member(f"{self.group}.t{self.rank}", role=_ROLE_TRAINER,
                                  instance=self.group, tp_size=self.world, tp_rank=self.rank,
                                  address=bytes(self.engine.address).hex(), data=desc.hex()))

    def connect(self, num_inference):
        """Waits for `world` training and `num_inference` inference ranks in the registry;
        rank 0 computes the schedule (raising its error naming the parameter) and publishes it,
        the others read it. Returns the schedule."""
        def mine(ms, role):
            return [m for m in ms if m.role == role and m.instance == self.group]
        members = _wait_members(
            self.registry, lambda ms: len(mine(ms, _ROLE_TRAINER)) >= self.world and
            len(mine(ms, _ROLE_INFERENCE)) >= num_inference, self.timeout, "every rank")
        inference = sorted(mine(members, _ROLE_INFERENCE), key=lambda m: m.tp_rank)
        if self.rank == 0:
            trainers = sorted(mine(members, _ROLE_TRAINER), key=lambda m: m.tp_rank)
            schedule = WeightSchedule.compute(
                [bytes.fromhex(m.data) for m in trainers],
                [_unpack(bytes.fromhex(m.data))[0] for m in inference], self.chunk_bytes)
            self._schedule_members = _publish_schedule(self.registry, self.group, schedule,
                                                       self._schedule_members)
        else:
            schedule = _read_schedule(self.registry, self.group, self.timeout)
            # Rank 0 computed it from these layouts; a schedule read back is held against them,
            # so that a damaged one cannot write one parameter's bytes into another's place.
            schedule.check_destinations([_unpack(bytes.fromhex(m.data))[0] for m in inference])
        self.schedule = schedule
        self._params = schedule.params
        # The push's order, the same on every rank: parameters by their sources, then by name,
        # so that those made from the same training parameters (an FP8 weight and its scales,
        # a fused gate/up and the up it holds) come one after another and share its gather.
        self._push_order = sorted(range(len(self._params)),
                                  key=lambda i: (list(self._params[i][4]), self._params[i][0]))
        # An FP8 weight's scales, and the scales' weight: the other FP8 parameter made from the
        # same sources (joined along the same dim) with the same block. Looked up once here: a
        # scan per parameter made a push of thousands of them quadratic (1.2 s of a 1.15 s push
        # of 1920 expert matrices, measured on one H200).
        groups = collections.defaultdict(list)
        for i, q in enumerate(self._params):
            if q[3] in ("fp8_quantize", "fp8_scale"):
                groups[(tuple(q[4]), q[6], q[5] if len(q[4]) > 1 else None)].append(i)
        self._fp8_partner = {i: next(j for j in g if j != i)
                             for g in groups.values() if len(g) > 1 for i in g}
        # Each inference rank's descriptors by parameter name and copy.
        self._targets = {}
        for m in inference:
            chunks = _unpack(bytes.fromhex(m.data))
            names = [p[0] for p in _ext._weights_decode_inference(chunks[0])]
            (num_regions,) = struct.unpack("<I", chunks[1])
            regions = [RemoteMemory(c) for c in chunks[2 : 2 + num_regions]]
            where = [struct.unpack("<IQ", c) for c in chunks[2 + num_regions :]]
            per = len(where) // max(1, len(names))
            self._targets[m.tp_rank] = {
                n: [(regions[where[i * per + c][0]], where[i * per + c][1]) for c in range(per)]
                for i, n in enumerate(names)}
        self._peers = self.engine.add_peer_group([bytes.fromhex(m.address) for m in inference])
        self._entries = collections.defaultdict(list)
        for e in schedule.entries(self.rank):
            self._entries[e[2]].append(e)
        if self.world > 1:
            import torch.distributed as dist
            boxes = {n: (box, rep, shape, t.dtype) for n, (t, shape, box, rep) in
                     self._shards.items()}
            self._boxes = [None] * self.world
            dist.all_gather_object(self._boxes, boxes, group=self.process_group)
            self._plan_gathers(schedule)
        return schedule

    def _plan_gathers(self, schedule):
        """Who sends which shard to whom in each push, parameter by parameter in push order. A
        rank scheduled to write a parameter needs each of its sources whole: it receives the
        other shards of the replica it holds from their holders, point to point, unless it has
        that source whole from the parameter before (an FP8 weight and its scales). Ranks that
        write nothing of a parameter receive nothing for it, and ranks that hold none of it
        (another pipeline stage, another replica) take no part."""
        writers = collections.defaultdict(set)  # projected parameter -> ranks writing it
        for r in range(self.world):
            for e in schedule.entries(r):
                writers[e[2]].add(r)
        self._gathers = {}  # (parameter, source) -> ([(from, to, box)], shape, dtype)
        self._reuse = {}  # (parameter, source) -> ranks holding it whole from the one before
        have = {}  # source -> ranks holding it whole after the parameter before
        for index in self._push_order:
            param = self._params[index]
            after = {}
            for name in param[4]:
                held = {r: b[name] for r, b in enumerate(self._boxes) if name in b}
                before = have.get(name, set())
                moves = []
                for n in sorted(writers[index] - before):
                    box, replica, shape, dtype = held[n]
                    if box:  # a shard: the rest of its replica comes from the other holders
                        moves += [(h, n, hb[0]) for h, hb in sorted(held.items())
                                  if h != n and hb[1] == replica]
                if moves:
                    self._gathers[(index, name)] = (moves, shape, dtype)
                self._reuse[(index, name)] = before
                after[name] = before | writers[index]
            have = after

    def _global_rank(self, rank):
        import torch.distributed as dist
        if self.process_group is None:
            return rank
        get = getattr(dist, "get_global_rank", None) or dist.distributed_c10d._get_global_rank
        return get(self.process_group, rank)

    def _on_message(self, message):
        if len(message) != _READY.size:
            return
        tag, version, imm, inference, copy = _READY.unpack(message)
        if tag != _READY_TAG:
            return
        with self._cond:
            self._ready.setdefault(version, {})[inference] = (imm, copy)
            self._cond.notify_all()

    def _wait_ready(self, version, ranks):
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while not ranks <= set(self._ready.get(version, {})):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(ranks - set(self._ready.get(version, {})))
                    raise _error(Timeout, _ext.ErrorCode.TIMEOUT,
                                 f"version {version}: inference ranks {missing} did not prepare "
                                 f"within {self.timeout} s")
                self._cond.wait(left)
            return self._ready.pop(version)

    def _gather_start(self, index, name, stats, current):
        """Starts gathering training parameter `name` for projected parameter `index` as
        _plan_gathers says (asynchronous sends and receives of its shards); returns a function
        that waits for them and returns the whole tensor where this rank needs it (taken from
        `current`, what the parameter before gathered, where the plan says so; else its own
        shard, or None)."""
        shard = self._shards.get(name, (None,))[0]
        if self.world == 1:
            if shard is None or self._shards[name][2]:
                raise _error(InvalidArgument, _ext.ErrorCode.INVALID_ARGUMENT,
                             f"training parameter '{name}': one rank holds only a shard of it")
            return lambda: shard
        # What this rank returns without receiving: the source whole from the parameter before,
        # or its own shard (whole, or unused here); what it sends is always its own shard.
        result = current[name] if self.rank in self._reuse.get((index, name), ()) else shard
        moves, shape, dtype = self._gathers.get((index, name), ((), None, None))
        sends = [(to, box) for frm, to, box in moves if frm == self.rank]
        recvs = [(frm, box) for frm, to, box in moves if to == self.rank]
        if not sends and not recvs:
            return lambda: result
        import torch.distributed as dist
        device = self._ring.buffer.device
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
        box_of = self._boxes[self.rank][name][0]

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
        staging ring), 'drain', 'total'}, the bytes, the
        bytes received from other training ranks ('gather_bytes'), the
        submissions ('writes': a scatter or a paged write counts once) and the staging
        high-water mark ('temp_high_water'). Projections are enqueued back to back and their
        writes posted in batches of about max_temp_bytes / 4 (one stream synchronisation per
        batch). on_param(name) runs after each parameter's writes are posted (progress; tests)."""
        t0 = time.perf_counter()
        stats = dict(wait_ready=0.0, gather=0.0, project=0.0, post=0.0, wait_ring=0.0,
                     drain=0.0, bytes=0, writes=0, gather_bytes=0)
        targets = {e[3] for es in self._entries.values() for e in es}
        ready = self._wait_ready(version, targets)
        stats["wait_ready"] = time.perf_counter() - t0
        batch = []  # (param index, ring start, bytes, its transfers, to fill) not posted yet
        batch_limit = max(1, self._ring.size // 4)
        batch_bytes = 0  # bytes of `batch`
        self._pending_fp8, self._pending_fp8_bytes = [], 0  # FP8 projections not launched yet
        flush_s = 0.0  # time in flush(), which counts its own stages

        def flush():
            nonlocal batch_bytes, flush_s
            if not batch:
                return
            t_flush = time.perf_counter()
            t = t_flush
            self._quantize_pending()
            if self._ring.buffer.is_cuda:
                torch.cuda.current_stream(self._ring.buffer.device).synchronize()
            stats["project"] += time.perf_counter() - t
            t = time.perf_counter()
            self._post(batch, ready, stats)
            stats["post"] += time.perf_counter() - t
            posted = [self._params[i][0] for i, _, _, _ in batch]
            batch.clear()
            batch_bytes = 0
            if on_param is not None:
                for name in posted:
                    on_param(name)
            flush_s += time.perf_counter() - t_flush

        self._ring.before_wait = flush
        wait0 = self._ring.wait_s
        try:
            done = set()
            # Every rank walks every parameter in the same order, so that the two ends of each
            # of the gather's sends meet; the next parameter's gather is in flight while this
            # one is projected and posted; only the ranks scheduled to send a parameter project
            # and write it.
            order = [i for i in self._push_order if self.world > 1 or self._entries.get(i)]

            def start(k, current):
                if k >= len(order):
                    return {}
                return {s: self._gather_start(order[k], s, stats, current)
                        for s in self._params[order[k]][4]}

            following = start(0, {})
            for k, index in enumerate(order):
                t = time.perf_counter()
                current = {s: finish() for s, finish in following.items()}
                full = [current[s] for s in self._params[index][4]]
                following = start(k + 1, current)
                stats["gather"] += time.perf_counter() - t
                if index in done or not self._entries.get(index):
                    continue
                t, w, f = time.perf_counter(), self._ring.wait_s, flush_s
                staged = self._project(index, full, done)
                batch.extend(staged)
                batch_bytes += sum(n for _, _, n, _ in staged)
                # Less what its take() waited for room and the flush that wait needed (counted
                # by flush() itself).
                stats["project"] += (time.perf_counter() - t - (self._ring.wait_s - w) -
                                     (flush_s - f))
                if batch_bytes >= batch_limit:
                    flush()
            flush()
            t = time.perf_counter()
            self._ring.drain(self.timeout)
            stats["drain"] = time.perf_counter() - t
        finally:
            self._ring.before_wait = None
            stats["wait_ring"] = self._ring.wait_s - wait0
        stats["total"] = time.perf_counter() - t0
        stats["temp_high_water"] = self._ring.high_water
        return stats

    def _stage(self, n, name):
        """n bytes of the ring, held at once (its transfers are added when posted)."""
        start = self._ring.take(n, name, self.timeout)
        transfers = []
        self._ring.hold(start, n, transfers)
        return start, transfers

    def _project(self, index, full, done):
        """Projects parameter `index` into the ring (enqueued, for GPU tensors); returns
        [(param index, start, bytes, transfers)]: two for an FP8 weight whose scales are
        scheduled too, since one kernel makes both."""
        name, dtype, shape, kind, sources, concat_dim, block = self._params[index][:7]
        n = _numel(shape) * _element_bytes(dtype)
        if kind in ("identity", "concat"):
            start, transfers = self._stage(n, name)
            view = self._ring.buffer[start : start + n].view(_TORCH[dtype]).view(shape)
            done.add(index)
            if kind == "identity":
                view.copy_(full[0])
            else:
                torch.cat(full, dim=concat_dim, out=view)
            return [(index, start, n, transfers)]
        # FP8: the weight and its scales come from one quantisation, into one ring range (so
        # neither half can be reused while the other is pending); both share its transfers.
        # Several sources (a fused gate/up) are concatenated first, in a temporary tensor.
        partner = self._fp8_partner.get(index)
        source = full[0] if len(full) == 1 else torch.cat(full, dim=concat_dim)
        rows, cols = source.shape
        tiles = ((rows + block - 1) // block) * ((cols + block - 1) // block)
        other_n = tiles * 4 if kind == "fp8_quantize" else rows * cols
        start, transfers = self._stage(_align(n) + other_n, name)
        done.add(index)
        view = self._ring.buffer[start : start + n]
        other = start + _align(n)
        other_view = self._ring.buffer[other : other + other_n]
        q, s = (view, other_view) if kind == "fp8_quantize" else (other_view, view)
        self._quantize_later(source, q.view(rows, cols), s.view(torch.float32).view(-1), block)
        out = [(index, start, n, transfers)]
        if partner is not None and partner in self._entries:
            done.add(partner)
            out.append((partner, other, other_n, transfers))
        return out

    def _quantize_later(self, source, out, scales, block):
        """Queues an FP8 projection into the ring, launched with the others by
        _quantize_pending: at the next flush (before its stream synchronisation), or once 64
        are queued or their sources hold an eighth of max_temp_bytes (sources gathered or
        concatenated for this push stay alive until then). On the CPU it runs at once."""
        if not source.is_cuda:
            _quantize_into(source, out, scales, block)
            return
        self._pending_fp8.append((source, out, scales, block))
        self._pending_fp8_bytes += source.numel() * source.element_size()
        if len(self._pending_fp8) >= 64 or self._pending_fp8_bytes >= self._ring.size // 8:
            self._quantize_pending()

    def _quantize_pending(self):
        by_block = collections.defaultdict(list)
        for source, out, scales, block in self._pending_fp8:
            by_block[block].append((source, out, scales))
        self._pending_fp8.clear()
        self._pending_fp8_bytes = 0
        for block, jobs in by_block.items():
            _quantize_many(jobs, block)

    def _post(self, batch, ready, stats):
        """Submits the writes of a batch of projected parameters: contiguous entries as one
        scatter per inference rank (one submission; each target counts one immediate, as a
        single write would), strided ones as paged writes. With several NICs every entry is
        its own write pinned to the schedule's NIC (a scatter picks NICs itself)."""
        singles = collections.defaultdict(list)  # inference rank -> ScatterTarget tuples
        holders = collections.defaultdict(list)  # inference rank -> transfer lists to extend
        for i, start, _, transfers in batch:
            for e in self._entries.get(i, []):
                stats["bytes"] += e[5] * e[6]
                if e[6] == 1 and self.num_nics == 1:
                    inference, src_offset, length, dst_offset = e[3], e[4], e[5], e[8]
                    dst, base = self._targets[inference][self._params[i][0]][ready[inference][1]]
                    singles[inference].append((dst, length, start + src_offset, base + dst_offset))
                    if not holders[inference] or holders[inference][-1] is not transfers:
                        holders[inference].append(transfers)
                else:
                    transfers.append(self._write(e, start, ready))
                    stats["writes"] += 1
        for inference, targets in singles.items():
            t = self.engine.scatter(self._ring.reg, self._peers, targets, imm=ready[inference][0])
            stats["writes"] += 1
            for transfers in holders[inference]:
                transfers.append(t)

    def _write(self, e, start, ready):
        _, nic, param, inference, src_offset, length, runs, src_stride, dst_offset, dst_stride = e
        imm, copy = ready[inference]
        dst, base = self._targets[inference][self._params[param][0]][copy]
        dst_offset += base
        routing = Routing.pinned(nic) if self.num_nics > 1 else None
        if runs == 1:
            return self.engine.write(self._ring.reg, dst, length, src_offset=start + src_offset,
                                     dst_offset=dst_offset, imm=imm, routing=routing)
        pages = list(range(runs))
        return self.engine.paged_write(self._ring.reg, dst, length, pages, pages,
                                       src_stride=src_stride, src_offset=start + src_offset,
                                       dst_stride=dst_stride, dst_offset=dst_offset, imm=imm)


def _align(n, to=256):
    """n rounded up to a multiple of `to`: every ring range starts aligned for any dtype."""
    return (n + to - 1) // to * to


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def _full_box(box, shape):
    return box if box else [(0, s) for s in shape]


def _box_numel(box, shape):
    return _numel([ln for _, ln in _full_box(box, shape)])
