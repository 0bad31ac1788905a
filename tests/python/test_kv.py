"""fabric_lib's KV-cache flow (KvDecoder, KvPrefiller) between engines of this process over tcp
and shm, the TP slice plan, and the registries (a FileRegistry member in another process).

Each rank is its own engine (a KvDecoder or KvPrefiller takes its engine's receive handler).
The model: 4 layers, pages of 4 tokens, 4 KV heads of 16 bytes, K and V; every byte of a
request's logical pages comes from one reference array, so a decode rank's pages are checked
against the heads it holds.
"""

import multiprocessing
import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import fabric_lib
from conftest import TIMEOUT
from peer import make_config

LAYERS, TOKENS, HEADS, HEAD_BYTES = 4, 4, 4, 16
OPTIONS = fabric_lib.KvOptions(heartbeat=0.1, quarantine=0.3, pull_timeout=10)


def layout(tp=1, rank=0, pages=8):
    return fabric_lib.KvLayout(num_layers=LAYERS, num_pages=pages, tokens_per_page=TOKENS,
                               num_kv_heads=HEADS, head_bytes=HEAD_BYTES, tp_size=tp,
                               tp_rank=rank)


def reference(seed, npages):
    """The request's KV: [layer][logical page][part][head][token][byte]."""
    rng = np.random.default_rng(seed)
    return rng.integers(1, 256, (LAYERS, npages, 2, HEADS, TOKENS, HEAD_BYTES), dtype=np.uint8)


def view(cache, lay):
    """A packed cache as [layer][page][part][local head][token][byte]."""
    return cache.reshape(lay.num_layers, lay.num_pages, lay.parts, lay.local_heads, TOKENS,
                         HEAD_BYTES)


def heads(lay):
    return slice(lay.first_head, lay.first_head + lay.local_heads)


class Rank:
    """One TP rank: an engine and its registered cache."""

    def __init__(self, provider, lay):
        self.engine = fabric_lib.TransferEngine(make_config(provider))
        self.layout = lay
        self.cache = np.zeros(lay.region_bytes, dtype=np.uint8)
        self.reg = self.engine.register(self.cache)

    def fill(self, seed, pages, ref):
        view(self.cache, self.layout)[:, pages] = ref[:, :, :, heads(self.layout)]

    def holds(self, pages, ref):
        got = view(self.cache, self.layout)[:, pages]
        return np.array_equal(got, ref[:, :, :, heads(self.layout)])

    def close(self):
        self.engine.close()


@pytest.fixture
def ranks(provider):
    """make(n, tp=..., pages=...) -> n ranks of a TP group; all closed after the test."""
    made = []

    def make(tp=1, pages=8):
        group = [Rank(provider, layout(tp, r, pages)) for r in range(tp)]
        made.extend(group)
        return group

    yield make
    for r in made:
        r.close()


def test_layout_and_plan():
    lay = layout(tp=2, rank=1)
    lay.validate()
    assert (lay.parts, lay.first_head, lay.local_heads) == (2, 2, 2)
    assert lay.page_bytes == 2 * 2 * TOKENS * HEAD_BYTES
    assert lay.region_bytes == LAYERS * 8 * lay.page_bytes
    assert lay.page_offset(1, 3) == lay.layer_step + 3 * lay.page_step
    assert lay.with_rank(4, 3).first_head == 3
    assert "tp_size" in repr(lay) or "tp" in repr(lay)

    plan = fabric_lib.plan_slices(layout(2), layout(4))
    # Each decode rank of TP4 holds one head, from one prefill rank: one slice per part.
    assert fabric_lib.sources_of(plan, 3) == [1]
    assert fabric_lib.targets_of(plan, 0) == [0, 1]
    assert fabric_lib.slices_into(plan, 2) == 2
    s = fabric_lib.slices_between(plan, 1, 3)
    assert [x.length for x in s] == [TOKENS * HEAD_BYTES] * 2
    assert s[0] == fabric_lib.slices_between(plan, 1, 3)[0]
    same = fabric_lib.plan_slices(layout(2), layout(2))
    assert len(same) == 2 and same[0].length == layout(2).page_bytes

    bad = layout(tp=3)
    with pytest.raises(fabric_lib.InvalidArgument, match="tp"):
        bad.validate()
    other = layout()
    other.head_bytes = 32
    with pytest.raises(ValueError):
        fabric_lib.plan_slices(layout(), other)


