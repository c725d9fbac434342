"""Mount points as /proc/self/mountinfo spells them."""

from tierfs.mount.mountinfo import unescape


def test_octal_escapes_and_utf8_names_come_back_as_they_were():
    assert unescape("/mnt/plain") == "/mnt/plain"
    assert unescape("/mnt/with\\040space\\011tab\\134back") == "/mnt/with space\ttab\\back"
    assert unescape("/mnt/daten\\040für") == "/mnt/daten für"
