"""`HFJobsExecutor`: each replica is one Hugging Face Job, run and watched through ``huggingface_hub``'s jobs API.

Per replica, ``launch_replicas`` calls ``HfApi.run_job`` (a Docker image and a command) or, with ``uv=True``,
``HfApi.run_uv_job`` (a uv script: local path, URL or command, plus ``dependencies``), with the replica's
``CRF_DILOCO_*`` variables and ``env`` as the job's environment and every secret (the per-run key
``CRF_DILOCO_SECRET``, store credentials, anything named like a credential, ``secrets``/``secret_env``) as the
job's encrypted ``secrets``. A thread per job follows ``fetch_job_logs(follow=True)`` and relays each line to
``on_output(rank, "stdout", line)`` (Jobs merge stdout and stderr into one log); a stream cut by a 429 or a 5xx is
reopened (after the ``Retry-After`` the Hub asks for) and resumes after the last line relayed. ``collect`` reads
the stages of all of a launch's jobs with one ``list_jobs`` call (filtered by the run's label) per poll, not one
``inspect_job`` per job, to stay within the Hub's rate limits; a 429 (on the listing, a submission or a cancel)
waits for ``Retry-After`` and never counts as lost contact. ``COMPLETED`` is success (``returncode=0``); ``ERROR``, ``CANCELED`` and ``DELETED`` are failures with the status
message (Jobs report no exit code, so ``returncode`` is ``None``); when one replica fails the others are cancelled
with ``cancel_job`` unless ``cancel_on_failure=False``; at the deadline the late ones are cancelled and reported as
timed out. Every text that comes back (log lines, status messages, server errors) has secret values masked.

``huggingface_hub`` (>= 1.5) is imported when the executor is constructed: ``pip install 'crf-diloco[hf]'``.
Authentication is ``huggingface_hub``'s (``token=``, else ``HF_TOKEN`` or the saved login); ``endpoint=``, else
``HF_ENDPOINT``, selects the Hub. Labels (and the job name, which is a label) are refused before any job starts
unless they are what the Hub accepts: keys and values of ``[A-Za-z0-9_-]`` only (no ``.``: labels are stored as
tags), so a run id with a ``.`` cannot name HF jobs.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import logging
import math
import re
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from crf_diloco.executors._process import _Tail
from crf_diloco.executors._remote import (
    PreparedLaunch,
    RemoteExecutor,
    ReplicaSecrets,
    ceil_seconds,
    validate_positive,
)
from crf_diloco.executors.base import OutputCallback, ReplicaResult, validate_timeout
from crf_diloco.executors.registry import BuildContext, Launcher, cancel_option
from crf_diloco.layout import validate_name

logger = logging.getLogger(__name__)

DEFAULT_IMAGE = "ghcr.io/astral-sh/uv:python3.12-bookworm"
"""Debian with Python 3.12 and uv (``huggingface_hub``'s image for uv scripts)."""
LABEL_RUN_ID = "crf-diloco-run-id"
LABEL_RANK = "crf-diloco-rank"
TERMINAL_STAGES = ("COMPLETED", "ERROR", "CANCELED", "DELETED")
_RUNNING_STAGES = ("SCHEDULING", "RUNNING")
_HUB_HINT = "HFJobsExecutor needs huggingface_hub>=1.5, which is not installed: pip install 'crf-diloco[hf]'"
_FLAVOR = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")
_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$")
_LABEL_KEY = re.compile(r"^[A-Za-z0-9_-]+$")
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9_-]*$")
_MAX_LINE_CHARS = 4000
_MAX_RETRY_AFTER_S = 300.0
_MAX_LOG_REOPENS = 50
"""Consecutive failed openings of a job's log stream (429 / 5xx) after which it is given up on."""
_ENDED_LOG_REOPENS = 3
"""The same once the job has ended (only the lines the cut stream missed are left to fetch)."""


