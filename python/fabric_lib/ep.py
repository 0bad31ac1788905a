"""fabric_lib.ep: MoE expert-parallel dispatch and combine between GPUs, within and across nodes.

Each rank holds num_experts / world_size experts (rank r the experts [r * n, (r + 1) * n)).
Dispatch sends every token to the ranks of its top-k experts; each rank gets one row per
(token, local expert) pair, grouped by expert. Combine sends each row's expert output back and
sums a token's outputs weighted by its top-k weights (fp32, output bf16). Tokens travel over
NVLink straight into the peers' GPU memory (CUDA IPC), and the receiving kernels learn what
arrived from flags on the GPU, so nothing waits on the host and the calls can be captured in a
CUDA graph. Ranks on other nodes (gpus_per_node < world size) are reached through a host proxy
thread per rank and a TransferEngine of `provider` (writes with immediates into the peer's
pinned host memory); the kernels stay the same and still wait only on flags::

    dist.init_process_group("nccl", ...)            # one process per GPU of the node
    a2a = fabric_lib.ep.AllToAll(num_experts=256, hidden=7168, top_k=8,
                                 max_tokens_per_rank=128, dtype=torch.float8_e4m3fn)
    got = a2a.dispatch(x, topk_idx, topk_weights, scales=x_scales)
    # local expert e's rows: got.tokens[got.expert_offsets[e]:got.expert_offsets[e + 1]]
    y = a2a.combine(expert_out, topk_idx, topk_weights)   # [num_tokens, hidden] bf16

Each of dispatch and combine is also split into a send and a receive half (dispatch_send,
dispatch_recv, combine_send, combine_recv) so that compute can run between them. Every rank
calls the same sequence. A rank that stops answering makes its peers' kernels give up after
`timeout` seconds; the next call (or check()) then raises fabric_lib.Timeout (or
fabric_lib.PeerUnreachable when the proxy could not reach a peer of another node), and the
object must be closed on every rank. torch is imported when these run, not when fabric_lib is imported.
See docs/moe.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

from ._fabric_lib import InvalidArgument, _EpAllToAll


@dataclass
class DispatchResult:
    """What dispatch_recv returns. Rows are grouped by local expert: expert e's rows are
    [expert_offsets[e], expert_offsets[e + 1]); rows from expert_offsets[-1] on hold nothing.
    Within an expert the rows come in no particular order."""

    tokens: Any  # [max_recv_rows, hidden], the dispatch dtype
    scales: Optional[Any]  # fp8: [max_recv_rows, hidden // 128] float32; bf16: None
    weights: Any  # [max_recv_rows] float32: each row's top-k weight (0 if none was sent)
    source: Any  # [max_recv_rows, 2] int32: each row's source rank and token index there
    expert_counts: Any  # [num_local_experts] int32
    expert_offsets: Any  # [num_local_experts + 1] int32


def _dtype_name(dtype: Any) -> str:
    import torch

    if dtype in (torch.bfloat16, "bf16"):
        return "bf16"
    if dtype == "fp8_e4m3" or dtype == getattr(torch, "float8_e4m3fn", None):
        return "fp8_e4m3"
    raise InvalidArgument(f"dtype {dtype}: expected torch.bfloat16 or torch.float8_e4m3fn")


def _torch_with_cuda() -> Any:
    """(torch, torch.distributed), once it is known that this process can run the kernels:
    Unsupported naming what is missing (checked before torch is asked for a device, which
    would raise its own AssertionError without CUDA)."""
    from ._fabric_lib import HAS_CUDA, Unsupported

    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        raise Unsupported(f"fabric_lib.ep.AllToAll needs PyTorch, which is not importable: {e}"
                          ) from e
    if not HAS_CUDA:
        raise Unsupported("fabric_lib.ep.AllToAll needs fabric_lib built with CUDA "
                          "(fabric_lib.HAS_CUDA is False)")
    if not torch.cuda.is_available():
        raise Unsupported(f"fabric_lib.ep.AllToAll needs a CUDA GPU, and torch "
                          f"{torch.__version__} sees none (torch.cuda.is_available() is False; "
                          f"torch built with CUDA {torch.version.cuda})")
    if not dist.is_available():
        raise Unsupported(f"fabric_lib.ep.AllToAll needs torch.distributed, which torch "
                          f"{torch.__version__} was built without")
    return torch, dist


class AllToAll:
    """One rank's side of an MoE all-to-all over the ranks of `group` (default: the world).
    gpus_per_node: ranks of one node (None: all of them; 1: each GPU its own node), ranks r and
    q sharing a node when r // gpus_per_node == q // gpus_per_node; ranks of other nodes go
    through the proxy, over `provider` ("auto", "tcp", "shm", "verbs") on `nics` (None: the
    provider's first). proxy_memory: where the proxy's staging and receive areas are ("host":
    pinned host memory; "gpu": GPU memory, for NICs that reach it themselves (GPUDirect RDMA),
    Unsupported elsewhere; "auto": "gpu" where the engine reaches it itself, else "host").
    Created collectively: every rank of the group constructs it (the handles
    are exchanged with torch.distributed.all_gather_object). Blocking. Not thread-safe."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        top_k: int,
        max_tokens_per_rank: int,
        dtype: Any = None,
        group: Any = None,
        gpus_per_node: Optional[int] = None,
        timeout: float = 10.0,
        device: Any = None,
        provider: str = "auto",
        nics: Optional[List[str]] = None,
        proxy_memory: str = "auto",
    ) -> None:
        torch, dist = _torch_with_cuda()
        self._torch = torch
        self.group = group
        self.device = torch.device("cuda" if device is None else device)
        if self.device.type != "cuda":
            raise InvalidArgument(f"device {self.device}: the all-to-all runs on a CUDA GPU")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = torch.bfloat16 if dtype is None else dtype
        name = _dtype_name(self.dtype)
        if name == "fp8_e4m3":
            self.dtype = torch.float8_e4m3fn
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        self._impl: Optional[_EpAllToAll] = _EpAllToAll(
            rank, world, num_experts, hidden, top_k, max_tokens_per_rank, name,
            gpus_per_node or 0, timeout, self.device.index, provider, list(nics or []),
            proxy_memory)
        handles: List[Any] = [None] * world
        dist.all_gather_object(handles, self._impl.handle(), group=group)
        self._impl.connect(handles)
        self._num_tokens = 0
        self._with_weights = False

    # --- properties ---

    @property
    def impl(self) -> _EpAllToAll:
        """The binding; raises Closed once closed."""
        if self._impl is None:
            from ._fabric_lib import Closed

            raise Closed("the all-to-all is closed")
        return self._impl

    @property
    def rank(self) -> int:
        return self.impl.rank

    @property
    def world_size(self) -> int:
        return self.impl.world_size

    @property
    def num_local_experts(self) -> int:
        return self.impl.num_local_experts

    @property
    def max_recv_rows(self) -> int:
        """Rows of dispatch_recv's outputs and of combine_send's input."""
        return self.impl.max_recv_rows

    # --- checks ---

    def _tensor(self, t: Any, name: str, dtype: Any, shape: tuple) -> int:
        """The address of `t` after checking its device, dtype, shape and layout."""
        torch = self._torch
        if not isinstance(t, torch.Tensor):
            raise InvalidArgument(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.device != self.device:
            raise InvalidArgument(f"{name} is on {t.device}, this rank's GPU is {self.device}")
        if t.dtype != dtype:
            raise InvalidArgument(f"{name} is {t.dtype}, expected {dtype}")
        if tuple(t.shape) != tuple(shape):
            raise InvalidArgument(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        if not t.is_contiguous():
            raise InvalidArgument(f"{name} is not contiguous")
        return t.data_ptr()

    def _stream(self) -> int:
        return self._torch.cuda.current_stream(self.device).cuda_stream

    # --- dispatch ---

    def dispatch_send(self, tokens: Any, topk_idx: Any, topk_weights: Any = None,
                      scales: Any = None) -> None:
        """Enqueues the send half of a dispatch on the current stream. tokens: [num_tokens,
        hidden] in the dispatch dtype; topk_idx: [num_tokens, top_k] int64 (negative: no
        expert); topk_weights: [num_tokens, top_k] float32 or None; scales (fp8 only):
        [num_tokens, hidden // 128] float32."""
        torch = self._torch
        impl = self.impl
        n = int(tokens.shape[0]) if isinstance(tokens, torch.Tensor) and tokens.dim() == 2 else -1
        if n < 0:
            raise InvalidArgument("tokens: expected a 2-D tensor [num_tokens, hidden]")
        k = impl.top_k
        t = self._tensor(tokens, "tokens", self.dtype, (n, impl.hidden))
        i = self._tensor(topk_idx, "topk_idx", torch.int64, (n, k))
        w = 0 if topk_weights is None else \
            self._tensor(topk_weights, "topk_weights", torch.float32, (n, k))
        s = 0
        if impl.scale_columns:
            if scales is None:
                raise InvalidArgument("scales: fp8 tokens need their [num_tokens, hidden // 128] "
                                      "float32 scales")
            s = self._tensor(scales, "scales", torch.float32, (n, impl.scale_columns))
        elif scales is not None:
            raise InvalidArgument("scales given, but bf16 tokens have no scales")
        impl.dispatch_send(t, s, i, w, n, self._stream())
        self._num_tokens = n
        self._with_weights = topk_weights is not None

    def dispatch_recv(self, out: Optional[DispatchResult] = None) -> DispatchResult:
        """Enqueues the receive half of a dispatch on the current stream and returns its
        outputs (filled when the stream gets there). `out`: tensors to fill instead of new ones
        (an earlier result of this object)."""
        torch = self._torch
        impl = self.impl
        rows, experts = impl.max_recv_rows, impl.num_local_experts
        if out is None:
            empty = lambda shape, dtype: torch.empty(shape, dtype=dtype, device=self.device)
            out = DispatchResult(
                tokens=empty((rows, impl.hidden), self.dtype),
                scales=empty((rows, impl.scale_columns), torch.float32)
                if impl.scale_columns else None,
                weights=empty((rows,), torch.float32),
                source=empty((rows, 2), torch.int32),
                expert_counts=empty((experts,), torch.int32),
                expert_offsets=empty((experts + 1,), torch.int32),
            )
        scales = 0
        if impl.scale_columns:
            scales = self._tensor(out.scales, "out.scales", torch.float32,
                                  (rows, impl.scale_columns))
        impl.dispatch_recv(
            self._tensor(out.tokens, "out.tokens", self.dtype, (rows, impl.hidden)), scales,
            self._tensor(out.weights, "out.weights", torch.float32, (rows,)),
            self._tensor(out.source, "out.source", torch.int32, (rows, 2)),
            self._tensor(out.expert_counts, "out.expert_counts", torch.int32, (experts,)),
            self._tensor(out.expert_offsets, "out.expert_offsets", torch.int32, (experts + 1,)),
            self._stream())
        return out

    def dispatch(self, tokens: Any, topk_idx: Any, topk_weights: Any = None, scales: Any = None,
                 out: Optional[DispatchResult] = None) -> DispatchResult:
        """dispatch_send, then dispatch_recv."""
        self.dispatch_send(tokens, topk_idx, topk_weights, scales)
        return self.dispatch_recv(out)

    # --- combine ---

    def combine_send(self, expert_out: Any) -> None:
        """Enqueues the send half of a combine: expert_out [max_recv_rows, hidden] bf16, row i
        the expert output for row i of the last dispatch_recv (rows past its last are not
        read)."""
        impl = self.impl
        impl.combine_send(
            self._tensor(expert_out, "expert_out", self._torch.bfloat16,
                         (impl.max_recv_rows, impl.hidden)),
            self._stream())

    def combine_recv(self, topk_idx: Any, topk_weights: Any, out: Any = None) -> Any:
        """Enqueues the receive half of a combine and returns out [num_tokens, hidden] bf16:
        out[t] = sum over k of topk_weights[t, k] x the output of expert topk_idx[t, k] for
        token t (slots with a negative index are skipped). topk_idx and topk_weights: the
        dispatch's tokens' (the same indices)."""
        torch = self._torch
        impl = self.impl
        n, k = self._num_tokens, impl.top_k
        if out is None:
            out = torch.empty((n, impl.hidden), dtype=torch.bfloat16, device=self.device)
        impl.combine_recv(
            self._tensor(topk_idx, "topk_idx", torch.int64, (n, k)),
            self._tensor(topk_weights, "topk_weights", torch.float32, (n, k)), n,
            self._tensor(out, "out", torch.bfloat16, (n, impl.hidden)), self._stream())
        return out

    def combine(self, expert_out: Any, topk_idx: Any, topk_weights: Any, out: Any = None) -> Any:
        """combine_send, then combine_recv."""
        self.combine_send(expert_out)
        return self.combine_recv(topk_idx, topk_weights, out)

    # --- failures and teardown ---

    def check(self) -> None:
        """Raises the first failure a kernel of this rank recorded (fabric_lib.Timeout when a
        peer stopped answering, InvalidArgument for an expert index past num_experts). Never
        blocks: synchronise with the stream first to cover the launches before it."""
        self.impl.check()

    def proxy_stats(self) -> dict:
        """The inter-node proxy's counters since creation (all zero with every rank on one node):
        per kind ``"dispatch"`` / ``"combine"`` a dict of ``rounds_sent``, ``writes_sent``,
        ``bytes_sent``, ``post_ns`` (the GPU's staged round seen to its writes posted),
        ``complete_ns`` (posted to the last write completed), ``rounds_received`` and
        ``receive_ns`` (a peer's counts seen to its flag raised), summed over rounds and peers;
        and ``passes`` and ``naps`` of the proxy's loop. See docs/moe.md."""
        return self.impl.proxy_stats()

    @property
    def proxy_memory(self) -> str:
        """Where the proxy's areas are: "none" (every rank on this node), "host" or "gpu" (GPU
        memory its engine reaches itself)."""
        return self.impl.proxy_memory

    def close(self, barrier: bool = True) -> None:
        """Waits for this rank's GPU work, then (with `barrier`, collective) for every rank of the
        group, and frees the buffers. Idempotent."""
        if self._impl is None:
            return
        self._torch.cuda.synchronize(self.device)
        if barrier:
            import torch.distributed as dist

            dist.barrier(group=self.group)
        self._impl.close()
        self._impl = None

    def __enter__(self) -> "AllToAll":
        return self

    def __exit__(self, *args: Any) -> None:
        self.close()
