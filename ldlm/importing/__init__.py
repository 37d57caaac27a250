"""Bring your own checkpoint: a trained model's weights renamed by key mappings (``mappings/``), its config
inferred from their shapes, and a report that accounts for every tensor (``ldlm import-checkpoint``)."""
