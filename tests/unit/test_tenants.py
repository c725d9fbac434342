"""The tenant model (tierfs/tenants.py, docs/tenants.md): which tenant owns a key (the
longest matching prefix, else "default"), shares of a budget, and every bad declaration
refused with one line naming the tenant and the field."""

from __future__ import annotations

import pytest

from tierfs.config import parse_tenants
from tierfs.errors import UsageError
from tierfs.tenants import DEFAULT, Share, Tenant, TenantMap


def tmap(**tables: dict) -> TenantMap:
    return parse_tenants(tables)


def test_the_longest_prefix_wins():
    m = tmap(data={"prefixes": ["datasets/"]},
             vision={"prefixes": ["datasets/imagenet/", "ckpt/vision/"]},
             train={"prefixes": ["datasets/imagenet/train/"]})
    assert m.of("datasets/imagenet/train/n01/x.jpeg") == "train"
    assert m.of("datasets/imagenet/val/x.jpeg") == "vision"
    assert m.of("datasets/coco/a.jpg") == "data"
    assert m.of("ckpt/vision/step-10.pt") == "vision"
    # a prefix is a string prefix, not a directory: "datasets/imagenet" (no slash) is data's
    assert m.of("datasets/imagenet") == "data"
    assert m.of("ckpt/visionary/x") == DEFAULT
    # the answers do not depend on the memo: the same keys again, from it
    assert m.of("datasets/imagenet/train/n01/x.jpeg") == "train"
    assert m.of("datasets/imagenet/val/x.jpeg") == "vision"


def test_a_key_no_prefix_matches_is_the_default_tenants():
    m = tmap(vision={"prefixes": ["ckpt/vision/"]})
    for key in ("", "c", "ckpt/", "ckpt/vision", "other/ckpt/vision/x"):
        assert m.of(key) == DEFAULT, key
    assert TenantMap().of("anything") == DEFAULT
    assert TenantMap().names() == (DEFAULT,) and not TenantMap().declared
    assert m.names() == (DEFAULT, "vision") and m.declared


def test_the_default_tenant_may_be_declared_for_its_shares():
    m = tmap(default={"soft": "10%"}, vision={"prefixes": ["v/"]})
    assert m.get(DEFAULT).soft == Share(fraction=0.1)
    assert m.of("x") == DEFAULT and m.declared
    with pytest.raises(KeyError):
        m.get("nobody")


def test_unicode_keys_and_prefixes():
    m = tmap(jp={"prefixes": ["データ/"]}, de={"prefixes": ["daten/größe/"]},
             emoji={"prefixes": ["🙂/"]})
    assert m.of("データ/画像/1.png") == "jp"
    assert m.of("daten/größe/x") == "de"
    assert m.of("daten/grösse/x") == DEFAULT  # code points compared as given
    assert m.of("🙂/a") == "emoji" and m.of("🙃/a") == DEFAULT


def test_the_memo_is_bounded_and_never_changes_an_answer():
    tenants = [Tenant(f"t{i}", (f"p{i}/",)) for i in range(10)]
    m = TenantMap(tenants, memo_size=100)
    for n in range(1000):
        assert m.of(f"p{n % 10}/k{n}") == f"t{n % 10}"
        assert len(m._memo) <= 100
    for n in range(1000):  # again, some from the memo, most computed again
        assert m.of(f"p{n % 10}/k{n}") == f"t{n % 10}"
    assert TenantMap(tenants, memo_size=0).of("p3/x") == "t3"


def test_shares_of_a_budget():
    assert Share(fraction=0.4).of(1000) == 400
    assert Share(fraction=1.0).of(1 << 40) == 1 << 40
    assert Share(bytes=200 << 30).of(1 << 40) == 200 << 30
    assert Share(bytes=200 << 30).of(100 << 30) == 100 << 30  # never more than the budget
    assert str(Share(fraction=0.4)) == "40%" and str(Share(bytes=300 << 30)) == "300.0 GiB"
    m = tmap(vision={"prefixes": ["v/"], "soft": "40%", "hard": "300G", "max_idle": "7d",
                     "pin_ttl": "2d"})
    v = m.get("vision")
    assert v == Tenant("vision", ("v/",), Share(fraction=0.4), Share(bytes=300 << 30),
                       7 * 86400.0, 2 * 86400.0)
    assert v.soft.of(1 << 40) == int(0.4 * (1 << 40)) and v.hard.of(1 << 40) == 300 << 30


def test_the_inline_toml_form_is_the_same_map():
    inline = parse_tenants('{vision = {prefixes = ["datasets/imagenet/", "ckpt/vision/"], '
                           'soft = "40%", hard = "60%"}, nlp = {prefixes = ["nlp/"]}}')
    tables = tmap(vision={"prefixes": ["datasets/imagenet/", "ckpt/vision/"], "soft": "40%",
                          "hard": "60%"}, nlp={"prefixes": ["nlp/"]})
    assert inline == tables and hash(inline) == hash(tables)
    assert parse_tenants("") == TenantMap() == parse_tenants({})
    assert parse_tenants(tables) is tables


