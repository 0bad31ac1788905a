"""fabric_lib.info(): what fabric-info reports, as a dict that prints like fabric-info.

Both come from the library's discovery API (include/fabric/discovery.h): the dict is
`fabric-info --json` parsed, str() is fabric-info's text, so neither can drift from the tool.
"""

from __future__ import annotations

import codecs
import json
from typing import Any, Optional, Sequence, Tuple

from ._fabric_lib import _gather_info


def _json_backslashreplace(err: UnicodeError) -> Tuple[str, int]:
    """Bytes of the report that are not UTF-8 as the JSON escape of a backslash followed by
    xNN: the string then reads '\\xNN', as the text report writes them. The report's writer
    (src/common/json.h) already escapes such bytes (a NIC name, an environment variable quoted
    in an error) that way, so this only guards against a report that is not its."""
    assert isinstance(err, UnicodeDecodeError)
    bad = err.object[err.start:err.end]
    return "".join(f"\\\\x{b:02x}" for b in bad), err.end


codecs.register_error("fabric_lib.json_backslashreplace", _json_backslashreplace)


class Info(dict):  # type: ignore[type-arg]
    """The report of `fabric-info --json` (same keys: libfabric, auto_provider, providers,
    verbs_built, verbs, nics, gpus, paths, allowed_cpus, cuda_built, cuda_device, engine);
    str() gives fabric-info's text."""

    def __init__(self, report: dict[str, Any], text: str) -> None:
        super().__init__(report)
        self._text = text

    def __str__(self) -> str:
        return self._text

    def __repr__(self) -> str:
        return f"Info({dict.__repr__(self)})"


def info(
    provider: Optional[str] = None,
    nics: Optional[Sequence[str]] = None,
    cpu: Optional[str] = None,
    engine: bool = True,
) -> Info:
    """What fabric-lib can use on this machine, as `fabric-info` reports it: the providers
    (tcp, shm, efa, verbs) and their NICs, the verbs backend's RDMA ports, the NICs and GPUs
    hwloc sees with their PCI address, NUMA node and CPUs (and, for GPUs, the NICs near them),
    the paths (provider on NIC) and what they can do, the CPUs this process may run on, and,
    with `engine`, what a TransferEngine opened on `provider` (default tcp, or FABRIC_PROVIDER)
    and `nics` (default lo for tcp, shm for shm, or FABRIC_NICS) turned out to be. `cpu`:
    "auto", "none" or a CPU number. Never raises for an absent provider: engine["ok"] is False
    and engine["error"] says why.

    print(fabric_lib.info()) prints fabric-info's text; the dict has fabric-info --json's keys.
    """
    report, text = _gather_info(provider, list(nics) if nics is not None else None, cpu, engine)
    return Info(json.loads(report.decode("utf-8", "fabric_lib.json_backslashreplace")), text)
