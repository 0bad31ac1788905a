"""fabric_lib.weights: a training process pushes versions of a small model into this process's
inference tensors over tcp and shm, through a FileRegistry; checked bit for bit against plain
PyTorch (copies, a fused QKV, a strided row slice, FP8 with block scales); bad layouts give
the named error; a trainer SIGKILLed mid-push fails that version within a bound while the last
complete version stays intact."""

import asyncio
import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import fabric_lib
import fabric_lib.weights as fw
from conftest import TIMEOUT
from fp8_reference import fp8_reference
from peer import make_config

sys.path.insert(0, str(Path(__file__).parent))
import weights_model as model  # noqa: E402

KILL_BOUND = 2.0  # seconds from SIGKILL to the version's error: FileRegistry polls every 0.1 s


class Trainer:
    """The training process (weights_model.serve_trainer), driven over a pipe."""

    def __init__(self, provider, directory, max_temp_bytes=1 << 20, rank=0, world=1, init=None,
                 device="cpu", num_nics=1, stages=1, replicas=1):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=model.serve_trainer,
            args=(child, provider, directory, max_temp_bytes, rank, world, init, device,
                  num_nics, stages, replicas),
            daemon=True)
        self.process.start()
        child.close()
        self.started = False

    def wait_started(self):
        if not self.started:
            self.reply(TIMEOUT)
            self.started = True

    def reply(self, timeout=TIMEOUT):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"the trainer did not answer within {timeout} s")
        r = self.conn.recv()
        if r[0] == "error":
            raise getattr(fabric_lib, r[1], RuntimeError)(f"in the trainer: {r[2]}")
        return r[1]

    def call(self, method, *args):
        self.wait_started()
        self.conn.send((method, args))
        return self.reply()

    def close(self):
        if self.process.is_alive():
            try:
                self.call("exit")
            except (OSError, EOFError, TimeoutError):
                pass
        self.process.kill()
        self.process.join(10)


def inference_side(provider, directory, mode, device="cpu", host_mirror=True):
    engine = fabric_lib.TransferEngine(make_config(provider))
    registry = fabric_lib.FileRegistry(directory, lease_ttl=3.0, poll_interval=0.1)
    inf = fw.InferenceWeights(engine, 0, registry, mode=mode, timeout=20.0,
                              host_mirror=host_mirror)
    # "big" and its spare live in one registered arena (at offsets), the others alone.
    arena = torch.zeros(2 * 512 * 1024 * 2 + 64, dtype=torch.uint8, device=device)
    inf.add_arena(arena)
    for name, kwargs, shape, dtype in model.inference_layout():
        if name == "big":
            at = 64
            kwargs = dict(kwargs, spare=arena[at + 512 * 1024 * 2 :].view(dtype).view(shape))
            inf.add(name, arena[at : at + 512 * 1024 * 2].view(dtype).view(shape), **kwargs)
        else:
            inf.add(name, torch.zeros(shape, dtype=dtype, device=device), **kwargs)
    inf.publish()
    return engine, registry, inf


def expect_version(inf, version):
    want = model.reference(version, fp8_reference)
    got = inf.tensors()
    for name, tensor in want.items():
        have = got[name].cpu().view(torch.uint8)
        assert torch.equal(have, tensor.contiguous().view(torch.uint8)), (
            f"{name} differs from the reference after version {version}")


@pytest.fixture(scope="module", params=["tcp", "shm"])
def provider(request):
    try:
        fabric_lib.TransferEngine(make_config(request.param)).close()
    except fabric_lib.Unsupported as e:
        pytest.skip(f"provider {request.param} not available here: {e}")
    return request.param


@contextlib.contextmanager
def pushing(provider, tmp_path, mode, world=1, device="cpu", num_nics=1, host_mirror=True,
            stages=1, replicas=1):
    """This process as the inference rank and `world` training processes (FSDP over gloo when
    world > 1, in `stages` pipeline stages or `replicas` HSDP replicas), connected through a FileRegistry in tmp_path;
    tensors on `device` ("cuda": the trainer on GPU 0, the inference tensors on the last
    GPU)."""
    directory = str(tmp_path / "registry")
    last = f"cuda:{torch.cuda.device_count() - 1}" if device == "cuda" else "cpu"
    engine, registry, inf = inference_side(provider, directory, mode, last, host_mirror)
    init = f"file://{tmp_path / 'dist-init'}"
    trainers = [Trainer(provider, directory, rank=r, world=world, init=init,
                        device="cuda:0" if device == "cuda" else "cpu", num_nics=num_nics,
                        stages=stages, replicas=replicas)
                for r in range(world)]
    try:
        for t in trainers:
            t.wait_started()
        for t in trainers:
            t.conn.send(("connect", (1,)))
        for t in trainers:
            t.entries = t.reply()
            assert t.entries > 0, "a training rank was scheduled nothing"
        yield inf, trainers
    finally:
        for t in trainers:
            t.close()
        inf.close()
        registry.close()
        engine.close()


