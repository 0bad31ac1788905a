"""The in-tree PEP 517 build backend of the fabric_lib Python package.

`pip install .` runs it. It needs nothing from any Python package index: it drives the
repository's CMake build (Debian's cmake, ninja, g++, pybind11-dev, python3-dev and the C++
library's dependencies, as `make deps` installs them), builds only the extension target, and
zips the package into a wheel for the interpreter running pip. So plain `pip install .` works
offline, build isolation included (the backend requires no packages).

Settings (environment variables, or pip's --config-settings KEY=VALUE):
  FABRIC_PY_BUILD_DIR / build-dir    CMake build directory (default: <source>/build-pip)
  FABRIC_PY_BUILD_TYPE / build-type  CMAKE_BUILD_TYPE (default: RelWithDebInfo, the
                                     project's tested optimisation level; debug info is
                                     stripped from the wheel's copy)
  FABRIC_PY_PREBUILT / prebuilt      a directory holding an already built fabric_lib package
                                     (e.g. build/python/fabric_lib): packaged as it is, no
                                     CMake run (the packaging test uses this)
"""

import base64
import csv
import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "fabric_lib"
PACKAGE_FILES = ("*.py", "*.pyi", "py.typed", "*.so")


# --- metadata -----------------------------------------------------------------------------------


def _project():
    """[project] of pyproject.toml."""
    text = (ROOT / "pyproject.toml").read_text()
    try:
        import tomllib
    except ImportError:  # Python < 3.11: the few plain `key = "value"` lines this needs
        section = text.split("[project]", 1)[1].split("\n[", 1)[0]
        return dict(re.findall(r'^(\w[\w-]*)\s*=\s*"([^"]*)"', section, re.M))
    return tomllib.loads(text)["project"]


def _names():
    p = _project()
    dist = re.sub(r"[-_.]+", "_", p["name"]).lower()
    return p, dist, f"{dist}-{p['version']}"


def _metadata_text():
    p, _, _ = _names()
    lines = [
        "Metadata-Version: 2.1",
        f"Name: {p['name']}",
        f"Version: {p['version']}",
        f"Summary: {p.get('description', '')}",
    ]
    if "requires-python" in p:
        lines.append(f"Requires-Python: {p['requires-python']}")
    if isinstance(p.get("license"), dict) and "text" in p["license"]:
        lines.append(f"License: {p['license']['text']}")
    return "\n".join(lines) + "\n"


def _tag():
    """The wheel tag of the running interpreter, e.g. cp311-cp311-linux_x86_64."""
    impl = {"cpython": "cp", "pypy": "pp"}.get(sys.implementation.name, "py")
    python = f"{impl}{sys.version_info.major}{sys.version_info.minor}"
    soabi = sysconfig.get_config_var("SOABI") or ""
    abi = python if soabi.startswith(("cpython-", "pypy")) else "none"
    if sysconfig.get_config_var("Py_DEBUG"):
        abi += "d"
    platform = re.sub(r"[-.]", "_", sysconfig.get_platform())
    return f"{python}-{abi}-{platform}"


def _wheel_text():
    return (
        "Wheel-Version: 1.0\n"
        "Generator: fabric_lib_build\n"
        "Root-Is-Purelib: false\n"
        f"Tag: {_tag()}\n"
    )


def _setting(config_settings, key, env, default=None):
    if config_settings and key in config_settings:
        return config_settings[key]
    return os.environ.get(env, default)


# --- building -----------------------------------------------------------------------------------


def _run(cmd):
    print("fabric_lib_build: " + " ".join(str(c) for c in cmd), file=sys.stderr, flush=True)
    subprocess.run([str(c) for c in cmd], check=True, stdout=sys.stderr)


