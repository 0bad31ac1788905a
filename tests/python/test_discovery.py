"""fabric-info, fabric_lib.info() and fabric-bench describe the machine through one discovery
API (include/fabric/discovery.h): the three must report the same thing."""

import json
import os
import subprocess
from pathlib import Path

import pytest

import fabric_lib

# make test-python runs against <build>/python; the tools are in <build>/bin.
BIN = Path(os.environ.get("FABRIC_BIN_DIR", Path(fabric_lib.__file__).resolve().parents[2] / "bin"))


def tool(name):
    path = BIN / name
    if not path.is_file():
        pytest.skip(f"{name} not found in {BIN} (set FABRIC_BIN_DIR to the build's bin/)")
    return path


def run(*args):
    return subprocess.run([str(a) for a in args], check=True, capture_output=True, text=True,
                          timeout=120).stdout


def test_info_tool_and_bench_report_the_same_machine():
    from_tool = json.loads(run(tool("fabric-info"), "--json", "--no-engine"))
    from_bench = json.loads(run(tool("fabric-bench"), "--machine"))
    from_python = fabric_lib.info(engine=False)
    assert dict(from_python) == from_tool == from_bench
    assert [p["name"] for p in from_tool["providers"]] == ["tcp", "shm", "efa", "verbs"]
    # What the Python copy used to drop: the verbs ports, GPUs and paths are there.
    for key in ("verbs_built", "verbs", "gpus", "paths"):
        assert key in from_python
    assert any(p["provider"] == "tcp" and p["nic"] == "lo" and p["usable"]
               for p in from_python["paths"])
    # The text is the same formatting code too.
    assert str(from_python) == run(tool("fabric-info"), "--no-engine")


def test_engine_report_is_the_same_but_for_the_address():
    from_tool = json.loads(
        run(tool("fabric-info"), "--json", "--provider", "tcp", "--nic", "lo", "--cpu", "none"))
    from_python = fabric_lib.info(provider="tcp", nics=["lo"], cpu="none")
    a, b = from_tool.pop("engine"), dict(from_python).pop("engine")
    assert {k: v for k, v in from_python.items() if k != "engine"} == from_tool
    assert a["ok"] and b["ok"]
    for key in ("address", "address_hex"):  # every engine has its own address
        a.pop(key), b.pop(key)
    assert a == b
