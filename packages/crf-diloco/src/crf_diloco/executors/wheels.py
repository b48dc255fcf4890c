"""Cloud replicas install this launcher's own crf-diloco when the package index does not have its version.

Before a release (or for a local change) ``crf-diloco==<this version>`` is on no index, so a replica that installs it
from one cannot start. `index_has` asks the index the replicas install from (the PEP 691 JSON simple API of
``CRF_DILOCO_INDEX_URL``, ``UV_DEFAULT_INDEX``, ``UV_INDEX_URL`` or ``PIP_INDEX_URL``, else PyPI); when it does not answer yes, `workspace_wheel` builds the wheel
from the source tree this crf-diloco is imported from (``uv build``) and the executors ship it with the job:

- Hugging Face Jobs: `with_wheels` packs the wheel into the command itself (base64, split into arguments under
  Linux's 128 KiB per-argument limit); on the replica a standard-library ``python -c`` program writes it to a
  temporary folder, puts that folder on ``UV_FIND_LINKS`` and ``PIP_FIND_LINKS`` and ``exec``-s the rest of the
  command, so ``uv run --with crf-diloco[s3]==<version>`` finds it there (its dependencies still come from the index).
- Modal: the wheel is copied into the image and ``pip_install`` resolves the requirement with it as find-links.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

import crf_diloco

DEFAULT_INDEX = "https://pypi.org/simple"
CHUNK_CHARS = 96 * 1024
"""Base64 characters per command argument (one argument must stay under Linux's 128 KiB)."""
_INDEX_TIMEOUT_S = 10.0

LOADER = (
    "import base64,os,sys,tempfile;"
    "d=tempfile.mkdtemp(prefix='crf-wheels-');i=1\n"
    "while sys.argv[i]!='--':\n"
    " n=int(sys.argv[i+1]);open(os.path.join(d,os.path.basename(sys.argv[i])),'wb').write("
    "base64.b64decode(''.join(sys.argv[i+2:i+2+n])));i+=2+n\n"
    "for k,s in (('UV_FIND_LINKS',','),('PIP_FIND_LINKS',' ')):os.environ[k]=s.join(filter(None,(d,os.environ.get(k))))\n"
    "a=sys.argv[i+1:];os.execvp(a[0],a)"
)
"""The ``python -c`` program: ``NAME N CHUNK*N ... -- COMMAND...`` → the wheels in a folder on the find-links."""


def index_url(environ: Mapping[str, str] | None = None) -> str:
    """The simple-API URL the replicas install from (``CRF_DILOCO_INDEX_URL``, ``UV_DEFAULT_INDEX`` ... or PyPI)."""
    environ = os.environ if environ is None else environ
    for name in ("CRF_DILOCO_INDEX_URL", "UV_DEFAULT_INDEX", "UV_INDEX_URL", "PIP_INDEX_URL"):
        if environ.get(name):
            return environ[name].rstrip("/")
    return DEFAULT_INDEX


def index_has(name: str, version: str, *, index: str | None = None, timeout: float = _INDEX_TIMEOUT_S) -> bool | None:
    """Whether ``index`` lists ``name==version`` (``None``: the index could not be asked or gave no clear answer)."""
    url = f"{(index or index_url()).rstrip('/')}/{name}/"
    request = urllib.request.Request(url, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return False if exc.code == 404 else None
    except (OSError, ValueError):
        return None
    if not isinstance(body, dict):
        return None
    versions = body.get("versions")
    if isinstance(versions, list):
        return version in versions
    files = body.get("files")
    if isinstance(files, list):
        stem = f"{name.replace('-', '_')}-{version}"
        return any(isinstance(f, dict) and str(f.get("filename", "")).startswith(stem) for f in files)
    return None


def source_tree() -> Path | None:
    """The crf-diloco project folder this package is imported from (a checkout or an editable install), if any."""
    package = Path(crf_diloco.__file__).resolve().parent  # .../packages/crf-diloco/src/crf_diloco
    project = package.parent.parent
    pyproject = project / "pyproject.toml"
    if pyproject.is_file() and 'name = "crf-diloco"' in pyproject.read_text(encoding="utf-8"):
        return project
    return None


def workspace_wheel(out_dir: str | os.PathLike[str] | None = None) -> Path:
    """Build this source tree's crf-diloco wheel with ``uv build``; its path. ``RuntimeError`` says what is missing."""
    project = source_tree()
    if project is None:
        raise RuntimeError(
            f"crf-diloco {crf_diloco.__version__} is not on the package index and this installation is not a source "
            "checkout to build it from: publish it, or pass --pip with a requirement the replicas can install"
        )
    uv = shutil.which("uv")
    if uv is None:
        raise RuntimeError("building the crf-diloco wheel for the replicas needs uv on PATH (pip install uv)")
    out = Path(out_dir or tempfile.mkdtemp(prefix="crf-diloco-wheel-"))
    proc = subprocess.run(
        [uv, "build", "--wheel", "--out-dir", str(out), str(project)], capture_output=True, text=True, check=False
    )
    wheels = sorted(out.glob(f"crf_diloco-{crf_diloco.__version__}-*.whl"))
    if proc.returncode != 0 or not wheels:
        raise RuntimeError(f"`uv build` of {project} failed: {proc.stderr.strip()[-800:]}")
    return wheels[-1]


def with_wheels(wheels: Sequence[str | os.PathLike[str]], argv: Sequence[str], *, python: str = "python") -> list[str]:
    """``[python, "-c", LOADER, <wheels>, "--", *argv]``: ``argv`` run with ``wheels`` on the find-links."""
    packed: list[str] = []
    for wheel in wheels:
        path = Path(wheel)
        if path.suffix != ".whl" or not path.is_file():
            raise ValueError(f"{path} is not a wheel file")
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        chunks = [data[i : i + CHUNK_CHARS] for i in range(0, len(data), CHUNK_CHARS)] or [""]
        packed += [path.name, str(len(chunks)), *chunks]
    if not argv:
        raise ValueError("argv must be a non-empty command")
    return [python, "-c", LOADER, *packed, "--", *argv]
