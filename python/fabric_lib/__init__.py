"""fabric_lib: one-sided RDMA-style writes with immediates between processes.

Python bindings of fabric-lib's TransferEngine (libfabric tcp, shm, efa). A receiver registers
memory and hands its engine address and the registration's descriptor (both bytes, picklable)
to a sender over any side channel (a pipe, torch.distributed: see fabric_lib.distributed); the
sender writes into it, and the receiver counts the immediates that arrive::

    engine = fabric_lib.TransferEngine(fabric_lib.Config(provider="tcp", nics=["lo"]))
    reg = engine.register(tensor)                     # NumPy, PyTorch (CPU), buffer protocol
    send_to_peer(bytes(engine.address), bytes(reg.descriptor))
    ...
    engine.paged_write(src_reg, dst_descriptor, page_bytes, src_pages, dst_pages, imm=7).result()
    await engine.write(src_reg, dst_descriptor)       # every submission is also awaitable
    engine.write(src_reg, dst_descriptor, counter=c)  # or counted: c = CompletionCounter()

fabric_lib also carries fabric::kv (KvLayout, KvDecoder, KvPrefiller: disaggregated KV-cache
transfer, docs/kv.md) and its membership registries (LocalRegistry, FileRegistry, EtcdRegistry),
and the RL weight push's schedule (WeightSchedule; the push itself is fabric_lib.weights,
docs/weights.md).

Every library status is raised as its own exception class, derived from FabricError.
"""

import atexit as _atexit

from ._fabric_lib import (
    HAS_CUDA,
    Address,
    AlreadyExists,
    Cancelled,
    Closed,
    CompletionCounter,
    Config,
    EngineStats,
    ErrorCode,
    EtcdRegistry,
    FabricError,
    FaultConfig,
    FileRegistry,
    GroupConfig,
    GroupConfigList,
    GroupInfo,
    GroupStats,
    NicStats,
    InternalError,
    InvalidArgument,
    KvDecodeGroup,
    KvDecoder,
    KvLayout,
    KvOptions,
    KvPrefiller,
    LocalRegistry,
    LocalRegistryState,
    Member,
    MemoryHandle,
    NotFound,
    OutOfRange,
    PeerGroup,
    PeerUnreachable,
    ProviderError,
    Registration,
    Registry,
    RemoteAccess,
    RemoteMemory,
    Routing,
    ScatterTarget,
    Sharding,
    SliceCopy,
    Timeout,
    TransferEngine,
    Unsupported,
    UvmWatchers,
    VerbsConfig,
    Watcher,
    WeightEntry,
    WeightGather,
    WeightParam,
    WeightReceiver,
    WeightSchedule,
    WeightSender,
    __version__,
    _close_all,
    _kv_close_all,
    error_class,
    plan_slices,
    slices_between,
    slices_into,
    sources_of,
    targets_of,
)
from ._futures import Expectation, KvRequest, Transfer
from ._info import Info, info

# No engine thread may outlive the interpreter: close every engine still open at exit, after
# the KV objects and registries that use them (atexit runs the last registered first).
_atexit.register(_close_all)
_atexit.register(_kv_close_all)

__all__ = [
    "HAS_CUDA",
    "Address",
    "AlreadyExists",
    "Cancelled",
    "Closed",
    "CompletionCounter",
    "Config",
    "EngineStats",
    "ErrorCode",
    "EtcdRegistry",
    "Expectation",
    "FabricError",
    "FaultConfig",
    "FileRegistry",
    "GroupConfig",
    "GroupConfigList",
    "GroupInfo",
    "GroupStats",
    "NicStats",
    "Info",
    "InternalError",
    "InvalidArgument",
    "KvDecodeGroup",
    "KvDecoder",
    "KvLayout",
    "KvOptions",
    "KvPrefiller",
    "KvRequest",
    "LocalRegistry",
    "LocalRegistryState",
    "Member",
    "MemoryHandle",
    "NotFound",
    "OutOfRange",
    "PeerGroup",
    "PeerUnreachable",
    "ProviderError",
    "Registration",
    "Registry",
    "RemoteAccess",
    "RemoteMemory",
    "Routing",
    "ScatterTarget",
    "Sharding",
    "SliceCopy",
    "Timeout",
    "Transfer",
    "TransferEngine",
    "Unsupported",
    "UvmWatchers",
    "VerbsConfig",
    "Watcher",
    "WeightEntry",
    "WeightGather",
    "WeightParam",
    "WeightReceiver",
    "WeightSchedule",
    "WeightSender",
    "__version__",
    "error_class",
    "info",
    "plan_slices",
    "slices_between",
    "slices_into",
    "sources_of",
    "targets_of",
]