def check_labels(labels: Mapping[str, str], what: str = "labels") -> dict[str, str]:
    """``labels`` if every key and value is what the Hub accepts (``[A-Za-z0-9_-]``, keys non-empty), else raise."""
    for key, value in labels.items():
        if not (
            isinstance(key, str) and _LABEL_KEY.match(key) and isinstance(value, str) and _LABEL_VALUE.match(value)
        ):
            raise ValueError(
                f"{what}: the Hub refuses the label {key!r}: {value!r}; keys and values may use only letters, digits, "
                "'-' and '_' (no '.', '/', ':' or spaces: labels are stored as tags)"
            )
    return dict(labels)


def _status_code(exc: BaseException) -> int | None:
    status = getattr(getattr(exc, "response", None), "status_code", None)
    return status if isinstance(status, int) else None


def retry_after_s(exc: BaseException) -> float | None:
    """Seconds to wait before retrying after a 429 (its ``Retry-After``, else 1 s, at most 300 s); ``None`` if the
    error is not a 429."""
    if _status_code(exc) != 429:
        return None
    headers = getattr(getattr(exc, "response", None), "headers", None) or {}
    try:
        delay = float(headers.get("Retry-After", "1"))
    except (TypeError, ValueError):  # an HTTP date: not worth parsing, wait a little and ask again
        delay = 1.0
    return min(max(delay, 0.0), _MAX_RETRY_AFTER_S)


def _rate_limited(call: Any, what: str, *, budget_s: float) -> Any:
    """``call()``, retried after each 429 for up to ``budget_s`` s of waiting (a 429 means nothing was done)."""
    waited = 0.0
    while True:
        try:
            return call()
        except Exception as exc:
            delay = retry_after_s(exc)
            if delay is None or waited + delay > budget_s:
                raise
            logger.warning("%s: rate limited by the Hub (HTTP 429); retrying in %.1f s", what, delay)
            time.sleep(delay)
            waited += delay


def _import_hub() -> Any:
    try:
        import huggingface_hub
    except ImportError as exc:
        raise ImportError(_HUB_HINT) from exc
    api = getattr(huggingface_hub, "HfApi", None)
    fetch = getattr(api, "fetch_job_logs", None)
    if fetch is None or "follow" not in inspect.signature(fetch).parameters or not hasattr(api, "run_uv_job"):
        raise ImportError(
            f"HFJobsExecutor needs huggingface_hub>=1.5 (jobs API with log following), found "
            f"{getattr(huggingface_hub, '__version__', '?')}: pip install -U 'crf-diloco[hf]'"
        )
    return huggingface_hub


def _describe(exc: BaseException) -> str:
    """``"HfHubHTTPError: HTTP 429: <message>"``: the exception type, the HTTP status when there is one, the text."""
    status = getattr(getattr(exc, "response", None), "status_code", None)
    return f"{type(exc).__name__}: " + (f"HTTP {status}: " if isinstance(status, int) else "") + str(exc)


def _checked_job_id(value: object) -> str:
    """The job id from a Jobs API reply, if it is a plain id (it becomes part of every later request's URL)."""
    if not isinstance(value, str) or not _JOB_ID.match(value):
        raise ValueError(
            f"the Jobs API returned the job id {value!r}, which is not a plain id and could redirect later requests; "
            "a job it may have started was not cancelled: check `hf jobs ls`"
        )
    return value


def _stage_name(stage: object) -> str:
    """A `JobStage` or plain string as its name (``"RUNNING"``)."""
    return str(getattr(stage, "value", stage))


@dataclass
class _HFLaunch:
    """What the jobs of one ``launch_replicas`` call share: the API client, namespace, secrets and output sink."""

    api: Any
    namespace: str
    secrets: ReplicaSecrets  # what is masked in text that comes back: the job secrets and the Hub token
    on_output: OutputCallback | None
    tail_lines: int
    log_drain_s: float
    board: _JobBoard
    retry_budget_s: float
    labels: list[dict[str, str]] = field(default_factory=list)  # each rank's job labels, checked before any starts


