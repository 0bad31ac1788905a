"""fabric_lib.ep between two processes, one GPU each, checked against a plain PyTorch reference:
dispatch delivers exactly the reference's tokens, scales and weights per local expert (compared
sorted by source rank and token index: the order within an expert is free), and combine equals
the reference's weighted sum within bf16 rounding; bf16 and fp8; random routings and the edges
(a rank that receives nothing, every token to one expert, the maximum number of tokens, top-k
experts all on one rank, a repeated expert, a rank with no tokens); eagerly and replayed from a
CUDA graph; 1000 rounds in a loop; a silent peer turned into fabric_lib.Timeout; peers
configured differently refused at connect. Each scenario runs twice: as one node (CUDA IPC
between the ranks) and as two nodes (gpus_per_node=WORLD // 2, provider="tcp": with two ranks,
two one-GPU nodes and every byte through the ranks' proxies and their engines over loopback;
with FABRIC_EP_TEST_WORLD=4, two nodes of two GPUs, CUDA IPC and the proxies side by side).

The two-GPU tests are skipped (with the reason) unless fabric_lib is built with CUDA and torch
sees two GPUs: CI has none; there the configuration checks below run, and the host-side logic
is covered by the C++ unit tests Ep*. tools/gpu/run_ep.sh runs this file on a GPU machine.
"""

import os
import socket
import time
from datetime import timedelta

import pytest

import fabric_lib

torch = pytest.importorskip("torch")

# Never NVLink multicast (NVLS): it can take a shared host's GPUs out of service.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(NO_MULTICAST)

# Ranks of the scenarios: 2, or FABRIC_EP_TEST_WORLD (an even number; 4 makes "two_nodes" two
# nodes of two GPUs: CUDA IPC and the proxy in the same kernels).
WORLD = int(os.environ.get("FABRIC_EP_TEST_WORLD", "2"))
SPAWN_TIMEOUT = 90  # seconds for one scenario
# The GPU of each rank. FABRIC_EP_TEST_DEVICES=0,0 puts both ranks' processes on one GPU (a
# machine with one GPU: the kernels' protocol runs, with CUDA IPC inside that GPU, the
# processes' kernels time-sliced).
DEVICES = [int(d) for d in os.environ.get(
    "FABRIC_EP_TEST_DEVICES", ",".join(str(r) for r in range(WORLD))).split(",")]


def gpu_count():
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


two_gpus = pytest.mark.skipif(
    not fabric_lib.HAS_CUDA or gpu_count() <= max(DEVICES),
    reason=f"needs fabric_lib built with CUDA (HAS_CUDA={fabric_lib.HAS_CUDA}) and GPUs "
    f"{DEVICES} for the {WORLD} ranks (torch sees {gpu_count()}); CI has none: the C++ unit "
    "tests Ep* cover the host side",
)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# How the WORLD ranks are placed: one node (CUDA IPC), or two nodes of WORLD / 2 GPUs (two ranks:
# two one-GPU nodes; ranks of the other node through the proxy path, over the tcp provider on
# loopback, the proxy's areas in pinned host memory: "auto" where GPU memory is staged).
TOPOLOGIES = {
    "one_node": {},
    "two_nodes": {"gpus_per_node": WORLD // 2, "provider": "tcp", "nics": ["lo"]},
}
# What AllToAll.proxy_memory reports under each.
PROXY_MEMORY = {"one_node": "none", "two_nodes": "host"}
_topology = []  # the scenario's topology, in the ranks' processes
topologies = pytest.mark.parametrize("topology", list(TOPOLOGIES))
_a2a_options = {}  # TOPOLOGIES[the scenario's topology], in the ranks' processes


def run_two(scenario, topology="one_node", **kwargs):
    """Runs SCENARIOS[scenario](rank, **kwargs) in WORLD processes (one GPU each, a gloo group),
    placed as TOPOLOGIES[topology] says; a failure in either fails the test with its
    traceback."""
    import torch.multiprocessing as mp

    ctx = mp.spawn(_worker, args=(free_port(), scenario, topology, kwargs), nprocs=WORLD,
                   join=False)
    deadline = time.monotonic() + SPAWN_TIMEOUT
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{scenario}: the ranks did not finish within {SPAWN_TIMEOUT} s")


def _worker(rank, port, scenario, topology, kwargs):
    import torch.distributed as dist

    _a2a_options.update(TOPOLOGIES[topology])
    _topology.append(topology)
    os.environ.update(NO_MULTICAST)
    torch.cuda.set_device(DEVICES[rank])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=120))
    try:
        SCENARIOS[scenario](rank, **kwargs)
    finally:
        dist.destroy_process_group()


