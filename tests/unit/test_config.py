"""config: sizes, durations, -o options and the validated MountConfig.

Every nonsense value must end as a UsageError whose message names the option, so the CLI
can print one line; nothing else may escape build_config.
"""

import pytest

from tierfs.config import (MountConfig, Source, build_config, parse_addr, parse_duration,
                           parse_o_options, parse_size)
from tierfs.errors import UsageError

SRC, MP = "s3://bucket/prefix", "/mnt/data"


@pytest.mark.parametrize("text, expected", [
    ("512M", 512 << 20), ("8MiB", 8 << 20), ("8MB", 8 << 20), ("8m", 8 << 20),
    ("500G", 500 << 30), ("1T", 1 << 40), ("1.5K", 1536), ("100", 100), (" 4 M ", 4 << 20),
    (4096, 4096),
])
def test_parse_size_accepts_binary_units(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["-1", "-5G", "abc", "5X", "", "1e3", "G", "1.2.3M"])
def test_parse_size_rejects_nonsense_naming_the_option(text):
    with pytest.raises(UsageError, match="cache-size"):
        parse_size(text, "cache-size")


@pytest.mark.parametrize("text", ["8i", "8iB", "4ib"])
def test_parse_size_rejects_binary_marker_without_a_unit(text):
    # "8i" is not a size anyone means; today it silently parses as 8 bytes
    with pytest.raises(UsageError, match="chunk-size"):
        parse_size(text, "chunk-size")


@pytest.mark.parametrize("text, expected", [
    ("60", 60.0), ("60s", 60.0), ("5m", 300.0), ("1h", 3600.0), ("1d", 86400.0),
    ("250ms", 0.25), ("1.5s", 1.5), (30, 30.0), (0.5, 0.5),
])
def test_parse_duration_accepts_units(text, expected):
    assert parse_duration(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["-1", "-5m", "5x", "m", "", "1 week", "1e3s"])
def test_parse_duration_rejects_nonsense_naming_the_option(text):
    with pytest.raises(UsageError, match="metadata-ttl"):
        parse_duration(text, "metadata-ttl")


def test_o_options_split_on_commas_and_merge_in_order():
    opts = parse_o_options(["ro,cache_size=5G", "chunk-size=4M,cache_size=6G", "allow_other"])
    assert opts == {"read_only": "true", "cache_size": "6G", "chunk_size": "4M",
                    "allow_other": True}


def test_o_options_ignore_generic_mount_options():
    assert parse_o_options(["rw,defaults,noatime,_netdev,nofail"]) == {}


def test_o_ro_becomes_read_only_in_the_config():
    cfg = build_config(SRC, MP, parse_o_options(["ro,cache_size=1G,metadata_ttl=5m"]))
    assert cfg.read_only is True
    assert cfg.cache_size == 1 << 30
    assert cfg.metadata_ttl == 300.0


def test_build_config_converts_every_kind_of_value():
    cfg = build_config(SRC, MP, {
        "endpoint_url": "http://127.0.0.1:7480", "cache_size": "1G", "memory_cache_size": "0",
        "chunk_size": "16M", "metadata_ttl": "90s", "metrics_addr": ":9100",
        "allow_other": "yes", "readahead_chunks": "4", "min_free_ratio": "0.2",
        "file_mode": "600", "log_level": "debug",
    })
    assert cfg.source == Source("s3", "bucket", "prefix/")
    assert cfg.mountpoint == MP
    assert cfg.endpoint_url == "http://127.0.0.1:7480"
    assert (cfg.cache_size, cfg.memory_cache_size, cfg.chunk_size) == (1 << 30, 0, 16 << 20)
    assert cfg.metadata_ttl == 90.0
    assert cfg.metrics_addr == ("127.0.0.1", 9100)
    assert cfg.allow_other is True
    assert cfg.readahead_chunks == 4
    assert cfg.min_free_ratio == 0.2
    assert cfg.file_mode == 0o600


def test_source_urls():
    assert Source.parse("s3://my-bucket") == Source("s3", "my-bucket", "")
    assert Source.parse("s3://my-bucket/a/b") == Source("s3", "my-bucket", "a/b/")
    assert Source.parse("s3://my-bucket/a/b/") == Source("s3", "my-bucket", "a/b/")
    assert Source.parse("file:///srv/data/") == Source("file", "/srv/data", "")


@pytest.mark.parametrize("url", ["http://bucket", "s3://", "s3:///prefix", "s3://Bad_Bucket",
                                 "file://relative/dir", "bucket/prefix", ""])
def test_bad_source_url_is_a_usage_error(url):
    with pytest.raises(UsageError, match="source|bucket"):
        build_config(url, MP, {})


