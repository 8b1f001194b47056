"""Builds the wsync-integrations wheel. The version is wsync's, written once in the checkout's CMakeLists.txt
(`project(wsync VERSION x.y.z)`): read from $WSYNC_SOURCE_DIR/CMakeLists.txt (a build from a copy of this directory),
../../CMakeLists.txt (pip in the checkout) or PKG-INFO (an sdist), and written into the wheel as
wsync_integrations/_version.py."""

import os
import re

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


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
    raise SystemExit("wsync-integrations: cannot find wsync's version (CMakeLists.txt of the checkout); set "
                     "WSYNC_SOURCE_DIR to the wsync checkout")


VERSION = wsync_version()


class BuildWithVersion(build_py):
    def run(self):
        super().run()
        with open(os.path.join(self.build_lib, "wsync_integrations", "_version.py"), "w") as f:
            f.write('__version__ = "%s"  # wsync\'s version (CMakeLists.txt), written when the wheel was built\n'
                    % VERSION)


setup(version=VERSION, cmdclass={"build_py": BuildWithVersion})