# --- inputs and the reference (plain PyTorch; usable on the CPU) -----------------------------


def fp8_dtype():
    return getattr(torch, "float8_e4m3fn", None)


def make_inputs(seed, rank, n, hidden, num_experts, top_k, fp8, routing, device="cpu"):
    """Rank `rank`'s tokens, scales, top-k indices and weights, the same in every process."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    L = num_experts // WORLD
    x = torch.randn(n, hidden, generator=g) * 2
    if routing == "random":
        idx = torch.rand(n, num_experts, generator=g).topk(top_k, dim=1).indices
    elif routing == "nothing_to_last":  # every expert on rank 0: the last rank receives nothing
        idx = torch.rand(n, L, generator=g).topk(top_k, dim=1).indices
    elif routing == "one_expert":  # every token to expert 3 only, the other slots empty (-1)
        idx = torch.full((n, top_k), -1, dtype=torch.int64)
        idx[:, 0] = 3
    elif routing == "one_rank":  # all top-k experts of a token on one rank (the token's parity)
        idx = torch.rand(n, L, generator=g).topk(top_k, dim=1).indices
        idx += (torch.arange(n) % WORLD * L).unsqueeze(1)
    elif routing == "repeated":  # an expert twice in a token's top-k
        idx = torch.rand(n, num_experts, generator=g).topk(top_k, dim=1).indices
        idx[:, 1] = idx[:, 0]
    else:
        raise ValueError(routing)
    w = torch.rand(n, top_k, generator=g)
    scales = None
    if fp8:
        x = x.to(fp8_dtype())
        scales = torch.rand(n, hidden // 128, generator=g) + 0.5
    else:
        x = x.to(torch.bfloat16)
    to = lambda t: None if t is None else t.to(device)
    return to(x), to(scales), to(idx.to(torch.int64).contiguous()), to(w.contiguous())


def dequant(x, scales):
    if scales is None:
        return x.float()
    return x.float() * scales.repeat_interleave(128, dim=1)


def expert_fn(experts, values):
    """What expert e does to a token here: values x (1 + (e mod 8) / 8) + e / 100, as bf16.
    Differs per expert, so a row combined from the wrong expert shows."""
    e = experts.to(torch.float32).unsqueeze(1)
    return (values * (1 + torch.remainder(e, 8) / 8) + e / 100).to(torch.bfloat16)


def reference_rows(inputs, dst, L):
    """The (local expert, source rank, token, slot) of every row rank `dst` must receive."""
    rows = []
    for s, (_, _, idx, _) in enumerate(inputs):
        idx = idx.cpu()
        mine = (idx >= dst * L) & (idx < (dst + 1) * L)
        t, k = mine.nonzero(as_tuple=True)
        rows.append(torch.stack([idx[t, k] - dst * L, torch.full_like(t, s), t, k], dim=1))
    return torch.cat(rows) if rows else torch.zeros(0, 4, dtype=torch.int64)


def check_dispatch(got, inputs, dst, L, fp8):
    """Asserts that `got` (a DispatchResult, any device) holds exactly the reference's rows."""
    ref = reference_rows(inputs, dst, L)
    counts = got.expert_counts.cpu().to(torch.int64)
    offsets = got.expert_offsets.cpu().to(torch.int64)
    ref_counts = torch.bincount(ref[:, 0], minlength=L)
    assert torch.equal(counts, ref_counts), f"rank {dst}: expert counts differ"
    assert offsets[0] == 0 and torch.equal(offsets[1:], torch.cumsum(ref_counts, 0)), \
        f"rank {dst}: expert offsets are not the counts' prefix sums"
    total = int(offsets[-1])
    expert = torch.repeat_interleave(torch.arange(L), counts)
    source = got.source[:total].cpu().to(torch.int64)
    weights = got.weights[:total].cpu()
    # Rows sorted by (expert, source rank, token, weight), on both sides.
    cpu = [[None if t is None else t.cpu() for t in inp] for inp in inputs]
    ref_weight = torch.stack([cpu[s][3][t, k] for _, s, t, k in ref.tolist()]) \
        if total else torch.zeros(0)
    g_order = sort_rows(expert, source[:, 0], source[:, 1], weights)
    r_order = sort_rows(ref[:, 0], ref[:, 1], ref[:, 2], ref_weight)
    assert torch.equal(source[g_order], ref[r_order][:, 1:3]), \
        f"rank {dst}: the rows' sources differ from the reference's"
    assert torch.equal(weights[g_order], ref_weight[r_order]), f"rank {dst}: weights differ"
    # Compared as bytes (exactly; fp8 tensors also support fewer operations than bytes do).
    as_bytes = lambda t: t.cpu().view(torch.uint8) if fp8 else t.cpu().view(torch.int16)
    pairs = ref[r_order][:, 1:3].tolist()
    g_tokens = as_bytes(got.tokens[:total])[g_order]
    source_bytes = [as_bytes(inp[0]) for inp in cpu]
    r_tokens = torch.stack([source_bytes[s][t] for s, t in pairs]) if pairs \
        else g_tokens[:0]
    assert torch.equal(g_tokens, r_tokens), f"rank {dst}: token bytes differ"
    if fp8:
        g_scales = got.scales[:total].cpu()[g_order]
        r_scales = torch.stack([cpu[s][1][t] for s, t in pairs]) if pairs \
            else g_scales[:0]
        assert torch.equal(g_scales, r_scales), f"rank {dst}: scales differ"


