"""The compiled decision path (``sglang_ext/policy/_compiled.c``), built on install where a
C compiler exists. It is optional: without a compiler the install goes on and the policy
runs its pure-Python reference (``sglang_ext.policy.compiled`` says which path a process
runs). Everything else about the package is in ``pyproject.toml``."""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "sglang_ext.policy._compiled",
    sources=["sglang_ext/policy/_compiled.c"],
    # no fused multiply-adds: every float must round as the Python reference's does
    extra_compile_args=["-O2", "-ffp-contract=off", "-fno-fast-math"],
    optional=True,
)])
