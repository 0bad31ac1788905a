"""Arguments as the module reads them: integers out of range (negative lengths, offsets,
counts, indices) raise InvalidArgument (a FabricError and a ValueError) naming the argument,
not pybind11's TypeError; and Config binds every field of the C++ fabric::Config."""

import re
from pathlib import Path

import numpy as np
import pytest

import fabric_lib
from conftest import open_engine_or_skip

HEADER = Path(__file__).resolve().parents[2] / "include" / "fabric" / "config.h"


@pytest.fixture(scope="module")
def tcp_pair():
    with open_engine_or_skip("tcp") as a, open_engine_or_skip("tcp") as b:
        src = a.register(np.ones(4096, np.uint8))
        dst = b.register(np.zeros(4096, np.uint8))
        yield a, b, src, dst


def refused(call, name):
    """call() raises InvalidArgument naming `name` (also a ValueError)."""
    with pytest.raises(fabric_lib.InvalidArgument, match=re.escape(name)) as info:
        call()
    assert isinstance(info.value, ValueError) and isinstance(info.value, fabric_lib.FabricError)
    return info.value


def test_negative_integers_to_submissions_are_invalid_arguments(tcp_pair):
    a, b, src, dst = tcp_pair
    d = dst.descriptor
    refused(lambda: a.write(src, d, -1), "length")
    refused(lambda: a.write(src, d, 16, src_offset=-1), "src_offset")
    refused(lambda: a.write(src, d, 16, dst_offset=-8), "dst_offset")
    refused(lambda: a.write(src, d, 2**64), "length")
    refused(lambda: a.write(src.handle, d, -1), "length")
    refused(lambda: a.paged_write(src, d, -1, [0], [0]), "page_bytes")
    refused(lambda: a.paged_write(src, d, 64, [0], [0], src_stride=-1), "src_stride")
    refused(lambda: a.paged_write(src, d, 64, [0], [0], src_offset=-1), "src_offset")
    refused(lambda: a.paged_write(src, d, 64, [0], [0], dst_stride=-1), "dst_stride")
    refused(lambda: a.paged_write(src, d, 64, [0], [0], dst_offset=-1), "dst_offset")
    refused(lambda: a.paged_write(src, d, 64, [0], [0], imm=-1), "imm")
    group = a.add_peer_group([b.address])
    refused(lambda: a.scatter(src, group, [(d, -1)]), "length")
    refused(lambda: a.scatter(src, group, [(d, 16, -1)]), "src_offset")
    refused(lambda: a.scatter(src, group, [(d, 16, 0, -1)]), "dst_offset")
    refused(lambda: fabric_lib.ScatterTarget(d, -1), "length")
    refused(lambda: fabric_lib.ScatterTarget(d, 16, dst_offset=-1), "dst_offset")
    target = fabric_lib.ScatterTarget(d, 16)
    refused(lambda: setattr(target, "length", -1), "length")
    refused(lambda: a.barrier(group, -1), "imm")
    refused(lambda: a.barrier(group, 1, nic=-1), "nic")
    refused(lambda: a.imm_write(b.address, -1), "imm")
    refused(lambda: a.imm_write(b.address, 1, local_group=-1), "local_group")
    refused(lambda: a.send(b.address, b"x", group=-1), "group")
    a.remove_peer_group(group)


