"""The model: its configuration, the layers, the five components (GPT-2 features, latent encoder, denoiser,
latent decoder, token decoder), the assembled ``LDLM``, the tokenizer and checkpoint files."""
