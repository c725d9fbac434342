"""config: the near store's options (tier, tier_endpoint_url, tier_region, tier_profile,
promote, near_size) from keywords, `-o`, TOML (top-level keys or one [[tiers]] table);
every bad value or combination is one UsageError line naming it (docs/tiers.md)."""

from __future__ import annotations

import pytest

from tierfs.config import Source, build_config, build_config_with_file, parse_o_options
from tierfs.errors import UsageError

SRC, MP = "s3://bucket/data", "/mnt/data"


def test_keywords_and_o_options():
    c = build_config(SRC, MP, {"tier": "s3://near/copies", "tier_endpoint_url":
                               "http://rgw.dc1:7480", "tier_profile": "onprem",
                               "near_size": "50T"})
    assert c.tier == Source("s3", "near", "copies/")
    assert (c.tier_endpoint_url, c.tier_profile, c.near_size, c.promote) == (
        "http://rgw.dc1:7480", "onprem", 50 << 40, "all")
    o = parse_o_options(["tier=s3://near,promote=none"])
    c = build_config(SRC, MP, o)
    assert (c.tier, c.promote) == (Source("s3", "near", ""), "none")
    assert build_config(SRC, MP, {}).tier is None


@pytest.mark.parametrize("options, why", [
    ({"tier_endpoint_url": "http://a:1"}, "invalid tier-endpoint-url: only with --tier"),
    ({"tier_profile": "p"}, "invalid tier-profile: only with --tier"),
    ({"near_size": "1T"}, "invalid near-size: only with --tier"),
    ({"tier": "s3://bucket/data/cache"}, "overlaps the source"),
    ({"tier": "s3://bucket/"}, "overlaps the source"),
    ({"tier": "s3://X"}, "invalid bucket name 'X' in tier"),
    ({"tier": "http://near"}, "invalid tier"),
    ({"tier": "s3://near", "promote": "some"}, "invalid promote"),
    ({"tier": "s3://near", "tier_endpoint_url": "ftp://x"}, "invalid tier-endpoint-url"),
    ({"tier": "s3://near", "tier_profile": "a b"}, "expected an AWS profile name"),
    ({"tier": "s3://near", "near_size": "-1G"}, "invalid near-size"),
    ({"tier": "s3://near", "near_size": "2P"}, "invalid near-size"),
    ({"tier": "s3://near", "tier_timeout": "0s"}, "invalid tier-timeout"),
])
def test_bad_values_are_one_line(options, why):
    with pytest.raises(UsageError) as exc:
        build_config(SRC, MP, options)
    assert why in str(exc.value) and "\n" not in str(exc.value)


def test_the_same_bucket_on_another_endpoint_is_another_store():
    c = build_config(SRC, MP, {"endpoint_url": "https://s3.us-east-1.amazonaws.com",
                               "tier": "s3://bucket/data", "tier_endpoint_url": "http://rgw:7480"})
    assert c.tier == Source("s3", "bucket", "data/")


def _toml(tmp_path, text: str) -> str:
    path = tmp_path / "m.toml"
    path.write_text(f'source = "{SRC}"\nmountpoint = "{MP}"\n' + text)
    return str(path)


def test_a_tiers_table_in_toml(tmp_path):
    path = _toml(tmp_path, '[[tiers]]\nurl = "s3://near/copies"\nendpoint-url = '
                           '"http://rgw.dc1:7480"\nprofile = "onprem"\nsize = "10T"\n'
                           'promote = "none"\ntimeout = "2s"\n')
    c = build_config_with_file(path, None, None, {})
    assert (c.tier, c.tier_endpoint_url, c.tier_profile, c.near_size, c.promote) == (
        Source("s3", "near", "copies/"), "http://rgw.dc1:7480", "onprem", 10 << 40, "none")
    assert c.tier_timeout == 2.0
    # the command line wins over the file
    assert build_config_with_file(path, None, None, {"promote": "all"}).promote == "all"


@pytest.mark.parametrize("text, why", [
    ('[[tiers]]\nurl = "s3://a"\n[[tiers]]\nurl = "s3://b2"\n', "one near store is supported"),
    ('[[tiers]]\nendpoint_url = "http://x:1"\n', "url is required"),
    ('[[tiers]]\nurl = "s3://near"\ncolour = "blue"\n', "unknown key 'colour'"),
    ('tiers = "s3://near"\n', "expected [[tiers]] tables"),
    ('tier = "s3://near"\n[[tiers]]\nurl = "s3://near"\n', "both at the top and in [[tiers]]"),
])
def test_bad_tiers_tables_are_one_line(tmp_path, text, why):
    with pytest.raises(UsageError) as exc:
        build_config_with_file(_toml(tmp_path, text), None, None, {})
    assert why in str(exc.value) and "\n" not in str(exc.value)
