"""Training a small LDLM on the reference corpus (``scripts/train_reference.py`` is the recipe), and tuning a
trained checkpoint's step grids.

- ``rdata``, ``corpus``: the reference corpus, public-domain prose read from R data packages;
- ``plan``: what a run does (stages, learning rates, batch mixes);
- ``objectives``: batches, the autoencoder and denoiser losses, the standardization statistics;
- ``run``: the stages in order, saved as they go and resumable;
- ``routing``: the aligned start of the latent encoder and decoder (position p reads position p);
- ``evaluation``: held-out reconstruction, denoising loss and the text a model generates;
- ``grid_search``: a checkpoint's step grids searched so that few steps land near many (``ldlm tune-schedule``).
"""

from ldlm.training.plan import TrainingPlan
from ldlm.training.run import train

__all__ = ["TrainingPlan", "train"]
