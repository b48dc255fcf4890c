"""What the cloud executors (Hugging Face Jobs, Modal) share: secrets kept out of plain env and logs, the wait loop.

A cloud replica runs on a machine that does not inherit the launcher's environment, so everything it needs travels
with the job: plain variables as the job's environment, credentials as the backend's secrets. `split_replica_env`
makes that split, and the resulting `ReplicaSecrets` masks every secret value in text that comes back (logs,
status messages, server errors) before it reaches a callback, a `ReplicaResult` or an exception.

`wait_for_replicas` is the ``collect`` of both executors: it polls each replica until it ends, cancels the others
when one fails (``cancel_on_failure``) or when the deadline passes, and gives up on a replica whose backend stops
answering for ``lost_contact_s`` seconds.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol, TypeVar

from crf_diloco.executors.base import (
    ExecutorBase,
    LaunchPlan,
    ReplicaResult,
    plan_launch,
    validate_launch,
    validate_tail_lines,
    validate_timeout,
)
from crf_diloco.replica_env import REPLICA_ENV_VARS, SECRET_ENV_VARS

logger = logging.getLogger(__name__)

REDACTED = "***"
MIN_REDACTED_CHARS = 4
"""Secret values shorter than this are still sent as secrets but cannot be masked in text (they would mask
ordinary words); use longer secrets."""

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_CREDENTIAL_NAME = re.compile(
    r"SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIAL|PRIVATE|ACCESS_KEY|API_KEY|ACCOUNT_KEY|CONNECTION_STRING|SAS_",
    re.IGNORECASE,
)


def looks_secret(name: str) -> bool:
    """True for the per-run secrets (``SECRET_ENV_VARS``) and names that read like credentials.

    ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``HF_TOKEN``,
    ``AZURE_STORAGE_CONNECTION_STRING``, ``OPENAI_API_KEY`` ... are secrets; ``AWS_ENDPOINT_URL`` and
    ``AWS_DEFAULT_REGION`` are not. Sending a harmless value as a secret costs nothing; the reverse would show it.
    """
    return name in SECRET_ENV_VARS or bool(_CREDENTIAL_NAME.search(name))


@dataclass(frozen=True)
class ReplicaSecrets:
    """The variables sent to every replica as backend secrets (name → value); the repr shows names only."""

    values: Mapping[str, str] = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"ReplicaSecrets(names={self.names!r})"

    @property
    def names(self) -> list[str]:
        """The secret variables' names, sorted."""
        return sorted(self.values)

    @functools.cached_property
    def _pattern(self) -> re.Pattern[str] | None:
        pieces = {v for v in self.values.values() if len(v) >= MIN_REDACTED_CHARS}
        # a multi-line value (a JSON key file) reaches logs line by line: mask each of its lines too
        pieces |= {line for v in self.values.values() for line in v.splitlines() if len(line) >= MIN_REDACTED_CHARS}
        if not pieces:
            return None
        return re.compile("|".join(re.escape(p) for p in sorted(pieces, key=len, reverse=True)))

    def redact(self, text: str) -> str:
        """``text`` with every secret value (and every line of a multi-line value) replaced by ``***``."""
        pattern = self._pattern
        return text if pattern is None else pattern.sub(REDACTED, text)


def redactor(secret_sets: Iterable[ReplicaSecrets]) -> Callable[[str], str]:
    """A function masking the values of every `ReplicaSecrets` given (the launches a ``collect`` spans)."""
    distinct = list({id(s): s for s in secret_sets}.values())

    def redact(text: str) -> str:
        for secrets in distinct:
            text = secrets.redact(text)
        return text

    return redact