class _JobBoard:
    """The stages of one launch's jobs, read with one ``list_jobs`` call per poll round (shared by its jobs).

    Within ``min_interval_s`` of a read every job's poll is answered from it; after a 429 nothing is read until
    ``Retry-After`` has passed (the jobs count as still running meanwhile, not as unreachable).
    """

    def __init__(self, api: Any, namespace: str, run_id: str, min_interval_s: float) -> None:
        self._api = api
        self._namespace = namespace
        self._run_id = run_id
        self._min_interval_s = min_interval_s
        self._lock = threading.Lock()
        self._infos: dict[str, Any] = {}
        self._error: Exception | None = None
        self._read_at = -math.inf
        self._retry_at = -math.inf

    def info(self, job_id: str) -> Any | None:
        """The job's latest `JobInfo`; ``None`` while rate limited; raises when the listing fails or lacks it."""
        with self._lock:
            now = time.monotonic()
            if now < self._retry_at:
                return None
            if now - self._read_at >= self._min_interval_s:
                self._read_at = now
                try:
                    listing = self._api.list_jobs(namespace=self._namespace, labels={LABEL_RUN_ID: self._run_id})
                    self._infos, self._error = {str(i.id): i for i in listing}, None
                except Exception as exc:
                    delay = retry_after_s(exc)
                    if delay is None:
                        self._error = exc
                    else:
                        self._retry_at = now + delay
                        logger.warning(
                            "listing the jobs: rate limited by the Hub (HTTP 429); next try in %.1f s", delay
                        )
                        return None
            if self._error is not None:
                raise self._error
            if job_id not in self._infos:
                raise LookupError(f"job {job_id} is missing from the listing of run {self._run_id}")
            return self._infos[job_id]


class _HFJob:
    """One submitted job: follows its log on a thread, polls its stage, cancels it (a `RemoteReplica`)."""

    def __init__(self, launch: _HFLaunch, rank: int, job_id: str) -> None:
        self.launch = launch
        self.rank = rank
        self.job_id = job_id
        self.started_at = time.monotonic()
        self.tail = _Tail(launch.tail_lines)
        self.result: ReplicaResult | None = None
        self.cancel_requested = False
        self._log_error: str | None = None
        self._callback_failed = False
        self._warned_stages: set[str] = set()
        self._ended = threading.Event()
        self._log_thread = threading.Thread(target=self._follow_logs, name=f"hf-job-logs-{rank}", daemon=True)
        self._log_thread.start()

    def _follow_logs(self) -> None:
        """Relay the log; reopen a stream cut by a 429 or a 5xx and skip the lines already relayed (it replays)."""
        launch = self.launch
        relayed = reopens = 0
        while True:
            seen = 0
            try:
                for entry in launch.api.fetch_job_logs(job_id=self.job_id, namespace=launch.namespace, follow=True):
                    seen += 1
                    if seen > relayed:
                        relayed, reopens = seen, 0
                        for line in str(entry).splitlines() or [""]:
                            self._relay(line)
                return
            except Exception as exc:  # the stage, polled separately, still decides the result
                status = _status_code(exc)
                delay = retry_after_s(exc)
                if delay is None and status is not None and status >= 500:
                    delay = min(2.0**reopens, 30.0)
                if delay is None or reopens >= (_ENDED_LOG_REOPENS if self._ended.is_set() else _MAX_LOG_REOPENS):
                    self._log_error = launch.secrets.redact(_describe(exc))
                    logger.warning(
                        "rank %d: the log stream of job %s failed: %s", self.rank, self.job_id, self._log_error
                    )
                    return
                reopens += 1
                logger.info("rank %d: log stream of job %s cut (%s); reopening in %.1f s", self.rank, self.job_id,
                            launch.secrets.redact(_describe(exc)), delay)  # fmt: skip
                time.sleep(delay)  # the Hub's Retry-After, also once the job has ended (its replay stops by itself)

    def _relay(self, line: str) -> None:
        line = self.launch.secrets.redact(line)[:_MAX_LINE_CHARS]
        self.tail.append(line)
        on_output = self.launch.on_output
        if on_output is not None and not self._callback_failed:
            try:
                on_output(self.rank, "stdout", line)
            except Exception:
                self._callback_failed = True
                logger.exception("on_output callback failed for rank %d; no more lines are relayed", self.rank)

    def poll(self) -> ReplicaResult | None:
        """The result once the job reached a terminal stage, else ``None`` (unknown stages count as running)."""
        if self.result is not None:
            return self.result
        launch = self.launch
        info = launch.board.info(self.job_id)
        if info is None:  # rate limited: ask again later
            return None
        stage = _stage_name(info.status.stage)
        if stage not in TERMINAL_STAGES:
            if stage not in _RUNNING_STAGES and stage not in self._warned_stages:
                self._warned_stages.add(stage)
                logger.warning("rank %d: job %s is in unknown stage %r; still waiting", self.rank, self.job_id, stage)
            return None
        duration = time.monotonic() - self.started_at
        self._ended.set()
        self._log_thread.join(launch.log_drain_s)  # the stream ends with the job; let the last lines arrive
        tail = self.tail.text()
        if stage == "COMPLETED":
            self.result = ReplicaResult(rank=self.rank, returncode=0, duration_s=duration, stdout_tail=tail)
            return self.result
        what = {"ERROR": "failed", "CANCELED": "was cancelled", "DELETED": "was deleted"}[stage]
        error = f"job {self.job_id} {what} (stage {stage})"
        if info.status.message:
            error += f": {info.status.message}"
        if self._log_error:
            error += f"; its log stream failed: {self._log_error}"
        self.result = ReplicaResult(
            rank=self.rank,
            returncode=None,
            duration_s=duration,
            stdout_tail=tail,
            stderr_tail=tail,  # one merged log: a failure's traceback is in it
            error=launch.secrets.redact(error),
        )
        return self.result

    def cancel(self) -> None:
        """``cancel_job`` (once)."""
        if self.result is None and not self.cancel_requested:
            self.cancel_requested = True
            launch = self.launch
            _rate_limited(
                lambda: launch.api.cancel_job(job_id=self.job_id, namespace=launch.namespace),
                f"cancelling job {self.job_id}",
                budget_s=launch.retry_budget_s,
            )

    @property
    def secrets(self) -> ReplicaSecrets:
        return self.launch.secrets

    def close(self) -> None:
        """Give the log thread a moment to deliver its last lines (it ends with the job's log stream)."""
        self._ended.set()
        self._log_thread.join(0.5)


