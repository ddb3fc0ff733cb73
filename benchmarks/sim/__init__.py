"""Simulator benchmarks (decision time, simulator speed, admission, hostile SLOs, Kairos,
SLO-aware annealing, cluster mode, the batching study) and the report of the paper's tables."""