def test_negative_integers_to_receiving_and_registering_are_invalid_arguments(tcp_pair):
    a, _, _, _ = tcp_pair
    refused(lambda: a.recv(0.01, group=-1), "group")
    refused(lambda: a.set_receive_handler(None, buffer_bytes=-1), "buffer_bytes")
    refused(lambda: a.set_receive_handler(None, count=-1), "count")
    refused(lambda: a.expect_imm(7, -1), "count")
    refused(lambda: a.expect_imm(-7, 1), "imm")
    refused(lambda: a.wait_imm(7, -1, timeout=0), "total")
    refused(lambda: a.imm_count(-1), "imm")
    refused(lambda: a.reset_imm(-1), "imm")
    refused(lambda: a.cancel_expect_imm(-1), "imm")
    refused(lambda: a.register(np.zeros(64, np.uint8), group=-1), "group")
    refused(lambda: a.register_ptr(0, -1), "length")
    refused(lambda: a.register_ptr(-4096, 64), "ptr")
    refused(lambda: a.group_info(-1), "group")
    refused(lambda: a.nics_up(-1), "group")
    refused(lambda: a.progress(-1), "group")
    refused(lambda: fabric_lib.Routing.pinned(-1), "nic")
    refused(lambda: fabric_lib.Routing.sharded(-1), "shards")
    refused(lambda: fabric_lib.MemoryHandle(-1), "id")
    refused(lambda: fabric_lib.CompletionCounter().wait(-1, timeout=0), "n")


def test_negative_config_fields_are_invalid_arguments():
    refused(lambda: fabric_lib.Config(shard_min_bytes=-1), "shard_min_bytes")
    c = fabric_lib.Config()
    for name in ("cq_batch", "post_budget", "max_message_bytes", "send_buffers",
                 "submission_ring", "max_wr_bytes", "cuda_ipc_streams", "shm_copy_threads"):
        refused(lambda: setattr(c, name, -1), name)
    refused(lambda: setattr(c.faults, "max_hold_polls", -1), "max_hold_polls")
    refused(lambda: setattr(c.verbs, "signal_every", -1), "signal_every")


def test_integers_of_numpy_and_bools_still_work(tcp_pair):
    a, b, src, dst = tcp_pair
    t = a.write(src, dst.descriptor, np.uint64(64), src_offset=np.int32(0), dst_offset=np.int64(64))
    t.result(timeout=30)
    with pytest.raises(TypeError):
        a.write(src, dst.descriptor, 1.5)
    with pytest.raises(TypeError):
        a.write(src, dst.descriptor, "64")


# --- Config against include/fabric/config.h --------------------------------------------------


def header_fields(text, struct):
    """The data members of `struct` in the header: declarations at the struct's own brace
    level that are not functions, static members, types or friends."""
    text = re.sub(r"//[^\n]*", "", text)
    start = re.search(r"\bstruct\s+" + struct + r"\s*\{", text)
    assert start, f"struct {struct} not found"
    statements, statement, depth, i = [], "", 1, start.end()
    while depth > 0:
        ch = text[i]
        i += 1
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if depth == 0:
            break
        if depth == 1 and ch == ";":
            statements.append(statement)
            statement = ""
            continue
        statement += ch
        if depth == 1 and ch == "}" and "(" in plain(statement):
            statements.append(statement)  # a member function's body ends it
            statement = ""
    names = []
    for s in statements:
        s = plain(s).split("=")[0].strip()
        if not s or re.match(r"^(static|enum|friend|using|template|public|private)\b", s):
            continue
        if "(" in s:  # a member function
            continue
        names.append(re.findall(r"\w+", s)[-1])
    return names


def plain(statement):
    """A declaration without its template arguments (which may hold parentheses) and brace
    initialisers or bodies, on one line."""
    s = " ".join(statement.split())
    while re.search(r"<[^<>]*>", s):
        s = re.sub(r"<[^<>]*>", "", s)
    while re.search(r"\{[^{}]*\}", s):
        s = re.sub(r"\{[^{}]*\}", "", s)
    return s


def bound_fields(cls):
    return {name for name, value in vars(cls).items() if isinstance(value, property)}


@pytest.mark.skipif(not HEADER.exists(), reason=f"{HEADER} not here (an installed package)")
@pytest.mark.parametrize("struct", ["Config", "GroupConfig", "FaultConfig", "VerbsConfig"])
def test_config_binds_every_field_of_the_header(struct):
    fields = header_fields(HEADER.read_text(), struct)
    assert len(fields) >= 3, fields
    cls = getattr(fabric_lib, struct)
    assert set(fields) == bound_fields(cls), (
        f"{struct}: missing in Python {sorted(set(fields) - bound_fields(cls))}, "
        f"not in the header {sorted(bound_fields(cls) - set(fields))}")