NO_CUDA = "no CUDA device in this torch build (Debian's torch has no CUDA)"


@pytest.mark.parametrize("mode,device", [
    ("flip", "cpu"), ("in_place", "cpu"),
    pytest.param("flip", "cuda", marks=pytest.mark.skipif(
        not torch.cuda.is_available() or not fabric_lib.HAS_CUDA, reason=NO_CUDA +
        " or fabric_lib was built without CUDA: GPU tensors on both sides"))])
def test_push_versions_bit_exact(provider, mode, device, tmp_path):
    with pushing(provider, tmp_path, mode, device=device) as (inf, [trainer]):
        seen = []
        inf.on_version(seen.append)
        for version in (1, 2):
            before = {n: t.clone() for n, t in inf.tensors().items()} if version > 1 else None
            future = inf.prepare(version)
            assert isinstance(future, fw.Version)
            if mode == "flip" and before is not None:  # the served copy is not the one written
                assert all(torch.equal(before[n], t) for n, t in inf.tensors().items())
            stats = trainer.call("push", version, 0)
            if version == 1:
                assert future.result(TIMEOUT) == version
            else:  # awaitable too
                assert asyncio.run(asyncio.wait_for(future, TIMEOUT)) == version
            assert inf.version == version
            expect_version(inf, version)
            assert stats["bytes"] == sum(t.numel() * t.element_size()
                                         for t in inf.tensors().values())
            assert stats["temp_high_water"] <= 1 << 20, "staging beyond max_temp_bytes"
            # Contiguous entries go out as one scatter per batch: fewer submissions.
            assert 0 < stats["writes"] < trainer.entries
        assert seen == [1, 2] and inf.progress is None
        assert inf.copies == (2 if mode == "flip" else 1)
        pending = inf.prepare(3)  # never pushed: closing fails it
        inf.close()
        with pytest.raises(fabric_lib.Closed, match="version 3"):
            pending.result(TIMEOUT)
        assert inf.version == 2


@pytest.mark.skipif(not torch.cuda.is_available() or not fabric_lib.HAS_CUDA,
                    reason=NO_CUDA + " or fabric_lib was built without CUDA")
def test_push_into_gpu_tensors_without_a_host_mirror(provider, tmp_path):
    """host_mirror=False on the inference side: its CUDA tensors cost no pinned host memory,
    and the trainer on this host pushes into them over CUDA IPC, bit-exact."""
    with pushing(provider, tmp_path, "flip", device="cuda", host_mirror=False) as (inf, [trainer]):
        assert inf.engine.stats().groups[0].host_mirror_bytes == 0
        future = inf.prepare(1)
        trainer.call("push", 1, 0)
        assert future.result(TIMEOUT) == 1
        expect_version(inf, 1)


