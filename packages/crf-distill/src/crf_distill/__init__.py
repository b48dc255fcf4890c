"""Loss math for Composer-style RL post-training: token log-probs, divergences, DPO family, SimPO, TAID, Entropy-OPD, chunked fused-linear losses."""

from crf_distill._version import __version__

__all__ = ["__version__"]