def validate_secret_settings(
    secrets: Mapping[str, str] | None, secret_env: Sequence[str]
) -> tuple[dict[str, str], tuple[str, ...]]:
    """Check an executor's ``secrets`` (name → value) and ``secret_env`` (names read at launch); return copies."""
    values = dict(secrets or {})
    if isinstance(secret_env, str):
        raise TypeError(f"secret_env must be a list of variable names, not the string {secret_env!r}")
    names = tuple(secret_env)
    for name in [*values, *names]:
        _check_env_name(name, "secret")
    bad = sorted(k for k, v in values.items() if not isinstance(v, str) or not v)
    if bad:
        raise ValueError(f"secrets must map names to non-empty strings; bad values for {bad}")
    return values, names


def split_replica_env(
    env: Mapping[str, str] | None,
    *,
    secrets: Mapping[str, str],
    secret_env: Sequence[str],
    environ: Mapping[str, str] | None = None,
) -> tuple[dict[str, str], ReplicaSecrets]:
    """Split what replicas get into plain variables and secrets.

    Secrets are: entries of ``env`` whose name `looks_secret`; ``secrets``; the variables named in ``secret_env``,
    read from ``environ`` (default ``os.environ``; a missing one is an error); and the per-run secrets
    (``SECRET_ENV_VARS``) found in ``environ`` when ``env`` does not set them, because a remote replica does not
    inherit the launcher's environment the way a local one does. Everything else in ``env`` stays plain.
    """
    environ = os.environ if environ is None else environ
    plain: dict[str, str] = {}
    hidden: dict[str, str] = {}
    for name, value in (env or {}).items():
        _check_env_name(name, "env")
        if not isinstance(value, str):
            raise TypeError(f"env values must be strings; {name} is {type(value).__name__}")
        (hidden if looks_secret(name) else plain)[name] = value
    missing = [name for name in secret_env if name not in environ]
    if missing:
        raise ValueError(
            f"secret_env names variables that are not set in this environment: {missing}; export them first "
            "or pass their values with secrets={...}"
        )
    hidden.update({name: environ[name] for name in secret_env})
    hidden.update(secrets)
    hidden.update({name: environ[name] for name in SECRET_ENV_VARS if name in environ and name not in hidden})
    clash = sorted(set(hidden) & set(REPLICA_ENV_VARS))
    if clash:
        raise ValueError(f"secrets must not set {clash}: the executor sets them per replica")
    empty = sorted(name for name, value in hidden.items() if not value)
    if empty:
        raise ValueError(f"secrets must not be empty strings: {empty}")
    return plain, ReplicaSecrets(hidden)


def _check_env_name(name: object, what: str) -> None:
    if not isinstance(name, str) or not _ENV_NAME.match(name):
        raise ValueError(f"{what} names must be environment variable names ([A-Za-z_][A-Za-z0-9_]*), got {name!r}")


def validate_positive(value: float, name: str) -> float:
    """Return ``value`` as a float if it is a finite number > 0 (``validate_timeout`` without ``None``)."""
    checked = validate_timeout(value, name)
    if checked is None:
        raise ValueError(f"{name} must be a finite number of seconds > 0, got None")
    return checked


def ceil_seconds(seconds: float | None) -> int | None:
    """Whole seconds, rounded up (backends take integer timeouts)."""
    return None if seconds is None else math.ceil(seconds)


class RemoteReplica(Protocol):
    """One cloud replica as `wait_for_replicas` and `RemoteExecutor` see it."""

    @property
    def rank(self) -> int: ...

    @property
    def secrets(self) -> ReplicaSecrets:
        """The secrets of the launch it belongs to (masked in whatever the replica sends back)."""
        ...

    def poll(self) -> ReplicaResult | None:
        """The final result once the replica has ended, ``None`` while it runs; raises when the backend is unreachable."""
        ...

    @property
    def cancel_requested(self) -> bool:
        """True once `cancel` was called (by the wait loop or by ``terminate``)."""
        ...

    def cancel(self) -> None:
        """Ask the backend to stop the replica (returns at once; a later `poll` reports the end)."""
        ...

    def close(self) -> None:
        """Release what watching the replica holds (log threads, the running app). Idempotent."""
        ...