def test_the_header_parser_sees_what_it_should():
    """The checker itself: a field added to a struct of a header is found, functions and
    constants are not."""
    text = """struct Config {
      // a comment; with a semicolon
      std::string provider = "auto";
      std::function<bool(uint64_t sequence)> hook;
      static constexpr int kX = 1;
      enum class Mode : uint8_t { kA, kB };
      Mode mode = Mode::kA;
      std::chrono::milliseconds timeout{30000};
      struct Inner { int not_mine; } inner;
      Status apply_env_overrides();
      static constexpr std::chrono::microseconds auto_spin(size_t cpus) {
        return cpus >= 8 ? kAutoSpin : std::chrono::microseconds(0);
      }
      bool added = false;
    };"""
    assert header_fields(text, "Config") == ["provider", "hook", "mode", "timeout", "inner",
                                             "added"]


def test_new_config_fields_reach_the_engine():
    import datetime

    c = fabric_lib.Config(provider="tcp", nics=["lo"], reliable_imm=True, nic_timeout=0.5,
                          nic_probe_interval=0.1, cuda_ipc_streams=2)
    assert c.reliable_imm is True
    assert c.nic_timeout == datetime.timedelta(milliseconds=500)
    assert c.nic_probe_interval == datetime.timedelta(milliseconds=100)
    assert c.cuda_ipc_streams == 2
    assert c.verbs.gid_index == fabric_lib.VerbsConfig.GID_AUTO
    c.verbs.gid_index = 3
    c.verbs.connect_retry = 0.2
    assert c.verbs.gid_index == 3
    assert c.verbs.connect_retry == datetime.timedelta(milliseconds=200)
    c.verbs = fabric_lib.VerbsConfig(thread_domain=False, signal_every=1)
    assert not c.verbs.thread_domain and c.verbs.signal_every == 1
    assert c.faults.receive_length_delta is None
    with fabric_lib.TransferEngine(c) as e:
        assert e.group_info().provider.startswith("tcp")


def test_unregister_of_something_else_is_a_type_error(tcp_pair):
    a, _, _, _ = tcp_pair
    with pytest.raises(TypeError, match="Registration or a MemoryHandle"):
        a.unregister(42)


def test_receive_length_delta_runs_on_each_received_message():
    """FaultConfig.receive_length_delta reaches the fault domain: it is called for the
    receive completions, and 0 leaves the message as it was sent."""
    calls = []

    def delta(sequence):
        calls.append(sequence)
        return 0

    def config():
        c = fabric_lib.Config(provider="tcp", nics=["lo"], cpu=fabric_lib.GroupConfig.CPU_NONE)
        c.faults.enabled = True
        c.faults.receive_length_delta = delta
        return c

    assert config().faults.receive_length_delta is delta
    with fabric_lib.TransferEngine(config()) as a, fabric_lib.TransferEngine(config()) as b:
        b.set_receive_handler(None)
        a.send(b.address, b"hello").result(timeout=30)
        assert b.recv(30) == b"hello"
    assert calls, "receive_length_delta was never called"


# --- the KV, EP and weight bindings ---------------------------------------------------------
# The same rule as the engine's calls: an integer argument (a length, an offset, a count, an
# id, a rank, a page, a layer) or field that is negative or does not fit its C++ type raises
# InvalidArgument naming it; NumPy integers are integers; other types stay TypeError.

KV_LAYOUT = dict(num_layers=2, num_pages=4, tokens_per_page=4, num_kv_heads=2, head_bytes=16)
EP_ARGS = dict(rank=0, world_size=2, num_experts=256, hidden=1024, top_k=8,
               max_tokens_per_rank=16)
U32_FIELDS = ["num_layers", "num_pages", "tokens_per_page", "num_kv_heads", "head_bytes",
              "tp_size", "tp_rank"]
