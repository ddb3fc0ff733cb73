"""The FairBatching policy core: pure Python, no sglang, no torch."""