@dataclass(frozen=True)
class HFJobHandle:
    """One replica running as a Hugging Face Job: rank, run id, job id and the job's page on the Hub."""

    rank: int
    run_id: str
    job_id: str
    url: str
    _replica: _HFJob = field(repr=False, compare=False)


class HFJobsExecutor(RemoteExecutor[_HFLaunch, HFJobHandle]):
    """Runs each replica as one Hugging Face Job (see the module docstring for the lifecycle).

    Args:
        flavor: hardware of each job (``"cpu-basic"``, ``"a10g-small"``, ``"a100-large"``, ``"h200"``, ...).
        image: Docker image (or ``hf.co/spaces/...``) the command runs in; the default has Python 3.12 and uv.
        job_timeout_s: the jobs' own time limit, enforced by the Hub even if this launcher dies (``None``: the
            platform's default, 30 minutes at the time of writing; set it for training runs).
        namespace: user or organisation that owns (and pays for) the jobs (default: the token's user).
        token: Hugging Face token (default: ``HF_TOKEN`` or the saved login). Never logged.
        endpoint: Hub URL (default: ``HF_ENDPOINT`` or https://huggingface.co).
        uv: run ``command[0]`` as a uv script with ``run_uv_job`` (``command[1:]`` are its arguments); a local
            script file is uploaded by ``huggingface_hub``.
        dependencies, python: extra packages and Python version for the uv script (``uv=True`` only).
        secrets: more secret variables for every job (name → value).
        secret_env: names of variables of this process's environment to send as secrets (store credentials such
            as ``AWS_ACCESS_KEY_ID``); a missing one is an error at launch.
        labels: extra job labels; ``crf-diloco-run-id``, ``crf-diloco-rank`` and the job name
            (``name``: ``crf-diloco-<run id>-rank<r>``, or ``<labels["name"]>-rank<r>``) are always set. Keys and
            values may use only ``[A-Za-z0-9_-]`` (the Hub's rule), and so may the run id.
        cancel_on_failure: cancel the other jobs when one fails.
        poll_interval_s: seconds between two ``list_jobs`` calls (one per poll, for all the launch's jobs).
        cancel_grace_s: how long a cancelled job may take to reach a terminal stage before it is given up on.
        lost_contact_s: how long reading a job's stage may keep failing before it counts as failed (429s do not
            count); also the longest a submission or cancel waits out 429s.
        log_drain_s: how long to wait for the last log lines once a job has ended.
        tail_lines: how many trailing log lines each `ReplicaResult` keeps.
    """

    def __init__(
        self,
        flavor: str = "cpu-basic",
        *,
        image: str = DEFAULT_IMAGE,
        job_timeout_s: float | None = None,
        namespace: str | None = None,
        token: str | None = None,
        endpoint: str | None = None,
        uv: bool = False,
        dependencies: Sequence[str] = (),
        python: str | None = None,
        secrets: Mapping[str, str] | None = None,
        secret_env: Sequence[str] = (),
        labels: Mapping[str, str] | None = None,
        cancel_on_failure: bool = True,
        poll_interval_s: float = 2.0,
        cancel_grace_s: float = 60.0,
        lost_contact_s: float = 60.0,
        log_drain_s: float = 10.0,
        tail_lines: int = 40,
    ) -> None:
        hub = _import_hub()
        if not isinstance(flavor, str) or not _FLAVOR.match(flavor):
            raise ValueError(f"flavor must be a hardware name such as 'cpu-basic' or 'a10g-small', got {flavor!r}")
        if not isinstance(image, str) or not image.strip():
            raise ValueError(f"image must be a Docker image name such as 'python:3.12', got {image!r}")
        validate_timeout(job_timeout_s, "job_timeout_s")
        if namespace is not None:
            validate_name(namespace, "namespace")
        if isinstance(dependencies, str) or not all(isinstance(d, str) and d for d in dependencies):
            raise ValueError(f"dependencies must be a list of requirement strings, got {dependencies!r}")
        if not uv and (dependencies or python):
            raise ValueError("dependencies and python apply to uv scripts only: pass uv=True")
        super().__init__(
            secrets=secrets,
            secret_env=secret_env,
            cancel_on_failure=cancel_on_failure,
            poll_interval_s=poll_interval_s,
            cancel_grace_s=cancel_grace_s,
            lost_contact_s=lost_contact_s,
            tail_lines=tail_lines,
        )
        self.labels = check_labels(labels or {})
        validate_positive(log_drain_s, "log_drain_s")
        self.flavor = flavor
        self.image = image
        self.job_timeout_s = ceil_seconds(job_timeout_s)
        self.namespace = namespace
        self.uv = uv
        self.dependencies = tuple(dependencies)
        self.python = python
        self.log_drain_s = float(log_drain_s)
        self._api = hub.HfApi(endpoint=endpoint, token=token)
        hub_token = token if isinstance(token, str) else hub.get_token()  # HF_TOKEN or the saved login
        self._token_mask = {"<hub token>": hub_token} if hub_token else {}

    def __repr__(self) -> str:
        return (
            f"HFJobsExecutor(flavor={self.flavor!r}, image={self.image!r}, namespace={self.namespace!r}, "
            f"uv={self.uv}, secret_names={self.secret_names})"
        )

    @property
    def endpoint(self) -> str:
        """The Hub URL the jobs are submitted to."""
        return str(self._api.endpoint)

    def _resolve_namespace(self, secrets: ReplicaSecrets) -> str:
        if self.namespace is None:
            try:
                who = _rate_limited(self._api.whoami, "whoami", budget_s=self.policy.lost_contact_s)
                self.namespace = validate_name(str(who["name"]), "the namespace returned by whoami")
            except Exception as exc:
                raise RuntimeError(
                    f"cannot find the Hugging Face user to run the jobs as ({secrets.redact(_describe(exc))}); "
                    "log in (`hf auth login` or HF_TOKEN) or pass namespace="
                ) from None
        return self.namespace

    def begin_launch(self, plan: PreparedLaunch, on_output: OutputCallback | None) -> _HFLaunch:
        """Check every rank's labels, find the namespace, set up the shared job board."""
        masked = ReplicaSecrets({**plan.secrets.values, **self._token_mask})  # the job secrets and the Hub token
        labels = [self._labels(plan.run_id, rank) for rank in range(plan.world_size)]  # all before any job starts
        namespace = self._resolve_namespace(masked)
        return _HFLaunch(
            api=self._api,
            namespace=namespace,
            secrets=masked,
            on_output=on_output,
            tail_lines=self.tail_lines,
            log_drain_s=self.log_drain_s,
            board=_JobBoard(self._api, namespace, plan.run_id, self.policy.poll_interval_s / 2),
            retry_budget_s=self.policy.lost_contact_s,
            labels=labels,
        )

    def start_replica(self, launch: _HFLaunch, plan: PreparedLaunch, rank: int) -> HFJobHandle:
        """Submit rank ``rank``'s job (429s waited out within the retry budget)."""
        submit = functools.partial(
            self._submit, plan.argv, plan.envs[rank], plan.secrets, launch.labels[rank], launch.namespace
        )
        info = _rate_limited(submit, f"submitting the job of rank {rank}", budget_s=self.policy.lost_contact_s)
        job_id = _checked_job_id(info.id)
        logger.info("rank %d: job %s", rank, info.url)
        return HFJobHandle(rank, plan.run_id, job_id, str(info.url), _HFJob(launch, rank, job_id))

    def launch_error(self, exc: Exception, launch: _HFLaunch, started: int) -> Exception:
        return RuntimeError(
            f"submitting the job of rank {started} failed ({launch.secrets.redact(_describe(exc))}); "
            f"the {started} job(s) already submitted were cancelled"
        )

    def _labels(self, run_id: str, rank: int) -> dict[str, str]:
        """The labels of rank ``rank``'s job (its name among them), checked against the Hub's rule."""
        name = f"{self.labels.get('name', 'crf-diloco-' + run_id)}-rank{rank}"
        labels = {**self.labels, "name": name, LABEL_RUN_ID: run_id, LABEL_RANK: str(rank)}
        try:
            return check_labels(labels, f"run id {run_id!r}")
        except ValueError as exc:
            raise ValueError(f"{exc}; choose a run id (and a name label) without such characters") from None

    def _submit(
        self, argv: list[str], job_env: dict[str, str], secrets: ReplicaSecrets, labels: dict[str, str], namespace: str
    ) -> Any:
        common: dict[str, Any] = {
            "env": job_env,
            "secrets": dict(secrets.values) or None,
            "flavor": self.flavor,
            "timeout": self.job_timeout_s,
            "labels": labels,
            "namespace": namespace,
        }
        if self.uv:
            return self._api.run_uv_job(
                argv[0],
                script_args=argv[1:],
                dependencies=list(self.dependencies) or None,
                python=self.python,
                image=self.image,
                **common,
            )
        return self._api.run_job(image=self.image, command=argv, **common)


def _add_cli_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--hf-flavor", default=None, metavar="FLAVOR", help="hardware per replica (cpu-basic)")
    group.add_argument("--hf-namespace", default=None, metavar="NS", help="user or org that runs the jobs")


def _from_cli(args: argparse.Namespace, context: BuildContext) -> HFJobsExecutor:
    del context  # the requirements and wheels travel inside the command
    image: dict[str, Any] = {"image": args.image} if args.image else {}
    return HFJobsExecutor(
        args.hf_flavor or "cpu-basic",
        job_timeout_s=args.timeout,
        namespace=args.hf_namespace,
        secret_env=args.secret,
        **image,
        **cancel_option(args),
    )


LAUNCHER = Launcher(
    "hf",
    "--executor hf (Hugging Face Jobs; HF_TOKEN or `hf auth login`)",
    _from_cli,
    add_options=_add_cli_options,
    remote=True,
    requirements_in_command=True,
    order=20,
)
