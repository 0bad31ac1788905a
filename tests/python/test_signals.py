"""An application's signal handlers survive the library loading its fabrics.

Loading Debian 12's libfabric (for a tcp engine) runs libinfinipath's constructor, which replaces
the handlers of SIGINT, SIGILL, SIGABRT, SIGBUS, SIGSEGV and SIGTERM with its own (a backtrace
file, then exit): Ctrl-C ended Python with status 1, with no KeyboardInterrupt, no `finally`, no
atexit. Each test runs in a fresh interpreter, where libfabric is not loaded yet.
"""

import os
import subprocess
import sys
import textwrap

import pytest

import fabric_lib

PROVIDERS = ["tcp", "shm"]


def run_fresh(code, tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.dirname(fabric_lib.__file__))] + sys.path
    )
    # In a scratch directory: a crash handler that took over would leave its backtrace file there.
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("provider", PROVIDERS)
def test_ctrl_c_interrupts_a_wait_after_an_engine_exists(provider, tmp_path):
    r = run_fresh(
        f"""
        import os, signal, sys, threading
        import fabric_lib as fl
        try:
            e = fl.TransferEngine(fl.Config(provider={provider!r}, nics=['lo'] if {provider!r} == 'tcp' else []))
        except fl.Unsupported as ex:
            print('SKIP', ex); sys.exit(0)
        threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        try:
            e.wait_imm(1, 1)
        except KeyboardInterrupt:
            print('interrupted')
        finally:
            print('finally ran')
        e.close()
        """,
        tmp_path,
    )
    if r.stdout.startswith("SKIP"):
        pytest.skip(r.stdout.strip())
    assert r.returncode == 0, f"exit {r.returncode}: {r.stdout}{r.stderr}"
    assert "interrupted" in r.stdout and "finally ran" in r.stdout, r.stdout + r.stderr
    assert not list(tmp_path.iterdir()), f"files left behind: {list(tmp_path.iterdir())}"


def test_the_process_handlers_are_unchanged_after_a_tcp_engine_opens(tmp_path):
    # Read at the C level (sigaction): Python's signal.getsignal() answers from its own cache.
    r = run_fresh(
        """
        import ctypes, signal, sys
        import fabric_lib as fl
        signal.signal(signal.SIGTERM, lambda *a: None)  # an application's handler
        libc = ctypes.CDLL(None, use_errno=True)
        class Sigaction(ctypes.Structure):  # glibc's struct sigaction on Linux
            _fields_ = [('handler', ctypes.c_void_p), ('mask', ctypes.c_ulong * 16),
                        ('flags', ctypes.c_int), ('restorer', ctypes.c_void_p)]
        def handlers():
            out = {}
            for s in range(1, 32):
                a = Sigaction()
                if libc.sigaction(s, None, ctypes.byref(a)) == 0:
                    # SA_RESTORER aside: glibc adds it to every action it installs.
                    out[s] = (a.handler, a.flags & ~0x04000000)
            return out
        before = handlers()
        try:
            e = fl.TransferEngine(fl.Config(provider='tcp', nics=['lo']))
        except fl.Unsupported as ex:
            print('SKIP', ex); sys.exit(0)
        after = handlers()
        changed = sorted(s for s in before if before[s] != after.get(s))
        print('changed', changed)
        e.close()
        """,
        tmp_path,
    )
    if r.stdout.startswith("SKIP"):
        pytest.skip(r.stdout.strip())
    assert r.returncode == 0, r.stdout + r.stderr
    assert "changed []" in r.stdout, r.stdout + r.stderr
