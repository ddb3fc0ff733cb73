"""GPU tools: the step-time profiler (a measured grid) and the profile fitted to it."""
