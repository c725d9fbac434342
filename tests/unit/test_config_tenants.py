"""The `tenants` option (tierfs/config.py) from every place options come from: the mount's
TOML file ([tenants.NAME] tables), `-o tenants={...}` (inline TOML, its commas kept), and
the checks that need the whole config (the source's prefix, the cache budget)."""

from __future__ import annotations

import pytest

from tierfs.cli import main as cli
from tierfs.config import build_config, build_config_with_file, parse_o_options
from tierfs.errors import UsageError
from tierfs.tenants import DEFAULT, Share, TenantMap

TWO_TENANTS = '''
source = "s3://research/"
mountpoint = "/mnt/research"
cache_size = "1T"

[tenants.vision]
prefixes = ["datasets/imagenet/", "ckpt/vision/"]
soft = "40%"
hard = "60%"
max_idle = "7d"
pin_ttl = "2d"

[tenants.nlp]
prefixes = ["datasets/text/"]
hard = "200G"

[tenants.default]
soft = "10%"
'''


def write(tmp_path, text: str) -> str:
    path = tmp_path / "mount.toml"
    path.write_text(text)
    return str(path)


def test_two_tenants_from_the_mounts_toml_file(tmp_path):
    cfg = build_config_with_file(write(tmp_path, TWO_TENANTS), None, None, {})
    t = cfg.tenants
    assert t.names() == (DEFAULT, "nlp", "vision")
    vision = t.get("vision")
    assert vision.prefixes == ("datasets/imagenet/", "ckpt/vision/")
    assert (vision.soft, vision.hard) == (Share(fraction=0.4), Share(fraction=0.6))
    assert (vision.max_idle, vision.pin_ttl) == (7 * 86400.0, 2 * 86400.0)
    assert t.get("nlp").hard == Share(bytes=200 << 30) and t.get("nlp").soft is None
    assert t.get(DEFAULT).soft == Share(fraction=0.1) and t.get(DEFAULT).prefixes == ()
    assert t.of("ckpt/vision/e1.pt") == "vision" and t.of("datasets/text/a") == "nlp"
    assert t.of("scratch/x") == DEFAULT
    hash(cfg)  # the config stays hashable and comparable
    assert cfg == build_config_with_file(write(tmp_path, TWO_TENANTS), None, None, {})


def test_without_tenants_the_default_owns_every_key(tmp_path):
    cfg = build_config("s3://research", "/mnt/r", {})
    assert cfg.tenants == TenantMap() and cfg.tenants.of("a/b") == DEFAULT
    assert not cfg.tenants.declared


def test_the_inline_form_on_the_command_line_keeps_its_commas():
    opts = parse_o_options(['cache_size=1T,tenants={vision = {prefixes = ["ckpt/vision/", '
                            '"odd,}name/"], soft = "40%"}, nlp = {prefixes = [\'nlp/\']}},ro',
                            "metadata_ttl=5m"])
    assert set(opts) == {"cache_size", "tenants", "read_only", "metadata_ttl"}
    cfg = build_config("s3://research", "/mnt/r", opts)
    assert cfg.read_only and cfg.cache_size == 1 << 40 and cfg.metadata_ttl == 300.0
    assert cfg.tenants.get("vision").prefixes == ("ckpt/vision/", "odd,}name/")
    assert cfg.tenants.of("odd,}name/x") == "vision" and cfg.tenants.of("nlp/x") == "nlp"


def test_the_command_line_replaces_the_files_tenants(tmp_path):
    cfg = build_config_with_file(write(tmp_path, TWO_TENANTS), None, None, parse_o_options(
        ['tenants={audio = {prefixes = ["audio/"]}}']))
    assert cfg.tenants.names() == ("audio", DEFAULT)


def test_the_cli_takes_the_inline_form():
    args = cli._parser().parse_args(
        ["mount", "s3://research", "/mnt/r", "-o", 'tenants={v = {prefixes = ["a/", "b/"]}}'])
    assert cli._config(args).tenants.of("b/x") == "v"


@pytest.mark.parametrize("body,expect", [
    ("[tenants.Vision]\nprefixes = [\"v/\"]\n", "tenant 'Vision': bad name"),
    ("[tenants.vision]\nprefixes = []\n", "tenant vision: prefixes: expected at least one"),
    ("[tenants.vision]\nprefixes = [\"v/\"]\nsoft = \"70%\"\nhard = \"60%\"\n",
     "tenant vision: hard: 60% is less than soft 70%"),
    ("[tenants.vision]\nprefixes = [\"v/\"]\nsoft = 0.4\n", "tenant vision: soft: expected a share"),
    ("[tenants.vision]\nprefixes = [\"v/\"]\nquota = \"60%\"\n",
     "tenant vision: 'quota': unknown key"),
    ("[tenants.vision]\nprefixes = [\"v/\"]\nmax_idle = \"a week\"\n",
     "tenant vision: max_idle: expected a duration"),
    ("[tenants.a]\nprefixes = [\"v/\"]\n[tenants.b]\nprefixes = [\"v/\"]\n",
     "tenant b: prefixes: 'v/' is also tenant a's"),
    ("tenants = 3\n", "tenants: expected tables [tenants.NAME]"),
    ("tenants = [\"v/\"]\n", "tenants: expected tables [tenants.NAME]"),
])
def test_bad_tenants_in_the_file_are_one_line_naming_the_file(tmp_path, body, expect):
    path = write(tmp_path, 'source = "s3://research"\nmountpoint = "/mnt/r"\n' + body)
    with pytest.raises(UsageError) as err:
        build_config_with_file(path, None, None, {})
    message = str(err.value)
    assert message.startswith(path + ": ") and expect in message, message
    assert "\n" not in message


@pytest.mark.parametrize("source,tenants,expect", [
    # keys are bucket keys, the source's prefix included: a prefix beside it never matches
    ("s3://research/data", '{v = {prefixes = ["ckpt/"]}}',
     "tenant v: prefixes: 'ckpt/' is outside the source's prefix 'data/'"),
    # a size against a fraction is compared on this mount's budget
    ("s3://research", '{v = {prefixes = ["v/"], soft = "200G", hard = "10%"}}',
     "tenant v: hard: 10% (102.4 GiB of 1.0 TiB) is less than soft 200.0 GiB"),
])
def test_checks_against_the_rest_of_the_config(source, tenants, expect):
    with pytest.raises(UsageError) as err:
        build_config(source, "/mnt/r", {"cache_size": "1T", "tenants": tenants})
    message = str(err.value)
    assert message.startswith("invalid tenants: ") and expect in message, message
    assert "\n" not in message


def test_prefixes_inside_or_around_the_source_prefix_are_fine():
    cfg = build_config("s3://research/data/", "/mnt/r", {"tenants": (
        '{v = {prefixes = ["data/vision/"]}, all = {prefixes = ["da"]}}')})
    assert cfg.tenants.of("data/vision/x") == "v" and cfg.tenants.of("data/x") == "all"


def test_a_bad_inline_value_is_one_line_with_a_nonzero_exit(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["mount", "s3://research", "/mnt/r", "-o", "tenants={v = {prefixes = [}}"])
    assert exit_.value.code != 0
    err = capsys.readouterr().err.strip()
    assert "invalid tenants" in err and "\n" not in err and "Traceback" not in err, err
