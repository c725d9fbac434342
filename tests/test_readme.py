"""U1: the README's commands run as root on a fresh Debian 12, which has no sudo.

Before: its first command was `sudo bash scripts/quickstart.sh` ("sudo: command not
found" there). Every shell block is read; no command may need sudo, and each script it
runs must exist."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _commands(markdown: str) -> list[str]:
    blocks = re.findall(r"```sh\n(.*?)```", markdown, flags=re.S)
    return [line.split("#")[0].strip() for block in blocks for line in block.splitlines()
            if line.split("#")[0].strip()]


def test_readme_commands_need_no_sudo_and_name_scripts_that_exist():
    commands = _commands((ROOT / "README.md").read_text())
    assert commands[0] == "bash scripts/quickstart.sh"
    for command in commands:
        assert not re.search(r"(^|[;&|]\s*)sudo\b", command), command
        for script in re.findall(r"\bbash (\S+)", command):
            assert (ROOT / script).is_file(), command
