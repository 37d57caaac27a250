"""The LDLM's three graphs written out again in NumPy float64, from the architecture as documented
(ldlm/model/ldlm.py's docstring), for the value tests: no torch in the math,
only the weights are read from the module's state_dict.

Shapes: B batch, T positions, D features, H heads, hd = D / H. Masks are (B, T) bool, True = real.
Masked keys get a score of -inf (a row always keeps at least one real key here).
"""

from __future__ import annotations

import math

import numpy as np

from tests.reference import layer_norm

_erf = np.vectorize(math.erf)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * g over the last axis."""
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * weight


def gelu(x: np.ndarray) -> np.ndarray:
    """Exact GELU: x Phi(x)."""
    return 0.5 * x * (1 + _erf(x / math.sqrt(2)))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GPT-2's GELU: the tanh approximation."""
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.exp(-x))


class Weights:
    """A module's state_dict as float64 arrays, read by dotted prefix."""

    def __init__(self, state: dict, prefix: str = "") -> None:
        self.state, self.prefix = state, prefix

    def __call__(self, name: str) -> np.ndarray:
        return self.state[self.prefix + name].detach().double().cpu().numpy()

    def has(self, name: str) -> bool:
        return self.prefix + name in self.state

    def sub(self, name: str) -> Weights:
        return Weights(self.state, f"{self.prefix}{name}.")

    def linear(self, name: str, x: np.ndarray) -> np.ndarray:
        y = x @ self(f"{name}.weight").T
        return y + self(f"{name}.bias") if self.has(f"{name}.bias") else y


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, key_mask: np.ndarray | None, causal: bool = False) -> np.ndarray:
    """softmax(q k^T / sqrt(hd)) v per head; q (B, H, T, hd), k, v (B, H, S, hd); key_mask (B, S)."""
    scores = np.einsum("bhtd,bhsd->bhts", q, k) / math.sqrt(q.shape[-1])
    allowed = np.ones(scores.shape, dtype=bool)
    if key_mask is not None:
        allowed &= key_mask[:, None, None, :]
    if causal:
        t = np.arange(scores.shape[-2])[:, None] >= np.arange(scores.shape[-1])[None, :]
        allowed &= t[None, None]
    scores = np.where(allowed, scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.einsum("bhts,bhsd->bhtd", weights, v)


def heads(x: np.ndarray, h: int) -> np.ndarray:
    b, t, d = x.shape
    return x.reshape(b, t, h, d // h).transpose(0, 2, 1, 3)  # (B, H, T, hd)


def unheads(x: np.ndarray) -> np.ndarray:
    b, h, t, hd = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, t, h * hd)  # (B, T, D)


def mlp(w: Weights, x: np.ndarray, eps: float) -> np.ndarray:
    """Pre-norm MLP: LayerNorm -> Linear -> exact GELU -> Linear."""
    hidden = gelu(w.linear("fc_in", layer_norm(x, 1, w("norm.weight"), w("norm.bias"), eps)))
    return w.linear("fc_out", hidden)


def latent_attention(w: Weights, query: np.ndarray, context: np.ndarray, mask: np.ndarray | None, h: int, eps: float) -> np.ndarray:
    """Perceiver attention: queries from ``query``; keys/values from [context; query], each stream
    RMS-normed on its own; per-head RMSNorm on q and k; keys masked by position in both streams."""
    d = query.shape[-1]
    xq, xc = rms_norm(query, w("norm_query.weight"), eps), rms_norm(context, w("norm_context.weight"), eps)
    kv_context = "kv_context" if w.has("kv_context.weight") else "kv"
    kv = np.concatenate([w.linear(kv_context, xc), w.linear("kv", xq)], axis=1)
    k, v = kv[..., :d], kv[..., d:]
    q = rms_norm(heads(w.linear("q", xq), h), w("q_norm.weight"), eps)
    k = rms_norm(heads(k, h), w("k_norm.weight"), eps)
    key_mask = None if mask is None else np.concatenate([mask, mask], axis=1)
    return w.linear("out", unheads(attend(q, k, heads(v, h), key_mask)))


def positions(w: Weights, length: int) -> np.ndarray:
    table = w("positions.weight")
    return table[:length] / math.sqrt(table.shape[1])


def gpt2_features(w: Weights, ids: np.ndarray, mask: np.ndarray, h: int, eps: float) -> np.ndarray:
    """GPT-2 blocks up to the feature layer (no ln_f): causal attention over real keys."""
    x = w("wte.weight")[ids] + w("wpe.weight")[: ids.shape[1]][None]
    d = x.shape[-1]
    i = 0
    while w.has(f"h.{i}.ln_1.weight"):
        b = w.sub(f"h.{i}")
        qkv = b.linear("attn.c_attn", layer_norm(x, 1, b("ln_1.weight"), b("ln_1.bias"), eps))
        q, k, v = (heads(qkv[..., j * d : (j + 1) * d], h) for j in range(3))
        x = x + b.linear("attn.c_proj", unheads(attend(q, k, v, mask, causal=True)))
        x = x + b.linear("mlp.c_proj", gelu_tanh(b.linear("mlp.c_fc", layer_norm(x, 1, b("ln_2.weight"), b("ln_2.bias"), eps))))
        i += 1
    return x


def encode_latents(model, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """input_ids (B, L), mask (B, L) -> standardized latents (B, L, D)."""
    c = model.config
    w = Weights(model.state_dict())
    features = gpt2_features(w.sub("feature_model"), ids, mask, c.n_heads, c.layer_norm_eps)
    features = (features - w("feature_mean")) / w("feature_std")
    e = w.sub("latent_encoder")
    length = ids.shape[1]
    features = features + positions(e, length)[None]
    latents = np.broadcast_to(rms_norm(e("latent_bank")[:length], e("latent_norm.weight"), c.rms_norm_eps), features.shape)
    for i in range(c.encoder_layers):
        blk = e.sub(f"blocks.{i}")
        latents = latents + latent_attention(blk.sub("attn"), latents, features, mask, c.n_heads, c.rms_norm_eps)
        latents = latents + mlp(blk.sub("mlp"), latents, c.layer_norm_eps)
    latents = rms_norm(latents, e("out_norm.weight"), c.rms_norm_eps)
    return (latents - w("latent_mean")) / w("latent_std")


def rotate(x: np.ndarray, theta: float) -> np.ndarray:
    """Rotary embedding of x (B, H, T, hd): pair (i, i + hd/2) turned by p * theta^(-2i/hd)."""
    t, hd = x.shape[-2], x.shape[-1]
    angle = np.arange(t)[:, None] * theta ** (-np.arange(0, hd, 2) / hd)[None, :]  # (T, hd/2)
    cos, sin = np.cos(angle), np.sin(angle)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def denoise(model, x_t: np.ndarray, t: np.ndarray, x0_prev: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """x_t (B, N, D), t (B,), x0_prev (B, N, D) -> x0_hat: the U-Net-skipped rotary transformer."""
    c = model.config
    w = Weights(model.state_dict()).sub("denoiser")
    d, h, eps = c.d_model, c.n_heads, c.rms_norm_eps
    half = d // 2
    freqs = np.exp(-math.log(c.time_max_period) * np.arange(half) / half)
    emb = np.concatenate([np.cos(t[:, None] * freqs), np.sin(t[:, None] * freqs)], axis=-1)  # (B, D)
    time = silu(w.linear("time_mlp.2", silu(w.linear("time_mlp.0", emb))))

    def block(i: int, x: np.ndarray) -> np.ndarray:
        b = w.sub(f"blocks.{i}")
        x = x + b.linear("time_proj", time)[:, None, :] + b.linear("self_cond_proj", x0_prev)
        a = rms_norm(x, b("attn_norm.weight"), eps)
        q, k, v = (heads(b.linear(f"attn.{p}_proj", a), h) for p in "qkv")
        x = x + b.linear("attn.o_proj", unheads(attend(rotate(q, c.rope_theta), rotate(k, c.rope_theta), v, mask)))
        m = rms_norm(x, b("mlp_norm.weight"), eps)
        return x + b.linear("mlp.w2", silu(b.linear("mlp.w1", m)) * b.linear("mlp.w3", m))

    x, skips = x_t, []
    n = c.denoiser_layers
    for i in range(n // 2):
        x = block(i, x)
        skips.append(x)
    for i in range(n // 2, n):
        x = block(i, x + skips.pop())
    return rms_norm(x, w("out_norm.weight"), eps)


def decode_logits(model, latents: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """standardized latents (B, L, D) -> logits (B, L, V): latent decoder, then token decoder."""
    c = model.config
    w = Weights(model.state_dict())
    latents = latents * w("latent_std") + w("latent_mean")
    dec = w.sub("latent_decoder")
    length = latents.shape[1]
    pos = positions(dec, length)[None]
    scale = 1 + dec("query_scale.weight")[0, 0] + dec("query_scale.bias")[0]  # every query is masked: indicator 1
    query = mlp(dec.sub("query_mlp"), dec("mask_embedding")[None, None], c.layer_norm_eps) * scale
    queries = np.broadcast_to(query + pos, latents.shape)
    latents = latents + pos
    for i in range(c.decoder_layers):
        blk = dec.sub(f"blocks.{i}")
        queries = queries + blk("attn_scale") * latent_attention(blk.sub("attn"), queries, latents, mask, c.n_heads, c.rms_norm_eps)
        queries = queries + blk("mlp_scale") * mlp(blk.sub("mlp"), queries, c.layer_norm_eps)
    tok = w.sub("token_decoder")
    x = queries
    d = c.d_model
    for i in range(c.token_decoder_layers):
        blk = tok.sub(f"blocks.{i}")
        qkv = blk.linear("attn.c_attn", layer_norm(x, 1, blk("attn_norm.weight"), blk("attn_norm.bias"), c.layer_norm_eps))
        q, k, v = (heads(qkv[..., j * d : (j + 1) * d], c.n_heads) for j in range(3))
        x = x + blk.linear("attn.c_proj", unheads(attend(q, k, v, mask)))
        x = x + mlp(blk.sub("mlp"), x, c.layer_norm_eps)
    return tok.linear("head", layer_norm(x, 1, tok("norm.weight"), tok("norm.bias"), c.layer_norm_eps))
