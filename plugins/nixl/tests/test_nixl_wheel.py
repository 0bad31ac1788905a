"""The FABRIC plugin as NIXL's Python wheel loads it (pip's nixl, which vLLM's NixlConnector uses),
installed beside the wheel's own plugins by tools/nixl/build_wheel_plugin.sh:

- two processes, each nixl_agent(name, nixl_agent_config(backends=["FABRIC"])) as vLLM makes
  it: FABRIC in the plugin list and created, DRAM registered, metadata exchanged, a WRITE and a
  READ each way with a notification, the bytes checked (sha256) where they land, at the moment
  the notification is seen;
- UCX created beside FABRIC from the wheel's plugin folder, with no NIXL_PLUGIN_DIR, and both
  moving bytes;
- the plugin's log lines follow NIXL_LOG_LEVEL: it logs through the Abseil that NIXL configured
  (libnixl_common.so's);
- a NIXL_PLUGIN_DIR that does not exist, one without the plugin, and a plugin that does not load:
  what NIXL says, and that tools/nixl/check_plugin.py names the folder, where it came from and
  what to set.

Run by tools/nixl/run_wheel_tests.sh (the ctest nixl_wheel) with the wheel's Python, once per
provider; by hand:

    FABRIC_PROVIDER=shm VENV/bin/python -m pytest -q plugins/nixl/tests/test_nixl_wheel.py
"""

import json
import os
import select
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

nixl_api = pytest.importorskip(
    "nixl._api", reason="NIXL's Python module is not importable (pip install nixl==1.4.0)")
pytest.importorskip("torch")

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
CHECK = REPO / "tools" / "nixl" / "check_plugin.py"
PEER = HERE / "nixl_peer.py"
PROVIDER = os.environ.get("FABRIC_PROVIDER", "tcp")
DEADLINE_S = 60.0

PKG = Path(nixl_api.__file__).resolve().parent
try:
    metadata.version(PKG.name.replace("_", "-"))
    IS_WHEEL = True
except metadata.PackageNotFoundError:  # NIXL built from source, on PYTHONPATH
    IS_WHEEL = False
# NIXL's default plugin folder: plugins/ beside libnixl.so; in the wheel,
# <site-packages>/.nixl_cu<N>.mesonpy.libs/plugins.
WHEEL_PLUGINS = PKG.parent / f".{PKG.name}.mesonpy.libs" / "plugins"

# A process that created a UCX backend of NIXL's 1.4.0 wheel crashes in its exit handlers on a
# host without RDMA devices (libnl-route-3's destructor, bundled for UCX; FABRIC or not): the
# scripts below that create UCX leave with os._exit once their answer is out.
UCX_EXIT = "sys.stdout.flush(); os._exit(0)"


def wheel_only():
    """Skips unless FABRIC is installed in the wheel's own plugin folder and NIXL_PLUGIN_DIR does
    not replace it."""
    if not (WHEEL_PLUGINS / "libplugin_FABRIC.so").exists():
        pytest.skip(f"FABRIC is not installed in {WHEEL_PLUGINS} (tools/nixl/build_wheel_plugin.sh)")
    if "NIXL_PLUGIN_DIR" in os.environ:
        pytest.skip("NIXL_PLUGIN_DIR is set: these tests are about the wheel's own plugin folder")


def run_python(code, env, timeout=DEADLINE_S):
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=timeout)


class PeerProcess:
    """plugins/nixl/tests/nixl_peer.py: one agent, one JSON answer per JSON command."""

    def __init__(self, name, size, env, log):
        self.name = name
        self.log = log
        self.proc = subprocess.Popen([sys.executable, str(PEER), name, str(size)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=open(log, "w"), text=True)

    def call(self, cmd, **args):
        self.proc.stdin.write(json.dumps({"cmd": cmd, **args}) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], DEADLINE_S)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.proc.kill()
            raise AssertionError(f"{self.name}: no answer to {cmd}; its log:\n"
                                 f"{Path(self.log).read_text()[-4000:]}")
        answer = json.loads(line)
        assert "error" not in answer, f"{self.name} {cmd}: {answer['error']}"
        return answer


# --- two processes, as vLLM's prefill and decode -----------------------------------------------


