"""The per-request caps every generating front end shares: ``ldlm serve``'s defaults
(``ServerSettings``) and ``ldlm generate``'s upper limits are these numbers, so the CLI and HTTP
refuse the same requests. No imports: the CLI reads them before anything heavy loads.
The length cap is the model's own ``max_seq_len``, checked where the config is known."""

MAX_N = 64  # samples per request
MAX_STEPS = 1000  # denoising steps per request
MAX_TEXTS = 64  # texts per /v1/reconstruct, /v1/encode request, prompts per completion
MAX_SEED = 2**63 - 1  # seeds are 0..MAX_SEED (a signed 64-bit integer, as Triton's INT64 input)