def run_request(prefill, decode, request_id, npages, seed, src_pages=None):
    """Starts `request_id` on every prefill rank and submits it on every decode rank; returns
    (decode futures, prefill futures, the reference)."""
    ref = reference(seed, npages)
    src_pages = src_pages if src_pages is not None else list(range(npages))
    pre_futures = []
    for p in prefill:
        p.fill(seed, src_pages, ref)
        pre_futures.append(p.kv.start(request_id, src_pages, len(decode)))
    addresses = [p.engine.address for p in prefill]
    dec_futures = [d.kv.submit(request_id, addresses, num_pages=npages) for d in decode]
    return dec_futures, pre_futures, ref


def attach(prefill, decode):
    for p in prefill:
        p.kv = fabric_lib.KvPrefiller(p.engine, p.layout, p.reg, OPTIONS)
    for d in decode:
        d.kv = fabric_lib.KvDecoder(d.engine, d.layout, d.reg, OPTIONS)


def test_same_tp_pages_byte_exact(ranks):
    prefill, decode = ranks(), ranks()
    attach(prefill, decode)
    readies, layers = [], []
    ref = reference(7, 3)
    prefill[0].fill(7, [5, 6, 7], ref)
    pre = prefill[0].kv.start(1, np.array([5, 6, 7], dtype=np.int32), 1,
                              on_layer=lambda i, rank, layer: layers.append((i, rank, layer)))
    dec = decode[0].kv.submit(1, [prefill[0].engine.address.hex()], num_pages=3,
                              on_ready=lambda i, pages: readies.append((i, pages)))
    assert dec.pages == [0, 1, 2] and decode[0].kv.free_pages == 5
    assert decode[0].kv.live_requests == 1
    for layer in range(LAYERS):
        prefill[0].kv.layer_done(1, layer)
    pages = dec.result(TIMEOUT)
    assert pages == dec.pages
    assert pre.result(TIMEOUT) is None
    assert readies == [(1, pages)]
    assert sorted(layers) == [(1, 0, layer) for layer in range(LAYERS)]
    assert decode[0].holds(pages, ref)
    decode[0].kv.release(1)
    assert decode[0].kv.free_pages == 8
    with pytest.raises(fabric_lib.NotFound):
        decode[0].kv.release(1)

    # Many at once, layers interleaved across requests.
    futures = [run_request(prefill, decode, 10 + i, 2, 100 + i, [2 * i, 2 * i + 1])
               for i in range(4)]
    for layer in range(LAYERS):
        for i in range(4):
            prefill[0].kv.layer_done(10 + i, layer)
    for i, (decs, pres, ref) in enumerate(futures):
        pages = decs[0].result(TIMEOUT)
        assert decode[0].holds(pages, ref), f"request {10 + i}"
        assert pres[0].result(TIMEOUT) is None
        decode[0].kv.release(10 + i)
    assert decode[0].kv.live_requests == 0 and prefill[0].kv.live_requests == 0


def test_mixed_tp_prefill2_into_decode4(ranks):
    prefill, decode = ranks(tp=2), ranks(tp=4)
    attach(prefill, decode)
    decs, pres, ref = run_request(prefill, decode, 42, 3, 42)
    for layer in range(LAYERS):
        for p in prefill:
            p.kv.layer_done(42, layer)
    for d, f in zip(decode, decs):
        pages = f.result(TIMEOUT)
        assert d.holds(pages, ref), f"decode rank {d.layout.tp_rank}"
    for f in pres:
        assert f.result(TIMEOUT) is None
    for d in decode:
        d.kv.release(42)

    # The same through a KvDecodeGroup: one future for the four ranks.
    with fabric_lib.KvDecodeGroup([d.kv for d in decode]) as group:
        assert group.size == 4
        ready = []
        ref = reference(43, 2)
        for p in prefill:
            p.fill(43, [4, 5], ref)
            p.kv.start(43, [4, 5], 4)
        req = group.submit(43, [p.engine.address for p in prefill], num_pages=2,
                           on_ready=lambda i, pages: ready.append(i))
        for layer in range(LAYERS):
            for p in prefill:
                p.kv.layer_done(43, layer)
        pages = req.result(TIMEOUT)
        assert ready == [43] and len(pages) == 4
        for d, rank_pages in zip(decode, pages):
            assert d.holds(rank_pages, ref), f"decode rank {d.layout.tp_rank}"
        group.release(43)
        # One prefill rank cancels: the group fails once, every rank's pages come back.
        for p in prefill:
            p.kv.start(44, [0], 4)
        req = group.submit(44, [p.engine.address for p in prefill], num_pages=1)
        for layer in range(LAYERS):
            prefill[0].kv.layer_done(44, layer)
        prefill[1].kv.cancel(44)
        with pytest.raises(fabric_lib.Cancelled):
            req.result(TIMEOUT)
        deadline = time.monotonic() + TIMEOUT
        while any(d.kv.free_pages != 8 for d in decode) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [d.kv.free_pages for d in decode] == [8] * 4
        with pytest.raises(fabric_lib.InvalidArgument):
            fabric_lib.KvDecodeGroup([decode[1].kv, decode[0].kv])


