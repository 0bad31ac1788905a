"""`pip install .` packaging: the in-tree backend builds a valid wheel that installs and imports
offline. Uses the package under test as a prebuilt (FABRIC_PY_PREBUILT), so no rebuild runs;
the CMake half of the backend is what `pip install .` itself exercises."""

import base64
import csv
import hashlib
import io
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import fabric_lib

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_installs_offline_and_imports(tmp_path):
    try:
        import pip  # noqa: F401
    except ImportError:
        pytest.skip("pip is not installed for this interpreter (Debian: python3-pip)")
    package = Path(fabric_lib.__file__).parent
    env = dict(os.environ, FABRIC_PY_PREBUILT=str(package), PIP_NO_INDEX="1",
               PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("PYTHONPATH", None)
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", wheels, ROOT],
                   check=True, env=env, capture_output=True, timeout=120)
    [wheel] = wheels.glob("*.whl")
    assert wheel.name.startswith(f"fabric_lib-{fabric_lib.__version__}-cp3")

    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for f in ("__init__.py", "_fabric_lib.pyi", "py.typed", "_futures.py", "distributed.py",
                  "ep.py"):
            assert f"fabric_lib/{f}" in names
        assert any(n.startswith("fabric_lib/_fabric_lib.") and n.endswith(".so") for n in names)
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        rows = list(csv.reader(io.StringIO(z.read(record).decode())))
        assert {r[0] for r in rows} == names
        for path, digest, size in rows:
            if path == record:
                continue
            data = z.read(path)
            want = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert digest == f"sha256={want}" and int(size) == len(data), path

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", site, wheel],
                   check=True, env=env, capture_output=True, timeout=120)
    run = subprocess.run(
        [sys.executable, "-c", "import fabric_lib; print(fabric_lib.__file__); print(fabric_lib.info())"],
        cwd=tmp_path, env=dict(env, PYTHONPATH=str(site)), capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith(str(site))
    assert lines[1].startswith("libfabric ") and "TransferEngine on provider tcp" in run.stdout