def invalid(options: dict, name: str) -> None:
    with pytest.raises(UsageError) as exc:
        build_config(SRC, MP, options)
    assert name in str(exc.value), f"{exc.value} does not name {name}"


@pytest.mark.parametrize("value", ["3M", "100K", "12345"])
def test_chunk_size_must_be_a_power_of_two(value):
    invalid({"chunk_size": value}, "chunk-size")


@pytest.mark.parametrize("value", ["32K", "512M"])
def test_chunk_size_must_be_in_range(value):
    invalid({"chunk_size": value, "cache_size": "10G"}, "chunk-size")


@pytest.mark.parametrize("options, name", [
    ({"cache_size": "-1G"}, "cache-size"),
    ({"cache_size": "8M"}, "cache-size"),  # fewer than two 8M chunks
    ({"memory_cache_size": "-1"}, "memory-cache-size"),
    ({"metadata_ttl": "-5s"}, "metadata-ttl"),
    ({"heat_half_life": "0"}, "heat-half-life"),
    ({"min_free_ratio": "1.5"}, "min-free-ratio"),
    ({"min_free_ratio": "-0.1"}, "min-free-ratio"),
    ({"evict_low": "0.99"}, "evict"),
    ({"readahead_chunks": "0"}, "readahead-chunks"),
    ({"readahead_chunks": "many"}, "readahead-chunks"),
    ({"backend_concurrency": "1000"}, "backend-concurrency"),
    ({"log_level": "loud"}, "log-level"),
    ({"allow_other": "maybe"}, "allow-other"),
    ({"read_only": "2"}, "read-only"),
])
def test_nonsense_values_name_their_option(options, name):
    invalid(options, name)


@pytest.mark.parametrize("options, name", [
    ({"backend_timeout": "0"}, "backend-timeout"),
    ({"backend_retries": "-1"}, "backend-retries"),
    ({"uid": "-5"}, "uid"),
    ({"file_mode": "7777777"}, "file-mode"),
])
def test_unvalidated_numbers_are_rejected_too(options, name):
    # today these pass MountConfig unchecked: backend_retries=-1 then crashes start-up with
    # botocore's InvalidMaxRetryAttemptsError (a traceback, not a one-line usage error)
    invalid(options, name)


@pytest.mark.parametrize("url", ["ftp://host", "localhost:7480", "http://", "127.0.0.1",
                                 "http//missing-colon"])
def test_bad_endpoint_url_is_a_usage_error(url):
    invalid({"endpoint_url": url}, "endpoint-url")


@pytest.mark.parametrize("addr", ["nope", "9100", "host:0", "host:70000", "host:http", ""])
def test_bad_metrics_addr_is_a_usage_error(addr):
    invalid({"metrics_addr": addr}, "metrics-addr")


def test_metrics_addr_defaults_host_to_loopback():
    assert parse_addr(":9100") == ("127.0.0.1", 9100)
    assert parse_addr("0.0.0.0:9100") == ("0.0.0.0", 9100)


@pytest.mark.parametrize("key", ["cache_sise", "bucket", "source", "mountpoint"])
def test_unknown_option_is_named(key):
    invalid({key: "1"}, repr(key))


def test_unknown_o_option_is_named():
    invalid(parse_o_options(["cache_size=1G,speed=ludicrous"]), "'speed'")


@pytest.mark.parametrize("key", ["endpoint_url", "log_level", "metadata_ttl", "cache_size",
                                 "readahead_chunks", "region"])
def test_o_option_without_its_value_is_a_usage_error(key):
    # `-o endpoint_url` (value forgotten) must not crash with a traceback, nor silently
    # become 1 (metadata_ttl=True -> 1 s, readahead_chunks=True -> 1)
    invalid(parse_o_options([key]), key.replace("_", "-"))


def test_missing_mountpoint_is_a_usage_error():
    with pytest.raises(UsageError, match="MOUNTPOINT"):
        build_config(SRC, "", {})


def test_none_values_mean_not_given():
    cfg = build_config(SRC, MP, {"cache_size": None, "region": None})
    assert cfg.cache_size == MountConfig.model_fields["cache_size"].default


def test_effective_cache_dir_depends_on_source_and_endpoint():
    a = build_config("s3://one", MP, {})
    b = build_config("s3://two", MP, {})
    c = build_config("s3://one", MP, {"endpoint_url": "http://127.0.0.1:1"})
    assert len({a.effective_cache_dir, b.effective_cache_dir, c.effective_cache_dir}) == 3
    assert build_config("s3://one", MP, {"cache_dir": "rel"}).effective_cache_dir.startswith("/")
