"""Model-based test: random sequences of file operations on the mount, compared after every
step with an in-memory model (contents, sizes, directory listings); at the end of each
sequence the bucket must hold exactly the model's files.

One mount per mode for the whole run (module-scoped); each example works in a fresh
directory model/exN. A small chunk size (256K) makes small writes cross chunk boundaries.
"""

from __future__ import annotations

import errno
import os
import uuid

import pytest
import wkit
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, invariant, precondition, rule,
                                 run_state_machine_as_test)
from mounting import Mount, Mounts
from rgw import delete_bucket
from wkit import KiB

FILES = ["a", "b", "c", "d0/x", "d0/y", "d1/x"]
DIRS = ["d0", "d1"]
CHUNK = 256 * KiB

# No shrinking: on a real mount a failure may depend on timing (an upload racing the next
# call) and not replay exactly, which turns shrinking into a "Flaky" error. Instead every
# assertion message carries the operations of the failing example (self.trace).
SETTINGS = settings(max_examples=25, stateful_step_count=30, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck), report_multiple_bugs=False,
                    phases=(Phase.explicit, Phase.reuse, Phase.generate))

offsets = st.one_of(st.integers(0, 4 * KiB), st.integers(0, 3 * CHUNK + 7))
sizes = st.one_of(st.integers(0, 64), st.integers(1, 2 * CHUNK + 5))
seeds = st.integers(0, 1 << 30)


@pytest.fixture(scope="module", params=list(wkit.MODES))
def model_mount(request, rgw, tmp_path_factory):
    client = rgw.client()
    name = f"model-{uuid.uuid4().hex[:20]}"
    client.create_bucket(Bucket=name)
    tmp = tmp_path_factory.mktemp(f"model-{request.param}")
    mounts = Mounts(rgw, name, tmp)
    try:
        yield mounts.start(*wkit.MODES[request.param], "--chunk-size", "256K"), client, name
    finally:
        mounts.close()
        delete_bucket(client, name)


