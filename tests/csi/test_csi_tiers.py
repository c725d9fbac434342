"""A volume's near store (docs/tiers.md) is volume attributes like any other option: checked
by tierfs's own schema at NodeStageVolume, passed to `tierfs mount` as -o options."""

from __future__ import annotations

import pytest
from tierfs_csi.options import OptionError, stage_spec


def test_near_store_options_are_volume_attributes():
    spec = stage_spec({"bucket": "data", "tier": "s3://near/copies",
                       "tier-endpoint-url": "http://rgw.dc1:7480", "promote": "all",
                       "near_size": "50T"}, [], False, "/staging")
    opts = spec.mount_args()[1].split(",")
    assert {"tier=s3://near/copies", "tier_endpoint_url=http://rgw.dc1:7480", "promote=all",
            "near_size=50T"} <= set(opts)


@pytest.mark.parametrize("attrs, text", [
    ({"tier": "s3://data/"}, "overlaps the source"),
    ({"tier_endpoint_url": "http://rgw:1"}, "only with --tier"),
    ({"tier": "s3://near", "promote": "maybe"}, "invalid promote"),
])
def test_bad_near_store_attributes_are_refused_at_stage(attrs, text):
    with pytest.raises(OptionError, match=text):
        stage_spec({"bucket": "data", **attrs}, [], False, "/staging")
