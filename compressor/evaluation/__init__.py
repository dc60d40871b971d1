"""Measuring models: perplexity and KL to the original (`metrics`), lm-eval harness tasks
(`harness`), decoding speed and memory (`throughput`, `memtrack`) and the plots (`plots`)."""