@pytest.mark.parametrize("mode", ["flip", "in_place"])
def test_trainer_killed_mid_push(provider, mode, tmp_path):
    with pushing(provider, tmp_path, mode) as (inf, [trainer]):
        inf.prepare(1)
        trainer.call("push", 1, 0)
        expect_version(inf, 1)
        future = inf.prepare(2)
        trainer.conn.send(("push", (2, 5.0)))  # stalls 5 s after each batch of writes
        deadline = time.monotonic() + TIMEOUT
        while inf.progress[1] == 0:  # wait until some of version 2 has landed
            assert time.monotonic() < deadline
            time.sleep(0.01)
        version, landed, expected = inf.progress
        assert version == 2 and 0 < landed < expected, "the push was not cut in the middle"
        os.kill(trainer.process.pid, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(fabric_lib.PeerUnreachable, match="version 2"):
            future.result(TIMEOUT)
        assert time.monotonic() - killed < KILL_BOUND
        assert inf.version == 1 and inf.progress is None
        if mode == "flip":
            expect_version(inf, 1)  # still serving the last complete version
        else:
            with pytest.raises(fabric_lib.InvalidArgument, match="half-written"):
                inf.tensors()


def test_inference_killed_mid_push_fails_the_push(provider, tmp_path):
    """The other way round: this process trains, the inference process is SIGKILLed after the
    first batch of version 2 was posted; push raises the engine's error within a bound."""
    directory = str(tmp_path / "registry")
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=model.serve_inference, args=(child, provider, directory),
                       daemon=True)
    proc.start()
    child.close()
    engine = fabric_lib.TransferEngine(make_config(provider))
    registry = fabric_lib.FileRegistry(directory, lease_ttl=3.0, poll_interval=0.1)
    trainer = fw.TrainerWeights(engine, 0, 1, registry, max_temp_bytes=1 << 20,
                                chunk_bytes=256 << 10, timeout=20.0)
    try:
        assert conn.poll(TIMEOUT) and conn.recv()[0] == "ok"
        for name in model.TRAINING:
            trainer.add(name, model.training_tensor(name, 1))
        trainer.publish()
        trainer.connect(1)
        conn.send(("prepare", (1,)))
        assert conn.poll(TIMEOUT) and conn.recv()[0] == "ok"
        assert trainer.push(1)["bytes"] > 0
        conn.send(("wait", ()))
        assert conn.poll(TIMEOUT) and conn.recv() == ("ok", 1)
        conn.send(("prepare", (2,)))
        assert conn.poll(TIMEOUT) and conn.recv()[0] == "ok"
        killed = []

        def kill_once(name):
            if not killed:
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(10)
                killed.append(time.monotonic())

        with pytest.raises(fabric_lib.PeerUnreachable):  # tcp: after peer_timeout; shm: at once
            trainer.push(2, on_param=kill_once)
        # tcp: peer_timeout (3 s) and its check; shm: at once. Generous for a loaded CI machine.
        assert killed and time.monotonic() - killed[0] < 3.0 + 5.0
    finally:
        proc.kill()
        proc.join(10)
        trainer.close()
        registry.close()
        engine.close()


def test_two_nics_get_pinned_writes(provider, tmp_path):
    """A trainer with two NICs: the schedule spreads its entries over both (checked in the
    trainer), each posted as its own write pinned to its NIC; bit-exact."""
    with pushing(provider, tmp_path, "flip", num_nics=2) as (inf, [trainer]):
        future = inf.prepare(1)
        stats = trainer.call("push", 1, 0)
        assert future.result(TIMEOUT) == 1
        expect_version(inf, 1)
        assert stats["writes"] == trainer.entries, "an entry was not its own pinned write"


def push_all(inf, trainers, version=1):
    """Every training rank pushes `version`; checks the result; returns their stats."""
    future = inf.prepare(version)
    for t in trainers:
        t.conn.send(("push", (version, 0)))
    stats = [t.reply() for t in trainers]
    assert future.result(TIMEOUT) == version
    expect_version(inf, version)
    return stats


def test_fsdp_trainers_gather_over_torch_distributed(tmp_path):
    """Two FSDP training processes (dim-0 shards of every parameter, gloo): each gathers with
    torch.distributed and sends its part of the schedule; the result is bit-exact."""
    with pushing("tcp", tmp_path, "flip", world=2) as (inf, trainers):
        stats = push_all(inf, trainers)
        total = sum(t.numel() * t.element_size() for t in inf.tensors().values())
        assert sum(s["bytes"] for s in stats) == total
        assert max(s["bytes"] for s in stats) <= total / 2 + (256 << 10), "unbalanced"


@pytest.mark.parametrize("stages,replicas", [(2, 1), (1, 2)], ids=["pp2xfsdp2", "hsdp2xfsdp2"])
def test_sharded_trainers_gather_only_what_their_writers_need(tmp_path, stages, replicas):
    """Four training processes as two pipeline stages of two FSDP ranks (each stage holds its
    own parameters), or as two HSDP replicas of two FSDP ranks: a rank receives, point to
    point, only the other shard of its own replica of the sources of the parameters it writes,
    never another stage's or replica's bytes (an all-gather over the four would bring it every
    shard of every parameter); the result is bit-exact."""
    with pushing("tcp", tmp_path, "flip", world=4, stages=stages, replicas=replicas) as (
            inf, trainers):
        stats = push_all(inf, trainers)
        sources = {name: kw.get("sources") or [name]
                   for name, kw, _, _ in model.inference_layout()}
        for rank, (t, st) in enumerate(zip(trainers, stats)):
            def missing(source):  # bytes of `source` outside this rank's shard
                shape, dtype = model.TRAINING[source]
                full = torch.empty(shape, dtype=dtype)
                shard, _ = model.shard_of(source, full, rank % 2, 2)
                return (full.numel() - shard.numel()) * full.element_size()
            writes = t.call("sends")
            assert writes, f"training rank {rank} writes nothing"
            assert all(model.stage_of(s, stages) == rank // 2 % stages
                       for w in writes for s in sources[w])
            need = [sum(missing(s) for s in sources[w]) for w in writes]
            assert max(need) <= st["gather_bytes"] <= sum(need), (rank, writes, st)