def test_two_processes_write_and_read_both_ways(tmp_path):
    env = dict(os.environ, FABRIC_PROVIDER=PROVIDER, NIXL_LOG_LEVEL="INFO")
    size = 1 << 20
    names = ("prefill", "decode")
    peers = {n: PeerProcess(n, size, env, tmp_path / f"{n}.log") for n in names}
    try:
        info = {n: p.call("start") for n, p in peers.items()}
        for n in names:
            assert "FABRIC" in info[n]["plugins"], info[n]["plugins"]
            assert info[n]["backends"] == ["FABRIC"]
        assert info["prefill"]["outbox_sha256"] != info["decode"]["outbox_sha256"]
        for a, b in (names, names[::-1]):
            assert peers[a].call("connect", metadata=info[b]["metadata"])["peer"] == b
        for a, b in (names, names[::-1]):
            # a WRITEs its outbox into b's inbox: in place when b sees the notification.
            w = peers[a].call("xfer", op="WRITE", peer=b, remote_addr=info[b]["inbox"],
                              notif=f"write from {a}")
            assert (w["state"], w["backend"]) == ("DONE", "FABRIC")
            seen = peers[b].call("wait_notif", peer=a, notif=f"write from {a}")
            assert "timeout" not in seen, seen
            assert seen["inbox_sha256"] == info[a]["outbox_sha256"]
            # a READs b's outbox into its landing region; b is told once it is read.
            r = peers[a].call("xfer", op="READ", peer=b, remote_addr=info[b]["outbox"],
                              notif=f"read by {a}")
            assert (r["state"], r["backend"]) == ("DONE", "FABRIC")
            assert r["local_sha256"] == info[b]["outbox_sha256"]
            seen = peers[b].call("wait_notif", peer=a, notif=f"read by {a}")
            assert "timeout" not in seen, seen
            assert seen["outbox_sha256"] == info[b]["outbox_sha256"]
        for p in peers.values():
            p.call("quit")
            assert p.proc.wait(timeout=DEADLINE_S) == 0
    finally:
        for p in peers.values():
            p.proc.kill()
            p.proc.wait()
    for n in names:
        log = (tmp_path / f"{n}.log").read_text()
        assert f"FABRIC: agent {n} on {PROVIDER}" in log, log[-2000:]


# --- beside the wheel's own plugins ------------------------------------------------------------

BOTH = r"""
import json, os, sys, torch
from nixl._api import nixl_agent, nixl_agent_config
agent = nixl_agent("both", nixl_agent_config(backends=["UCX", "FABRIC"]))
src = torch.arange(0, 1 << 16, dtype=torch.int32)
regs = agent.register_memory(src)
moved = {}
for backend in ("UCX", "FABRIC"):
    dst = torch.zeros_like(src)
    reg = agent.register_memory(dst, backends=[backend])
    h = agent.initialize_xfer("WRITE", agent.get_xfer_descs(src), agent.get_xfer_descs(dst),
                              agent.name, backends=[backend])
    state = agent.transfer(h)
    while state == "PROC":
        state = agent.check_xfer_state(h)
    moved[backend] = [state, agent.query_xfer_backend(h), bool(torch.equal(src, dst))]
    agent.release_xfer_handle(h)
    agent.deregister_memory(reg, backends=[backend])
print(json.dumps({"plugins": agent.get_plugin_list(), "backends": list(agent.backends),
                  "moved": moved}))
""" + UCX_EXIT


def test_ucx_loads_beside_fabric_from_the_wheel_folder():
    wheel_only()
    out = run_python(BOTH, dict(os.environ, FABRIC_PROVIDER=PROVIDER))
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"UCX", "FABRIC"} <= set(result["plugins"])
    assert sorted(result["backends"]) == ["FABRIC", "UCX"]
    assert result["moved"] == {"UCX": ["DONE", "UCX", True], "FABRIC": ["DONE", "FABRIC", True]}


LOGGING = r"""
import os, sys
from nixl._api import nixl_agent, nixl_agent_config
agent = nixl_agent("logs", nixl_agent_config(backends=[]))
agent.create_backend("FABRIC", {"no_such_parameter": "1"})
print("created", list(agent.backends))
"""


@pytest.mark.parametrize("level,info,debug", [
    (None, False, False), ("INFO", True, False), ("DEBUG", True, True), ("ERROR", False, False)])
