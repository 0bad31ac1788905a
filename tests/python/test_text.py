"""Text that crosses from C++ into Python: error messages, provider and NIC names, parameter
names. Such strings may hold bytes that are not UTF-8 (a corrupt descriptor, an environment
variable, a peer's bytes); the module turns them into str without raising (undecodable bytes
written as backslash escapes) or refuses them with a FabricError where they are decoded, and a
failed transfer's future resolves even when its exception cannot be built."""

import os
import time

import numpy as np
import pytest

import fabric_lib
from conftest import TIMEOUT, open_engine_or_skip
from peer import make_config


@pytest.fixture
def environ_bytes():
    """Sets environment variables to raw bytes for one test, restoring them afterwards."""
    saved = {}

    def put(name, value):
        key = name.encode()
        saved.setdefault(key, os.environb.get(key))
        os.environb[key] = value

    yield put
    for key, value in saved.items():
        if value is None:
            os.environb.pop(key, None)
        else:
            os.environb[key] = value


def test_a_failure_whose_message_holds_foreign_bytes_resolves_its_future():
    """The message reaches Python with the bytes escaped; on_error runs once; the future
    resolves with the FabricError (it stayed pending forever, the conversion raising in the
    callback)."""
    errors = []
    t = fabric_lib._fabric_lib._fail_transfer_for_test(
        fabric_lib.ErrorCode.PEER_UNREACHABLE, b"peer '/fabric-shm.\xc9\xff' is gone",
        on_error=errors.append)
    with pytest.raises(fabric_lib.PeerUnreachable) as info:
        t.result(timeout=TIMEOUT)
    assert "\\xc9\\xff" in str(info.value)
    assert info.value.message == str(info.value)
    assert info.value.code == fabric_lib.ErrorCode.PEER_UNREACHABLE
    assert len(errors) == 1 and errors[0].message == info.value.message


def test_a_future_resolves_even_when_its_exception_cannot_be_built():
    """Building the exception object fails (simulated): the future still resolves, with a
    FabricError of the same class carrying the message as ASCII escapes."""
    errors = []
    t = fabric_lib._fabric_lib._fail_transfer_for_test(
        fabric_lib.ErrorCode.REMOTE_ACCESS, b"key \xfe refused", on_error=errors.append,
        break_exception=True)
    exc = t.exception(timeout=TIMEOUT)
    assert isinstance(exc, fabric_lib.RemoteAccess), repr(exc)
    assert "\\xfe" in str(exc)
    assert len(errors) == 1


def test_a_shm_descriptor_naming_foreign_bytes_fails_the_write_once():
    """A shm descriptor whose endpoint name holds a byte that is not UTF-8: the write fails
    with a FabricError (or is refused at once), exactly once, and close() leaves nothing
    pending."""
    a = open_engine_or_skip("shm")
    b = open_engine_or_skip("shm")
    with a, b:
        src = a.register(np.ones(64, np.uint8))
        dst = b.register(np.zeros(64, np.uint8))
        data = bytearray(bytes(dst.descriptor))
        at = data.find(b"/fabric-shm.")
        assert at >= 0
        data[at + 14] = 0xC9
        ends = []
        try:
            t = a.write(src, bytes(data), 16, on_done=lambda: ends.append("done"),
                        on_error=ends.append)
        except fabric_lib.FabricError as e:
            assert "\\xc9" in str(e) or "UTF-8" in str(e) or "0xc9" in str(e), str(e)
            return
        exc = t.exception(timeout=TIMEOUT)
        assert isinstance(exc, fabric_lib.FabricError), repr(exc)
        time.sleep(0.1)
        assert len(ends) == 1, ends
        a.close()
        assert t.done()


def test_a_provider_name_with_foreign_bytes_from_the_environment(environ_bytes):
    """FABRIC_PROVIDER and FABRIC_NICS are bytes: the config shows them escaped, and the engine
    refuses the provider with a FabricError whose message shows them escaped too."""
    environ_bytes("FABRIC_PROVIDER", b"tc\xffp")
    environ_bytes("FABRIC_NICS", b"l\xfeo")
    cfg = fabric_lib.Config()
    cfg.apply_env_overrides()
    assert cfg.provider == "tc\\xffp"
    assert list(cfg.groups[0].nics) == ["l\\xfeo"]
    assert "tc\\xffp" in repr(cfg) and "l\\xfeo" in repr(cfg.groups[0])
    with pytest.raises(fabric_lib.FabricError) as info:
        fabric_lib.TransferEngine(cfg)
    assert_quoted_escaped(info.value, b"\xff")


def assert_quoted_escaped(exc, raw):
    """The exception's message, if it quotes `raw` (a byte that is not UTF-8) at all, shows it
    as a backslash escape; it is a str that encodes (no lone surrogate)."""
    message = str(exc)
    assert exc.message == message
    message.encode("utf-8")
    assert raw.decode("latin-1") not in message, message


def test_a_nic_name_with_foreign_bytes_is_refused_with_a_fabric_error(environ_bytes):
    environ_bytes("FABRIC_NICS", b"l\xfeo")
    cfg = make_config("tcp")
    cfg.apply_env_overrides()
    with pytest.raises(fabric_lib.FabricError) as info:
        fabric_lib.TransferEngine(cfg)
    assert_quoted_escaped(info.value, b"\xfe")


