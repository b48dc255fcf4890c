"""Serverless DiLoCo: torchft's DiLoCo synchronised through nothing but an object store."""

from crf_diloco._version import __version__

__all__ = ["__version__"]
