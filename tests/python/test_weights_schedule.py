"""fabric_lib.weights: the schedule travels through the registry in chunks (a header member
naming their count, the bytes' length and sha256, then <group>.schedule.<i> members of at most
512 KiB of hex each). A 4000-parameter schedule (2.85 MB of hex, six chunks) round-trips
through a LocalRegistry, a FileRegistry and a real etcd (Debian's etcd-server, started here;
a visible skip without it), where one member holding it all is refused; a push whose schedule
is in several chunks lands bit-exact and closing rank 0 withdraws every chunk; an altered,
truncated, missing or foreign chunk, or a malformed header, gives the error naming it."""

import math
import shutil
import socket
import subprocess
import tempfile
import time
import uuid

import pytest
import torch

import fabric_lib
import fabric_lib.weights as fw
import weights_model as model
from conftest import TIMEOUT
from peer import make_config

ETCD_REQUEST_LIMIT = 1536 << 10  # etcd's default --max-request-bytes (1.5 MiB)
ETCD_BINARIES = ("/usr/bin/etcd", "/usr/local/bin/etcd")  # as tests/kv/etcd_server.h


def big_schedule(params=4000, ranks=4):
    """`params` parameters [2 * ranks, 8] held whole by one training rank, each cut in dim-0
    slices over `ranks` inference ranks: params * ranks entries (4000 x 4: 1.43 MB encoded)."""
    enc = fabric_lib._fabric_lib
    shape = [2 * ranks, 8]
    trainer = enc._weights_encode_trainer(
        0, 1, [(f"layers.{k}.w", "bf16", shape, [], 0) for k in range(params)])
    inference = [enc._weights_encode_inference(
        r, [(f"layers.{k}.w", "bf16", shape, 0, 2 * r, 2, "identity", [], 0, 128)
            for k in range(params)]) for r in range(ranks)]
    return fw.WeightSchedule.compute([trainer], inference)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def etcd():
    """A private etcd on 127.0.0.1 (free ports, a temporary data directory): its endpoint."""
    binary = next((b for b in ETCD_BINARIES if shutil.which(b)), None)
    if binary is None:
        pytest.skip("etcd-server is not installed (make deps): no etcd to test against")
    directory = tempfile.mkdtemp(prefix="fabric-weights-etcd-")
    client, peer = (f"http://127.0.0.1:{free_port()}" for _ in range(2))
    proc = subprocess.Popen(
        [binary, "--name=test", f"--data-dir={directory}/data", f"--listen-client-urls={client}",
         f"--advertise-client-urls={client}", f"--listen-peer-urls={peer}",
         f"--initial-advertise-peer-urls={peer}", f"--initial-cluster=test={peer}",
         f"--log-outputs={directory}/etcd.log", "--logger=zap"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                fabric_lib.EtcdRegistry(client, lease_ttl=1.0, request_timeout=0.5).close()
                break
            except fabric_lib.FabricError:
                assert proc.poll() is None, f"etcd exited ({proc.returncode}), see {directory}"
                assert time.monotonic() < deadline, "etcd did not answer within 10 s"
                time.sleep(0.05)
        yield client
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(params=["local", "file", "etcd"])
def registries(request, tmp_path):
    """A function making registries that see each other (one per rank), of each kind; closed
    at the end."""
    made = []
    if request.param == "local":
        state = fabric_lib.LocalRegistryState()

        def make():
            return fabric_lib.LocalRegistry(state)
    elif request.param == "file":
        def make():
            return fabric_lib.FileRegistry(str(tmp_path / "registry"), lease_ttl=3.0,
                                           poll_interval=0.1)
    else:
        endpoint, prefix = request.getfixturevalue("etcd"), f"/fabric-test/{uuid.uuid4()}/"

        def make():
            return fabric_lib.EtcdRegistry(endpoint, prefix=prefix, lease_ttl=3.0)

    def tracked():
        made.append(make())
        return made[-1]

    tracked.kind = request.param
    yield tracked
    for r in reversed(made):
        r.close()


def schedule_members(registry, group="weights"):
    return sorted(m.name for m in registry.members()
                  if m.instance == group and m.role.startswith("weights-schedule"))


def test_a_large_schedule_round_trips_in_chunks(registries):
    schedule = big_schedule()
    data = schedule.encode()
    assert 2 * len(data) > ETCD_REQUEST_LIMIT, "the schedule must be beyond etcd's limit"
    writer, reader = registries(), registries()
    if registries.kind == "etcd":  # the single member of old is refused: the limit is real
        with pytest.raises(fabric_lib.FabricError, match="too large|larger than max"):
            writer.join(fabric_lib.Member("whole", data=data.hex()))
    names = fw._publish_schedule(writer, "weights", schedule)
    chunks = math.ceil(2 * len(data) / fw._SCHEDULE_CHUNK_CHARS)
    assert chunks == 6 and names[0] == "weights.schedule"
    assert schedule_members(reader) == sorted(names) and len(names) == 1 + chunks
    for m in reader.members():
        assert len(m.encode()) < ETCD_REQUEST_LIMIT // 2, f"member {m.name} is too large"
    back = fw._read_schedule(reader, "weights", TIMEOUT)
    assert back.encode() == data
    assert back.entries() == schedule.entries()


def test_a_small_schedule_is_one_chunk():
    registry = fabric_lib.LocalRegistry(fabric_lib.LocalRegistryState())
    schedule = big_schedule(params=3)
    names = fw._publish_schedule(registry, "weights", schedule)
    assert names == ["weights.schedule", "weights.schedule.0"]
    header = next(m for m in registry.members() if m.name == "weights.schedule")
    assert header.data.split()[:2] == ["chunks=1", f"bytes={len(schedule.encode())}"]
    assert fw._read_schedule(registry, "weights", 1.0).encode() == schedule.encode()


def test_a_push_whose_schedule_is_in_chunks(registries, monkeypatch):
    """This process as the inference rank and the training rank (two tcp engines), the
    schedule in at least three chunks: bit-exact, and closing rank 0 withdraws every chunk."""
    monkeypatch.setattr(fw, "_SCHEDULE_CHUNK_CHARS", 1000)
    engines = [fabric_lib.TransferEngine(make_config("tcp")) for _ in range(2)]
    inf_registry, trainer_registry = registries(), registries()
    inf = fw.InferenceWeights(engines[0], 0, inf_registry, timeout=20.0)
    trainer = fw.TrainerWeights(engines[1], 0, 1, trainer_registry, max_temp_bytes=1 << 20,
                                chunk_bytes=256 << 10, timeout=20.0)
    try:
        for name, kwargs, shape, dtype in model.inference_layout():
            inf.add(name, torch.zeros(shape, dtype=dtype), **kwargs)
        inf.publish()
        for name in model.TRAINING:
            trainer.add(name, model.training_tensor(name, 1))
        trainer.publish()
        schedule = trainer.connect(1)
        chunks = math.ceil(2 * len(schedule.encode()) / 1000)
        assert chunks >= 3, "the schedule fits one chunk: the test proves nothing"
        assert len(schedule_members(inf_registry)) == 1 + chunks
        future = inf.prepare(1)
        trainer.push(1)
        assert future.result(TIMEOUT) == 1
        want = model.reference(1, fw.fp8_reference)
        for name, tensor in inf.tensors().items():
            assert torch.equal(tensor.view(torch.uint8),
                               want[name].contiguous().view(torch.uint8)), name
        trainer.close()
        assert schedule_members(inf_registry) == [], "a chunk outlived rank 0's close"
    finally:
        trainer.close()
        inf.close()
        for e in engines:
            e.close()


@pytest.fixture
def published(monkeypatch):
    """A 50-parameter schedule published in LocalRegistry chunks of 1000 characters: (registry,
    schedule, chunk count)."""
    monkeypatch.setattr(fw, "_SCHEDULE_CHUNK_CHARS", 1000)
    registry = fabric_lib.LocalRegistry(fabric_lib.LocalRegistryState())
    schedule = big_schedule(params=50)
    names = fw._publish_schedule(registry, "weights", schedule)
    assert len(names) > 4
    return registry, schedule, len(names) - 1


def rejoin_chunk(registry, index, change):
    m = next(m for m in registry.members() if m.name == f"weights.schedule.{index}")
    m.data = change(m.data)
    registry.join(m)


def test_an_altered_chunk_fails_the_checksum(published):
    registry, _, count = published
    flip = {"0": "1", "1": "0"}
    rejoin_chunk(registry, 2, lambda d: d[:-1] + flip.get(d[-1], "0"))
    with pytest.raises(fabric_lib.InvalidArgument,
                       match=rf"schedule's {count} chunks do not match its sha256"):
        fw._read_schedule(registry, "weights", 1.0)


def test_a_truncated_chunk_fails_the_length(published):
    registry, schedule, count = published
    rejoin_chunk(registry, 1, lambda d: d[:-2])
    with pytest.raises(fabric_lib.InvalidArgument, match=rf"{count} chunks hold "
                       rf"{len(schedule.encode()) - 1} bytes, its header says"):
        fw._read_schedule(registry, "weights", 1.0)
    rejoin_chunk(registry, 1, lambda d: d + "zz")
    with pytest.raises(fabric_lib.InvalidArgument, match=rf"chunk 1 of {count} is not hex"):
        fw._read_schedule(registry, "weights", 1.0)


def test_a_missing_chunk_times_out_naming_it(published):
    registry, _, count = published
    registry.leave("weights.schedule.3")
    started = time.monotonic()
    with pytest.raises(fabric_lib.Timeout, match=rf"chunks \[3\] of {count} of the schedule "
                       r"sha256 [0-9a-f]{16}\.\.\. not in the registry after 0.5 s"):
        fw._read_schedule(registry, "weights", 0.5)
    assert time.monotonic() - started >= 0.5, "gave up before the timeout"
    registry.leave("weights.schedule")
    with pytest.raises(fabric_lib.Timeout, match=r"the schedule header \(weights.schedule\)"):
        fw._read_schedule(registry, "weights", 0.1)


def test_chunks_of_two_schedules_are_not_mixed(published):
    """A chunk of another schedule (rank 0 publishing again while a reader looks) is not taken:
    the reader waits for the header's own chunk, then names both schedules."""
    registry, schedule, count = published
    other = big_schedule(params=20)  # fewer chunks: the last ones become stale
    digest = next(m for m in registry.members()
                  if m.name == "weights.schedule").data.split("sha256=")[1]
    writer = fabric_lib.LocalRegistry(fabric_lib.LocalRegistryState())
    fw._publish_schedule(writer, "weights", other)
    foreign = next(m for m in writer.members() if m.name == "weights.schedule.0")
    assert not foreign.data.startswith(digest)
    registry.join(foreign)
    with pytest.raises(fabric_lib.Timeout, match=rf"chunks \[0\] of {count} of the schedule "
                       rf"sha256 {digest[:16]}\.\.\. \(chunks \[0\] there are of another "
                       rf"schedule: sha256 {foreign.data[:16]}\.\.\.\)"):
        fw._read_schedule(registry, "weights", 0.3)
    # Publishing the second schedule in full replaces the header: the reader takes it whole.
    names = fw._publish_schedule(registry, "weights", other,
                                 previous=[f"weights.schedule.{i}" for i in range(count)])
    assert schedule_members(registry) == sorted(names), "stale chunks were not withdrawn"
    assert fw._read_schedule(registry, "weights", 1.0).encode() == other.encode()


def test_a_malformed_header_is_refused(published):
    registry, _, _ = published
    header = next(m for m in registry.members() if m.name == "weights.schedule")
    header.data = header.data.replace("bytes=", "length=")
    registry.join(header)
    with pytest.raises(fabric_lib.InvalidArgument, match=r"schedule header weights.schedule is "
                       r"malformed: 'chunks=\d+ length="):
        fw._read_schedule(registry, "weights", 1.0)
