"""The prolog's input: comment tokens, manifests, scontrol output, settings (no Slurm)."""

import os
import subprocess
import sys

import pytest

from tierfs.errors import UsageError
from tierfs.mount.mountinfo import Mount
from tierfs.cli.slurm import (
    Declared,
    Job,
    collect,
    comment_from_scontrol,
    load_settings,
    parse_comment,
    parse_manifest,
    search_root,
)


def test_tokens_live_beside_other_text():
    d = parse_comment("run 42 of sweep; tierfs:warm=/data/imagenet,/ckpt/run42 owner=alice "
                      "tierfs:manifest=/home/alice/more.warm tierfs:warm=/data/extra/*.tar")
    assert d.paths == ("/data/imagenet", "/ckpt/run42", "/data/extra/*.tar")
    assert d.manifests == ("/home/alice/more.warm",)
    assert d.errors == ()


@pytest.mark.parametrize("comment", ["", "plain text", "notierfs:warm=/x", "x=tierfs:warm=/a"])
def test_no_tokens_declares_nothing(comment):
    assert not parse_comment(comment)


@pytest.mark.parametrize("comment, error", [
    ("tierfs:wram=/data", "unknown token tierfs:wram="),
    ("tierfs:warm=", "empty tierfs:warm="),
    ("tierfs:warm=,", "empty tierfs:warm="),
    ("tierfs:manifest=", "empty tierfs:manifest="),
    ("tierfs:warm=data/x", "absolute paths, not 'data/x'"),
    ("tierfs:manifest=warm.txt", "absolute paths, not 'warm.txt'"),
])
def test_bad_tokens_are_errors_not_silence(comment, error):
    d = parse_comment(comment)
    assert bool(d) and d.paths == () and len(d.errors) == 1
    assert error in d.errors[0]


def test_a_bad_token_keeps_the_good_ones():
    d = parse_comment("tierfs:warm=/a,rel,/b tierfs:typo=1")
    assert d.paths == ("/a", "/b") and len(d.errors) == 2


def test_manifest_lines():
    paths, errors = parse_manifest("# the set\n/data/a\n\n  /data/b/*.npy  \nrelative\n#/off\n",
                                   "m.warm")
    assert paths == ["/data/a", "/data/b/*.npy"]
    assert errors == ["m.warm:5: not an absolute path: 'relative'"]


@pytest.mark.parametrize("path, root", [
    ("/data/a.bin", "/data/a.bin"),
    ("/data/in/train-*.tar", "/data/in"),
    ("/data/*/x", "/data"),
    ("/d?ta", "/"),
    ("/data/[ab]/x", "/data"),
])
def test_search_root(path, root):
    assert search_root(path) == root


SHOW_JOB = """\
JobId=7 JobName=wrap
   UserId=nobody(65534) GroupId=nogroup(65534) MCS_label=N/A
   WorkDir=/tmp
   Comment=hello world tierfs:warm=/a,/b  x=y StdErr=not-a-field 
   StdErr=/tmp/j7.out
   StdIn=/dev/null
"""


def test_comment_from_scontrol_multiline():
    assert comment_from_scontrol(SHOW_JOB) == \
        "hello world tierfs:warm=/a,/b  x=y StdErr=not-a-field"
    assert parse_comment(comment_from_scontrol(SHOW_JOB)).paths == ("/a", "/b")


@pytest.mark.parametrize("text", ["JobId=7 JobName=x\n   WorkDir=/tmp\n",
                                  "JobId=7\n   Comment=(null)\n"])
def test_comment_from_scontrol_none(text):
    assert comment_from_scontrol(text) == ""


def test_settings_file(tmp_path):
    p = tmp_path / "tierfs-slurm.toml"
    p.write_text('strict = true\npin_ttl = "2h"\ntimeout = 45\nlog_file = ""\n'
                 'max_bytes = "2T"\n')
    s = load_settings(str(p))
    assert (s.strict, s.pin_ttl, s.timeout, s.log_file, s.max_bytes) == \
        (True, 7200.0, 45.0, None, 2 << 40)
    p.write_text('pin_ttl = "0"\n')
    assert load_settings(str(p)).pin_ttl is None
    assert load_settings(str(tmp_path / "missing.toml")).strict is False  # defaults