@dataclass(frozen=True)
class WaitPolicy:
    """How `wait_for_replicas` waits.

    Attributes:
        poll_interval_s: seconds between two polls of a replica.
        cancel_on_failure: when a replica fails, cancel the others (a DiLoCo run usually cannot finish without it;
            turn this off to let the survivors continue with fewer participants).
        cancel_grace_s: how long a cancelled replica may take to report its end before it is given up on.
        lost_contact_s: how long polling a replica may keep failing before it counts as lost (and is cancelled).
    """

    poll_interval_s: float = 2.0
    cancel_on_failure: bool = True
    cancel_grace_s: float = 60.0
    lost_contact_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("poll_interval_s", "cancel_grace_s", "lost_contact_s"):
            validate_positive(getattr(self, name), name)
        if not isinstance(self.cancel_on_failure, bool):
            raise TypeError(f"cancel_on_failure must be a bool, got {self.cancel_on_failure!r}")


def wait_for_replicas(
    replicas: Sequence[RemoteReplica],
    *,
    timeout: float | None,
    policy: WaitPolicy,
    redact: Callable[[str], str],
) -> list[ReplicaResult]:
    """Poll until every replica has ended; cancel on failure, at the deadline, or when contact is lost.

    A replica the launcher cancelled reports its backend result with the reason in front of ``error``
    (``"timed out after 60 s; ..."``, ``"cancelled after rank 1 failed; ..."``); one that does not report an end
    within ``cancel_grace_s`` of the cancel gets ``returncode=None`` and that reason. A replica that finished
    successfully before a cancel landed stays successful. Results are ordered by rank.
    """
    timeout = validate_timeout(timeout)
    start = time.monotonic()
    deadline = None if timeout is None else start + timeout
    pending = {replica.rank: replica for replica in replicas}
    results: dict[int, ReplicaResult] = {}
    # replicas stopped by ``terminate`` before this wait are held to the same grace period as those it cancels
    cancels = {r.rank: _Cancel("cancelled by terminate()", False, start) for r in replicas if r.cancel_requested}
    unreachable_since: dict[int, float] = {}

    def request_cancel(replica: RemoteReplica) -> None:
        try:
            replica.cancel()
        except Exception as exc:  # the end is still observed by polling, or given up on after the grace period
            logger.warning("rank %d: cancel failed: %s", replica.rank, redact(f"{type(exc).__name__}: {exc}"))

    def cancel(rank: int, reason: str, timed_out: bool) -> None:
        if rank not in cancels:
            cancels[rank] = _Cancel(reason, timed_out, time.monotonic())
            request_cancel(pending[rank])

    def poll(replica: RemoteReplica) -> ReplicaResult | None:
        rank, now = replica.rank, time.monotonic()
        try:
            result = replica.poll()
        except Exception as exc:
            since = unreachable_since.setdefault(rank, now)
            if now - since < policy.lost_contact_s:
                return None
            request_cancel(replica)
            error = f"lost contact with the backend for {now - since:.1f} s (last error {type(exc).__name__}: {exc})"
            return ReplicaResult(rank=rank, returncode=None, duration_s=now - start, error=redact(error))
        unreachable_since.pop(rank, None)
        order = cancels.get(rank)
        if order is None:
            return result
        if result is None:
            if now - order.at < policy.cancel_grace_s:
                return None
            result = ReplicaResult(
                rank=rank,
                returncode=None,
                duration_s=now - start,
                error=f"the backend did not report an end within {policy.cancel_grace_s:g} s of the cancel",
            )
        return order.applied_to(result)

    while pending:
        for rank in sorted(pending):
            result = poll(pending[rank])
            if result is None:
                continue
            del pending[rank]
            results[rank] = result
            if not result.ok and policy.cancel_on_failure and rank not in cancels:
                for other in sorted(pending):
                    cancel(other, f"cancelled after rank {rank} failed", False)
        if not pending:
            break
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            for rank in sorted(pending):
                cancel(rank, f"timed out after {timeout:g} s", True)
        wake = now + policy.poll_interval_s
        if deadline is not None and now < deadline:
            wake = min(wake, deadline)
        time.sleep(max(0.0, wake - time.monotonic()))
    return [results[rank] for rank in sorted(results)]


