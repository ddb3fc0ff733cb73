"""This checkout's benchmarks and measuring tools: not product code, not shipped in the wheel.

Run from the repository root (the ``scripts/*.sh`` wrappers ``cd`` there), e.g.
``python -m benchmarks.sim.decision_time``. Rooms: :mod:`benchmarks.support` (helpers
shared by the others), :mod:`benchmarks.sim` (the simulator: benchmarks and the report),
:mod:`benchmarks.server` (stock SGLang servers on the emulated GPU),
:mod:`benchmarks.controlplane` (the daemon, the gateway, standard clients),
:mod:`benchmarks.routers` (SGLang's router against the daemon) and
:mod:`benchmarks.gpu` (step-time profiling on a real GPU). Tests may import from here;
nothing here imports from ``tests/``.
"""