def sort_rows(expert, rank, token, weight):
    order = torch.argsort(weight, stable=True)
    key = (expert * WORLD + rank) * (1 << 32) + token
    return order[torch.argsort(key[order], stable=True)]


def expert_outputs(got, L, rank, fp8):
    """Every row's expert output (expert_fn of its dequantised token), capturable: no host
    synchronisation. Rows past the last are 0."""
    rows = got.tokens.shape[0]
    at = torch.arange(rows, device=got.tokens.device, dtype=torch.int32)
    local = torch.searchsorted(got.expert_offsets[1:].contiguous(), at, right=True)
    y = expert_fn(local + rank * L, dequant(got.tokens, got.scales if fp8 else None))
    return torch.where((at < got.expert_offsets[-1]).unsqueeze(1), y, torch.zeros_like(y))


def reference_combine(x, scales, idx, w):
    """out[t] = sum_k w[t, k] x expert_fn(idx[t, k], token t), fp32, slots with idx < 0
    skipped; bf16."""
    values = dequant(x, scales)
    out = torch.zeros(values.shape, dtype=torch.float32, device=values.device)
    for k in range(idx.shape[1]):
        y = expert_fn(idx[:, k].clamp(min=0), values).float()
        out += torch.where((idx[:, k] >= 0).unsqueeze(1), w[:, k : k + 1] * y, 0.0)
    return out.to(torch.bfloat16)


def assert_combined(out, ref, what):
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), rtol=1e-2, atol=2e-2,
                               msg=lambda m: f"{what}: {m}")


# --- scenarios (each runs in both ranks) --------------------------------------------------


def new_a2a(hidden, top_k, max_tokens, fp8, num_experts=16, timeout=10.0):
    from fabric_lib.ep import AllToAll

    a2a = AllToAll(num_experts=num_experts, hidden=hidden, top_k=top_k,
                   max_tokens_per_rank=max_tokens,
                   dtype=fp8_dtype() if fp8 else torch.bfloat16, timeout=timeout,
                   **_a2a_options)
    assert a2a.proxy_memory == PROXY_MEMORY[_topology[0]], a2a.proxy_memory
    return a2a