def test_cancel_from_either_side(ranks):
    prefill, decode = ranks(), ranks()
    attach(prefill, decode)
    errors = []
    # The decoder cancels after two layers.
    decs, pres, _ = run_request(prefill, decode, 1, 4, 1)
    decs[0].add_done_callback(lambda f: None)
    prefill[0].kv.layer_done(1, 0)
    prefill[0].kv.layer_done(1, 1)
    decode[0].kv.cancel(1)
    with pytest.raises(fabric_lib.Cancelled):
        decs[0].result(TIMEOUT)
    with pytest.raises(fabric_lib.FabricError):
        pres[0].result(TIMEOUT)
    assert decode[0].kv.free_pages == 8  # back in the pool once nothing is in flight

    # The prefiller cancels before any layer.
    ref = reference(2, 2)
    prefill[0].fill(2, [0, 1], ref)
    pre = prefill[0].kv.start(2, [0, 1], 1)
    dec = decode[0].kv.submit(2, [prefill[0].engine.address], num_pages=2,
                              on_error=lambda i, e: errors.append((i, type(e))))
    prefill[0].kv.cancel(2)
    with pytest.raises(fabric_lib.Cancelled):
        pre.result(TIMEOUT)
    with pytest.raises(fabric_lib.Cancelled):
        dec.result(TIMEOUT)
    assert errors == [(2, fabric_lib.Cancelled)]
    with pytest.raises(fabric_lib.NotFound):
        decode[0].kv.cancel(2)

    # The pages serve a new request byte-exact.
    decs, pres, ref = run_request(prefill, decode, 3, 8, 3)
    for layer in range(LAYERS):
        prefill[0].kv.layer_done(3, layer)
    assert decode[0].holds(decs[0].result(TIMEOUT), ref)


def test_refused_registrations_and_engines_raise_fabric_errors():
    """What docs/kv.md says a decoder or prefiller refuses, with the class it says: another
    engine's Registration and an unregistered one (InvalidArgument), a closed engine (Closed)."""
    lay = layout()
    with fabric_lib.TransferEngine(make_config("tcp")) as e, \
            fabric_lib.TransferEngine(make_config("tcp")) as other:
        theirs = other.register(np.zeros(lay.region_bytes, np.uint8))
        for cls in (fabric_lib.KvDecoder, fabric_lib.KvPrefiller):
            with pytest.raises(fabric_lib.InvalidArgument, match="another engine"):
                cls(e, lay, theirs)
        gone = e.register(np.zeros(lay.region_bytes, np.uint8))
        gone.unregister()
        for cls in (fabric_lib.KvDecoder, fabric_lib.KvPrefiller):
            with pytest.raises(fabric_lib.InvalidArgument, match="unregistered"):
                cls(e, lay, gone)
        mine = other.register(np.zeros(lay.region_bytes, np.uint8))
        other.close()
        for cls in (fabric_lib.KvDecoder, fabric_lib.KvPrefiller):
            with pytest.raises(fabric_lib.Closed):
                cls(other, lay, mine)


