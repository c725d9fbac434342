"""A CSI volume's `tenants` attribute (inline TOML, docs/tenants.md) reaches tierfs mount
and is validated by tierfs's schema at NodeStageVolume."""

from __future__ import annotations

import pytest
from tierfs_csi.options import OptionError, stage_spec

from tierfs.cli.main import _config, _parser


def test_a_tenants_attribute_becomes_the_mounts_tenants():
    spec = stage_spec({"bucket": "data", "tenants": '{vision = {prefixes = ["ckpt/vision/"]}}'},
                      [], False, "/staging")
    args = _parser().parse_args(["mount", spec.source, "/staging", *spec.mount_args()])
    assert _config(args).tenants.of("ckpt/vision/e1.pt") == "vision"


def test_a_bad_tenants_attribute_is_refused_with_tierfs_message():
    with pytest.raises(OptionError, match="tenant vision: prefixes: expected at least one"):
        stage_spec({"bucket": "data", "tenants": "{vision = {prefixes = []}}"}, [], False,
                   "/staging")