def test_a_descriptor_with_a_foreign_provider_name_raises_only_fabric_errors():
    """The provider name of a tcp descriptor made not UTF-8: decoding refuses it
    (InvalidArgument), or every use of it works or raises a FabricError."""
    a = open_engine_or_skip("tcp")
    with a:
        src = a.register(np.ones(64, np.uint8))
        dst = a.register(np.zeros(64, np.uint8))
        data = bytearray(bytes(dst.descriptor))
        data[data.find(b"tcp")] = 0xFF
        try:
            remote = fabric_lib.RemoteMemory(bytes(data))
        except fabric_lib.InvalidArgument:
            remote = None
        if remote is not None:
            assert "\\xff" in remote.owner.provider
            repr(remote)
            repr(remote.owner)
            remote.owner.short_name
        try:
            a.write(src, bytes(data), 16).exception(timeout=TIMEOUT)
        except fabric_lib.FabricError:
            pass


def schedule_bytes():
    """A small schedule: one trainer holding 'w' whole, one inference rank holding it whole."""
    ext = fabric_lib._fabric_lib
    trainer = ext._weights_encode_trainer(0, 1, [("w", "bf16", [4, 8], [], 0)])
    inference = ext._weights_encode_inference(
        0, [("w", "bf16", [4, 8], -1, 0, 0, "identity", [], 0, 128)])
    return trainer, inference, fabric_lib.WeightSchedule.compute([trainer], [inference]).encode()


def corrupt_name(data, name=b"w"):
    """`data` with the first byte of every length-prefixed `name` made 0xFF."""
    data = bytearray(data)
    prefixed = len(name).to_bytes(4, "little") + name
    at = data.find(prefixed)
    assert at >= 0
    while at >= 0:
        data[at + 4] = 0xFF
        at = data.find(prefixed, at + 1)
    return bytes(data)


def test_weight_descriptions_with_names_that_are_not_utf8_are_refused():
    trainer, inference, schedule = schedule_bytes()
    assert fabric_lib.WeightSchedule.decode(schedule).params[0][0] == "w"
    with pytest.raises(fabric_lib.InvalidArgument, match=r"param(eter)?s?\W*0.*UTF-8"):
        fabric_lib.WeightSchedule.decode(corrupt_name(schedule))
    with pytest.raises(fabric_lib.InvalidArgument, match="UTF-8"):
        fabric_lib._fabric_lib._weights_decode_inference(corrupt_name(inference))
    with pytest.raises(fabric_lib.InvalidArgument, match="UTF-8"):
        fabric_lib.WeightSchedule.compute([corrupt_name(trainer)], [inference])
    with pytest.raises(fabric_lib.InvalidArgument, match="UTF-8"):
        fabric_lib.WeightSchedule.compute([trainer], [corrupt_name(inference)])


def test_info_quotes_a_nic_name_of_foreign_bytes(environ_bytes):
    """fabric_lib.info() with FABRIC_NICS naming bytes that are not UTF-8: the dict (parsed from
    the JSON report) and the text both show them escaped, the same way."""
    environ_bytes("FABRIC_PROVIDER", b"tcp")
    environ_bytes("FABRIC_NICS", b"l\xfeo")
    report = fabric_lib.info()
    assert report["engine"]["ok"] is False
    error = report["engine"]["error"]
    assert isinstance(error, str) and "\xfe" not in error
    assert ("l\\xfeo" in error) == ("l\\xfeo" in str(report)), (error, str(report))


def test_fabric_info_json_is_utf8_when_a_name_holds_foreign_bytes(environ_bytes):
    """`fabric-info --json` with FABRIC_NICS holding a byte that is not UTF-8 (the engine
    section quotes it): the output is valid UTF-8 and JSON (the byte went out raw before, which
    no strict reader accepts), the name reads with the byte as a backslash escape, and
    fabric_lib.info() reads the same."""
    import json
    import subprocess
    from pathlib import Path

    bin_dir = Path(os.environ.get("FABRIC_BIN_DIR",
                                  Path(fabric_lib.__file__).resolve().parents[2] / "bin"))
    tool = bin_dir / "fabric-info"
    if not tool.is_file():
        pytest.skip(f"fabric-info not found in {bin_dir} (set FABRIC_BIN_DIR to the build's bin/)")
    environ_bytes("FABRIC_NICS", b"l\xfeo")
    # The engine cannot open on that NIC: the tool says so in the report and exits 1.
    out = subprocess.run([str(tool), "--json", "--provider", "tcp", "--cpu", "none"],
                         capture_output=True, timeout=120).stdout
    report = json.loads(out.decode("utf-8"))  # strict: raises on a byte that is not UTF-8
    assert b"\xfe" not in out
    assert report["engine"]["requested_nics"] == ["l\\xfeo"], report["engine"]
    from_python = fabric_lib.info(provider="tcp", cpu="none")
    assert from_python["engine"]["requested_nics"] == ["l\\xfeo"]