def test_the_example_serves_each_new_version():
    example = Path(__file__).parents[2] / "examples" / "weight_push.py"
    run = subprocess.run([sys.executable, str(example), "shm"], capture_output=True, text=True,
                         timeout=TIMEOUT)
    assert run.returncode == 0, run.stderr[-2000:]
    for version in (1, 2, 3):
        assert f"inference: serving version {version}:" in run.stdout, run.stdout


def describe(trainers, inference):
    t = [fabric_lib._fabric_lib._weights_encode_trainer(r, 1, shards)
         for r, shards in enumerate(trainers)]
    i = [fabric_lib._fabric_lib._weights_encode_inference(r, params)
         for r, params in enumerate(inference)]
    return fw.WeightSchedule.compute(t, i)


def p(name, shape, dtype="bf16", dim=-1, start=0, length=0, kind="identity", sources=()):
    return (name, dtype, list(shape), dim, start, length, kind, list(sources), 0, 128)


def test_bad_layouts_name_the_parameter():
    whole = [("w", "bf16", [8, 8], [], 0)]
    with pytest.raises(fabric_lib.NotFound, match="'missing'"):
        describe([whole], [[p("missing", (8, 8))]])
    with pytest.raises(fabric_lib.InvalidArgument, match="'w': shape mismatch"):
        describe([whole], [[p("w", (8, 4))]])
    with pytest.raises(fabric_lib.InvalidArgument, match="'w': dtype bf16 -> f32 has no"):
        describe([whole], [[p("w", (8, 8), dtype="f32")]])
    halves = [[("w", "bf16", [8, 8], [(0, 5), (0, 8)], 0)],
              [("w", "bf16", [8, 8], [(4, 4), (0, 8)], 0)]]
    with pytest.raises(fabric_lib.InvalidArgument, match="'w': the shards of ranks 0 and 1"):
        describe(halves, [[p("w", (8, 8))]])
    gap = [[("w", "bf16", [8, 8], [(0, 4), (0, 8)], 0)]]
    with pytest.raises(fabric_lib.InvalidArgument, match="'w': incomplete shards"):
        describe(gap, [[p("w", (8, 8))]])
    with pytest.raises(fabric_lib.InvalidArgument, match="unknown projection 'fuse'"):
        describe([whole], [[p("w", (8, 8), kind="fuse")]])
    # The Python side's own checks name the parameter too.
    engine = fabric_lib.TransferEngine(make_config("tcp"))
    try:
        registry = fabric_lib.LocalRegistry(fabric_lib.LocalRegistryState())
        inf = fw.InferenceWeights(engine, 0, registry)
        with pytest.raises(fabric_lib.InvalidArgument, match="'t': the tensor must be contiguous"):
            inf.add("t", torch.zeros(4, 4).t())
        with pytest.raises(fabric_lib.InvalidArgument, match="'t': a torch.float32 tensor cannot "
                           "hold bf16"):
            inf.add("t", torch.zeros(4, 4), dtype="bf16")
        with pytest.raises(fabric_lib.InvalidArgument, match="'t': the tensor has 16 elements"):
            inf.add("t", torch.zeros(4, 4), shape=(8, 8), dim=1)
    finally:
        engine.close()


def test_schedule_through_the_bindings_round_trips():
    s = describe([[("w", "bf16", [64, 32], [], 0)]],
                 [[p("w", (64, 32), dim=1, start=0, length=16)],
                  [p("w", (64, 32), dim=1, start=16, length=16)]])
    assert s.num_trainers == 1 and s.num_inference == 2
    assert s.writes_into(0) == 64 and s.writes_into(1) == 64  # one per row of a column slice
    assert s.bytes_from(0) == 64 * 32 * 2
    back = fw.WeightSchedule.decode(s.encode())
    assert back.entries() == s.entries() and back.params == s.params
    with pytest.raises(fabric_lib.InvalidArgument, match="schedule"):
        fw.WeightSchedule.decode(s.encode()[:-3])


# The staging ring's bookkeeping and its batching are the sender's, in C++:
# WeightsRing.OverlapCheckAgreesWithAScanOfEveryLiveRange and
# WeightsFlow.AFullRingPostsEarlyOnlyWhenItsOldestRangeIsNotPosted (tests/weights/flow_test.cc).


