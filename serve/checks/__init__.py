"""The checks that measure: eager-vs-backend parity, per-LayerNorm eps probes and the benchmark."""
