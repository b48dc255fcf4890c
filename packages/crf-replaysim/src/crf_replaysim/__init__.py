"""Trace replay against a teacher, DPO pair records and their schema, and data-juicer-compatible normalisation. No torch."""

from crf_replaysim._version import __version__

__all__ = ["__version__"]
