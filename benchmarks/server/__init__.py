"""Real-server benchmarks and tools: stock SGLang servers on the emulated GPU (launching
them, replaying a trace against them, stock against FairBatching, admission control), the
step log's cost and report, and the scheduling cost on a real ``Scheduler``."""
