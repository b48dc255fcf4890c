"""`HFJobsExecutor`: each replica is one Hugging Face Job, run and watched through ``huggingface_hub``'s jobs API.

Per replica, ``launch_replicas`` calls ``HfApi.run_job`` (a Docker image and a command) or, with ``uv=True``,
``HfApi.run_uv_job`` (a uv script: local path, URL or command, plus ``dependencies``), with the replica's
``CRF_DILOCO_*`` variables and ``env`` as the job's environment and every secret (the per-run key
``CRF_DILOCO_SECRET``, store credentials, anything named like a credential, ``secrets``/``secret_env``) as the
job's encrypted ``secrets``. A thread per job follows ``fetch_job_logs(follow=True)`` and relays each line to
``on_output(rank, "stdout", line)`` (Jobs merge stdout and stderr into one log). ``collect`` polls ``inspect_job``:
``COMPLETED`` is success (``returncode=0``); ``ERROR``, ``CANCELED`` and ``DELETED`` are failures with the status
message (Jobs report no exit code, so ``returncode`` is ``None``); when one replica fails the others are cancelled
with ``cancel_job`` unless ``cancel_on_failure=False``; at the deadline the late ones are cancelled and reported as
timed out. Every text that comes back (log lines, status messages, server errors) has secret values masked.

``huggingface_hub`` (>= 1.5) is imported when the executor is constructed: ``pip install 'crf-diloco[hf]'``.
Authentication is ``huggingface_hub``'s (``token=``, else ``HF_TOKEN`` or the saved login); ``endpoint=``, else
``HF_ENDPOINT``, selects the Hub.
"""

from __future__ import annotations

import inspect
import logging
import re
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from crf_diloco.executors._process import _Tail
from crf_diloco.executors._remote import RemoteExecutor, ReplicaSecrets, ceil_seconds, validate_positive
from crf_diloco.executors.base import OutputCallback, ReplicaResult, validate_timeout
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
_LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_MAX_LINE_CHARS = 4000


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
        self._log_thread = threading.Thread(target=self._follow_logs, name=f"hf-job-logs-{rank}", daemon=True)
        self._log_thread.start()

    def _follow_logs(self) -> None:
        launch = self.launch
        try:
            for entry in launch.api.fetch_job_logs(job_id=self.job_id, namespace=launch.namespace, follow=True):
                for line in str(entry).splitlines() or [""]:
                    self._relay(line)
        except Exception as exc:  # the stage, polled separately, still decides the result
            self._log_error = launch.secrets.redact(_describe(exc))
            logger.warning("rank %d: the log stream of job %s failed: %s", self.rank, self.job_id, self._log_error)

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
        info = launch.api.inspect_job(job_id=self.job_id, namespace=launch.namespace)
        stage = _stage_name(info.status.stage)
        if stage not in TERMINAL_STAGES:
            if stage not in _RUNNING_STAGES and stage not in self._warned_stages:
                self._warned_stages.add(stage)
                logger.warning("rank %d: job %s is in unknown stage %r; still waiting", self.rank, self.job_id, stage)
            return None
        duration = time.monotonic() - self.started_at
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
            self.launch.api.cancel_job(job_id=self.job_id, namespace=self.launch.namespace)

    @property
    def secrets(self) -> ReplicaSecrets:
        return self.launch.secrets

    def close(self) -> None:
        """Give the log thread a moment to deliver its last lines (it ends with the job's log stream)."""
        self._log_thread.join(0.5)


@dataclass(frozen=True)
class HFJobHandle:
    """One replica running as a Hugging Face Job: rank, run id, job id and the job's page on the Hub."""

    rank: int
    run_id: str
    job_id: str
    url: str
    _replica: _HFJob = field(repr=False, compare=False)


class HFJobsExecutor(RemoteExecutor):
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
            (``name``: ``crf-diloco-<run id>-rank<r>``, or ``<labels["name"]>-rank<r>``) are always set.
        cancel_on_failure: cancel the other jobs when one fails.
        poll_interval_s: seconds between two ``inspect_job`` calls per job.
        cancel_grace_s: how long a cancelled job may take to reach a terminal stage before it is given up on.
        lost_contact_s: how long ``inspect_job`` may keep failing for a job before it counts as failed.
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
        self.labels = dict(labels or {})
        for key, value in self.labels.items():
            if not all(isinstance(x, str) and _LABEL.match(x) for x in (key, value)):
                raise ValueError(f"labels must be short [A-Za-z0-9._-] strings, got {key!r}: {value!r}")
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
                self.namespace = validate_name(str(self._api.whoami()["name"]), "the namespace returned by whoami")
            except Exception as exc:
                raise RuntimeError(
                    f"cannot find the Hugging Face user to run the jobs as ({secrets.redact(_describe(exc))}); "
                    "log in (`hf auth login` or HF_TOKEN) or pass namespace="
                ) from None
        return self.namespace

    def launch_replicas(
        self,
        command: Sequence[str],
        *,
        world_size: int,
        uri: str,
        run_id: str | None = None,
        env: Mapping[str, str] | None = None,
        on_output: OutputCallback | None = None,
    ) -> list[HFJobHandle]:
        """Submit ``world_size`` jobs running ``command``; if one cannot be submitted, cancel the others and raise."""
        prepared = self.prepare_launch(command, world_size, uri, run_id, env)
        argv, run_id, secrets = prepared.argv, prepared.run_id, prepared.secrets
        masked = ReplicaSecrets({**secrets.values, **self._token_mask})  # the job secrets and the Hub token
        launch = _HFLaunch(
            api=self._api,
            namespace=self._resolve_namespace(masked),
            secrets=masked,
            on_output=on_output,
            tail_lines=self.tail_lines,
            log_drain_s=self.log_drain_s,
        )
        handles: list[HFJobHandle] = []
        try:
            for rank in range(world_size):
                name = f"{self.labels.get('name', 'crf-diloco-' + run_id)}-rank{rank}"
                labels = {**self.labels, "name": name, LABEL_RUN_ID: run_id, LABEL_RANK: str(rank)}
                info = self._submit(argv, prepared.envs[rank], secrets, labels, launch.namespace)
                job_id = _checked_job_id(info.id)
                handles.append(HFJobHandle(rank, run_id, job_id, str(info.url), _HFJob(launch, rank, job_id)))
                logger.info("rank %d: job %s", rank, info.url)
        except Exception as exc:
            self.terminate(handles)
            raise RuntimeError(
                f"submitting the job of rank {len(handles)} failed ({masked.redact(_describe(exc))}); "
                f"the {len(handles)} job(s) already submitted were cancelled"
            ) from None
        except BaseException:
            self.terminate(handles)
            raise
        return handles

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
