"""Discrete-event simulator for FairBatching: hardware profiles, a roofline GPU model, and the
simulation engine.  Kept import-light: import submodules (``sglang_ext.sim.gpu``,
``sglang_ext.sim.profile``) directly."""
