"""A replica that does what its flags say, for executor and CLI tests (no torch, starts fast).

Every replica prints one JSON line describing itself (rank, world size, URI, run id, argv, cwd, chosen env vars).
Flags starting with ``--fail-`` apply only to the rank given by ``--fail-rank`` (default: every rank).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-rank", type=int, default=None, help="apply the --fail-* flags to this rank only")
    parser.add_argument("--fail-exit", type=int, default=None, help="exit with this status")
    parser.add_argument("--fail-stderr", default=None, help="write this line to stderr before failing")
    parser.add_argument("--fail-raise", action="store_true", help="raise an uncaught exception")
    parser.add_argument("--fail-kill-self", default=None, help="send this signal (e.g. SIGKILL) to itself")
    parser.add_argument("--fail-kill-parent", action="store_true", help="SIGKILL the parent process")
    parser.add_argument("--sleep", type=float, default=0.0, help="sleep this long before exiting")
    parser.add_argument("--fail-sleep", type=float, default=0.0, help="sleep this long (on top of --sleep)")
    parser.add_argument("--ignore-sigterm", action="store_true", help="ignore SIGTERM (needs SIGKILL)")
    parser.add_argument("--grandchild-pidfile", default=None, help="spawn a sleeping grandchild, write its pid here")
    parser.add_argument("--pidfile-dir", default=None, help="write this replica's pid to DIR/rank<r>.pid")
    parser.add_argument("--lines", type=int, default=0, help="print this many numbered lines to stdout")
    parser.add_argument("--show-env", action="append", default=[], help="include this env var in the JSON line")
    args, extra = parser.parse_known_args()

    rank = int(os.environ["CRF_DILOCO_RANK"])
    record = {
        "rank": rank,
        "world_size": int(os.environ["CRF_DILOCO_WORLD_SIZE"]),
        "uri": os.environ["CRF_DILOCO_URI"],
        "run_id": os.environ["CRF_DILOCO_RUN_ID"],
        "extra_argv": extra,
        "cwd": os.getcwd(),
        "env": {name: os.environ.get(name) for name in args.show_env},
    }
    print(json.dumps(record), flush=True)
    print(f"stderr line of rank {rank}", file=sys.stderr, flush=True)
    for i in range(args.lines):
        print(f"line {i} of rank {rank}")
    if args.pidfile_dir:
        path = os.path.join(args.pidfile_dir, f"rank{rank}.pid")
        with open(path + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(path + ".tmp", path)  # a reader never sees it empty
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.grandchild_pidfile:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        with open(args.grandchild_pidfile, "w") as f:
            f.write(str(child.pid))

    failing = args.fail_rank is None or args.fail_rank == rank
    if failing and args.fail_stderr:
        print(args.fail_stderr, file=sys.stderr, flush=True)
    if failing and args.fail_raise:
        raise RuntimeError(f"replica {rank} raised on purpose")
    if failing and args.fail_kill_self:
        os.kill(os.getpid(), getattr(signal, args.fail_kill_self))
        time.sleep(10)
    if failing and args.fail_kill_parent:
        os.kill(os.getppid(), signal.SIGKILL)
        time.sleep(10)
    deadline = time.monotonic() + args.sleep + (args.fail_sleep if failing else 0.0)
    while time.monotonic() < deadline:  # a loop, so an ignored SIGTERM does not cut the sleep short
        time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
    if failing and args.fail_exit is not None:
        sys.exit(args.fail_exit)


if __name__ == "__main__":
    main()
