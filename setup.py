"""The native shared-memory core: plain C, built at install as an optional extension.

Everything else about the package is in pyproject.toml. Without a C compiler the install still
succeeds (optional=True) and the shared-memory transport runs its Python path
(gradsync/comm/transport/shm/native/__init__.py says which, and why).
"""

from pathlib import Path

from setuptools import Extension, setup

NATIVE = Path("src/gradsync/comm/transport/shm/native")

setup(ext_modules=[Extension(
    "gradsync.comm.transport.shm.native._core",
    sources=[str(path) for path in sorted(NATIVE.glob("*.c"))],
    depends=[str(NATIVE / "core.h")],
    extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-Wno-unused-parameter"],
    optional=True,
)])