def _build_package(config_settings):
    """Builds the extension with CMake; returns the directory holding the built package."""
    prebuilt = _setting(config_settings, "prebuilt", "FABRIC_PY_PREBUILT")
    if prebuilt:
        return Path(prebuilt)
    if shutil.which("cmake") is None:
        raise RuntimeError("fabric_lib: cmake is needed to build (run `make deps`)")
    build = Path(_setting(config_settings, "build-dir", "FABRIC_PY_BUILD_DIR", ROOT / "build-pip"))
    build_type = _setting(config_settings, "build-type", "FABRIC_PY_BUILD_TYPE", "RelWithDebInfo")
    configure = ["cmake", "-S", ROOT, "-B", build, f"-DCMAKE_BUILD_TYPE={build_type}",
                 "-DFABRIC_BUILD_TESTS=OFF", "-DFABRIC_BUILD_TOOLS=OFF",
                 "-DFABRIC_BUILD_PYTHON=ON", f"-DPython_EXECUTABLE={sys.executable}"]
    if shutil.which("ninja") and not (build / "CMakeCache.txt").exists():
        configure += ["-G", "Ninja"]
    _run(configure)
    _run(["cmake", "--build", build, "--target", "_fabric_lib", "fabric_lib_python_files"])
    return build / "python" / PACKAGE


def _package_files(package_dir):
    files = sorted({f for pattern in PACKAGE_FILES for f in package_dir.glob(pattern)})
    ext = sysconfig.get_config_var("EXT_SUFFIX")
    if not any(f.name == f"_fabric_lib{ext}" for f in files):
        raise RuntimeError(f"fabric_lib: {package_dir} holds no _fabric_lib{ext} for "
                           f"{sys.executable}; was it built for another interpreter?")
    return [f for f in files if f.suffix != ".so" or f.name.endswith(ext)]


def _stripped(library):
    """The library's bytes without debug sections (as they are when `strip` is absent)."""
    strip = shutil.which("strip")
    if strip is None:
        return library.read_bytes()
    copy = library.with_name(library.name + ".stripped")
    try:
        subprocess.run([strip, "--strip-debug", "-o", str(copy), str(library)], check=True)
        return copy.read_bytes()
    finally:
        copy.unlink(missing_ok=True)


def _record_line(arcname, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return [arcname, f"sha256={digest}", str(len(data))]


# --- PEP 517 hooks ------------------------------------------------------------------------------


def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    _, _, stem = _names()
    dist_info = Path(metadata_directory) / f"{stem}.dist-info"
    dist_info.mkdir(parents=True, exist_ok=True)
    (dist_info / "METADATA").write_text(_metadata_text())
    (dist_info / "WHEEL").write_text(_wheel_text())
    return dist_info.name


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    _, _, stem = _names()
    package_dir = _build_package(config_settings)
    wheel = Path(wheel_directory) / f"{stem}-{_tag()}.whl"
    records = []
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as z:

        def add(arcname, data):
            z.writestr(arcname, data)
            records.append(_record_line(arcname, data))

        for f in _package_files(package_dir):
            add(f"{PACKAGE}/{f.name}", _stripped(f) if f.suffix == ".so" else f.read_bytes())
        dist_info = f"{stem}.dist-info"
        add(f"{dist_info}/METADATA", _metadata_text().encode())
        add(f"{dist_info}/WHEEL", _wheel_text().encode())
        add(f"{dist_info}/top_level.txt", f"{PACKAGE}\n".encode())
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerows(records + [[f"{dist_info}/RECORD", "", ""]])
        z.writestr(f"{dist_info}/RECORD", out.getvalue())
    print(f"fabric_lib_build: wrote {wheel}", file=sys.stderr)
    return wheel.name


def build_sdist(sdist_directory, config_settings=None):
    """The tracked files of the repository (git ls-files), as name-version.tar.gz."""
    _, _, stem = _names()
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True,
                            capture_output=True).stdout.decode().split("\0")
    sdist = Path(sdist_directory) / f"{stem}.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        for name in filter(None, listed):
            tar.add(ROOT / name, arcname=f"{stem}/{name}", recursive=False)
        info = tarfile.TarInfo(f"{stem}/PKG-INFO")
        data = _metadata_text().encode()
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return sdist.name
