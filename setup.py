"""The optional compiled accelerator (cachetree._speedups); everything else is in pyproject.toml.

The extension is `optional`: when it cannot be compiled (no compiler, no Python headers),
setuptools prints a warning and the install goes on with the pure-Python twins, which give the
same results (README, "The compiled accelerator"). KVROUTER_NO_EXTENSIONS=1 at build time skips
it altogether, as it forces the pure path at run time.
"""

import os

from setuptools import Extension, setup

ACCELERATOR = Extension("cachetree._speedups", ["cachetree/_speedups.c"], optional=True)
TABLES = Extension("cachetree._tables", ["cachetree/_tables.c"], optional=True)


def extensions() -> list[Extension]:
    if os.environ.get("KVROUTER_NO_EXTENSIONS", "") not in ("", "0"):
        return []
    return [ACCELERATOR, TABLES]


if __name__ == "__main__":
    setup(ext_modules=extensions())
