"""fabric_lib.info(): what fabric-info reports, as a dict that prints like fabric-info."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from ._fabric_lib import _gather_info


def _cpu_ranges(cpus: Sequence[int]) -> str:
    """'0-3,8,10-11'; '-' when empty."""
    if not cpus:
        return "-"
    parts = []
    i = 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        parts.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(parts)


class Info(dict):  # type: ignore[type-arg]
    """The report of `fabric-info --json` (same keys: libfabric, auto_provider, providers,
    nics, allowed_cpus, engine; engine also has requested_provider and requested_nics); str()
    gives fabric-info's text."""

    def __str__(self) -> str:
        out = [f'libfabric {self["libfabric"]}; provider "auto" resolves to {self["auto_provider"]}', ""]
        out.append("Providers (reliable-datagram endpoints with RMA and remote CQ data):")
        for p in self["providers"]:
            if not p["present"]:
                out.append(f'  {p["name"]:<6} absent')
                continue
            providers: list[str] = []
            nics: list[str] = []
            for d in p["domains"]:
                if d["provider"] not in providers:
                    providers.append(d["provider"])
                if d["nic"] not in nics:
                    nics.append(d["nic"])
            out.append(f'  {p["name"]:<6} present ({", ".join(providers)})')
            for nic in nics:
                fabrics = [
                    d["fabric"] + (" (ipv4)" if d["ipv4"] else "")
                    for d in p["domains"]
                    if d["nic"] == nic
                ]
                out.append(f'           NIC {nic:<10} fabric {", ".join(fabrics)}')
        out += ["", "NICs seen by hwloc:"]
        if not self["nics"]:
            out.append("  (none)")
        for n in self["nics"]:
            numa = "-" if n["numa_node"] < 0 else str(n["numa_node"])
            out.append(
                f'  {n["name"]:<14} pci {n["pci"] or "-":<13} numa {numa:<3} cpus {_cpu_ranges(n["cpus"])}'
            )
        cpus = self["allowed_cpus"]
        out += ["", f"CPUs this process may run on: {_cpu_ranges(cpus)} ({len(cpus)} in all)"]
        e = self["engine"]
        if e is not None:
            nics_text = ",".join(e["requested_nics"]) if e["requested_nics"] else "(first)"
            out += ["", f'TransferEngine on provider {e["requested_provider"]}, NIC(s) {nics_text}:']
            if not e["ok"]:
                out.append(f'  could not be created: {e["error"]}')
            else:
                cpu = "unpinned" if e["cpu"] < 0 else str(e["cpu"])
                out.append(f'  provider           {e["provider"]}')
                out.append(f'  NICs               {", ".join(e["nics"])}')
                out.append(f"  worker CPU         {cpu}")
                out.append(f'  delivery_complete  {"yes" if e["delivery_complete"] else "no"}')
                out.append(f'  address            {e["address"]}')
                out.append(f'  address hex        {e["address_hex"]}')
        return "\n".join(out)

    def __repr__(self) -> str:
        return f"Info({dict.__repr__(self)})"


def info(
    provider: Optional[str] = None,
    nics: Optional[Sequence[str]] = None,
    cpu: Optional[str] = None,
    engine: bool = True,
) -> Info:
    """What fabric-lib can use on this machine, as `fabric-info` reports it: the libfabric
    providers (tcp, shm, efa, verbs) and their NICs, the NICs hwloc sees with their NUMA node
    and CPUs, the CPUs this process may run on, and, with `engine`, what a TransferEngine opened
    on `provider` (default tcp, or FABRIC_PROVIDER) and `nics` (default lo for tcp, shm for shm,
    or FABRIC_NICS) turned out to be. `cpu`: "auto", "none" or a CPU number. Never raises for an
    absent provider: engine["ok"] is False and engine["error"] says why.

    print(fabric_lib.info()) prints fabric-info's text; the dict has fabric-info --json's keys.
    """
    report: dict[str, Any] = _gather_info(
        provider, list(nics) if nics is not None else None, cpu, engine
    )
    return Info(report)