@pytest.mark.parametrize("text, error", [
    ("strcit = true\n", "unknown setting 'strcit'"),
    ("timeout = \"soon\"\n", "invalid timeout"),
    ("strict = \n", "tierfs-slurm.toml"),
    ("log_file = 3\n", "invalid log-file 3"),
    ("timeout = 0\n", "invalid timeout 0: must be more than 0s"),
    ("max_bytes = \"lots\"\n", "invalid max-bytes 'lots'"),
    ("daemon_user = \"no-such-user-here\"\n", "daemon_user 'no-such-user-here': no such user"),
])
def test_bad_settings(tmp_path, text, error):
    p = tmp_path / "tierfs-slurm.toml"
    p.write_text(text)
    with pytest.raises(UsageError, match=error):
        load_settings(str(p))


# ------------------------------------------------------------------ as the job's user
# (more in test_asuser.py: symlinks, `..`, globs into closed folders, FIFOs, the deadline)
NOBODY = Job("1", "nobody", 65534, 65534)
EVERYWHERE = [Mount("/", "fuse.tierfs", {"user_id": "0"})]  # as if all were under a tierfs mount


def test_paths_outside_trusted_tierfs_mounts_are_left_out(public_dir):
    for d in ("data", "data/ckpt", "datax", "other", "users"):
        (public_dir / d).mkdir(mode=0o755)
    for f in ("data/a", "datax/b", "data/ckpt/m.pt", "other/c", "users/d"):
        (public_dir / f).write_text("x")
        (public_dir / f).chmod(0o644)
    table = [Mount(str(public_dir / "data"), "fuse.tierfs", {"user_id": "0"}),
             Mount(str(public_dir / "data/ckpt"), "fuse.tierfs", {"user_id": "0"}),
             Mount(str(public_dir / "other"), "ext4", {}),
             Mount(str(public_dir / "users"), "fuse.tierfs", {"user_id": "65534"})]
    p = str(public_dir)
    paths, problems = collect(Job("1", "root", 0, 0), Declared(paths=(
        f"{p}/data/a", f"{p}/datax/b", f"{p}/data/ckpt/*.pt", f"{p}/other/c", f"{p}/users/d")),
        table)
    assert paths == [f"{p}/data/a", f"{p}/data/ckpt/m.pt"]
    assert problems == [f"not under a tierfs mount: {p}/datax/b",
                        f"not under a tierfs mount: {p}/other/c",
                        f"not under a tierfs mount: {p}/users/d"]  # a user's own mount
    paths, problems = collect(Job("1", "root", 0, 0), Declared(paths=(f"{p}/users/d",)), table,
                              trusted=frozenset({0, 65534}))  # daemon_user = "nobody"
    assert (paths, problems) == ([f"{p}/users/d"], [])


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="dropping to the job user needs root")


@needs_root
def test_manifest_is_read_as_the_job_user(tmp_path, public_dir):
    # tmp_path is under /tmp/pytest-of-root (0700): nobody cannot read what is there
    secret = tmp_path / "root-only.warm"
    secret.write_text("/etc/shadow\n")
    public = public_dir / "mine.warm"
    public.write_text("# mine\n/etc/passwd\n/etc/hostname\n")
    paths, problems = collect(NOBODY, Declared(manifests=(str(secret), str(public))), EVERYWHERE)
    assert paths == ["/etc/passwd", "/etc/hostname"]
    assert problems == [f"cannot read manifest {secret} as nobody: Permission denied"]


@needs_root
def test_paths_the_user_cannot_read_are_dropped(tmp_path, public_dir):
    hidden = tmp_path / "a.bin"  # exists, but inside a folder nobody cannot enter
    hidden.write_text("x")
    for name, mode in (("a.conf", 0o644), ("b.conf", 0o600), ("c.txt", 0o644)):
        (public_dir / name).write_text(name)
        (public_dir / name).chmod(mode)
    paths, problems = collect(NOBODY, Declared(paths=(
        "/etc/passwd", "/etc/shadow", str(hidden), f"{public_dir}/*.conf",
        f"{public_dir}/nonexistent/x")), EVERYWHERE)
    assert paths == ["/etc/passwd", f"{public_dir}/a.conf"]
    assert problems == ["unreadable for nobody: /etc/shadow", f"unreadable for nobody: {hidden}",
                        f"unreadable for nobody: {public_dir}/b.conf",
                        f"missing for nobody: {public_dir}/nonexistent/x"]


def run_hook(hook, env, tmp_path):
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    settings = tmp_path / "s.toml"
    settings.write_text(f'log_file = "{tmp_path}/hook.log"\n')
    return subprocess.run([sys.executable, "-m", "tierfs", "slurm", hook],
                          env={**base, "TIERFS_SLURM_CONFIG": str(settings), **env},
                          capture_output=True, text=True, timeout=60)


def test_hook_outside_slurm_is_one_usage_line(tmp_path):
    r = run_hook("prolog", {}, tmp_path)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        "tierfs-slurm prolog: error: SLURM_JOB_ID is not set: run this as slurmd's Prolog=/Epilog="]