class FsMachine(RuleBasedStateMachine):
    mount: Mount | None = None
    client = None
    bucket = ""
    examples = 0

    def __init__(self) -> None:
        super().__init__()
        FsMachine.examples += 1
        self.rel = f"model/ex{FsMachine.examples}"
        self.root = self.mount.path / self.rel
        os.makedirs(self.root)
        self.files: dict[str, bytearray] = {}
        self.dirs: set[str] = set()
        self.fds: dict[str, int] = {}
        self.trace: list[str] = []

    def note(self, what: str) -> None:
        self.trace.append(what)

    def why(self, what: str) -> str:
        return f"{what}\n  after the operations of {self.rel}:\n    " + "\n    ".join(self.trace)

    # ------------------------------------------------------------ helpers
    def p(self, name: str):
        return self.root / name

    def parent_ok(self, name: str) -> bool:
        return "/" not in name or name.split("/")[0] in self.dirs

    def close(self, name: str) -> None:
        fd = self.fds.pop(name, None)
        if fd is not None:
            os.close(fd)

    def close_under(self, prefix: str) -> None:
        for n in [n for n in self.fds if n == prefix or n.startswith(prefix + "/")]:
            self.close(n)

    def handle(self, name: str) -> int:
        if name not in self.fds:
            self.fds[name] = os.open(self.p(name), os.O_RDWR | os.O_CREAT, 0o644)
            self.files.setdefault(name, bytearray())
        return self.fds[name]

    # ------------------------------------------------------------ rules
    @rule(d=st.sampled_from(DIRS))
    def mkdir(self, d):
        self.note(f"mkdir {d}")
        if d in self.dirs:
            with pytest.raises(FileExistsError):
                os.mkdir(self.p(d))
        else:
            os.mkdir(self.p(d))
            self.dirs.add(d)

    @rule(name=st.sampled_from(FILES), off=offsets, seed=seeds, size=sizes)
    def pwrite(self, name, off, seed, size):
        if not self.parent_ok(name):
            return
        data = wkit.payload(seed, size)
        self.note(f"pwrite {name} at {off}: {size} bytes{' (opens)' if name not in self.fds else ''}")
        assert os.pwrite(self.handle(name), data, off) == size
        wkit.apply_write(self.files[name], off, data)

    @rule(name=st.sampled_from(FILES), seed=seeds, size=sizes)
    def create_truncating(self, name, seed, size):
        if not self.parent_ok(name):
            return
        self.note(f"create/O_TRUNC {name}: {size} bytes, close")
        self.close(name)
        data = wkit.payload(seed, size)
        wkit.write_file(self.p(name), data)
        self.files[name] = bytearray(data)

    @rule(name=st.sampled_from(FILES), seed=seeds, size=sizes)
    def append(self, name, seed, size):
        if not self.parent_ok(name):
            return
        self.note(f"O_APPEND {name}: {size} bytes, close")
        self.close(name)
        data = wkit.payload(seed, size)
        wkit.write_file(self.p(name), data, flags=os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        self.files.setdefault(name, bytearray()).extend(data)

    @rule(name=st.sampled_from(FILES), size=st.one_of(st.integers(0, 100), offsets))
    def truncate(self, name, size):
        if name not in self.files:
            return
        self.note(f"{'ftruncate' if name in self.fds else 'truncate'} {name} to {size}")
        if name in self.fds:
            os.ftruncate(self.fds[name], size)
        else:
            os.truncate(self.p(name), size)
        wkit.apply_truncate(self.files[name], size)

    @rule(src=st.sampled_from(FILES), dst=st.sampled_from(FILES))
    def rename(self, src, dst):
        if src not in self.files or not self.parent_ok(dst) or src == dst:
            return
        self.note(f"rename {src} -> {dst}{' (replaces)' if dst in self.files else ''}")
        self.close(src)
        self.close(dst)
        os.rename(self.p(src), self.p(dst))
        self.files[dst] = self.files.pop(src)

    @rule(name=st.sampled_from(FILES))
    def unlink(self, name):
        if name not in self.files:
            if self.parent_ok(name):
                with pytest.raises(FileNotFoundError):
                    os.unlink(self.p(name))
            return
        self.note(f"unlink {name}")
        self.close(name)
        os.unlink(self.p(name))
        del self.files[name]

    @rule(d=st.sampled_from(DIRS))
    def rmdir(self, d):
        if d not in self.dirs:
            return
        self.note(f"rmdir {d}")
        if any(n.startswith(d + "/") for n in self.files):
            with pytest.raises(OSError) as e:
                os.rmdir(self.p(d))
            assert e.value.errno == errno.ENOTEMPTY
        else:
            os.rmdir(self.p(d))
            self.dirs.discard(d)

    @rule(src=st.sampled_from(DIRS), dst=st.sampled_from(DIRS))
    def rename_dir(self, src, dst):
        if src not in self.dirs or dst in self.dirs:
            return
        self.note(f"rename dir {src} -> {dst}")
        self.close_under(src)
        os.rename(self.p(src), self.p(dst))
        self.dirs.discard(src)
        self.dirs.add(dst)
        for n in [n for n in self.files if n.startswith(src + "/")]:
            self.files[dst + n[len(src):]] = self.files.pop(n)

    @precondition(lambda self: self.fds)
    @rule(data=st.data())
    def fsync(self, data):
        name = data.draw(st.sampled_from(sorted(self.fds)))
        self.note(f"fsync {name}")
        os.fsync(self.fds[name])

    @precondition(lambda self: self.fds)
    @rule(data=st.data())
    def close_and_reopen(self, data):
        name = data.draw(st.sampled_from(sorted(self.fds)))
        self.note(f"close + reopen {name}")
        self.close(name)
        fd = self.handle(name)
        got = os.pread(fd, len(self.files[name]) + 1, 0)
        assert got == bytes(self.files[name]), self.why(f"{name} reopened reads {wkit.short(got)}")

    @precondition(lambda self: self.fds)
    @rule(data=st.data())
    def close_one(self, data):
        name = data.draw(st.sampled_from(sorted(self.fds)))
        self.note(f"close {name}")
        self.close(name)

    # ------------------------------------------------------------ checks
    @invariant()
    def same_as_model(self):
        listed = sorted(os.listdir(self.root))
        top = sorted({n.split("/")[0] for n in self.files} | self.dirs)
        assert listed == top, self.why(f"listing of {self.rel}")
        for d in self.dirs:
            inside = sorted(n.split("/", 1)[1] for n in self.files if n.startswith(d + "/"))
            assert sorted(os.listdir(self.p(d))) == inside, self.why(f"listing of {d}")
        for name, want in self.files.items():
            size = os.stat(self.p(name)).st_size
            assert size == len(want), self.why(f"stat {name}: size {size}, model {len(want)}")
            with open(self.p(name), "rb") as f:
                got = f.read()
            assert got == bytes(want), self.why(
                f"{name} reads {wkit.short(got)}, model {wkit.short(bytes(want))}")

    def teardown(self) -> None:
        for name in list(self.fds):
            self.close(name)
        prefix = self.rel + "/"
        want = {prefix + n: bytes(v) for n, v in self.files.items()}

        def bucket_matches() -> None:
            got = wkit.s3_files(self.client, self.bucket, prefix)
            diff = {k: (wkit.short(got.get(k)), wkit.short(want.get(k)))
                    for k in set(got) | set(want) if got.get(k) != want.get(k)}
            assert not diff, self.why(f"bucket vs model (bucket, model): {diff}")

        wkit.eventually(bucket_matches, wkit.BUCKET_LAG)


def test_random_operations_match_the_model(model_mount):
    m, client, bucket = model_mount
    os.makedirs(m.path / "model", exist_ok=True)
    FsMachine.mount, FsMachine.client, FsMachine.bucket = m, client, bucket
    run_state_machine_as_test(FsMachine, settings=SETTINGS)
