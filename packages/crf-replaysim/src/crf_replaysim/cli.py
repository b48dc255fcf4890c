"""``crf-replaysim`` command line: ``replay``, ``normalize`` and ``validate``.

Each command streams its input, shows a progress line on stderr (``--quiet`` turns it off) and
ends with a summary on stderr listing every malformed line with its number. ``replay`` and
``normalize`` take their output as a second positional argument or as ``-o``. Exit status: 0 on
success, 1 on an error that stopped the run, 2 on bad arguments, 3 when ``validate`` found
malformed lines (always) or, with ``--strict``, when ``replay``/``normalize`` skipped malformed lines
or failed decision points, 130 when interrupted (Ctrl-C: the previous output is untouched; an
interrupted replay resumes when run again). No message printed contains the API key.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from crf_replaysim._version import __version__
from crf_replaysim.formats import INPUT_FORMATS, OUTPUT_FORMATS
from crf_replaysim.jsonl import DEFAULT_MAX_LINE_BYTES, loads_bounded
from crf_replaysim.normalize import BACKENDS
from crf_replaysim.progress import StderrProgress
from crf_replaysim.replay import CHOSEN_SOURCES
from crf_replaysim.teacher import (
    DEFAULT_API_KEY_ENV,
    DEFAULT_MAX_RESPONSE_BYTES,
    NULL_CONTENT_MODES,
    OPENROUTER_BASE_URL,
)

__all__ = ["build_parser", "main"]

EXIT_OK, EXIT_ERROR, EXIT_STRICT, EXIT_INTERRUPTED = 0, 1, 3, 130


def _add_common(p: argparse.ArgumentParser, strict_help: str) -> None:
    p.add_argument("-q", "--quiet", action="store_true", help="no progress line (the closing summary is still printed)")
    p.add_argument("--strict", action="store_true", help=strict_help)
    p.add_argument(
        "--max-line-bytes",
        type=int,
        default=DEFAULT_MAX_LINE_BYTES,
        help=f"longer input lines are reported and skipped (default {DEFAULT_MAX_LINE_BYTES})",
    )


def _add_output(p: argparse.ArgumentParser, what: str) -> None:
    """The output as a second positional argument or as ``-o``/``--output`` (checked by :func:`_resolve_output`)."""
    p.add_argument("output_arg", nargs="?", type=Path, metavar="OUTPUT", help=f"where to write {what} (or -o)")
    p.add_argument("-o", "--output", type=Path, default=None, help=f"where to write {what} (JSONL)")


def _resolve_output(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    positional = getattr(args, "output_arg", None)
    if positional is not None and args.output is not None and positional != args.output:
        parser.error(f"two outputs given ({str(positional)!r} and -o {str(args.output)!r}); give one")
    if "output_arg" in args:
        args.output = args.output or positional
        if args.output is None:
            parser.error(f"{args.command}: an output is required: give it after the input or as -o OUTPUT")


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = loads_bounded(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, e.g. '{\"top_p\": 0.9}'")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="crf-replaysim",
        description="Replay agent traces against a teacher into DPO pairs, and normalise the pairs.",
    )
    parser.add_argument("--version", action="version", version=f"crf-replaysim {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    rp = sub.add_parser("replay", help="query a teacher at each assistant decision point of each trace")
    rp.add_argument("traces", type=Path, help="trace JSONL (one agent conversation per line)")
    _add_output(rp, "the DPO pairs")
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
    rp.add_argument(
        "--timeout", type=_finite, default=120.0, help="deadline in seconds for each whole request (default 120)"
    )
    rp.add_argument(
        "--max-response-bytes",
        type=int,
        default=DEFAULT_MAX_RESPONSE_BYTES,
        help=f"largest reply body accepted, after decompression (default {DEFAULT_MAX_RESPONSE_BYTES})",
    )
    rp.add_argument("--max-retries", type=int, default=5, help="retries on 429/5xx/timeouts (default 5)")
    rp.add_argument("--backoff-base", type=_finite, default=1.0, help="first backoff in seconds (default 1)")
    rp.add_argument("--backoff-max", type=_finite, default=60.0, help="longest backoff in seconds (default 60)")
    rp.add_argument("--cache-dir", type=Path, default=None, help="on-disk response cache (default: no cache)")
    rp.add_argument("--temperature", type=_finite, default=0.0, help="teacher sampling temperature (default 0)")
    rp.add_argument("--max-tokens", type=int, default=None, help="teacher max_tokens (default: endpoint default)")
    rp.add_argument(
        "--extra-body",
        type=_json_object,
        default=None,
        help='more request fields as a JSON object, e.g. \'{"tool_choice": "auto", "top_p": 0.9}\'',
    )
    rp.add_argument(
        "--null-content",
        choices=NULL_CONTENT_MODES,
        default="keep",
        help="send the null content of tool-calling assistant messages as null (keep, OpenAI's form) or as an "
        "empty string (empty: servers such as llama-cpp-python's reject null)",
    )
    rp.add_argument("--chosen", choices=CHOSEN_SOURCES, default="teacher", help="which action is preferred")
    rp.add_argument("--keep-identical", action="store_true", help="also write pairs where teacher == recorded")
    rp.add_argument("--max-pending", type=int, default=None, help="requests queued at most (default 4 x concurrency)")
    rp.add_argument(
        "--restart",
        action="store_true",
        help="discard the saved state of an interrupted replay into the same output instead of resuming it",
    )
    _add_common(rp, "exit with status 3 if any trace line was malformed or any decision point failed")

    np_ = sub.add_parser("normalize", help="apply a data-juicer-format recipe to DPO pairs")
    np_.add_argument("pairs", type=Path, help="pairs JSONL: replay output, or TRL standard/conversational rows")
    _add_output(np_, "the kept pairs")
    np_.add_argument(
        "--recipe", type=Path, default=None, help="recipe YAML (default: the shipped recipes/default.yaml)"
    )
    np_.add_argument("--backend", choices=BACKENDS, default="native", help="op implementation (default native)")
    np_.add_argument(
        "--skip-dj", action="store_true", help="pass records through unchanged (imports neither data-juicer nor Ray)"
    )
    _add_format_args(np_)
    np_.add_argument(
        "--output-format",
        choices=OUTPUT_FORMATS,
        default="records",
        help="records (default); trl: TRL rows in the input's flavour (records become conversational); "
        "trl-standard or trl-conversational to choose",
    )
    _add_common(np_, "exit with status 3 if any line was malformed")

    vp = sub.add_parser(
        "validate",
        help="check a pairs JSONL (records or TRL rows) against the schema",
        description="Check every line of a pairs JSONL against the schema. Exit status 0 when every line is "
        "valid, 3 when any line is malformed (each one listed with its number), 1 on an error.",
    )
    vp.add_argument("pairs", type=Path, help="pairs JSONL")
    _add_format_args(vp)
    _add_common(vp, "accepted for symmetry: validate always exits with status 3 on malformed lines")
    return parser


def _add_format_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--input-format",
        choices=INPUT_FORMATS,
        default="auto",
        help="auto (default: the first good line decides), records, or trl (TRL standard or conversational)",
    )


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
        max_response_bytes=args.max_response_bytes,
        extra_body=args.extra_body,
        null_content=args.null_content,
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
            resume=not args.restart,
            max_line_bytes=args.max_line_bytes,
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
            args.pairs,
            args.output,
            recipe=args.recipe,
            backend=args.backend,
            skip_dj=args.skip_dj,
            progress=progress,
            input_format=args.input_format,
            output_format=args.output_format,
            max_line_bytes=args.max_line_bytes,
        )
    finally:
        if progress is not None:
            progress.close()
    print(summary.format(), file=sys.stderr)
    return EXIT_STRICT if args.strict and summary.malformed else EXIT_OK


def _validate(args: argparse.Namespace) -> int:
    from crf_replaysim.pairs import read_pairs
    from crf_replaysim.records import RecordError

    progress = _progress(args, "validate", "records")
    valid, malformed, formats = 0, [], set()
    try:
        for item in read_pairs(args.pairs, input_format=args.input_format, max_line_bytes=args.max_line_bytes):
            if isinstance(item, RecordError):
                malformed.append((item.line, item.reason))
            else:
                valid += 1
                formats.add(item.format)
            if progress is not None:
                progress(valid + len(malformed))
    finally:
        if progress is not None:
            progress.close()
    lines = [f"valid records:   {valid}" + (f" ({', '.join(sorted(formats))})" if formats else "")]
    lines += [f"malformed lines: {len(malformed)}"]
    lines += [f"  line {ln}: {why}" for ln, why in malformed]
    print("\n".join(lines), file=sys.stderr)
    return EXIT_STRICT if malformed else EXIT_OK


def _redactor(args: argparse.Namespace) -> Callable[[str], str]:
    """Last line of defence: the key's value out of anything the CLI prints (the library already redacts)."""
    name = getattr(args, "api_key_env", None)
    key = os.environ.get(name, "").strip() if isinstance(name, str) and name else ""
    return (lambda text: text.replace(key, "<secret>")) if key else (lambda text: text)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``crf-replaysim`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _resolve_output(parser, args)
    handlers = {"replay": _replay, "normalize": _normalize, "validate": _validate}
    redact = _redactor(args)
    try:
        return handlers[args.command](args)
    except KeyboardInterrupt:
        print(f"crf-replaysim {args.command}: interrupted. {_interrupted_note(args)}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (OSError, ValueError, RuntimeError) as err:  # TeacherError, RecordError, FileNotFoundError...
        print(redact(f"crf-replaysim {args.command}: error: {err}"), file=sys.stderr)
        return EXIT_ERROR


def _interrupted_note(args: argparse.Namespace) -> str:
    output = getattr(args, "output", None)
    if output is None:
        return "Nothing was written."
    note = f"{str(output)!r} was not touched."
    if args.command == "replay":
        from crf_replaysim.replay import replay_state_paths

        partial, journal = replay_state_paths(Path(output))
        if journal.exists():
            note += (
                f" The work done so far is kept in {str(partial)!r} and {str(journal)!r}: run the same command "
                "again to resume it (--restart starts over)."
            )
    return note