@dataclass(frozen=True)
class _Cancel:
    """Why and when the launcher cancelled a replica."""

    reason: str
    timed_out: bool
    at: float

    def applied_to(self, result: ReplicaResult) -> ReplicaResult:
        """``result`` with this reason in front of its error; a replica that succeeded first stays successful."""
        if result.ok:
            return result
        error = self.reason if not result.error else f"{self.reason}; {result.error}"
        return replace(result, error=error, timed_out=result.timed_out or self.timed_out)


class RemoteHandle(Protocol):
    """A cloud executor's handle: it carries its `RemoteReplica`."""

    @property
    def _replica(self) -> RemoteReplica: ...


@dataclass(frozen=True)
class PreparedLaunch(LaunchPlan):
    """A cloud launch's `LaunchPlan`: ``envs`` hold each rank's plain variables only, ``secrets`` the rest."""

    secrets: ReplicaSecrets = field(default_factory=ReplicaSecrets)


LR = TypeVar("LR")
HR = TypeVar("HR", bound=RemoteHandle)


class RemoteExecutor(ExecutorBase[PreparedLaunch, LR, HR]):
    """What `HFJobsExecutor` and `ModalExecutor` share: secret settings, the wait policy, launch preparation,
    ``collect`` and ``terminate``. Subclasses submit the replicas (`begin_launch`, `start_replica`) and wrap each
    in a `RemoteReplica`."""

    def __init__(
        self,
        *,
        secrets: Mapping[str, str] | None,
        secret_env: Sequence[str],
        cancel_on_failure: bool,
        poll_interval_s: float,
        cancel_grace_s: float,
        lost_contact_s: float,
        tail_lines: int,
    ) -> None:
        self._secret_values, self.secret_env = validate_secret_settings(secrets, secret_env)
        self.policy = WaitPolicy(
            poll_interval_s=poll_interval_s,
            cancel_on_failure=cancel_on_failure,
            cancel_grace_s=cancel_grace_s,
            lost_contact_s=lost_contact_s,
        )
        self.tail_lines = validate_tail_lines(tail_lines)

    @property
    def secret_names(self) -> list[str]:
        """Names of the secrets configured on the executor (``secrets`` and ``secret_env``); never the values."""
        return sorted({*self._secret_values, *self.secret_env})

    def prepare_launch(
        self,
        command: Sequence[str],
        world_size: int,
        uri: str,
        run_id: str | None,
        env: Mapping[str, str] | None,
    ) -> PreparedLaunch:
        """Validate everything ``launch_replicas`` gets before anything is submitted; secrets leave the plain env."""
        argv, uri, run_id = validate_launch(command, world_size, uri, run_id)
        plain, secrets = split_replica_env(env, secrets=self._secret_values, secret_env=self.secret_env)
        plan = plan_launch(argv, world_size, uri, run_id, plain)
        return PreparedLaunch(plan.argv, plan.uri, plan.run_id, plan.envs, secrets)

    def collect(self, handles: Sequence[HR], *, timeout: float | None = None) -> list[ReplicaResult]:
        """Wait for every replica (cancelling the rest on failure and the late ones at ``timeout``); by rank."""
        replicas = [h._replica for h in handles]
        try:
            redact = redactor(r.secrets for r in replicas)
            return wait_for_replicas(replicas, timeout=timeout, policy=self.policy, redact=redact)
        finally:
            for replica in replicas:
                replica.close()

    def terminate(self, handles: Sequence[HR]) -> None:
        """Cancel every replica not known to have ended, then release them. Idempotent; errors are logged."""
        for handle in handles:
            replica = handle._replica
            try:
                replica.cancel()
            except Exception as exc:
                error = replica.secrets.redact(f"{type(exc).__name__}: {exc}")
                logger.warning("rank %d: cancelling it failed: %s", replica.rank, error)
        for handle in handles:
            handle._replica.close()
