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
