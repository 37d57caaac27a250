"""The HTTP surface: the FastAPI app (KServe v2, the /v1 text API, OpenAI completions), its codecs, guards, schemas and metrics.

From the socket inwards:

- ``server``: binds the socket, assembles the app (``create_app``) and shuts it down gracefully;
- ``http_guard``: the connection layer and the middleware (auth, body caps and timeouts, error mapping, logs);
- ``errors``: the one error shape (OpenAI's on OpenAI's routes) and the app's exception handlers;
- ``routes/``, one router per API: ``kserve`` (/v2), ``text`` (/v1 texts), ``openai`` (/v1/completions, /v1/models),
  ``playground`` (/, /docs), ``metrics`` (/metrics);
- what the routers share: ``offload`` (deadlines; blocking work and JSON off the event loop), ``schemas`` and
  ``openai_schemas`` (request bodies with this server's limits), ``streaming`` (Server-Sent Events), ``kserve`` (the v2 codec);
- ``service``: ``ServerSettings`` and ``LDLMService``, the graphs, batchers and scheduler a server process holds.
"""