U64_FIELDS = ["base_offset", "layer_stride", "page_stride"]


def shard(name="w", shape=(4, 8), box=(), replica=0):
    return (name, "bf16", list(shape), list(box), replica)


def param(name="w", shape=(4, 8), dim=-1, start=0, length=0, kind="identity", sources=(),
          concat_dim=0, block=128):
    return (name, "bf16", list(shape), dim, start, length, kind, list(sources), concat_dim, block)


@pytest.fixture(scope="module")
def kv():
    """A decoder (with a one-rank KvDecodeGroup) and a prefiller on two tcp engines, a plan,
    options, a member and a small weight schedule: the objects whose calls are checked."""
    from types import SimpleNamespace

    ext = fabric_lib._fabric_lib
    with open_engine_or_skip("tcp") as a, open_engine_or_skip("tcp") as b:
        layout = fabric_lib.KvLayout(**KV_LAYOUT)
        ra = a.register(np.zeros(layout.region_bytes, np.uint8))
        rb = b.register(np.zeros(layout.region_bytes, np.uint8))
        dec = fabric_lib.KvDecoder(a, layout, ra)
        pre = fabric_lib.KvPrefiller(b, layout, rb)
        group = fabric_lib.KvDecodeGroup([dec])
        trainer = ext._weights_encode_trainer(0, 1, [shard()])
        inference = ext._weights_encode_inference(0, [param()])
        yield SimpleNamespace(
            layout=layout, dec=dec, pre=pre, group=group, peer=b.address,
            plan=fabric_lib.plan_slices(layout, layout), options=fabric_lib.KvOptions(),
            member=fabric_lib.Member("m"), trainer=trainer, inference=inference,
            schedule=fabric_lib.WeightSchedule.compute([trainer], [inference]))
        group.close()
        dec.close()
        pre.close()


def ep(**kwargs):
    return fabric_lib._fabric_lib._EpAllToAll(**{**EP_ARGS, **kwargs})


