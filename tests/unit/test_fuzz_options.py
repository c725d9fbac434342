"""Property-based fuzz of option parsing (hypothesis): whatever the command line, `-o`, a
TOML file or a CSI volume gives, the answer is a MountConfig or one UsageError line naming
what is wrong, never another exception. Bounded: 200 examples per property."""

from __future__ import annotations

import contextlib
import io
import math
import os
import tempfile

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierfs.cli import main as cli
from tierfs.config import (MAX_ID, OPTIONS, MountConfig, build_config, parse_o_options,
                           physical_memory, read_config_file)
from tierfs.errors import UsageError

FUZZ = settings(max_examples=100, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

# what people type: sizes, durations, numbers at and beyond every edge, URLs, odd text
_WORDS = ["0", "1", "-1", "8M", "99999P", "1e400", "nan", "inf", "-inf", "Infinity", "1.5",
          "4294967295", "4294967296", "true", "no", "", " ", "http://[::1", "http://a b:1",
          "http://127.0.0.1:7480", "us-east-1", "us\neast", "0644", "0o777", "99999999999999d",
          "5m", "250ms", "127.0.0.1:9100", "[::1]:9100", "DEBUG", "\x1b[31m", "a,b", "=",
          "9" * 500, "1" * 5000]
values = st.one_of(
    st.sampled_from(_WORDS),
    st.text(max_size=40),
    st.integers(min_value=-(1 << 70), max_value=1 << 70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.lists(st.integers(), max_size=2),
)
keys = st.one_of(st.sampled_from(OPTIONS), st.text(max_size=12))


def one_line(exc: UsageError) -> None:
    message = str(exc)
    assert message and "\n" not in message and "\r" not in message, repr(message)
    assert len(message) < 1000, message


def sane(cfg: MountConfig) -> None:
    """What any accepted config must satisfy, whatever produced it."""
    for name in OPTIONS:
        value = getattr(cfg, name)
        if isinstance(value, float):
            assert math.isfinite(value), name
    assert 0 <= cfg.uid <= MAX_ID and 0 <= cfg.gid <= MAX_ID
    assert 0 <= cfg.memory_cache_size <= physical_memory()
    assert 2 * cfg.chunk_size <= cfg.cache_size
    for text in (cfg.endpoint_url, cfg.region, cfg.log_file, cfg.cache_dir):
        assert text is None or not any(ord(c) < 32 for c in text)


@FUZZ
@given(st.dictionaries(keys, values, max_size=6))
def test_any_option_values_give_a_config_or_one_line(options):
    try:
        cfg = build_config("s3://bucket/prefix", "/mnt/data", options)
    except UsageError as exc:
        one_line(exc)
    else:
        sane(cfg)


@FUZZ
@given(st.lists(st.one_of(st.text(max_size=60), st.sampled_from(
    [f"{k}={w}" for k in ("uid", "cache_size", "bounded_memory", "region") for w in _WORDS[:12]]
    + ["bounded_memory", "allow_other", "ro", "writeback", "uid", "rw,noatime"])), max_size=4))
def test_any_dash_o_list_gives_a_config_or_one_line(items):
    try:
        cfg = build_config("s3://bucket", "/mnt/data", parse_o_options(items))
    except UsageError as exc:
        one_line(exc)
    else:
        sane(cfg)


@FUZZ
@given(st.text(max_size=80), st.text(max_size=80))
def test_any_source_and_mountpoint_give_a_config_or_one_line(source, mountpoint):
    try:
        sane(build_config(source, mountpoint, {}))
    except UsageError as exc:
        one_line(exc)


@FUZZ
@given(st.one_of(st.binary(max_size=300), st.dictionaries(
    st.sampled_from([*OPTIONS, "source", "mountpoint", "colour"]),
    st.one_of(st.sampled_from(_WORDS), st.integers(), st.floats(), st.booleans()),
    max_size=5).map(lambda d: "\n".join(f"{k} = {_toml(v)}" for k, v in d.items()).encode())))
def test_any_toml_file_gives_a_config_or_one_line(content):
    with tempfile.NamedTemporaryFile(suffix=".toml") as f:
        f.write(content)
        f.flush()
        try:
            options = read_config_file(f.name)
            sane(build_config("s3://bucket", "/mnt/data", {k: v for k, v in options.items()
                                                           if k not in ("source", "mountpoint")}))
        except UsageError as exc:
            one_line(exc)


def _toml(v: object) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, (int, float)):
        return repr(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") \
        .replace("\x1b", "\\u001b") + '"'


_FLAGS = ["--endpoint-url", "--region", "--cache-size", "--memory-cache-size", "--chunk-size",
          "--metadata-ttl", "--metrics-addr", "--min-free-ratio", "--readahead-chunks",
          "--backend-concurrency", "--dirty-wait", "--stall-warn", "--startup-timeout",
          "--log-level", "-o", "--allow-other", "--read-only", "--writeback", "--bogus"]


@FUZZ
@given(st.lists(st.one_of(st.sampled_from(_FLAGS), st.sampled_from(_WORDS),
                          st.text(max_size=20).filter(lambda t: "\0" not in t)), max_size=6))
def test_any_mount_command_line_is_one_error_line(args):
    # the mount point never exists, so even a valid command stops at its check: no daemon,
    # and nothing is created (no --log-file, --cache-dir or --foreground in the pool)
    argv = ["mount", "s3://bucket", "/nonexistent/tierfs-fuzz/mnt", *args]
    err = io.StringIO()
    umask = os.umask(0o022)  # main() sets the daemon's private umask: not for this process
    os.umask(umask)
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            cli.main(argv)
        except SystemExit as exc:
            assert exc.code not in (0, None)
        else:
            raise AssertionError("a mount on a missing mount point succeeded")
        finally:
            os.umask(umask)
    text = err.getvalue()
    lines = text.splitlines()
    assert len(lines) == 1 and lines[0].startswith("tierfs: error: "), text
    assert "Traceback" not in text and "tierfs tierfs" not in text
    assert not os.path.exists("/nonexistent/tierfs-fuzz")
