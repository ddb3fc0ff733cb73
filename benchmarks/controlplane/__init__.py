"""Control-plane benchmarks: the daemon's routing rate and report ingestion, the gateway's
cost over the SDK, SGLang's serving benchmark against the gateway, and a live daemon on
loopback (for them and for the tests)."""
