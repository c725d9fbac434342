"""Generates tierfs_csi/csi_pb2.py and csi_pb2_grpc.py from tierfs_csi/csi.proto while
building (wheel and editable installs alike), so generated code is never committed and
always matches the pinned grpcio-tools of pyproject.toml."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def generate(out_dir: str) -> None:
    import grpc_tools  # a build requirement (pyproject.toml)
    from grpc_tools import protoc

    include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    # proto path "tierfs_csi/csi.proto" makes the stub import `from tierfs_csi import csi_pb2`
    args = ["protoc", f"-I{HERE}", f"-I{include}", f"--python_out={out_dir}",
            f"--grpc_python_out={out_dir}", os.path.join(HERE, "tierfs_csi", "csi.proto")]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed on tierfs_csi/csi.proto")


class BuildWithStubs(build_py):
    def run(self) -> None:
        super().run()
        # editable installs import from the source tree, wheels from build_lib
        generate(HERE if getattr(self, "editable_mode", False) else self.build_lib)


setup(cmdclass={"build_py": BuildWithStubs})
