"""FairBatching for SGLang. Importing this package never imports sglang or torch."""
