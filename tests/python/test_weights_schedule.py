"""fabric_lib.weights: every rank computes the schedule from the members it reads and checks it
by digest against training rank 0's, which publishes only a header (the ranks' counts, the
chunk size, the schedule's length and sha256), never the schedule itself. A 4000-parameter
schedule (1.4 MB encoded, beyond etcd's request limit as one member) is agreed through a
LocalRegistry, a FileRegistry and a real etcd (Debian's etcd-server, started here; a visible
skip without it); a push over each registry lands bit-exact and closing rank 0 withdraws the
header; a rank that reads other descriptions, a missing header or rank, and a malformed header
give the error naming them."""

import hashlib
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
from fp8_reference import fp8_reference
from peer import make_config

ETCD_REQUEST_LIMIT = 1536 << 10  # etcd's default --max-request-bytes (1.5 MiB)
ETCD_BINARIES = ("/usr/bin/etcd", "/usr/local/bin/etcd")  # as tests/kv/etcd_server.h
ENC = fabric_lib._fabric_lib


def big_descriptions(params=4000, ranks=4, block=128):
    """`params` parameters [2 * ranks, 8] held whole by one training rank, each cut in dim-0
    slices over `ranks` inference ranks (params * ranks entries; 4000 x 4: 1.43 MB encoded):
    (trainer description, inference layouts)."""
    shape = [2 * ranks, 8]
    trainer = ENC._weights_encode_trainer(
        0, 1, [(f"layers.{k}.w", "bf16", shape, [], 0) for k in range(params)])
    inference = [ENC._weights_encode_inference(
        r, [(f"layers.{k}.w", "bf16", shape, 0, 2 * r, 2, "identity", [], 0, block)
            for k in range(params)]) for r in range(ranks)]
    return trainer, inference


class Members:
    """Publishes descriptions as the ranks' members (inference endpoints with the descriptor of
    a small registered buffer: nothing is pushed)."""

    def __init__(self, registry):
        self.registry = registry
        self.engine = fabric_lib.TransferEngine(make_config("tcp"))
        self.buffer = bytearray(64)
        self.reg = self.engine.register(self.buffer)

    def publish(self, trainer, inference):
        address = bytes(self.engine.address).hex()
        self.registry.join(fabric_lib.Member("weights.t0", role="weights-trainer",
                                             instance="weights", tp_size=1, tp_rank=0,
                                             address=address, data=trainer.hex()))
        for r, layout in enumerate(inference):
            params = len(ENC._weights_decode_inference(layout))
            endpoint = ENC._weights_encode_endpoint(layout, [self.reg.descriptor],
                                                    [[(0, 0), (0, 0)]] * params)
            self.registry.join(fabric_lib.Member(f"weights.i{r}", role="weights-inference",
                                                 instance="weights", tp_rank=r, address=address,
                                                 data=endpoint.hex()))

    def close(self):
        self.engine.close()


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
                  if m.instance == group and m.role == "weights-schedule")


def test_a_large_schedule_is_agreed_by_digest(registries):
    trainer, inference = big_descriptions()
    writer, reader = registries(), registries()
    members = Members(writer)
    try:
        members.publish(trainer, inference)
        schedule = ENC._weights_publish_schedule(writer, "weights", 1, 4, 64 << 20, TIMEOUT)
        data = schedule.encode()
        assert len(data) > ETCD_REQUEST_LIMIT // 2, "the schedule must be beyond etcd's limit"
        if registries.kind == "etcd":  # one member holding the schedule is refused there
            with pytest.raises(fabric_lib.FabricError, match="too large|larger than max"):
                writer.join(fabric_lib.Member("whole", data=data.hex()))
        assert schedule_members(reader) == ["weights.schedule"]
        header = next(m for m in reader.members() if m.name == "weights.schedule")
        assert len(header.encode()) < 1024, "the header carries more than the digest"
        for m in reader.members():
            assert len(m.encode()) < ETCD_REQUEST_LIMIT // 2, f"member {m.name} is too large"
        back = ENC._weights_agree_schedule(reader, "weights", TIMEOUT)
        assert back.encode() == data
        assert back.entries() == schedule.entries()
    finally:
        members.close()


def test_a_push_agreed_over_each_registry(registries):
    """This process as the inference rank and the training rank (two tcp engines), each with
    its own registry client: bit-exact, one schedule member (the header), which closing rank 0
    withdraws."""
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
        assert schedule_members(inf_registry) == ["weights.schedule"]
        future = inf.prepare(1)  # computes the schedule itself, checks the digest
        trainer.push(1)
        assert future.result(TIMEOUT) == 1
        assert inf.schedule.encode() == schedule.encode()
        want = model.reference(1, fp8_reference)
        for name, tensor in inf.tensors().items():
            assert torch.equal(tensor.view(torch.uint8),
                               want[name].contiguous().view(torch.uint8)), name
        trainer.close()
        assert schedule_members(inf_registry) == [], "the header outlived rank 0's close"
    finally:
        trainer.close()
        inf.close()
        for e in engines:
            e.close()


@pytest.fixture
def published():
    """A 50-parameter schedule's descriptions and header in a LocalRegistry: (registry,
    members, schedule)."""
    registry = fabric_lib.LocalRegistry(fabric_lib.LocalRegistryState())
    members = Members(registry)
    members.publish(*big_descriptions(params=50))
    schedule = ENC._weights_publish_schedule(registry, "weights", 1, 4, 64 << 20, 1.0)
    yield registry, members, schedule
    members.close()


def test_a_rank_reading_other_descriptions_names_both_digests(published):
    registry, members, schedule = published
    assert ENC._weights_agree_schedule(registry, "weights", 1.0).encode() == schedule.encode()
    # The inference ranks published again with another FP8 block (nothing to do with these
    # BF16 copies, but part of the schedule): a rank computing now disagrees with rank 0.
    members.publish(*big_descriptions(params=50, block=64))
    length, digest = len(schedule.encode()), hashlib.sha256(schedule.encode()).hexdigest()
    with pytest.raises(fabric_lib.InvalidArgument,
                       match=rf"differs from training rank 0's \({length} bytes, sha256 "
                             rf"{digest[:16]}\.\.\.\): the ranks read different descriptions"):
        ENC._weights_agree_schedule(registry, "weights", 1.0)


def test_a_missing_header_or_rank_times_out_naming_it(published):
    registry, _, _ = published
    registry.leave("weights.i2")
    started = time.monotonic()
    with pytest.raises(fabric_lib.Timeout, match=r"1 training and 4 inference ranks \(found 1 "
                       r"and 3\) not in the registry after 0.5 s"):
        ENC._weights_agree_schedule(registry, "weights", 0.5)
    assert time.monotonic() - started >= 0.5, "gave up before the timeout"
    registry.leave("weights.schedule")
    with pytest.raises(fabric_lib.Timeout, match=r"the schedule header \(weights.schedule\)"):
        ENC._weights_agree_schedule(registry, "weights", 0.1)


def test_a_malformed_header_is_refused(published):
    registry, _, _ = published
    header = next(m for m in registry.members() if m.name == "weights.schedule")
    header.data = header.data.replace(" bytes=", " length=")
    registry.join(header)
    with pytest.raises(fabric_lib.InvalidArgument, match=r"schedule header weights.schedule is "
                       r"malformed: 'trainers=1 inference=4 chunk_bytes=\d+ length="):
        ENC._weights_agree_schedule(registry, "weights", 1.0)