def test_a_schedule_read_back_is_held_against_the_inference_layouts():
    """check_destinations: the schedule fits the layouts it was computed from; against a layout
    whose tensor is smaller (a damaged schedule, or one for another layout) it raises
    InvalidArgument naming the parameter and the rank."""
    enc = fabric_lib._fabric_lib._weights_encode_inference
    s = describe([[("w", "bf16", [64, 32], [], 0)]],
                 [[p("w", (64, 32), dim=1, start=0, length=16)],
                  [p("w", (64, 32), dim=1, start=16, length=16)]])
    fits = [enc(0, [p("w", (64, 32), dim=1, start=0, length=16)]),
            enc(1, [p("w", (64, 32), dim=1, start=16, length=16)])]
    fw.WeightSchedule.decode(s.encode()).check_destinations(fits)
    narrower = [fits[0], enc(1, [p("w", (64, 32), dim=1, start=16, length=8)])]
    with pytest.raises(fabric_lib.InvalidArgument, match="'w' writes past the end of inference "
                       "rank 1"):
        s.check_destinations(narrower)
    with pytest.raises(fabric_lib.InvalidArgument, match="does not hold it"):
        s.check_destinations([fits[0], enc(1, [p("v", (64, 32), dim=1, start=16, length=16)])])


def test_fp8_cpu_quantiser_matches_the_pytorch_reference():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(333, 270, generator=g)
    x[::13, ::7] *= 1e3
    x[7] *= 1e-6  # subnormal e4m3 after scaling
    x[0, :5] = torch.tensor([0.0, -0.0, 1.0, -1.0, 0.5])
    x[256:, 256:] = 0.0  # an all-zero tile
    x = x.to(torch.bfloat16)
    q, s = fw.quantize_fp8(x)
    rq, rs = fp8_reference(x)
    assert torch.equal(s, rs), "scales differ"
    assert torch.equal(q, rq), f"{int((q != rq).sum())} of {q.numel()} e4m3 bytes differ"
    assert s.shape == (3, 3) and int(q[0, 1]) == 0x80  # -0 keeps its sign


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA + ": the kernel's own test "
                    "is tests/gpu")
def test_fp8_cuda_kernel_matches_the_pytorch_reference():
    if not fabric_lib._fabric_lib._WEIGHTS_HAS_CUDA:
        pytest.skip("this build of fabric_lib has no CUDA projections")
    x = (torch.randn(1000, 700) * 3).to(torch.bfloat16)
    q, s = fw.quantize_fp8(x.cuda())
    rq, rs = fp8_reference(x)
    assert torch.equal(s.cpu(), rs) and torch.equal(q.cpu(), rq)


def test_fp8_many_gives_each_tensor_its_own_quantisation():
    """quantize_fp8_many over tensors of mixed shapes equals quantize_fp8 of each (on the CPU
    here, one by one; grouped kernel launches with CUDA tensors: the test below)."""
    g = torch.Generator().manual_seed(3)
    xs = [(torch.randn(r, c, generator=g) * 5).to(torch.bfloat16)
          for r, c in [(128, 128), (300, 517), (1, 7), (129, 8)] * 3]
    for x, (q, s) in zip(xs, fw.quantize_fp8_many(xs)):
        rq, rs = fw.quantize_fp8(x)
        assert torch.equal(q, rq) and torch.equal(s, rs)
    assert fw.quantize_fp8_many([]) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA + ": the kernel's own test "
                    "is tests/gpu")
def test_fp8_cuda_grouped_kernel_matches_the_pytorch_reference():
    """150 CUDA tensors in grouped launches (64 a launch): each equals the reference; a source
    that is not bf16 is refused, naming what is wrong."""
    if not fabric_lib._fabric_lib._WEIGHTS_HAS_CUDA:
        pytest.skip("this build of fabric_lib has no CUDA projections")
    g = torch.Generator().manual_seed(4)
    xs = [(torch.randn(r, c, generator=g) * 3).to(torch.bfloat16)
          for r, c in [(256, 384), (300, 517), (1, 7), (129, 8), (512, 128)] * 30]
    outs = fw.quantize_fp8_many([x.cuda() for x in xs])
    for i, (x, (q, s)) in enumerate(zip(xs, outs)):
        rq, rs = fp8_reference(x)
        assert torch.equal(s.cpu(), rs), f"tensor {i}: scales differ"
        assert torch.equal(q.cpu(), rq), f"tensor {i}: bytes differ"
    with pytest.raises(fabric_lib.InvalidArgument, match="bf16 source"):
        fw.quantize_fp8_many([torch.zeros(128, 128, device="cuda")])