W = fabric_lib._fabric_lib
OUT_OF_RANGE_CASES = [
    # KvLayout: constructor keywords and fields, each u32 and u64 field.
    *[(f"KvLayout({f}=-1)", lambda k, f=f: fabric_lib.KvLayout(**{f: -1}), f)
      for f in U32_FIELDS + U64_FIELDS],
    *[(f"KvLayout({f}=2**32)", lambda k, f=f: fabric_lib.KvLayout(**{f: 2**32}), f)
      for f in U32_FIELDS],
    ("KvLayout(base_offset=2**64)", lambda k: fabric_lib.KvLayout(base_offset=2**64),
     "base_offset"),
    *[(f"KvLayout.{f} = -1", lambda k, f=f: setattr(k.layout, f, -1), f"KvLayout.{f}")
      for f in U32_FIELDS + U64_FIELDS],
    ("KvLayout.page_offset(layer)", lambda k: k.layout.page_offset(-1, 0), "layer"),
    ("KvLayout.page_offset(page)", lambda k: k.layout.page_offset(0, -1), "page"),
    ("KvLayout.head_offset(part)", lambda k: k.layout.head_offset(-1, 0), "part"),
    ("KvLayout.head_offset(head)", lambda k: k.layout.head_offset(0, 2**32), "head"),
    ("KvLayout.with_rank(tp_size)", lambda k: k.layout.with_rank(-2, 0), "tp_size"),
    ("KvLayout.with_rank(tp_rank)", lambda k: k.layout.with_rank(1, -1), "tp_rank"),
    ("slices_between(src_rank)", lambda k: fabric_lib.slices_between(k.plan, -1, 0),
     "src_rank"),
    ("slices_between(dst_rank)", lambda k: fabric_lib.slices_between(k.plan, 0, -1),
     "dst_rank"),
    ("slices_into", lambda k: fabric_lib.slices_into(k.plan, -1), "dst_rank"),
    ("sources_of", lambda k: fabric_lib.sources_of(k.plan, -1), "dst_rank"),
    ("targets_of", lambda k: fabric_lib.targets_of(k.plan, 2**32), "src_rank"),
    ("KvOptions(imm_first)", lambda k: fabric_lib.KvOptions(imm_first=-1), "imm_first"),
    ("KvOptions(imm_count)", lambda k: fabric_lib.KvOptions(imm_count=2**32), "imm_count"),
    ("KvOptions.imm_first = -1", lambda k: setattr(k.options, "imm_first", -1),
     "KvOptions.imm_first"),
    ("KvOptions.imm_count = -1", lambda k: setattr(k.options, "imm_count", -1),
     "KvOptions.imm_count"),
    # The flow: request ids, page counts, layers, TP sizes.
    ("KvDecoder.submit(request_id)", lambda k: k.dec.submit(-1, [k.peer], num_pages=1),
     "request_id"),
    ("KvDecoder.submit(num_pages)", lambda k: k.dec.submit(1, [k.peer], num_pages=-1),
     "num_pages"),
    ("KvDecoder.cancel", lambda k: k.dec.cancel(-1), "request_id"),
    ("KvDecoder.release", lambda k: k.dec.release(-1), "request_id"),
    ("KvDecodeGroup.submit(request_id)", lambda k: k.group.submit(-1, [k.peer], num_pages=1),
     "request_id"),
    ("KvDecodeGroup.submit(num_pages)", lambda k: k.group.submit(1, [k.peer], num_pages=-1),
     "num_pages"),
    ("KvDecodeGroup.cancel", lambda k: k.group.cancel(-1), "request_id"),
    ("KvDecodeGroup.release", lambda k: k.group.release(2**64), "request_id"),
    ("KvPrefiller.start(request_id)", lambda k: k.pre.start(-1, [0], 1), "request_id"),
    ("KvPrefiller.start(decode_tp)", lambda k: k.pre.start(1, [0], -1), "decode_tp"),
    ("KvPrefiller.layer_done(request_id)", lambda k: k.pre.layer_done(-1, 0), "request_id"),
    ("KvPrefiller.layer_done(layer)", lambda k: k.pre.layer_done(1, -1), "layer"),
    ("KvPrefiller.cancel", lambda k: k.pre.cancel(-1), "request_id"),
    # Members.
    ("Member(tp_size)", lambda k: fabric_lib.Member("m", tp_size=-1), "tp_size"),
    ("Member(tp_rank)", lambda k: fabric_lib.Member("m", tp_rank=2**32), "tp_rank"),
    ("Member.tp_size = -1", lambda k: setattr(k.member, "tp_size", -1), "Member.tp_size"),
    ("Member.tp_rank = -1", lambda k: setattr(k.member, "tp_rank", -1), "Member.tp_rank"),
    # EP: checked before the configuration and before any GPU is asked for.
    ("_EpAllToAll(rank)", lambda k: ep(rank=-1), "rank"),
    ("_EpAllToAll(world_size)", lambda k: ep(world_size=2**31), "world_size"),
    ("_EpAllToAll(num_experts)", lambda k: ep(num_experts=-256), "num_experts"),
    ("_EpAllToAll(hidden)", lambda k: ep(hidden=-1), "hidden"),
    ("_EpAllToAll(top_k)", lambda k: ep(top_k=-8), "top_k"),
    ("_EpAllToAll(max_tokens_per_rank)", lambda k: ep(max_tokens_per_rank=2**32),
     "max_tokens_per_rank"),
    ("_EpAllToAll(gpus_per_node)", lambda k: ep(gpus_per_node=-1), "gpus_per_node"),
    ("_EpAllToAll(cuda_device)", lambda k: ep(cuda_device=-2), "cuda_device"),
    # Weights: rank descriptions, their nested tuples, the schedule, the quantiser.
    ("_weights_encode_trainer(rank)", lambda k: W._weights_encode_trainer(-1, 1, []), "rank"),
    ("_weights_encode_trainer(num_nics)", lambda k: W._weights_encode_trainer(0, -1, []),
     "num_nics"),
    ("_weights_encode_trainer(shape)",
     lambda k: W._weights_encode_trainer(0, 1, [shard(shape=(4, -8))]), "shards[0].shape[1]"),
    ("_weights_encode_trainer(box start)",
     lambda k: W._weights_encode_trainer(0, 1, [shard(), shard(box=[(-1, 2)])]),
     "shards[1].box[0]"),
    ("_weights_encode_trainer(box length)",
     lambda k: W._weights_encode_trainer(0, 1, [shard(box=[(0, 2), (0, 2**64)])]),
     "shards[0].box[1]"),
    ("_weights_encode_trainer(replica)",
     lambda k: W._weights_encode_trainer(0, 1, [shard(replica=-1)]), "shards[0].replica"),
    ("_weights_encode_inference(rank)", lambda k: W._weights_encode_inference(2**32, []),
     "rank"),
    ("_weights_encode_inference(shape)",
     lambda k: W._weights_encode_inference(0, [param(shape=[-4])]), "params[0].shape[0]"),
    ("_weights_encode_inference(dim)",
     lambda k: W._weights_encode_inference(0, [param(dim=2**31)]), "params[0].dim"),
    ("_weights_encode_inference(start)",
     lambda k: W._weights_encode_inference(0, [param(), param(dim=0, start=-1)]),
     "params[1].start"),
    ("_weights_encode_inference(length)",
     lambda k: W._weights_encode_inference(0, [param(dim=0, length=-1)]), "params[0].length"),
    ("_weights_encode_inference(concat_dim)",
     lambda k: W._weights_encode_inference(0, [param(concat_dim=-1)]), "params[0].concat_dim"),
    ("_weights_encode_inference(block)",
     lambda k: W._weights_encode_inference(0, [param(block=-128)]), "params[0].block"),
    ("WeightSchedule.compute(chunk_bytes)",
     lambda k: fabric_lib.WeightSchedule.compute([k.trainer], [k.inference], chunk_bytes=-1),
     "chunk_bytes"),
    ("WeightSchedule.entries", lambda k: k.schedule.entries(-1), "trainer"),
    ("WeightSchedule.bytes_from", lambda k: k.schedule.bytes_from(-1), "trainer"),
    ("WeightSchedule.writes_into", lambda k: k.schedule.writes_into(2**32), "inference"),
    ("_weights_quantize_fp8_tensors(block)",
     lambda k: W._weights_quantize_fp8_tensors([], -128, {}), "block"),
]


