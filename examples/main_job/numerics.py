"""CPU numerics pinned so that a seed prints the same figures on every x86-64 machine, not only on this one.

The job is chaotic in the numerical sense: 400 warm-start steps and 300 RL steps of sampling amplify a last-bit
difference in one matrix product into different rollouts, and so into a different held-out pass rate. Load
does not change the numbers (every process computes on one thread in a fixed order), but the CPU does: PyTorch
picks its vectorised kernels (``AVX512`` or ``AVX2``) and MKL its GEMM code path by what the CPU offers, and the
two round differently (measured: 60 warm-start steps end with other weights under ``ATEN_CPU_CAPABILITY=avx2``
than under the ``AVX512`` a Zen 4 machine picks by itself). So the job asks every x86-64 machine for the same
code paths, the ones every x86-64 CPU of the last decade has:

* ``ATEN_CPU_CAPABILITY=avx2``: PyTorch's own kernels (softmax, reductions, element-wise ops);
* ``MKL_CBWR=AVX2``: MKL's conditional numerical reproducibility mode for its GEMMs;
* ``ONEDNN_MAX_CPU_ISA=AVX2``: oneDNN's kernels (PyTorch uses them for some CPU ops).

A variable already set in the environment is left as it is (the report shows what ran). They must be set before
``torch`` is imported, which is why `pin_cpu_numerics` is the first thing the job does, in the launcher and in
every replica process. Other architectures (aarch64) get nothing pinned: their figures are their own.
"""

from __future__ import annotations

import os
import platform
import sys

__all__ = ["PINNED", "cpu_numerics", "pin_cpu_numerics"]

PINNED = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
"""The variables and values `pin_cpu_numerics` sets on x86-64."""


def pin_cpu_numerics() -> bool:
    """Set `PINNED` (where unset) on x86-64; returns whether this process's torch will honour them (False when torch
    was imported before the call, so only child processes get them; the report then says so)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    for name, value in PINNED.items():
        os.environ.setdefault(name, value)
    return "torch" not in sys.modules


def cpu_numerics() -> str:
    """What this process computes with, for the report: torch's CPU capability and the MKL reproducibility mode."""
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    return f"{platform.machine()} {capability}, MKL_CBWR={os.environ.get('MKL_CBWR', 'unset')}"