def slurm_cmd(*argv, **env):
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TIERFS_"))}
    return subprocess.run([sys.executable, "-m", "tierfs", "slurm", *argv], capture_output=True,
                          text=True, env={**base, **env}, timeout=60)


def test_check_shows_the_settings_or_one_error_line(tmp_path):
    p = tmp_path / "tierfs-slurm.toml"
    p.write_text('strict = true\npin_ttl = "2h"\n')
    r = slurm_cmd("check", "--config", str(p))
    assert r.returncode == 0 and r.stderr == ""
    assert r.stdout.splitlines()[:3] == [f"settings: {p}", "strict = true", "pin_ttl = 7200s"]
    r = slurm_cmd("check", SLURM_CONF=str(tmp_path / "slurm.conf"))  # found beside slurm.conf
    assert r.stdout.splitlines()[:2] == [f"settings: {p}", "strict = true"]
    r = slurm_cmd("check", SLURM_CONF=str(tmp_path / "elsewhere" / "slurm.conf"))
    assert r.stdout.splitlines()[0] == \
        f"settings: defaults (there is no {tmp_path}/elsewhere/tierfs-slurm.toml)"
    p.write_text('strict = "maybe"\n')
    r = slurm_cmd("check", SLURM_CONF=str(tmp_path / "slurm.conf"))
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr.splitlines() == [f"tierfs-slurm check: error: {p}: invalid strict "
                                     f"'maybe': expected true or false"]


def test_broken_settings_under_slurmd_do_not_fail_the_hook(tmp_path):
    # exit 2 would drain every node the file reaches; the error goes to stderr and syslog
    for hook in ("prolog", "epilog"):
        r = slurm_cmd(hook, "--config", str(tmp_path / "nope.toml"), SLURM_JOB_ID="3",
                      SLURM_JOB_UID="0")
        assert r.returncode == 0
        assert r.stderr.splitlines() == [
            f"tierfs-slurm {hook}: error: {tmp_path}/nope.toml: no such settings file"]


def test_bad_declaration_is_logged_and_the_prolog_exits_0(tmp_path):
    env = {"SLURM_JOB_ID": "9", "SLURM_JOB_UID": str(os.getuid()), "SLURM_JOB_USER": "u",
           "SLURM_SCRIPT_CONTEXT": "prolog_slurmd", "SLURM_JOB_COMMENT": "tierfs:warm=rel"}
    r = run_hook("prolog", env, tmp_path)
    assert r.returncode == 0
    line = "tierfs-slurm prolog job=9 user=u warm FAILED (best-effort: the job starts): " \
           "tierfs:warm= takes absolute paths, not 'rel'"
    assert r.stderr.startswith(line) and len(r.stderr.splitlines()) == 1
    assert line in (tmp_path / "hook.log").read_text()


def test_job_without_declaration_logs_nothing(tmp_path):
    env = {"SLURM_JOB_ID": "10", "SLURM_JOB_UID": "0", "SLURM_SCRIPT_CONTEXT": "prolog_slurmd",
           "SLURM_JOB_COMMENT": "just a comment"}
    r = run_hook("prolog", env, tmp_path)
    assert (r.returncode, r.stderr) == (0, "")
    assert not (tmp_path / "hook.log").exists()


def test_without_scontrol_the_comment_is_unknown_and_logged(tmp_path):
    # no SLURM_JOB_COMMENT / SLURM_SCRIPT_CONTEXT (older slurmd): the hook asks scontrol
    settings = tmp_path / "s.toml"
    settings.write_text(f'log_file = "{tmp_path}/hook.log"\nscontrol = "{tmp_path}/scontrol"\n')
    r = slurm_cmd("prolog", "--config", str(settings), SLURM_JOB_ID="11", SLURM_JOB_UID="0",
                  SLURM_JOB_USER="root")
    assert r.returncode == 0
    [line] = r.stderr.splitlines()
    assert line.startswith("tierfs-slurm prolog job=11 user=root warm FAILED (best-effort: "
                           f"the job starts): {tmp_path}/scontrol: No such file or directory in ")


def test_a_large_warm_set_goes_in_bounded_manifests():
    from tierfs.cli.slurm import batches

    paths = [f"/mnt/data/{i:06d}.bin" for i in range(20_000)]  # 20 bytes + newline each
    parts = batches(paths, limit=100_000)
    assert [p for part in parts for p in part] == paths
    assert all(sum(len(p) + 1 for p in part) <= 100_000 for part in parts)
    assert len(parts) == 5
    assert batches([]) == [[]] and batches(["/a"]) == [["/a"]]
