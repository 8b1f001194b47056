"""Builds the wsync_client wheel: generates the gRPC/protobuf stubs from wsync's protos with grpcio-tools.

The stubs go into the wheel only (wsync_client/_proto), never into the source tree. The protos are looked for in
$WSYNC_PROTO_DIR, then ./proto (an sdist), then ../../proto (this directory inside the wsync checkout). The runtime
requirements follow the generator: protobuf of the same major version as grpcio-tools' bundled protoc (and at least
it), grpcio at least grpcio-tools' version (what the generated code checks at import).

The version is wsync's, written once in the checkout's CMakeLists.txt (`project(wsync VERSION x.y.z)`): read from
$WSYNC_SOURCE_DIR/CMakeLists.txt (a build from a copy of this directory), ../../CMakeLists.txt (pip in the checkout),
or PKG-INFO (an sdist), and written into the wheel as wsync_client/_version.py.
"""

import glob
import os
import re

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PROTOS = ["common.proto", "coordinator.proto", "trainer.proto"]


def proto_root():
    for root in (os.environ.get("WSYNC_PROTO_DIR"), os.path.join(HERE, "proto"),
                 os.path.join(HERE, "..", "..", "proto")):
        if root and os.path.isfile(os.path.join(root, "wsync", "v1", "trainer.proto")):
            return os.path.normpath(root)
    raise SystemExit("wsync_client: cannot find wsync's protos (wsync/v1/*.proto); set WSYNC_PROTO_DIR")


def wsync_version():
    for root in (os.environ.get("WSYNC_SOURCE_DIR"), os.path.join(HERE, "..", "..")):
        path = os.path.join(root, "CMakeLists.txt") if root else ""
        if path and os.path.isfile(path):
            m = re.search(r"^project\(wsync VERSION ([0-9]+\.[0-9]+\.[0-9]+)", open(path).read(), re.M)
            if m:
                return m.group(1)
    pkg_info = os.path.join(HERE, "PKG-INFO")
    if os.path.isfile(pkg_info):
        m = re.search(r"^Version: (\S+)", open(pkg_info).read(), re.M)
        if m:
            return m.group(1)
    raise SystemExit("wsync_client: cannot find wsync's version (CMakeLists.txt of the checkout); set "
                     "WSYNC_SOURCE_DIR to the wsync checkout")


VERSION = wsync_version()


def generator_versions():
    """(grpcio-tools version, protobuf version of its protoc): the generated code needs at least these at run time."""
    try:
        import grpc_tools  # noqa: F401
        from importlib.metadata import requires, version
        import google.protobuf
    except ImportError:
        raise SystemExit("wsync_client: building needs grpcio-tools (pip installs it from pyproject.toml's "
                         "build requirements)")
    gencode = google.protobuf.__version__
    for req in requires("grpcio-tools") or []:
        m = re.match(r"protobuf\s*[^;]*?>=\s*([0-9][0-9.]*)", req)
        if m:
            gencode = m.group(1)  # grpcio-tools requires the protobuf its protoc matches
    return version("grpcio-tools"), gencode


class BuildWithStubs(build_py):
    def run(self):
        super().run()
        with open(os.path.join(self.build_lib, "wsync_client", "_version.py"), "w") as f:
            f.write('__version__ = "%s"  # wsync\'s version (CMakeLists.txt), written when the wheel was built\n'
                    % VERSION)
        from grpc_tools import protoc
        import grpc_tools
        root = proto_root()
        out = os.path.join(self.build_lib, "wsync_client", "_proto")
        os.makedirs(out, exist_ok=True)
        include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
        files = [os.path.join(root, "wsync", "v1", p) for p in PROTOS]
        rc = protoc.main(["grpc_tools.protoc", "-I" + root, "-I" + include, "--python_out=" + out,
                          "--pyi_out=" + out, "--grpc_python_out=" + out] + files)
        if rc != 0:
            raise SystemExit("wsync_client: protoc failed (%d)" % rc)
        # protoc writes absolute imports of the proto package (`from wsync.v1 import ...`); inside the wheel the
        # package lives under wsync_client._proto.
        for d in (out, os.path.join(out, "wsync"), os.path.join(out, "wsync", "v1")):
            open(os.path.join(d, "__init__.py"), "a").close()
        for path in glob.glob(os.path.join(out, "wsync", "v1", "*.py*")):
            with open(path) as f:
                text = f.read()
            text = re.sub(r"^from wsync\.v1 import", "from wsync_client._proto.wsync.v1 import", text, flags=re.M)
            with open(path, "w") as f:
                f.write(text)


tools_version, protobuf_version = generator_versions()
pb_major = int(protobuf_version.split(".")[0])
setup(
    version=VERSION,
    cmdclass={"build_py": BuildWithStubs},
    install_requires=[
        "grpcio>=%s" % tools_version,
        "protobuf>=%s,<%d" % (protobuf_version, pb_major + 1),
    ],
)
