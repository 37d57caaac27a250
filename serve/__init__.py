"""Serving LDLM, installed as ``ldlm.serve`` and grouped by role:

- ``runtime``: what runs graphs (one backend interface, the dynamic batcher, the generation scheduler);
- ``api``: the HTTP surface (KServe v2, the /v1 text API, OpenAI routes, previews, the playground);
- ``checks``: the checks that measure (parity, eps probes, the benchmark);
- ``deploy``: running the service elsewhere (Ray Serve, Triton's Python backend).

The eager reference it builds on is ``ldlm.pipeline.LDLMPipeline``.
"""
