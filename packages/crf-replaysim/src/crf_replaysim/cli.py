"""``crf-replaysim`` command line: ``replay``, ``normalize`` and ``validate``.

Each command streams its input, shows a progress line on stderr (``--quiet`` turns it off) and
ends with a summary on stderr listing every malformed line with its number. Exit status: 0 on
success, 1 on an error that stopped the run, 2 on bad arguments, 3 with ``--strict`` when some
lines were malformed or some decision points failed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from crf_replaysim._version import __version__
from crf_replaysim.progress import StderrProgress
from crf_replaysim.teacher import DEFAULT_API_KEY_ENV, OPENROUTER_BASE_URL

__all__ = ["build_parser", "main"]

EXIT_OK, EXIT_ERROR, EXIT_STRICT = 0, 1, 3


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("-q", "--quiet", action="store_true", help="no progress line (the closing summary is still printed)")
    p.add_argument("--strict", action="store_true", help="exit with status 3 if any line was malformed or failed")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="crf-replaysim",
        description="Replay agent traces against a teacher into DPO pairs, and normalise the pairs.",
    )
    parser.add_argument("--version", action="version", version=f"crf-replaysim {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    rp = sub.add_parser("replay", help="query a teacher at each assistant decision point of each trace")
    rp.add_argument("traces", type=Path, help="trace JSONL (one agent conversation per line)")
    rp.add_argument("-o", "--output", type=Path, required=True, help="where to write the DPO pairs (JSONL)")
    rp.add_argument("--model", required=True, help="teacher model id, e.g. anthropic/claude-sonnet-4")
    rp.add_argument(
        "--base-url", default=OPENROUTER_BASE_URL, help=f"OpenAI-compatible endpoint (default {OPENROUTER_BASE_URL})"
    )
    key = rp.add_mutually_exclusive_group()
    key.add_argument(
        "--api-key-env",
        default=DEFAULT_API_KEY_ENV,
        help=f"environment variable holding the key (default {DEFAULT_API_KEY_ENV})",
    )
    key.add_argument("--no-api-key", action="store_true", help="send no key (local endpoints)")
    rp.add_argument("--concurrency", type=int, default=8, help="requests in flight at most (default 8)")
    rp.add_argument("--timeout", type=float, default=120.0, help="seconds per request (default 120)")
    rp.add_argument("--max-retries", type=int, default=5, help="retries on 429/5xx/timeouts (default 5)")
    rp.add_argument("--backoff-base", type=float, default=1.0, help="first backoff in seconds (default 1)")
    rp.add_argument("--backoff-max", type=float, default=60.0, help="longest backoff in seconds (default 60)")
    rp.add_argument("--cache-dir", type=Path, default=None, help="on-disk response cache (default: no cache)")
    rp.add_argument("--temperature", type=float, default=0.0, help="teacher sampling temperature (default 0)")
    rp.add_argument("--max-tokens", type=int, default=None, help="teacher max_tokens (default: endpoint default)")
    rp.add_argument("--chosen", choices=["teacher", "recorded"], default="teacher", help="which action is preferred")
    rp.add_argument("--keep-identical", action="store_true", help="also write pairs where teacher == recorded")
    rp.add_argument("--max-pending", type=int, default=None, help="requests queued at most (default 4 x concurrency)")
    _add_common(rp)

    np_ = sub.add_parser("normalize", help="apply a data-juicer-format recipe to DPO pairs")
    np_.add_argument("pairs", type=Path, help="DPO pairs JSONL (replay output)")
    np_.add_argument("-o", "--output", type=Path, required=True, help="where to write the kept pairs (JSONL)")
    np_.add_argument(
        "--recipe", type=Path, default=None, help="recipe YAML (default: the shipped recipes/default.yaml)"
    )
    np_.add_argument(
        "--backend", choices=["native", "data-juicer"], default="native", help="op implementation (default native)"
    )
    np_.add_argument(
        "--skip-dj", action="store_true", help="pass records through unchanged (imports neither data-juicer nor Ray)"
    )
    _add_common(np_)

    vp = sub.add_parser("validate", help="check a DPO pairs JSONL against the record schema")
    vp.add_argument("pairs", type=Path, help="DPO pairs JSONL")
    _add_common(vp)
    return parser


def _progress(args: argparse.Namespace, label: str, unit: str) -> StderrProgress | None:
    return None if args.quiet else StderrProgress(label, unit)


def _replay(args: argparse.Namespace) -> int:
    from crf_replaysim.replay import replay_jsonl
    from crf_replaysim.teacher import TeacherClient

    client = TeacherClient(
        args.model,
        base_url=args.base_url,
        api_key_env=None if args.no_api_key else args.api_key_env,
        max_concurrency=args.concurrency,
        timeout_s=args.timeout,
        max_retries=args.max_retries,
        backoff_base_s=args.backoff_base,
        backoff_max_s=args.backoff_max,
        cache_dir=args.cache_dir,
        temperature=args.temperature,
        max_tokens=args.max_tokens,
    )
    progress = _progress(args, "replay", "decision points")
    try:
        summary = replay_jsonl(
            args.traces,
            args.output,
            client=client,
            chosen=args.chosen,
            keep_identical=args.keep_identical,
            max_pending=args.max_pending,
            progress=progress,
        )
    finally:
        if progress is not None:
            progress.close()
    print(summary.format(), file=sys.stderr)
    return EXIT_STRICT if args.strict and (summary.malformed or summary.failed) else EXIT_OK


def _normalize(args: argparse.Namespace) -> int:
    from crf_replaysim.normalize import normalize_jsonl

    progress = _progress(args, "normalize", "records")
    try:
        summary = normalize_jsonl(
            args.pairs, args.output, recipe=args.recipe, backend=args.backend, skip_dj=args.skip_dj, progress=progress
        )
    finally:
        if progress is not None:
            progress.close()
    print(summary.format(), file=sys.stderr)
    return EXIT_STRICT if args.strict and summary.malformed else EXIT_OK


def _validate(args: argparse.Namespace) -> int:
    from crf_replaysim.records import RecordError, validate_dj_record

    progress = _progress(args, "validate", "records")
    valid, malformed = 0, []
    with open(args.pairs, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            try:
                validate_dj_record(json.loads(raw.decode("utf-8")))
            except (ValueError, RecordError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                malformed.append((lineno, str(err)))
            else:
                valid += 1
            if progress is not None:
                progress(1)
    if progress is not None:
        progress.close()
    lines = [f"valid records:   {valid}", f"malformed lines: {len(malformed)}"]
    lines += [f"  line {ln}: {why}" for ln, why in malformed]
    print("\n".join(lines), file=sys.stderr)
    return EXIT_STRICT if args.strict and malformed else EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``crf-replaysim`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    handlers = {"replay": _replay, "normalize": _normalize, "validate": _validate}
    try:
        return handlers[args.command](args)
    except (OSError, ValueError, RuntimeError) as err:  # TeacherError, RecordError, FileNotFoundError...
        print(f"crf-replaysim {args.command}: error: {err}", file=sys.stderr)
        return EXIT_ERROR