def test_plugin_logs_follow_nixl_log_level(level, info, debug):
    env = {k: v for k, v in os.environ.items() if k != "NIXL_LOG_LEVEL"}
    if level:
        env["NIXL_LOG_LEVEL"] = level
    env["FABRIC_PROVIDER"] = PROVIDER
    out = run_python(LOGGING, env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "created ['FABRIC']" in out.stdout
    assert ("FABRIC: agent logs on" in out.stderr) == info, out.stderr
    assert ("FABRIC: ignoring parameter no_such_parameter" in out.stderr) == debug, out.stderr


# --- when NIXL does not find it: what NIXL says, and what check_plugin.py says ------------------

AGENT = r"""
import json, os, sys, torch
from nixl._api import nixl_agent, nixl_agent_config
try:
    agent = nixl_agent("vllm_like", nixl_agent_config(backends=["FABRIC"]))
except Exception as e:
    print(json.dumps({"raised": f"{type(e).__name__}: {e}"}))
    sys.exit(0)
answer = {"plugins": agent.get_plugin_list(), "backends": list(agent.backends)}
try:
    agent.register_memory(torch.zeros(4096, dtype=torch.uint8))
except Exception as e:
    answer["register_memory"] = f"{type(e).__name__}: {e}"
print(json.dumps(answer))
""" + UCX_EXIT


def another_plugin():
    """A plugin of NIXL's own (UCX in the wheel), to put beside a missing or broken FABRIC."""
    lib = next(p for p in (Path(x) for x in open("/proc/self/maps").read().split())
               if p.name == "libnixl.so")
    plugins = sorted(p for p in (lib.parent / "plugins").glob("libplugin_*.so")
                     if p.name != "libplugin_FABRIC.so")
    if not plugins:
        pytest.skip(f"NIXL has no plugin of its own in {lib.parent / 'plugins'}")
    ucx = lib.parent / "plugins" / "libplugin_UCX.so"
    return ucx if ucx in plugins else plugins[0]


@pytest.mark.parametrize("case", ["no_such_folder", "folder_without_fabric", "fabric_unloadable"])
def test_missing_plugin_says_what_to_set(tmp_path, case):
    folder = tmp_path / "plugins"
    if case != "no_such_folder":
        folder.mkdir()
        other = another_plugin()
        (folder / other.name).symlink_to(other)
        if case == "fabric_unloadable":
            (folder / "libplugin_FABRIC.so").write_bytes(b"not an ELF file\n" * 256)
    env = dict(os.environ, NIXL_PLUGIN_DIR=str(folder), FABRIC_PROVIDER=PROVIDER)

    out = run_python(AGENT, env)
    assert out.returncode == 0, out.stdout + out.stderr
    nixl_says = json.loads(out.stdout.strip().splitlines()[-1])
    print("NIXL:", nixl_says, out.stdout, out.stderr, sep="\n")
    assert "FABRIC" not in nixl_says.get("backends", [])
    # NIXL 1.4.0's own words: none names NIXL_PLUGIN_DIR or the folder it searched.
    if case == "no_such_folder":
        assert "No plugins available" in nixl_says["raised"]
    elif case == "folder_without_fabric":
        assert "Skipping backend registration FABRIC due to the missing plugin" in out.stdout
        assert "NIXL_ERR_NOT_FOUND" in nixl_says["register_memory"]
    else:
        assert "NIXL_ERR_NOT_FOUND" in nixl_says["raised"]  # dlerror() only at NIXL's INFO
    assert "NIXL_PLUGIN_DIR" not in out.stdout + out.stderr

    check = subprocess.run([sys.executable, str(CHECK)], env=env, capture_output=True, text=True,
                           timeout=DEADLINE_S)
    print("check_plugin.py:", check.stdout, check.stderr, sep="\n")
    assert check.returncode == 1
    said = check.stdout
    assert f"plugin folder: {folder} (from NIXL_PLUGIN_DIR in the environment" in said
    assert "FABRIC: NOT available" in said
    # The command that rebuilds it: for the wheel, or for a NIXL built from source.
    assert ("tools/nixl/build_wheel_plugin.sh" if IS_WHEEL else "FABRIC_NIXL_ROOT") in said
    if case == "no_such_folder":
        assert f"{folder} does not exist" in said
        assert "unset NIXL_PLUGIN_DIR" in said
    elif case == "folder_without_fabric":
        assert f"{folder / 'libplugin_FABRIC.so'} does not exist" in said
        assert "NIXL_PLUGIN_DIR replaces NIXL's own plugin folder: unset it" in said
    else:
        assert "it does not load:" in said and "invalid ELF header" in said
        assert "built against the NIXL and the Abseil that load it" in said


def test_check_plugin_passes_on_the_installed_plugin():
    wheel_only()
    env = dict(os.environ, FABRIC_PROVIDER=PROVIDER)
    check = subprocess.run([sys.executable, str(CHECK), "FABRIC", "UCX"], env=env,
                           capture_output=True, text=True, timeout=DEADLINE_S)
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"FABRIC: loaded and created from {WHEEL_PLUGINS / 'libplugin_FABRIC.so'}" in check.stdout
    assert f"UCX: loaded and created from {WHEEL_PLUGINS / 'libplugin_UCX.so'}" in check.stdout