def test_bad_input_raises_clear_errors(ranks):
    prefill, decode = ranks(), ranks()
    small = np.zeros(64, dtype=np.uint8)
    reg = decode[0].engine.register(small)
    with pytest.raises(fabric_lib.InvalidArgument, match="smaller than the layout"):
        fabric_lib.KvDecoder(decode[0].engine, decode[0].layout, reg)
    with pytest.raises(fabric_lib.InvalidArgument, match="another engine"):
        fabric_lib.KvDecoder(decode[0].engine, decode[0].layout, prefill[0].reg)
    with pytest.raises(TypeError):
        fabric_lib.KvDecoder(decode[0].reg, decode[0].layout, decode[0].reg)
    with pytest.raises(fabric_lib.InvalidArgument):
        fabric_lib.KvDecoder(decode[0].engine, layout(tp=3), decode[0].reg)
    with pytest.raises(fabric_lib.InvalidArgument, match="heartbeat"):
        fabric_lib.KvOptions(heartbeat=-1)
    attach(prefill, decode)
    with pytest.raises(fabric_lib.AlreadyExists):  # one receive handler per engine
        fabric_lib.KvPrefiller(prefill[0].engine, prefill[0].layout, prefill[0].reg)
    dec, pre = decode[0].kv, prefill[0].kv
    address = prefill[0].engine.address
    with pytest.raises(fabric_lib.InvalidArgument, match="prefill_ranks"):
        dec.submit(1, [], num_pages=1)
    with pytest.raises(fabric_lib.InvalidArgument, match="prefill_ranks"):
        dec.submit(1, ["not hex"], num_pages=1)
    with pytest.raises(fabric_lib.OutOfRange):
        dec.submit(1, [address], num_pages=9)
    with pytest.raises(fabric_lib.InvalidArgument):
        dec.submit(1, [address], pages=[8])
    with pytest.raises(TypeError, match="on_ready"):
        dec.submit(1, [address], num_pages=1, on_ready=5)
    first = dec.submit(1, [address], num_pages=1)
    with pytest.raises(fabric_lib.AlreadyExists):
        dec.submit(1, [address], num_pages=1)
    with pytest.raises(fabric_lib.NotFound):
        dec.cancel(99)
    with pytest.raises(fabric_lib.NotFound):
        pre.layer_done(99, 0)
    with pytest.raises(fabric_lib.InvalidArgument):
        pre.start(5, [], 1)
    with pytest.raises(fabric_lib.InvalidArgument):
        pre.start(5, [0], 3)  # a decode TP of 3 does not fit 4 heads
    pre.start(1, [0], 1)
    with pytest.raises(fabric_lib.OutOfRange):
        pre.layer_done(1, LAYERS)
    # Closing fails what is pending, and every call afterwards raises Closed.
    dec.close()
    assert dec.closed
    with pytest.raises(fabric_lib.Closed):
        first.result(TIMEOUT)
    with pytest.raises(fabric_lib.Closed):
        dec.submit(2, [address], num_pages=1)
    pre.cancel(1)
    pre.close()
    pre.close()  # idempotent


def test_callback_exception_is_reported(ranks):
    from conftest import unraisable

    prefill, decode = ranks(), ranks()
    attach(prefill, decode)
    decs, pres, ref = run_request(prefill, decode, 1, 1, 1)
    with unraisable() as seen:
        f = decode[0].kv.submit(2, [prefill[0].engine.address], num_pages=1,
                                on_error=lambda i, e: 1 / 0)
        decode[0].kv.cancel(2)
        with pytest.raises(fabric_lib.Cancelled):
            f.result(TIMEOUT)
    assert any(isinstance(u.exc_value, ZeroDivisionError) for u in seen)
    for layer in range(LAYERS):
        prefill[0].kv.layer_done(1, layer)
    assert decode[0].holds(decs[0].result(TIMEOUT), ref)  # the others are served


def closing_in(obj, caught):
    """A callback that tries obj.close() and obj.__exit__(), recording what each raised."""

    def callback(*_):
        for call in (obj.close, lambda: obj.__exit__(None, None, None)):
            try:
                call()
            except BaseException as exc:  # noqa: BLE001 - what close() raised is the point
                caught.append((type(obj).__name__, exc))

    return callback


def assert_refused_as_invalid_argument(caught, names):
    assert {name for name, _ in caught} == names, caught
    for name, exc in caught:
        assert type(exc) is fabric_lib.InvalidArgument, (name, repr(exc))
        assert isinstance(exc, ValueError) and exc.code == fabric_lib.ErrorCode.INVALID_ARGUMENT
        assert f"{name}.close() cannot be called from a callback" in str(exc), str(exc)


