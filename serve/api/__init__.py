"""The HTTP surface: the FastAPI app (KServe v2 + /v1 text API), its codecs, guards, schemas and metrics."""
