"""Every bound a value is checked against, in one table: ``ldlm serve``'s settings (``ServerSettings`` and
its options), the request bodies' fields (/v1/generate, /v1/completions), ``ldlm generate``'s options,
the request resolution (``ldlm.sampling.request``) and the Triton repository's config all read their ranges
here, so each front end refuses the same values with the same words. No imports beyond the standard
library: the CLI reads these before anything heavy loads.
The length cap is the model's own ``max_seq_len``, checked where the config is known."""

from __future__ import annotations

from dataclasses import dataclass

MAX_N = 64  # samples per request (ldlm serve's default max_n; ldlm generate's cap)
MAX_STEPS = 1000  # denoising steps per request (ldlm serve's default max_steps; ldlm generate's cap)
MAX_TEXTS = 64  # texts per /v1/reconstruct, /v1/encode request, prompts per completion
MAX_SEED = 2**63 - 1  # seeds are 0..MAX_SEED (a signed 64-bit integer, as Triton's INT64 input)
MAX_THREADS = 1024  # intra-op threads: more than any machine's cores; a pool this size only adds switching
MAX_TIMEOUT_S = 86400.0  # request, header and body timeouts: finite, at most a day
MAX_DELAY_MS = 60000.0  # a batching window longer than the default request timeout would only time requests out
MAX_TEMPERATURE = 2.0  # the token decoder's temperature: OpenAI's range, 0..2
MAX_TOP_LOGPROBS = 5  # log-probability alternatives per token: OpenAI's legacy completions, 0..5
# Prompt guidance's weight w (ldlm/sampling/loop.py): 0 ignores the prompt, 1 is inpainting alone. On the reference
# checkpoint w = 3 already leaves 23% of the generated tokens in the held-out text, against 71% at 1 (docs/sampling.md):
# past 4 a continuation is the extrapolation's, not the model's
MAX_PROMPT_STRENGTH = 4.0
# Shares of wall time that decoding streamed previews may take (serve/runtime/delivery.py), in (0, 1]:
PREVIEW_BUDGET = 0.05  # beside other generations
PREVIEW_LONE_BUDGET = 1.0  # while a stream's own generation is the only one: every preview it asks for


@dataclass(frozen=True)
class Range:
    """A value's allowed interval, as messages name it: ``1..64`` for integers; for numbers ``(0, 1)``
    (``low_open``, ``high_open``: that end excluded). ``unit``: how a list's size is named (" items")."""

    low: float
    high: float
    low_open: bool = False
    high_open: bool = False
    unit: str = ""
    number: bool = False  # a float field: named as an interval even with both ends included

    def __str__(self) -> str:
        if not (self.number or self.low_open or self.high_open):
            return f"{self.low}..{self.high}"
        interval = f"{'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        return f"a number in {interval}" + (", both ends excluded" if self.low_open and self.high_open else "")

    def __contains__(self, value: object) -> bool:
        """Whether ``value`` is a number (never a bool) inside the interval; NaN is in none."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def check(self, name: str, value: object) -> None:
        """Refuse ``value`` outside the range, naming it and the range."""
        if value not in self:
            raise ValueError(self.refusal(f"{name}={value!r}"))

    def refusal(self, given: str, why: str = "") -> str:
        """What refuses ``given`` (the value as its caller names it: ``n=0``, ``--n 0``): both ends of the range,
        then ``why`` (the unit, or where a limit comes from)."""
        return out_of_range(given, f"{self}{why}")

    def field_bounds(self) -> dict[str, float]:
        """The range as pydantic's ``Field`` constraints (gt/ge, lt/le)."""
        return {"gt" if self.low_open else "ge": self.low, "lt" if self.high_open else "le": self.high}


def out_of_range(given: str, allowed: str) -> str:
    """The one sentence of every range refusal, on every front end: the value as given, then the whole range."""
    return f"{given} is out of range; allowed: {allowed}"


def sequence_lengths(max_seq_len: int) -> Range:
    """A sample's tokens (a prompt's included) on a model of this ``max_seq_len``."""
    return Range(1, max_seq_len)


def number(low: float, high: float, low_open: bool = False, high_open: bool = False) -> Range:
    return Range(low, high, low_open, high_open, number=True)


T_MIN = number(0, 1, low_open=True, high_open=True)  # the last time of a sampling grid
PRIOR_TEMPERATURE = number(0, 1, low_open=True)  # x_1 ~ N(0, tau^2 I): above 1 starts wider than training saw
PROMPT_STRENGTH = number(0, MAX_PROMPT_STRENGTH)
SEED = Range(0, MAX_SEED)
TEMPERATURE = number(0, MAX_TEMPERATURE)
TOP_P = number(0, 1, low_open=True)
TOP_LOGPROBS = Range(0, MAX_TOP_LOGPROBS)
THREADS = Range(1, MAX_THREADS)
TIMEOUT_S = number(0, MAX_TIMEOUT_S, low_open=True)
BUDGET = number(0, 1, low_open=True)

# ServerSettings field -> its range; ``ldlm serve``'s options parse with the same ranges
SETTINGS: dict[str, Range] = {
    "port": Range(0, 65535),  # 0: the OS picks a free port
    "grpc_port": Range(0, 65535),  # likewise; None: no gRPC endpoint
    "max_batch": Range(1, 1 << 16),
    "max_queue": Range(1, 1 << 20),
    "max_body_bytes": Range(1024, 1 << 31),
    "max_n": Range(1, 1 << 16),
    "max_steps": Range(1, 1 << 20),
    "max_texts": Range(1, 1 << 16),
    "max_request_samples": Range(1, 1 << 20),
    "max_request_tokens": Range(1, 1 << 30),
    "max_connections": Range(1, 1 << 20),
    "max_delay_ms": number(0, MAX_DELAY_MS),
    "request_timeout_s": TIMEOUT_S,
    "header_timeout_s": TIMEOUT_S,
    "body_timeout_s": TIMEOUT_S,
    "keep_alive_s": TIMEOUT_S,
    "preview_budget": BUDGET,
    "preview_lone_budget": BUDGET,
    "threads": THREADS,
}


def body_ranges(max_n: int, max_steps: int, max_texts: int, max_seq_len: int, max_timeout_s: float) -> dict[str, Range]:
    """Each bounded request-body field's range on a server with these caps: /v1/generate's, /v1/encode's
    and /v1/completions' fields (a field both bodies have is bounded alike)."""
    return {
        "n": Range(1, max_n),
        "length": sequence_lengths(max_seq_len),
        "max_tokens": sequence_lengths(max_seq_len),
        "min_tokens": Range(0, max_seq_len),  # and at most the request's max_tokens, checked with the body
        "steps": Range(1, max_steps),
        "preview_every": Range(1, max_steps),
        "seed": SEED,
        "texts": Range(1, max_texts, unit=" items"),
        "t_min": T_MIN,
        "prior_temperature": PRIOR_TEMPERATURE,
        "prompt_strength": PROMPT_STRENGTH,
        "temperature": TEMPERATURE,
        "top_p": TOP_P,
        "logprobs": TOP_LOGPROBS,
        "timeout_s": number(0, max_timeout_s, low_open=True),
    }
