"""The checks that measure a backend against eager PyTorch: parity (which runs the LayerNorm eps probes of
``ldlm.export.layernorm`` on the artifact) and the benchmark."""
