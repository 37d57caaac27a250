"""The routers, one per API, each built from the service: ``kserve`` (/v2), ``text`` (/v1 texts),
``openai`` (/v1/completions, /v1/models, and vLLM's /health, /version, /v1/tokenize,
/v1/detokenize), ``playground`` (/, /docs, with ``static/``), ``metrics`` (/metrics)."""
