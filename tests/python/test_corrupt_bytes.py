"""Corrupt bytes from peers: every byte of a valid memory descriptor flipped (xor 0x01, 0x80 and
0xFF) and every truncation of it, written to over tcp and over shm; every byte of a weight
schedule's bytes flipped and every truncation, decoded and used.

What must hold for each case: the write is refused at once with a FabricError, or it resolves,
within a bound, exactly once (one on_done or one on_error, then the future) with success or a
FabricError; nothing else is raised, nothing hangs, nothing crashes, no callback error is
reported; and afterwards the engine still writes correctly (the bytes checked) to the peer it
had and to a peer it never saw.

Network safety: a flipped byte of an IP address makes the engine connect to an arbitrary
address. The tcp sweep therefore runs in a child process inside a private network namespace
(`unshare --net`) where only loopback is up, and it refuses to start if it sees any other
interface; the test is skipped, saying why, where unshare is not permitted. The shm sweep runs
in a child process too, so that a crash is reported (with the case that causes it) instead of
taking pytest down.

Run as a script (`test_corrupt_bytes.py tcp|shm [i,j,...]`) it is that child: it prints one
JSON line with the outcome.
"""

import collections
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import fabric_lib

pytestmark = pytest.mark.timeout(300)

HERE = Path(__file__).resolve().parent
PATTERNS = (0x01, 0x80, 0xFF)
SIZE = 64  # bytes of the destination region; each corrupt write sends 16 of them
RESOLVE_BOUND = 30.0  # seconds in which every corrupt write must resolve
CHILD_BOUND = 150  # seconds for one child process
SKIP_EXIT = 77  # the child's exit status when its provider is absent
BISECT_BOUND = 100  # seconds for finding the cases behind a crash
CRASH_AT = "FABRIC_TEST_SWEEP_CRASH_AT"  # tests only: the child crashes at this case


def mutations(data):
    """(label, bytes) for every byte of `data` xor each pattern, then every truncation."""
    out = []
    for i in range(len(data)):
        for p in PATTERNS:
            b = bytearray(data)
            b[i] ^= p
            out.append((f"byte {i} xor {p:#04x}", bytes(b)))
    for n in range(len(data)):
        out.append((f"truncated to {n} bytes", data[:n]))
    return out


# --- the child: one provider's sweep --------------------------------------------------------


