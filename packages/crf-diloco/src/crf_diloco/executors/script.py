"""`script_command`: a local Python script packed into a command, for replicas on machines that lack your files.

A Hugging Face Job or a Modal container starts from an image, not from your working tree. ``script_command`` reads
the script, compresses it into one argument of ``python -c <loader> <payload> <args...>``; on the replica the loader
writes it to a temporary folder and ``exec``-s the interpreter on it, so the script runs exactly as
``python script.py args...`` would (same ``sys.argv``, same process, so signals from the platform reach it).
Only that one file travels: anything it imports must be installed in the image.
"""

from __future__ import annotations

import base64
import json
import os
import zlib
from collections.abc import Sequence

MAX_PAYLOAD_BYTES = 96 * 1024
"""Upper bound of the packed script (compressed, base64): one argument must stay under Linux's 128 KiB limit."""

LOADER = (
    "import base64,json,os,sys,tempfile,zlib;"
    "p=json.loads(zlib.decompress(base64.b64decode(sys.argv[1])));"
    "f=os.path.join(tempfile.mkdtemp(prefix='crf-diloco-'),p['name']);"
    "open(f,'w',encoding='utf-8').write(p['source']);"
    "os.execv(sys.executable,[sys.executable,f,*sys.argv[2:]])"
)
"""The ``python -c`` program that unpacks and runs the script (standard library only)."""


def script_command(script: str | os.PathLike[str], args: Sequence[str] = (), *, python: str = "python") -> list[str]:
    """``[python, "-c", LOADER, payload, *args]``: runs ``script`` with ``args`` wherever ``python`` exists.

    Raises ``ValueError`` if the script is not UTF-8 text or packs to more than ``MAX_PAYLOAD_BYTES`` (then put the
    code in a package installed on the replicas and launch a small entry script).
    """
    path = os.fspath(script)
    if isinstance(args, (str, bytes)) or not all(isinstance(a, str) for a in args):
        raise TypeError(f"args must be a list of strings, got {args!r}")
    if not python or not isinstance(python, str):
        raise ValueError(f"python must be the interpreter's name or path on the replica, got {python!r}")
    try:
        with open(path, "rb") as f:
            raw = f.read()
        source = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"script {path!r} is not UTF-8 text") from None
    packed = json.dumps({"name": os.path.basename(path), "source": source}).encode("utf-8")
    payload = base64.b64encode(zlib.compress(packed, 9)).decode("ascii")
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise ValueError(
            f"script {path!r} packs to {len(payload) // 1024} KiB, more than the {MAX_PAYLOAD_BYTES // 1024} KiB "
            "one command argument can carry; put the code in a package installed on the replicas (or in the image) "
            "and launch a small entry script"
        )
    return [python, "-c", LOADER, payload, *args]