@pytest.mark.parametrize("call,name", [pytest.param(c, n, id=i) for i, c, n in
                                       OUT_OF_RANGE_CASES])
def test_integers_out_of_range_to_kv_ep_and_weights_are_invalid_arguments(kv, call, name):
    exc = refused(lambda: call(kv), name)
    assert "is not an integer from" in str(exc), str(exc)


def test_the_kv_ep_and_weight_bindings_take_numpy_integers(kv):
    u32, i64 = np.uint32, np.int64
    layout = fabric_lib.KvLayout(**{f: u32(v) for f, v in KV_LAYOUT.items()},
                                 base_offset=i64(0))
    assert layout.region_bytes == kv.layout.region_bytes
    assert layout.page_offset(i64(1), u32(2)) == kv.layout.page_offset(1, 2)
    layout.num_pages = i64(8)
    assert layout.num_pages == 8
    assert fabric_lib.sources_of(kv.plan, np.uint8(0)) == [0]
    with pytest.raises(fabric_lib.NotFound):
        kv.dec.cancel(np.uint64(77))
    with pytest.raises(fabric_lib.NotFound):
        kv.pre.layer_done(i64(77), i64(0))
    options = fabric_lib.KvOptions(imm_first=u32(5), imm_count=i64(10))
    assert (options.imm_first, options.imm_count) == (5, 10)
    assert fabric_lib.Member("m", tp_size=i64(4), tp_rank=u32(3)).tp_rank == 3
    assert W._weights_encode_trainer(u32(0), i64(1), [shard(shape=(i64(4), u32(8)),
                                                            box=[(i64(0), u32(4))],
                                                            replica=np.uint8(0))]) == \
        W._weights_encode_trainer(0, 1, [shard(box=[(0, 4)])])
    assert W._weights_encode_inference(i64(0), [param(dim=np.int8(-1), block=i64(128))]) == \
        kv.inference
    assert kv.schedule.bytes_from(i64(0)) == kv.schedule.bytes_from(0) > 0
    W._weights_quantize_fp8_tensors([], i64(128), {})
    # A configuration the C++ check refuses (hidden 7 is not a multiple of 8): read as ints.
    with pytest.raises(fabric_lib.InvalidArgument, match="hidden 7"):
        ep(rank=i64(0), world_size=u32(2), num_experts=i64(256), hidden=u32(7), top_k=i64(8))