def remote_ranks(rank):
    """The ranks of other nodes than `rank`'s under the scenario's topology."""
    per = _a2a_options.get("gpus_per_node")
    return [r for r in range(WORLD) if per and r // per != rank // per]


def round_trip(a2a, rank, seed, sizes, hidden, num_experts, top_k, fp8, routing):
    """One dispatch and combine, both checked against the reference; across nodes, also the
    combine's bytes on the wire: each row once, with its 4-byte slot id, and the 16-byte counts."""
    L = num_experts // WORLD
    inputs = [make_inputs(seed, r, sizes[r % len(sizes)], hidden, num_experts, top_k, fp8,
                          routing, "cuda") for r in range(WORLD)]
    x, scales, idx, w = inputs[rank]
    before = a2a.proxy_stats()["combine"]
    got = a2a.dispatch(x, idx, w, scales=scales)
    y = expert_outputs(got, L, rank, fp8)
    out = a2a.combine(y, idx, w)
    torch.cuda.synchronize()
    a2a.check()
    check_dispatch(got, inputs, rank, L, fp8)
    assert_combined(out, reference_combine(x, scales, idx, w), f"rank {rank} {routing} combine")
    remote = remote_ranks(rank)
    if remote:
        # This rank's GPU has staged its rows; its proxy posts them once it sees the round.
        deadline = time.monotonic() + 5
        while (a2a.proxy_stats()["combine"]["rounds_sent"] - before["rounds_sent"] < len(remote)
               and time.monotonic() < deadline):
            time.sleep(0.001)
        after = a2a.proxy_stats()["combine"]
        assert after["rounds_sent"] - before["rounds_sent"] == len(remote)
        rows = [int(((inputs[q][2] >= rank * L) & (inputs[q][2] < (rank + 1) * L)).sum())
                for q in remote]
        want = sum(16 + n * (4 + 2 * hidden) for n in rows)
        assert after["bytes_sent"] - before["bytes_sent"] == want, \
            f"rank {rank} sent {after['bytes_sent'] - before['bytes_sent']} combine bytes for " \
            f"{rows} rows to ranks {remote}, not {want}"


def scenario_routings(rank, fp8, hidden, top_k, max_tokens, cases):
    a2a = new_a2a(hidden, top_k, max_tokens, fp8)
    for seed, (routing, sizes) in enumerate(cases):
        round_trip(a2a, rank, seed, sizes, hidden, 16, top_k, fp8, routing)
    a2a.close()


def scenario_graph(rank, fp8, replays):
    """A whole round (dispatch, expert compute, combine) captured once, replayed with new
    routings copied into its static inputs, each replay checked."""
    hidden, num_experts, top_k, n = 1024, 16, 4, 64
    L = num_experts // WORLD
    a2a = new_a2a(hidden, top_k, n, fp8)
    static = make_inputs(0, rank, n, hidden, num_experts, top_k, fp8, "random", "cuda")
    x, scales, idx, w = static
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up round, outside the graph
        got = a2a.dispatch(x, idx, w, scales=scales)
        a2a.combine(expert_outputs(got, L, rank, fp8), idx, w)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = a2a.dispatch(x, idx, w, scales=scales)
        out = a2a.combine(expert_outputs(got, L, rank, fp8), idx, w)
    for i in range(replays):
        routing = ["random", "one_rank", "repeated", "nothing_to_last"][i % 4]
        inputs = [make_inputs(100 + i, r, n, hidden, num_experts, top_k, fp8, routing, "cuda")
                  for r in range(WORLD)]
        for static_t, new_t in zip(static, inputs[rank]):
            if static_t is not None:
                static_t.copy_(new_t)
        graph.replay()
        torch.cuda.synchronize()
        a2a.check()
        check_dispatch(got, inputs, rank, L, fp8)
        assert_combined(out, reference_combine(*inputs[rank]), f"rank {rank} replay {i}")
    a2a.close()


def scenario_loop(rank, iterations):
    """Rounds of changing sizes and routings; errors counted on the GPU, looked at every 100
    rounds (a hang would end in fabric_lib.Timeout, not here)."""
    hidden, num_experts, top_k, max_tokens = 512, 16, 4, 96
    L = num_experts // WORLD
    a2a = new_a2a(hidden, top_k, max_tokens, False)
    bad = torch.zeros((), dtype=torch.int64, device="cuda")
    for i in range(iterations):
        sizes = [(i * 37 + r * 11) % (max_tokens + 1) for r in range(WORLD)]
        g = torch.Generator(device="cuda").manual_seed(i)
        idx_all = [torch.rand(sizes[r], num_experts, generator=g, device="cuda")
                   .topk(top_k, dim=1).indices for r in range(WORLD)]
        x = torch.randn(sizes[rank], hidden, generator=g, device="cuda").to(torch.bfloat16)
        idx = idx_all[rank].contiguous()
        w = torch.rand(sizes[rank], top_k, generator=g, device="cuda")
        got = a2a.dispatch(x, idx, w)
        out = a2a.combine(expert_outputs(got, L, rank, False), idx, w)
        want_counts = torch.bincount(torch.cat(idx_all).flatten(), minlength=num_experts)
        bad += (got.expert_counts.to(torch.int64) != want_counts[rank * L:(rank + 1) * L]).sum()
        ref = reference_combine(x, None, idx, w).float()
        bad += ((out.float() - ref).abs() > 2e-2 + 1e-2 * ref.abs()).sum()
        if i % 100 == 99 or i == iterations - 1:
            torch.cuda.synchronize()
            a2a.check()
            assert int(bad) == 0, f"rank {rank}: {int(bad)} mismatches by round {i}"
    a2a.close()


def scenario_silent_peer(rank):
    """Only rank 0 dispatches: its receive gives up after the timeout, and the error comes back
    on the host as fabric_lib.Timeout naming a silent rank."""
    import torch.distributed as dist

    a2a = new_a2a(256, 2, 8, False, timeout=1.0)
    if rank == 0:
        x, _, idx, w = make_inputs(0, 0, 8, 256, 16, 2, False, "random", "cuda")
        started = time.monotonic()
        a2a.dispatch(x, idx, w)
        torch.cuda.synchronize()
        waited = time.monotonic() - started
        # The first silent rank it waited for (its GPU's wait, or its proxy's for a rank of
        # another node: "... for rank 1's dispatched tokens" or "... for rank 2's dispatch").
        with pytest.raises(fabric_lib.Timeout, match=r"for rank [1-9][0-9]*'s"):
            a2a.check()
        assert 0.9 < waited < 10, f"the GPU wait ended after {waited:.1f} s (timeout 1 s)"
        with pytest.raises(fabric_lib.Timeout):  # the object is unusable from then on
            a2a.dispatch_send(x, idx, w)
    dist.barrier()
    a2a.close()


def scenario_mismatch(rank):
    """Rank 1 has another hidden size: connect refuses, naming the field, on both ranks."""
    with pytest.raises(fabric_lib.InvalidArgument, match="hidden"):
        new_a2a(256 if rank == 0 else 512, 2, 8, False)


SCENARIOS = {
    "routings": scenario_routings,
    "graph": scenario_graph,
    "loop": scenario_loop,
    "silent_peer": scenario_silent_peer,
    "mismatch": scenario_mismatch,
}

EDGES = [
    ("random", [50, 64]),
    ("nothing_to_last", [64, 30]),
    ("one_expert", [64, 64]),
    ("one_rank", [64, 64]),
    ("repeated", [40, 64]),
    ("random", [0, 64]),  # a rank with no tokens
    ("random", [0, 0]),
    ("random", [64, 64]),  # the maximum on both
]


# --- the tests ----------------------------------------------------------------------------

# bf16 and fp8 tokens; fp8 skipped, with the reason, where torch has no float8_e4m3fn.
token_dtypes = pytest.mark.parametrize("fp8", [
    False,
    pytest.param(True, marks=pytest.mark.skipif(
        fp8_dtype() is None, reason=f"torch {torch.__version__} has no float8_e4m3fn")),
], ids=["bf16", "fp8"])


@two_gpus
@token_dtypes
@topologies
def test_random_routings_at_deepseek_hidden(fp8, topology):
    cases = [("random", [128, 128]), ("random", [77, 128]), ("random", [128, 5])]
    run_two("routings", topology, fp8=fp8, hidden=7168, top_k=8, max_tokens=128, cases=cases)


@two_gpus
@token_dtypes
@topologies
def test_edge_routings(fp8, topology):
    run_two("routings", topology, fp8=fp8, hidden=1024, top_k=4, max_tokens=64, cases=EDGES)


@two_gpus
@token_dtypes
@topologies
def test_cuda_graph_replays(fp8, topology):
    run_two("graph", topology, fp8=fp8, replays=8)


@two_gpus
@topologies
def test_a_thousand_rounds(topology):
    run_two("loop", topology, iterations=1000)


@two_gpus
@topologies
def test_a_silent_peer_is_a_timeout_not_a_hang(topology):
    run_two("silent_peer", topology)


@two_gpus
@topologies
def test_peers_configured_differently_are_refused(topology):
    run_two("mismatch", topology)


# Everywhere (CI included): the configuration is checked before any GPU is touched.


@pytest.mark.parametrize("field,kwargs,words", [
    ("num_experts", {"num_experts": 255}, "num_experts 255"),
    ("hidden", {"hidden": 7000}, "hidden 7000"),
    ("top_k", {"top_k": 0}, "top_k 0"),
    ("rank", {"rank": 2}, "rank 2"),
    ("dtype", {"dtype": "fp16"}, "fp16"),
    ("timeout", {"timeout": -1.0}, "timeout"),
    ("proxy_memory", {"proxy_memory": "cpu"}, "proxy_memory 'cpu' is none of"),
])
def test_bad_configuration_is_named(field, kwargs, words):
    args = dict(rank=0, world_size=2, num_experts=256, hidden=7168, top_k=8,
                max_tokens_per_rank=128, dtype="fp8_e4m3")
    args.update(kwargs)
    with pytest.raises(fabric_lib.InvalidArgument, match=words):
        fabric_lib._fabric_lib._EpAllToAll(**args)


def test_nodes_of_unequal_size_are_refused():
    with pytest.raises(fabric_lib.InvalidArgument, match="gpus_per_node 8 does not divide"):
        fabric_lib._fabric_lib._EpAllToAll(0, 12, 264, 7168, 8, 128, gpus_per_node=8)


@pytest.mark.skipif(fabric_lib.HAS_CUDA and gpu_count() > 0,
                    reason="this machine has a CUDA GPU: the two-GPU tests create objects")
def test_several_nodes_take_a_provider_and_need_a_gpu_here():
    # Valid as a configuration (two one-GPU nodes over tcp); without a GPU creation is refused.
    with pytest.raises(fabric_lib.Unsupported):
        fabric_lib._fabric_lib._EpAllToAll(0, 2, 256, 7168, 8, 128, gpus_per_node=1,
                                           provider="tcp", nics=["lo"])


@pytest.mark.skipif(not fabric_lib.HAS_CUDA or gpu_count() == 0,
                    reason="needs a GPU to create the object (CI has none)")
def test_gpu_areas_need_an_engine_that_reaches_gpu_memory():
    # tcp stages GPU memory through host memory: the proxy's areas cannot be in GPU memory, and
    # "auto" puts them in host memory. (Creation alone, with no peer: no connect().)
    with pytest.raises(fabric_lib.Unsupported, match="proxy_memory 'gpu' needs NICs"):
        fabric_lib._fabric_lib._EpAllToAll(0, 2, 256, 1024, 8, 16, gpus_per_node=1,
                                           provider="tcp", nics=["lo"], proxy_memory="gpu")
    a2a = fabric_lib._fabric_lib._EpAllToAll(0, 2, 256, 1024, 8, 16, gpus_per_node=1,
                                             provider="tcp", nics=["lo"])
    assert a2a.proxy_memory == "host"
    a2a.close()


@pytest.mark.skipif(fabric_lib.HAS_CUDA and gpu_count() > 0,
                    reason="this machine has a CUDA GPU: the two-GPU tests create objects")
def test_without_a_gpu_creation_is_unsupported():
    with pytest.raises(fabric_lib.Unsupported):
        fabric_lib._fabric_lib._EpAllToAll(0, 2, 256, 7168, 8, 128)


@pytest.mark.skipif(fabric_lib.HAS_CUDA and gpu_count() > 0,
                    reason="this machine has a CUDA GPU: the two-GPU tests create objects")
def test_the_wrapper_without_cuda_raises_unsupported_naming_what_is_missing():
    """fabric_lib.ep.AllToAll checks for CUDA before torch is asked for a device (torch raised
    its own AssertionError from torch.cuda.current_device())."""
    from fabric_lib.ep import AllToAll

    with pytest.raises(fabric_lib.Unsupported, match="CUDA"):
        AllToAll(num_experts=256, hidden=7168, top_k=8, max_tokens_per_rank=128)


def test_the_reference_checks_catch_a_wrong_dispatch():
    """The checks themselves, on the CPU with a plain-PyTorch all-to-all: they pass on its
    output and fail once one row is wrong."""
    L, hidden, top_k = 8, 256, 4
    inputs = [make_inputs(5, r, 20, hidden, 16, top_k, False, "repeated") for r in range(WORLD)]
    got = simulated_dispatch(inputs, 1, L)
    check_dispatch(got, inputs, 1, L, False)
    got.tokens[0, 0] += 1
    with pytest.raises(AssertionError, match="token bytes"):
        check_dispatch(got, inputs, 1, L, False)
    got = simulated_dispatch(inputs, 1, L)
    other = int((got.source != got.source[0]).any(dim=1).nonzero()[0])  # a row from elsewhere
    got.source[[0, other]] = got.source[[other, 0]].clone()
    with pytest.raises(AssertionError):
        check_dispatch(got, inputs, 1, L, False)
    got = simulated_dispatch(inputs, 1, L)
    got.expert_counts[0] += 1
    with pytest.raises(AssertionError, match="counts"):
        check_dispatch(got, inputs, 1, L, False)
    # The combine reference against a plain-PyTorch combine of every rank's expert outputs.
    x, _, idx, w = inputs[1]
    ref = reference_combine(x, None, idx, w)
    out = torch.zeros(ref.shape)
    for dst in range(WORLD):
        got = simulated_dispatch(inputs, dst, L)
        y = expert_outputs(got, L, dst, False)
        assert y.shape == (WORLD * 20 * top_k, hidden)
        for i in range(int(got.expert_offsets[-1])):
            s, t = got.source[i].tolist()
            if s == 1:
                out[t] += got.weights[i] * y[i].float()
    assert_combined(out.to(torch.bfloat16), ref, "simulated combine")
    with pytest.raises(AssertionError, match="combine"):
        assert_combined(ref + 0.5, ref, "combine")


def simulated_dispatch(inputs, dst, L):
    """What rank `dst` should receive, in the flat layout, from plain PyTorch (rows reversed
    within each expert, as the order there is free)."""
    from fabric_lib.ep import DispatchResult

    ref = reference_rows(inputs, dst, L)
    order = torch.argsort(ref[:, 0] * 10**6 - torch.arange(len(ref)), stable=True)
    ref = ref[order]
    hidden = inputs[0][0].shape[1]
    rows = WORLD * inputs[0][0].shape[0] * inputs[0][2].shape[1]
    tokens = torch.zeros(rows, hidden, dtype=inputs[0][0].dtype)
    weights = torch.zeros(rows)
    source = torch.zeros(rows, 2, dtype=torch.int32)
    for i, (_, s, t, k) in enumerate(ref.tolist()):
        tokens[i] = inputs[s][0][t]
        weights[i] = inputs[s][3][t, k]
        source[i] = torch.tensor([s, t])
    counts = torch.bincount(ref[:, 0], minlength=L).to(torch.int32)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(counts, 0)])
    return DispatchResult(tokens=tokens, scales=None, weights=weights, source=source,
                          expert_counts=counts, expert_offsets=offsets.to(torch.int32))