def sweep(provider, only=None):
    """Runs the write sweep on `provider`; returns the outcome as a dict."""
    sys.path.insert(0, str(HERE))
    from peer import make_config

    if provider == "tcp":
        names = sorted(name for _, name in socket.if_nameindex())
        if names != ["lo"]:
            raise SystemExit(f"refusing to run: interfaces {names} besides loopback are up here "
                             "(the tcp sweep runs only in a private network namespace)")

    def engine():
        try:
            return fabric_lib.TransferEngine(
                make_config(provider, peer_timeout=1.0, close_timeout=1.0))
        except fabric_lib.Unsupported as e:
            print(json.dumps({"skip": f"provider {provider} not available here: {e}"}))
            sys.exit(SKIP_EXIT)

    seen = []
    sys.unraisablehook = seen.append
    problems = []
    outcomes = collections.Counter()
    a, b = engine(), engine()
    src = a.register(np.arange(SIZE, dtype=np.uint8))
    dst = b.register(np.zeros(SIZE, np.uint8))
    cases = mutations(bytes(dst.descriptor))
    chosen = range(len(cases)) if only is None else only
    # Every write submitted at once, then waited for: the failures' timeouts overlap.
    pending = []
    for i in chosen:
        label, data = cases[i]
        if os.environ.get(CRASH_AT) == str(i):  # the crash reporting's own test
            os.kill(os.getpid(), signal.SIGSEGV)
        ends = []
        try:
            t = a.write(src, data, 16, dst_offset=16, on_done=lambda ends=ends: ends.append(None),
                        on_error=ends.append)
        except fabric_lib.FabricError as e:
            outcomes[f"refused: {type(e).__name__}"] += 1
            continue
        except BaseException as e:  # noqa: BLE001 - what is not a FabricError is the finding
            problems.append(f"{label}: the submission raised {type(e).__name__}: {e}")
            continue
        pending.append((label, t, ends))
    deadline = time.monotonic() + RESOLVE_BOUND
    for label, t, ends in pending:
        try:
            exc = t.exception(timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            problems.append(f"{label}: still pending {RESOLVE_BOUND} s after submission")
            continue
        if exc is not None and not isinstance(exc, fabric_lib.FabricError):
            problems.append(f"{label}: failed with {type(exc).__name__}: {exc}")
        outcomes["written" if exc is None else f"failed: {type(exc).__name__}"] += 1
    time.sleep(0.2)  # a second callback, if any, would come now
    for label, t, ends in pending:
        if t.done() and (len(ends) != 1 or (ends[0] is None) != (t.exception() is None)):
            problems.append(f"{label}: {len(ends)} callbacks ran ({ends!r}) for one transfer")

    # Afterwards: the same engine writes correctly to the peer it had and to a new one.
    fresh = np.random.default_rng(7).integers(0, 256, SIZE, dtype=np.uint8)
    fresh_src = a.register(fresh)
    dst.obj[:] = 0
    try:
        a.write(fresh_src, dst.descriptor, imm=11).result(timeout=30)
        if not b.wait_imm(11, 1, timeout=30) or not np.array_equal(dst.obj, fresh):
            problems.append("afterwards: the write to the existing peer landed wrong bytes")
    except Exception as e:  # noqa: BLE001
        problems.append(f"afterwards: the write to the existing peer raised "
                        f"{type(e).__name__}: {e}")
    with engine() as c:
        new_dst = c.register(np.zeros(SIZE, np.uint8))
        try:
            a.write(fresh_src, new_dst.descriptor, imm=12).result(timeout=30)
            if not c.wait_imm(12, 1, timeout=30) or not np.array_equal(new_dst.obj, fresh):
                problems.append("afterwards: the write to a new peer landed wrong bytes")
        except Exception as e:  # noqa: BLE001
            problems.append(f"afterwards: the write to a new peer raised "
                            f"{type(e).__name__}: {e}")
        new_dst.unregister()
    a.close()
    b.close()
    for label, t, _ in pending:
        if not t.done():
            problems.append(f"{label}: still pending after close()")
    problems += [f"reported by a callback: {u.exc_type.__name__}: {u.exc_value}" for u in seen]
    return {"provider": provider, "cases": len(chosen), "outcomes": dict(outcomes),
            "problems": problems}


def child_main(argv):
    provider = argv[1]
    if argv[2:] == ["labels"]:
        # The cases' labels, from a descriptor of this provider (without writing anything).
        sys.path.insert(0, str(HERE))
        from peer import make_config

        with fabric_lib.TransferEngine(make_config(provider)) as e:
            reg = e.register(np.zeros(SIZE, np.uint8))
            print(json.dumps({"labels": [label for label, _ in mutations(bytes(reg.descriptor))]}))
            reg.unregister()
        os._exit(0)
    only = [int(i) for i in argv[2].split(",")] if len(argv) > 2 and argv[2] else None
    result = sweep(provider, only)
    print(json.dumps(result), flush=True)
    # No exit path of the interpreter's own (atexit closes engines already closed).
    os._exit(0)


# --- the parent: pytest ----------------------------------------------------------------------


def child_command(provider, only=None, labels=False):
    cmd = [sys.executable, str(Path(__file__).resolve()), provider]
    if labels:
        cmd.append("labels")
    elif only is not None:
        cmd.append(",".join(map(str, only)))
    if provider == "tcp":
        cmd = ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$@"', "sh"] + cmd
    return cmd


def child_env():
    env = dict(os.environ)
    package_root = str(Path(fabric_lib.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (package_root, env.get("PYTHONPATH")) if p)
    return env


def run_child(provider, only=None, labels=False):
    """(return code, the child's JSON result or None, its stderr)."""
    try:
        proc = subprocess.run(child_command(provider, only, labels), capture_output=True, text=True,
                              timeout=CHILD_BOUND, env=child_env())
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr
        return "timeout", None, err or ""
    result = None
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            result = json.loads(line)
            break
    return proc.returncode, result, proc.stderr


def describe(rc):
    if rc == "timeout":
        return f"ran past {CHILD_BOUND} s (a hang)"
    if isinstance(rc, int) and rc < 0:
        return f"died of signal {-rc} ({signal.Signals(-rc).name})"
    return f"exited with status {rc}"


def smallest_failing(provider, indices):
    """Bisects the cases of a crashing child down to a small set that still crashes on its own
    (within BISECT_BOUND seconds)."""
    deadline = time.monotonic() + BISECT_BOUND
    while len(indices) > 1 and time.monotonic() < deadline:
        half = len(indices) // 2
        for part in (indices[:half], indices[half:]):
            rc, result, _ = run_child(provider, part)
            if rc != 0 or result is None:
                indices = part
                break
        else:
            break  # neither half fails alone: the cases fail together
    return indices


def failure_report(provider, rc, err):
    """What went wrong with a child that crashed, hung or exited badly, and which cases do it:
    for a crash, the smallest set of cases that still crashes on its own (a hang is not
    bisected: each try would take CHILD_BOUND)."""
    labels = []
    if rc != "timeout":
        rc_labels, listed, _ = run_child(provider, labels=True)
        every = listed["labels"] if rc_labels == 0 and listed else []
        labels = [every[i] for i in smallest_failing(provider, list(range(len(every))))]
    tail = "\n".join(err.splitlines()[-15:])
    return (f"{provider}: the sweep's process {describe(rc)}; the smallest set of cases that "
            f"fails on its own: {labels}\nits stderr ends:\n{tail}")


def unshare_refusal():
    """None when `unshare --net` works here, else why not."""
    try:
        proc = subprocess.run(["unshare", "--net", "sh", "-c", "ip link set lo up"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    return None if proc.returncode == 0 else (proc.stderr.strip() or f"status {proc.returncode}")


@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_every_corrupt_descriptor_fails_cleanly_and_the_engine_goes_on(provider):
    if provider == "tcp":
        why = unshare_refusal()
        if why is not None:
            pytest.skip(f"the tcp sweep needs a private network namespace (unshare --net), "
                        f"which is not permitted here: {why}")
    rc, result, err = run_child(provider)
    if rc == SKIP_EXIT and result is not None and "skip" in result:
        pytest.skip(result["skip"])
    if rc != 0 or result is None:
        pytest.fail(failure_report(provider, rc, err))
    assert "a user callback threw" not in err, err
    assert not result["problems"], (
        f"{provider}: {len(result['problems'])} of {result['cases']} cases went wrong:\n" +
        "\n".join(result["problems"][:40]))
    print(f"{provider}: {result['cases']} cases: {result['outcomes']}")


def test_a_crash_is_reported_with_the_case_that_causes_it(monkeypatch):
    """The reporting itself: a child made to crash at one case (shm, 24 cases) is reported as
    died of SIGSEGV, and the bisection names that case alone."""
    monkeypatch.setenv(CRASH_AT, "13")
    rc, result, err = run_child("shm", list(range(24)))
    if rc == SKIP_EXIT and result is not None and "skip" in result:
        pytest.skip(result["skip"])
    assert rc == -signal.SIGSEGV and result is None, (rc, result, err[-2000:])
    assert smallest_failing("shm", list(range(24))) == [13]
    report = failure_report("shm", rc, err)
    assert "died of signal 11 (SIGSEGV)" in report and "['byte 4 xor 0x80']" in report, report


# --- weight schedules --------------------------------------------------------------------------


def weight_descriptions():
    """Two training ranks and two inference ranks over three parameters (a fused concatenation
    of two sources, an FP8 quantisation and its scales): every kind of field the bytes hold."""
    ext = fabric_lib._fabric_lib
    trainers = [
        ext._weights_encode_trainer(r, 2, [
            ("q", "bf16", [8, 16], [(4 * r, 4), (0, 16)], 0),
            ("k", "bf16", [8, 16], [(4 * r, 4), (0, 16)], 0),
            ("w", "bf16", [128, 128], [], r),
        ]) for r in range(2)
    ]
    inference = [
        ext._weights_encode_inference(r, [
            ("qk", "bf16", [16, 16], 0, 8 * r, 8, "concat", ["q", "k"], 0, 128),
            ("w8", "fp8_e4m3", [128, 128], 1, 64 * r, 64, "fp8_quantize", ["w"], 0, 128),
            ("w8.scale", "f32", [1, 1], -1, 0, 0, "fp8_scale", ["w"], 0, 128),
        ]) for r in range(2)
    ]
    return trainers, inference


def use_schedule(s, inference):
    """Everything a rank does with a decoded schedule; only FabricErrors may come out."""
    repr(s)
    len(s)
    for p in s.params:
        repr(p)
    s.entries()
    for t in range(min(s.num_trainers, 8)):
        s.bytes_from(t)
        s.entries(t)
    for r in range(min(s.num_inference, 8)):
        s.writes_into(r)
    try:
        s.check_destinations(inference)
    except fabric_lib.FabricError:
        pass
    s.encode()


def test_every_corrupt_weight_schedule_is_refused_or_usable():
    trainers, inference = weight_descriptions()
    schedule = fabric_lib.WeightSchedule.compute(trainers, inference, chunk_bytes=4096)
    data = schedule.encode()
    assert len(schedule) > 0 and len(schedule.params) == 3
    problems = []
    outcomes = collections.Counter()
    start = time.monotonic()
    for label, bad in mutations(data):
        try:
            s = fabric_lib.WeightSchedule.decode(bad)
        except fabric_lib.FabricError as e:
            outcomes[type(e).__name__] += 1
            continue
        except BaseException as e:  # noqa: BLE001
            problems.append(f"{label}: decode raised {type(e).__name__}: {e}")
            continue
        outcomes["decoded"] += 1
        try:
            use_schedule(s, inference)
        except BaseException as e:  # noqa: BLE001
            problems.append(f"{label}: using it raised {type(e).__name__}: {e}")
    # The ranks' descriptions, which compute() decodes, likewise.
    for which, descs in (("trainer", trainers), ("inference", inference)):
        for label, bad in mutations(descs[0]):
            args = ([bad] + trainers[1:], inference) if which == "trainer" else \
                (trainers, [bad] + inference[1:])
            try:
                s = fabric_lib.WeightSchedule.compute(*args, chunk_bytes=4096)
                use_schedule(s, inference)
            except fabric_lib.FabricError:
                pass
            except BaseException as e:  # noqa: BLE001
                problems.append(f"{which} {label}: compute raised {type(e).__name__}: {e}")
            if which == "inference":
                try:
                    fabric_lib._fabric_lib._weights_decode_inference(bad)
                except fabric_lib.FabricError:
                    pass
                except BaseException as e:  # noqa: BLE001
                    problems.append(f"inference {label}: decode raised {type(e).__name__}: {e}")
    assert not problems, "\n".join(problems[:40])
    assert outcomes["InvalidArgument"] > 0
    assert time.monotonic() - start < 60


if __name__ == "__main__":
    child_main(sys.argv)