def test_close_in_a_callback_is_an_invalid_argument(ranks):
    """close() (or leaving a `with` block) of a KvDecoder, KvDecodeGroup or KvPrefiller inside
    one of its own callbacks raises InvalidArgument saying why (it was a RuntimeError); the
    object stays open and serves the next request."""
    prefill, decode = ranks(), ranks()
    attach(prefill, decode)
    pre, dec = prefill[0].kv, decode[0].kv
    group = fabric_lib.KvDecodeGroup([dec])
    caught = []
    address = [prefill[0].engine.address]
    ref = reference(5, 2)
    prefill[0].fill(5, [0, 1], ref)
    pf = pre.start(1, [0, 1], 1, on_finished=closing_in(pre, caught),
                   on_layer=closing_in(pre, caught))
    df = dec.submit(1, address, num_pages=2, on_ready=closing_in(dec, caught))
    for layer in range(LAYERS):
        pre.layer_done(1, layer)
    assert decode[0].holds(df.result(TIMEOUT), ref)
    assert pf.result(TIMEOUT) is None
    dec.release(1)
    failed = dec.submit(2, address, num_pages=1, on_error=closing_in(dec, caught))
    dec.cancel(2)
    with pytest.raises(fabric_lib.Cancelled):
        failed.result(TIMEOUT)
    pre.start(3, [0, 1], 1)
    gf = group.submit(3, address, num_pages=2, on_ready=closing_in(group, caught))
    for layer in range(LAYERS):
        pre.layer_done(3, layer)
    assert decode[0].holds(gf.result(TIMEOUT)[0], ref)
    group.release(3)
    assert_refused_as_invalid_argument(caught, {"KvPrefiller", "KvDecoder", "KvDecodeGroup"})
    assert not (pre.closed or dec.closed or group.closed)
    decs, pres, ref = run_request(prefill, decode, 4, 2, 4)
    for layer in range(LAYERS):
        pre.layer_done(4, layer)
    assert decode[0].holds(decs[0].result(TIMEOUT), ref)
    group.close()


def test_closing_a_registry_in_its_watch_callback_is_an_invalid_argument():
    state = fabric_lib.LocalRegistryState()
    caught = []
    with fabric_lib.LocalRegistry(state) as a, fabric_lib.LocalRegistry(state) as b:
        a.watch(closing_in(a, caught))
        b.join(fabric_lib.Member("d0", role="decode"))
        assert_refused_as_invalid_argument(caught, {"LocalRegistry"})
        assert len(caught) == 2 and not a.closed
        assert [m.name for m in a.members()] == ["d0"]


class Watched:
    def __init__(self):
        self.members = {}
        self.cv = threading.Condition()

    def __call__(self, joined, member):
        with self.cv:
            if joined:
                self.members[member.name] = member
            else:
                self.members.pop(member.name, None)
            self.cv.notify_all()

    def wait(self, name, present, timeout=10):
        with self.cv:
            return self.cv.wait_for(lambda: (name in self.members) == present, timeout)


def test_local_registry():
    state = fabric_lib.LocalRegistryState()
    with fabric_lib.LocalRegistry(state) as a, fabric_lib.LocalRegistry(state) as b:
        seen = Watched()
        a.watch(seen)
        with pytest.raises(fabric_lib.AlreadyExists):
            a.watch(seen)
        b.join(fabric_lib.Member("d0", role="decode", tp_size=4, tp_rank=1))
        assert seen.wait("d0", True, 0)
        assert seen.members["d0"].tp_rank == 1
        assert [m.name for m in a.members()] == ["d0"]
        with pytest.raises(fabric_lib.InvalidArgument):
            a.join(fabric_lib.Member("bad/name"))
        with pytest.raises(fabric_lib.NotFound):
            a.leave("d0")
        b.close()
        assert seen.wait("d0", False, 0)
    m = fabric_lib.Member("x", role="prefill", data="layers=4")
    assert fabric_lib.Member.decode(m.encode()) == m
    with pytest.raises(fabric_lib.InvalidArgument):
        fabric_lib.Member.decode("role=decode")


def _file_member(directory, name, conn):
    registry = fabric_lib.FileRegistry(directory, lease_ttl=1.0)
    registry.join(fabric_lib.Member(name, role="prefill"))
    conn.send("joined")
    time.sleep(60)  # until killed


def test_file_registry_across_processes(tmp_path):
    with pytest.raises(fabric_lib.InvalidArgument, match="plain"):
        (tmp_path / "plain").write_text("x")
        fabric_lib.FileRegistry(str(tmp_path / "plain" / "sub"))
    directory = str(tmp_path / "members")
    with fabric_lib.FileRegistry(directory, lease_ttl=1.0, poll_interval=0.05) as registry:
        assert registry.directory == directory
        seen = Watched()
        registry.watch(seen)
        registry.join(fabric_lib.Member("me", role="decode"))
        assert seen.wait("me", True)
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_file_member, args=(directory, "other", child), daemon=True)
        proc.start()
        try:
            assert parent.poll(TIMEOUT) and parent.recv() == "joined"
            assert seen.wait("other", True)
            assert {m.name for m in registry.members()} == {"me", "other"}
            os.kill(proc.pid, signal.SIGKILL)
            killed = time.monotonic()
            assert seen.wait("other", False)
            assert time.monotonic() - killed < 1.0  # its pid is gone: well within its TTL
        finally:
            proc.kill()
            proc.join(10)
        registry.leave("me")
        assert seen.wait("me", False)
    assert os.listdir(directory) == []
