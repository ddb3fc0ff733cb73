"""Helpers the benchmarks share, each defined once: the checkout's paths, free ports,
process groups, server-sent events, the machine and git state, saved points and outputs."""
