"""PRIME-RL custom-loss adapter: DPPO + KL with Composer teacher channels, per-sample contract."""

from crf_primerl._version import __version__

__all__ = ["__version__"]
