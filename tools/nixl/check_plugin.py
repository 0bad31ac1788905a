#!/usr/bin/env python3
"""Says whether NIXL, as this Python imports it, finds and loads a backend plugin (FABRIC by
default), and what to set when it does not.

    VENV/bin/python tools/nixl/check_plugin.py [BACKEND ...]      # default: FABRIC

NIXL itself says little: with a NIXL_PLUGIN_DIR that lacks the plugin, nixl_agent(...,
backends=["FABRIC"]) logs "Skipping backend registration FABRIC due to the missing plugin." and
makes an agent without it (register_memory then fails with NIXL_ERR_NOT_FOUND); a plugin that is
there but does not load (built for another NIXL, a library missing) is logged at INFO only, below
NIXL's default level. This names the folder NIXL searched, where that folder came from, why the
plugin did not load, and the fix.

Exit status: 0 when NIXL creates every backend named, 1 when one is not created, 2 when NIXL's
module does not import.
"""

import ctypes
import os
import sys
from importlib import metadata

BUILD_SCRIPT = "tools/nixl/build_wheel_plugin.sh"


def libnixl_path():
    """The libnixl.so this process loaded (NIXL's default plugin folder is plugins/ beside it)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if os.path.basename(path) == "libnixl.so":
                return path
    return None


def configured_plugin_dir():
    """NIXL_PLUGIN_DIR as NIXL reads it: the environment, else the first configuration file of
    NIXL_CONFIG_FILE, ~/.nixl.cfg, /etc/nixl.cfg (TOML). Returns (folder, where it came from)."""
    if "NIXL_PLUGIN_DIR" in os.environ:
        return os.environ["NIXL_PLUGIN_DIR"], "NIXL_PLUGIN_DIR in the environment"
    candidates = []
    if "NIXL_CONFIG_FILE" in os.environ:
        candidates.append(os.environ["NIXL_CONFIG_FILE"])
    elif "HOME" in os.environ:
        candidates.append(os.path.join(os.environ["HOME"], ".nixl.cfg"))
    candidates.append("/etc/nixl.cfg")
    for path in candidates:
        if not os.path.exists(path):
            continue
        try:
            import tomllib

            with open(path, "rb") as f:
                value = tomllib.load(f).get("NIXL_PLUGIN_DIR")
        except Exception:  # noqa: BLE001 - NIXL would fail on it too; report no folder from it
            value = None
        if value:
            return str(value), f"NIXL_PLUGIN_DIR in {path}"
        break  # NIXL reads only the first configuration file it finds
    return None, None


def try_create(nixl_api, backend):
    """NIXL's own verdict: the plugin list, and whether createBackend succeeds."""
    try:
        agent = nixl_api.nixl_agent(f"check_{backend}_{os.getpid()}",
                                    nixl_api.nixl_agent_config(backends=[]))
    except RuntimeError as e:  # "No plugins available for NIXL": the folder holds none
        return [], f"NIXL found no plugins at all ({e})"
    plugins = agent.get_plugin_list()
    if backend not in plugins:
        return plugins, f"{backend} is not in NIXL's plugin list"
    try:
        agent.create_backend(backend, {})
    except Exception as e:  # noqa: BLE001 - NIXL raises a status-named exception
        return plugins, f"createBackend failed: {type(e).__name__} {e}"
    return plugins, None


def dlopen_error(path):
    """Why the plugin does not load (NIXL logs dlerror() at INFO only). NIXL's libraries are
    loaded in this process already, so the plugin's NEEDED entries resolve as they would in NIXL."""
    try:
        ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_LOCAL)
    except OSError as e:
        return str(e)
    return None


def main():
    backends = sys.argv[1:] or ["FABRIC"]
    try:
        import nixl._api as nixl_api
    except Exception as e:  # noqa: BLE001
        print(f"NIXL's Python module does not import with {sys.executable}: {e}")
        print(f"fix: {sys.executable} -m pip install nixl==1.4.0")
        return 2
    pkg = os.path.dirname(nixl_api.__file__)
    lib = libnixl_path()
    default_dir = os.path.join(os.path.dirname(lib), "plugins") if lib else None
    plugin_dir, origin = configured_plugin_dir()
    try:
        version = metadata.version(os.path.basename(pkg).replace("_", "-"))
        wheel = True
    except metadata.PackageNotFoundError:
        version, wheel = "(no distribution: not a wheel)", False
    print(f"NIXL: {os.path.basename(pkg)} {version} ({pkg})")
    print(f"libnixl.so: {lib}")
    if plugin_dir:
        print(f"plugin folder: {plugin_dir} (from {origin}; it replaces NIXL's own, {default_dir})")
    else:
        plugin_dir = default_dir
        print(f"plugin folder: {plugin_dir} (NIXL's own: plugins/ beside libnixl.so; "
              "NIXL_PLUGIN_DIR is not set)")
    failed = 0
    for backend in backends:
        plugins, problem = try_create(nixl_api, backend)
        path = os.path.join(plugin_dir or "", f"libplugin_{backend}.so")
        if problem is None:
            print(f"{backend}: loaded and created from {path}")
            continue
        failed = 1
        print(f"{backend}: NOT available: {problem}")
        print(f"  NIXL's plugin list: {', '.join(plugins) or '(empty)'}")
        if wheel:
            rebuild = (f"{BUILD_SCRIPT} {sys.prefix} builds it for this NIXL and installs it in "
                       f"{default_dir}")
        else:
            rebuild = ("build it against this NIXL's install (cmake -DFABRIC_NIXL_ROOT=<its prefix>, "
                       "or tools/nixl/build_nixl.sh)")
        if origin and not os.path.isdir(plugin_dir):
            print(f"  {plugin_dir} does not exist.")
            print(f"  fix: unset NIXL_PLUGIN_DIR (remove it from {origin.split(' in ', 1)[1]}) so "
                  f"that NIXL uses {default_dir}, or point it at a folder holding "
                  f"libplugin_{backend}.so and every other plugin you use (UCX's is "
                  f"{default_dir}/libplugin_UCX.so); {rebuild}")
        elif not os.path.exists(path):
            print(f"  {path} does not exist.")
            if origin:
                print(f"  fix: NIXL_PLUGIN_DIR replaces NIXL's own plugin folder: unset it (from "
                      f"{origin.split(' in ', 1)[1]}) to use {default_dir}, or put "
                      f"libplugin_{backend}.so there beside every other plugin you use; {rebuild}")
            else:
                print(f"  fix: {rebuild}; or set NIXL_PLUGIN_DIR to a folder holding "
                      f"libplugin_{backend}.so and every other plugin you use (UCX's too)")
        else:
            err = dlopen_error(path)
            if err:
                print(f"  it does not load: {err}")
            print(f"  fix: a plugin must be built against the NIXL and the Abseil that load it "
                  f"(NIXL checks only the plugin API version): {rebuild}")
    return failed


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    # Without running exit handlers: a process that created a UCX backend of NIXL's 1.4.0 wheel
    # crashes in them on a host without RDMA devices (libnl-route-3's destructor, which the
    # wheel bundles for UCX), and the verdict is the exit status.
    os._exit(status)
