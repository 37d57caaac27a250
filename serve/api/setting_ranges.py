"""The allowed range of every numeric ``ldlm serve`` setting, shared by ``ServerSettings`` and the
``ldlm serve`` options, so the CLI refuses at parse time what the server would refuse at start.
No imports: the CLI reads them before anything heavy loads."""

SETTING_RANGES: dict[str, tuple[int, int]] = {  # ServerSettings field -> (low, high), both included
    "port": (0, 65535),  # 0: the OS picks a free port
    "max_batch": (1, 1 << 16),
    "max_queue": (1, 1 << 20),
    "max_body_bytes": (1024, 1 << 31),
    "max_n": (1, 1 << 16),
    "max_steps": (1, 1 << 20),
    "max_texts": (1, 1 << 16),
    "max_request_samples": (1, 1 << 20),
    "max_request_tokens": (1, 1 << 30),
    "max_connections": (1, 1 << 20),
}
MAX_THREADS = 1024  # intra-op threads: more than any machine's cores; a pool this size only adds switching
MAX_TIMEOUT_S = 86400.0  # request, header and body timeouts: finite, at most a day
MAX_DELAY_MS = 60000.0  # a batching window longer than the default request timeout would only time requests out
# Shares of wall time that decoding streamed previews may take (serve/api/streaming.py), in (0, 1]:
PREVIEW_BUDGET = 0.05  # beside other generations
PREVIEW_LONE_BUDGET = 1.0 / 3.0  # while a stream's own generation is the only one: at most 1.5x its plain run