@pytest.mark.parametrize("tables,expect", [
    ({"Vision": {"prefixes": ["v/"]}}, "tenant 'Vision': bad name"),
    ({"a" * 33: {"prefixes": ["v/"]}}, "bad name"),
    ({"vi sion": {"prefixes": ["v/"]}}, "tenant 'vi sion': bad name"),
    ({"vision": {"prefixes": []}}, "tenant vision: prefixes: expected at least one"),
    ({"vision": {"prefixes": "v/"}}, "tenant vision: prefixes: expected a list"),
    ({"vision": {"prefixes": [""]}}, "tenant vision: prefixes: an empty prefix"),
    ({"vision": {"prefixes": [3]}}, "tenant vision: prefixes: expected strings"),
    ({"vision": {"prefixes": ["/v/"]}}, "tenant vision: prefixes: '/v/' starts with '/'"),
    ({"vision": {"prefixes": ["v/\n"]}}, "tenant vision: prefixes: 'v/\\n' contains a control"),
    ({"vision": {"prefixes": ["v/", "v/"]}}, "tenant vision: prefixes: 'v/' is given twice"),
    ({"vision": {"prefixes": ["x" * 1025]}}, "tenant vision: prefixes: "),
    ({"default": {"prefixes": ["d/"]}}, "tenant default: prefixes: the default tenant"),
    ({"vision": {"prefixes": ["v/"]}, "nlp": {"prefixes": ["n/", "v/"]}},
     "tenant nlp: prefixes: 'v/' is also tenant vision's"),
    ({"vision": {"prefixes": ["v/"], "soft": "50%", "hard": "40%"}},
     "tenant vision: hard: 40% is less than soft 50%"),
    ({"vision": {"prefixes": ["v/"], "soft": "2T", "hard": "1T"}},
     "tenant vision: hard: 1.0 TiB is less than soft 2.0 TiB"),
    ({"vision": {"prefixes": ["v/"], "soft": "0%"}}, "tenant vision: soft: 0%: must be more"),
    ({"vision": {"prefixes": ["v/"], "hard": "101%"}}, "tenant vision: hard: 101%: must be"),
    ({"vision": {"prefixes": ["v/"], "soft": 0}}, "tenant vision: soft: must be more than 0"),
    ({"vision": {"prefixes": ["v/"], "soft": 0.4}}, "tenant vision: soft: expected a share"),
    ({"vision": {"prefixes": ["v/"], "soft": "lots"}}, "tenant vision: soft: expected a share"),
    ({"vision": {"prefixes": ["v/"], "hard": True}}, "tenant vision: hard: expected a share"),
    ({"vision": {"prefixes": ["v/"], "soft": "2P"}}, "tenant vision: soft: must be at most 1P"),
    ({"vision": {"prefixes": ["v/"], "max_idle": "soon"}},
     "tenant vision: max_idle: expected a duration"),
    ({"vision": {"prefixes": ["v/"], "max_idle": 0}}, "tenant vision: max_idle: must be more"),
    ({"vision": {"prefixes": ["v/"], "pin_ttl": "400d"}}, "tenant vision: pin_ttl: must be at "
                                                          "most 365d"),
    ({"vision": {"prefixes": ["v/"], "pin_ttl": float("nan")}}, "tenant vision: pin_ttl: "),
    ({"vision": {"prefixes": ["v/"], "sfot": "40%"}},
     "tenant vision: 'sfot': unknown key (known: prefixes, soft, hard, max_idle, pin_ttl)"),
    ({"vision": {"prefixes": ["v/"], "max-idle": "1d", "max_idle": "2d"}},
     "tenant vision: 'max_idle': given twice"),
    ({"vision": ["v/"]}, "tenant vision: expected a table"),
    ({f"t{i}": {"prefixes": [f"p{i}/"]} for i in range(65)}, "more than 64 tenants"),
])
def test_every_bad_declaration_is_one_line_naming_tenant_and_field(tables, expect):
    with pytest.raises(UsageError) as err:
        parse_tenants(tables)
    message = str(err.value)
    assert message.startswith("invalid tenants: ") and expect in message, message
    assert "\n" not in message and len(message) < 400, message


@pytest.mark.parametrize("text,expect", [
    ("{vision = ", "expected an inline TOML table like"),
    ("[1, 2]", "expected a table of tenants"),
    ('"vision"', "expected a table of tenants"),
    ("{vision = {prefixes = []}}", "tenant vision: prefixes: expected at least one"),
    ("{a = 1}\nb = 2", "expected an inline TOML table"),
])
def test_a_bad_inline_string_is_one_line(text, expect):
    with pytest.raises(UsageError) as err:
        parse_tenants(text)
    message = str(err.value)
    assert expect in message and "\n" not in message, message


def test_the_records_check_themselves():
    with pytest.raises(ValueError, match="not both or none"):
        Share()
    with pytest.raises(ValueError, match="not both or none"):
        Share(fraction=0.5, bytes=10)
    with pytest.raises(ValueError, match="tenant vision: declared twice"):
        TenantMap([Tenant("vision", ("a/",)), Tenant("vision", ("b/",))])
    with pytest.raises(TypeError):
        TenantMap([{"name": "vision"}])  # type: ignore[list-item]
    # a size against a fraction needs the budget to compare them
    t = Tenant("vision", ("v/",), soft=Share(bytes=50 << 30), hard=Share(fraction=0.1))
    t.check_budget(1 << 40)  # 50 GiB <= 102.4 GiB
    with pytest.raises(ValueError, match=r"tenant vision: hard: 10% \(10.0 GiB of 100.0 GiB\) "
                                         r"is less than soft 50.0 GiB"):
        t.check_budget(100 << 30)
