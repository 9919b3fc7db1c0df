"""The native shared-memory core: plain C, built at install as an optional extension.

Everything else about the package is in pyproject.toml. Without a C compiler the install still
succeeds (optional=True) and the shared-memory collectives run their Python path
(gradsync/comm/transport/shm/native/__init__.py says which, and why).

One extension module, from two places: the transport's machinery (doorbells, barriers, fingerprint
slots, the hold, the reductions, and the module's Core and Plan) in comm/transport/shm/native/, and
each collective's C variant beside its Python variant in comm/ (allreduce_one_shot.c beside
allreduce_one_shot.py, and so on).
"""

from pathlib import Path

from setuptools import Extension, setup

COMM = Path("src/gradsync/comm")
NATIVE = COMM / "transport/shm/native"

setup(ext_modules=[Extension(
    "gradsync.comm.transport.shm.native._core",
    sources=[str(path) for path in sorted(NATIVE.glob("*.c")) + sorted(COMM.glob("*.c"))],
    depends=[str(NATIVE / "core.h")],
    include_dirs=[str(NATIVE)],
    extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-Wno-unused-parameter"],
    optional=True,
)])