WRONG_TYPE_CASES = [
    ("KvLayout(num_layers='2')", lambda k: fabric_lib.KvLayout(num_layers="2")),
    ("KvLayout.num_pages = 2.0", lambda k: setattr(k.layout, "num_pages", 2.0)),
    ("KvLayout.page_offset(1.5)", lambda k: k.layout.page_offset(1.5, 0)),
    ("KvDecoder.cancel('1')", lambda k: k.dec.cancel("1")),
    ("KvPrefiller.start(decode_tp=None)", lambda k: k.pre.start(1, [0], None)),
    ("KvOptions(imm_first=1.0)", lambda k: fabric_lib.KvOptions(imm_first=1.0)),
    ("Member(tp_size='4')", lambda k: fabric_lib.Member("m", tp_size="4")),
    ("_EpAllToAll(hidden=1024.0)", lambda k: ep(hidden=1024.0)),
    ("_weights_encode_trainer(rank='0')", lambda k: W._weights_encode_trainer("0", 1, [])),
    ("_weights_encode_trainer(shape)",
     lambda k: W._weights_encode_trainer(0, 1, [shard(shape=(4.0, 8))])),
    ("_weights_encode_inference(dim)",
     lambda k: W._weights_encode_inference(0, [param(dim="0")])),
    ("WeightSchedule.bytes_from(None)", lambda k: k.schedule.bytes_from(None)),
    ("_weights_quantize_fp8_tensors(block=128.0)",
     lambda k: W._weights_quantize_fp8_tensors([], 128.0, {})),
]


@pytest.mark.parametrize("call", [pytest.param(c, id=i) for i, c in WRONG_TYPE_CASES])
def test_wrong_types_to_kv_ep_and_weights_stay_type_errors(kv, call):
    with pytest.raises(TypeError):
        call(kv)


@pytest.mark.skipif(not fabric_lib.HAS_CUDA, reason="needs fabric_lib built with CUDA and a GPU "
                    "to create an _EpAllToAll (CI has neither); its constructor is checked above")
def test_integers_out_of_range_to_ep_launchers_are_invalid_arguments():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU torch can use")
    a2a = ep(gpus_per_node=1, provider="tcp", nics=["lo"])
    try:
        refused(lambda: a2a.dispatch_send(-1, 0, 0, 0, 1, 0), "tokens")
        refused(lambda: a2a.dispatch_send(0, 0, 0, 0, -1, 0), "num_tokens")
        refused(lambda: a2a.dispatch_send(0, 0, 0, 0, 1, -1), "stream")
        refused(lambda: a2a.dispatch_recv(0, 0, 0, 0, 0, -16, 0), "expert_offsets")
        refused(lambda: a2a.combine_send(2**64, 0), "expert_out")
        refused(lambda: a2a.combine_recv(0, 0, 2**32, 0, 0), "num_tokens")
        refused(lambda: a2a.combine_recv(0, 0, 1, -1, 0), "out")
        with pytest.raises(TypeError):
            a2a.combine_send(0.0, 0)
    finally:
        a2a.close()
