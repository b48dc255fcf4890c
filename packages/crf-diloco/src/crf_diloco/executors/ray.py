"""`RayExecutor`: each replica is one Ray task (``max_retries=0``) that runs the command as a child process.

Ray places the tasks on the cluster's nodes (``ray.init()`` starts a local one when none is running), so a
replica's process can die with its worker or node; such deaths come back as failed `ReplicaResult` s rather
than exceptions. Ray is imported lazily: install it with ``pip install 'crf-diloco[ray]'``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, get_args

from crf_diloco._checks import is_number
from crf_diloco.executors._process import ReplicaProcess, terminate_all
from crf_diloco.executors.base import (
    ExecutorBase,
    LaunchPlan,
    OutputCallback,
    ReplicaResult,
    describe_returncode,
    plan_launch,
    validate_tail_lines,
    validate_timeout,
)
from crf_diloco.executors.registry import BuildContext, Launcher, number

_RAY_INSTALL_HINT = "RayExecutor needs Ray, which is not installed: pip install 'crf-diloco[ray]'"
_CANCEL_POLL_S = 0.2
_CANCELLED = "cancelled by the launcher"
PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
"""How a placement group spreads the replicas' bundles over nodes (Ray's strategy names)."""
_PLACEMENT_STRATEGIES: tuple[PlacementStrategy, ...] = get_args(PlacementStrategy)


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ImportError(_RAY_INSTALL_HINT) from exc
    return ray


def _accept_interrupts() -> None:
    """Let ``ray.cancel`` interrupt this worker even when it inherited an ignored SIGINT.

    ``ray.cancel(force=False)`` raises KeyboardInterrupt through Python's SIGINT handler; a worker forked from a
    driver in a background shell job (SIGINT ignored, inherited through exec) would sit out the cancellation until
    the force-kill, losing the child's exit status and output. Only the main thread may set a handler.
    """
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) in (
        signal.SIG_IGN,
        signal.SIG_DFL,
    ):
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _run_replica_task(
    rank: int,
    argv: list[str],
    env: dict[str, str],
    cwd: str | None,
    output_queue: Any,
    terminate_grace_s: float,
    tail_lines: int,
) -> ReplicaResult:
    """Body of one replica task, run inside a Ray worker: start the child, relay its lines, wait, report.

    Lines go to ``output_queue`` (a `ray.util.queue.Queue`) when the driver asked for them, otherwise to this
    worker's own stdout/stderr with a ``[rank r]`` prefix (Ray forwards those to the driver's console).
    A cancellation (``ray.cancel``) arrives as KeyboardInterrupt between bytecodes, hence the polling wait; the
    child is then stopped and the result says so.
    """
    import sys

    _accept_interrupts()

    def relay(r: int, stream: str, line: str) -> None:
        if output_queue is not None:
            output_queue.put((r, stream, line))
        else:
            print(f"[rank {r}] {line}", file=sys.stdout if stream == "stdout" else sys.stderr, flush=True)

    process = ReplicaProcess(rank, argv, {**os.environ, **env}, cwd=cwd, on_output=relay, tail_lines=tail_lines)
    cancelled = False
    try:
        while process.wait(_CANCEL_POLL_S) is None:
            pass
    except KeyboardInterrupt:
        cancelled = True
    finally:
        terminate_all([process], terminate_grace_s)
    result = process.finish()
    if cancelled:
        result = replace(result, error=f"{_CANCELLED}; terminated ({describe_returncode(result.returncode)})")
    return result


@dataclass
class RayReplicaHandle:
    """One replica running as a Ray task: its rank, run id, task reference and launch time."""

    rank: int
    run_id: str
    ref: Any
    started_at: float
    _launch: _RayLaunch | None = field(default=None, repr=False)


class _OutputRelay:
    """Drains a Ray queue of ``(rank, stream, line)`` on a driver thread and calls ``on_output`` for each."""

    def __init__(self, queue: Any, on_output: OutputCallback) -> None:
        self._queue = queue
        self._on_output = on_output
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while True:
            try:
                rank, stream, line = self._queue.get(block=True, timeout=_CANCEL_POLL_S)
            except Exception:  # queue.Empty on timeout, or the queue actor is gone
                if self._stop.is_set():
                    return
                continue
            with contextlib.suppress(Exception):  # a broken callback must not stop the relay for other replicas
                self._on_output(rank, stream, line)

    def close(self) -> None:
        """Stop after the queue is empty; then kill the queue actor."""
        self._stop.set()
        self._thread.join(10.0)
        self._queue.shutdown(force=True)


@dataclass
class _RayLaunch:
    """What one `launch_replicas` call holds until its replicas are collected: output relay, placement group, and
    the task options and working directory its replicas are submitted with."""

    relay: _OutputRelay | None
    placement_group: Any
    options: dict[str, Any] = field(default_factory=dict)
    cwd: str | None = None
    closed: bool = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.relay is not None:
            self.relay.close()
        if self.placement_group is not None:
            from ray.util import remove_placement_group

            remove_placement_group(self.placement_group)


class RayExecutor(ExecutorBase[LaunchPlan, _RayLaunch, RayReplicaHandle]):
    """Runs each replica as a Ray task that starts ``command`` as a child process of its worker.

    The task gets ``num_cpus`` (and ``num_gpus``) per replica and ``max_retries=0``: a replica that dies is a
    failed replica, not a silent re-run. Replicas are gang-scheduled: a placement group reserves one bundle per
    replica first, because replicas that allreduce must all run at once (if only some fit, the others would
    wait in Ray's queue while the running ones time out their rounds). When the cluster cannot hold them all
    within ``placement_timeout_s``, `launch_replicas` raises instead. The environment of each child is the worker's plus ``env`` and the
    ``CRF_DILOCO_*`` variables. Output lines reach ``on_output`` through a Ray queue; without ``on_output`` they
    are printed by the workers as ``[rank r] line`` and forwarded by Ray to the driver's console.

    Args:
        address: Ray cluster to connect to when Ray is not initialised yet (``None``: ``RAY_ADDRESS`` or a new
            local cluster). A cluster this executor started is shut down by `close`.
        num_cpus, num_gpus: resources each replica task reserves.
        placement_strategy: how the bundles spread over nodes: ``"PACK"`` (default), ``"SPREAD"``,
            ``"STRICT_PACK"`` or ``"STRICT_SPREAD"`` (one replica per node).
        placement_timeout_s: how long to wait for the cluster to fit every replica.
        cwd: working directory of the replicas (default: the driver's, unless ``runtime_env`` ships a
            ``working_dir``, which then is the replica's).
        runtime_env: Ray runtime environment for the replica tasks (``working_dir``, ``pip``, ...).
        terminate_grace_s: seconds between SIGTERM and SIGKILL when stopping a replica's process.
        tail_lines: how many trailing lines of stdout and stderr each `ReplicaResult` keeps.
        init_kwargs: extra keyword arguments for ``ray.init`` when this executor starts Ray.
    """

    def __init__(
        self,
        *,
        address: str | None = None,
        num_cpus: float = 1.0,
        num_gpus: float = 0.0,
        placement_strategy: PlacementStrategy = "PACK",
        placement_timeout_s: float = 60.0,
        cwd: str | None = None,
        runtime_env: Mapping[str, Any] | None = None,
        terminate_grace_s: float = 5.0,
        tail_lines: int = 40,
        init_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self._ray = _import_ray()
        for name, value in (("num_cpus", num_cpus), ("num_gpus", num_gpus)):
            if not is_number(value) or value < 0:
                raise ValueError(f"{name} must be a number >= 0 (resources per replica task), got {value!r}")
        if placement_strategy not in _PLACEMENT_STRATEGIES:
            raise ValueError(f"placement_strategy must be one of {_PLACEMENT_STRATEGIES}, got {placement_strategy!r}")
        validate_timeout(placement_timeout_s, "placement_timeout_s")
        validate_timeout(terminate_grace_s, "terminate_grace_s")
        validate_tail_lines(tail_lines)
        self.address = address
        self.num_cpus = float(num_cpus)
        self.num_gpus = float(num_gpus)
        self.placement_strategy = placement_strategy
        self.placement_timeout_s = float(placement_timeout_s)
        self.cwd = cwd
        self.runtime_env = dict(runtime_env) if runtime_env else None
        self.terminate_grace_s = float(terminate_grace_s)
        self.tail_lines = tail_lines
        self.init_kwargs = dict(init_kwargs or {})
        self._owns_ray = False
        self._remote_fn: Any = None

    def _ensure_ray(self) -> None:
        if not self._ray.is_initialized():
            self._ray.init(address=self.address, **self.init_kwargs)
            self._owns_ray = True
        if self._remote_fn is None:
            self._remote_fn = self._ray.remote(_run_replica_task)

    def close(self) -> None:
        """Shut Ray down if this executor started it."""
        if self._owns_ray and self._ray.is_initialized():
            self._ray.shutdown()
        self._owns_ray = False
        self._remote_fn = None

    def __enter__(self) -> RayExecutor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def prepare_launch(
        self, command: Sequence[str], world_size: int, uri: str, run_id: str | None, env: Mapping[str, str] | None
    ) -> LaunchPlan:
        return plan_launch(command, world_size, uri, run_id, env)

    def begin_launch(self, plan: LaunchPlan, on_output: OutputCallback | None) -> _RayLaunch:
        """Start Ray if needed, reserve the placement group, open the output relay."""
        self._ensure_ray()
        cwd = self.cwd
        if cwd is None and not (self.runtime_env and "working_dir" in self.runtime_env):
            cwd = os.getcwd()
        bundle = {k: v for k, v in (("CPU", self.num_cpus), ("GPU", self.num_gpus)) if v > 0}
        placement_group = self._reserve(bundle, plan.world_size) if bundle else None
        relay = None
        if on_output is not None:
            from ray.util.queue import Queue

            relay = _OutputRelay(Queue(actor_options={"num_cpus": 0}), on_output)
        options: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus, "max_retries": 0}
        if self.runtime_env:
            options["runtime_env"] = self.runtime_env
        return _RayLaunch(relay=relay, placement_group=placement_group, options=options, cwd=cwd)

    def start_replica(self, launch: _RayLaunch, plan: LaunchPlan, rank: int) -> RayReplicaHandle:
        """Submit rank ``rank``'s task (in its bundle of the placement group)."""
        options = dict(launch.options)
        if launch.placement_group is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=launch.placement_group, placement_group_bundle_index=rank
            )
        queue = launch.relay._queue if launch.relay is not None else None
        ref = self._remote_fn.options(name=f"crf-diloco-{plan.run_id}-rank{rank}", **options).remote(
            rank, plan.argv, plan.envs[rank], launch.cwd, queue, self.terminate_grace_s, self.tail_lines
        )
        return RayReplicaHandle(rank=rank, run_id=plan.run_id, ref=ref, started_at=time.monotonic(), _launch=launch)

    def abort_launch(self, launch: _RayLaunch) -> None:
        launch.close()

    def _reserve(self, bundle: dict[str, float], world_size: int) -> Any:
        """A ready placement group of ``world_size`` bundles, or RuntimeError naming what the cluster lacks."""
        from ray.util import placement_group, remove_placement_group

        ray = self._ray
        group = placement_group([dict(bundle)] * world_size, strategy=self.placement_strategy)
        try:
            ray.get(group.ready(), timeout=self.placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(group)
            raise RuntimeError(
                f"the Ray cluster cannot run {world_size} replicas at once ({bundle} each, strategy "
                f"{self.placement_strategy}) within {self.placement_timeout_s:g} s; it has "
                f"{ray.available_resources()} available. Launch fewer replicas, lower num_cpus/num_gpus, or add nodes."
            ) from None
        return group

    def collect(self, handles: Sequence[RayReplicaHandle], *, timeout: float | None = None) -> list[ReplicaResult]:
        """Wait for every task or ``timeout`` s; cancel the late ones; map Ray errors to failed results."""
        timeout = validate_timeout(timeout)
        refs = [h.ref for h in handles]
        _, pending = self._ray.wait(refs, num_returns=len(refs), timeout=timeout)
        late = {id(ref) for ref in pending}
        if pending:
            self._cancel(pending)
        results = [self._result(h, timed_out_after=timeout if id(h.ref) in late else None) for h in handles]
        self._close_launches(handles)
        return sorted(results, key=lambda r: r.rank)

    def terminate(self, handles: Sequence[RayReplicaHandle]) -> None:
        """Cancel every unfinished replica task (its child process gets SIGTERM, then SIGKILL)."""
        refs = [h.ref for h in handles]
        if refs:
            _, pending = self._ray.wait(refs, num_returns=len(refs), timeout=0)
            if pending:
                self._cancel(pending)
        self._close_launches(handles)

    def _cancel(self, refs: list[Any]) -> None:
        """Interrupt the tasks (their ``finally`` stops the child); force-kill workers that do not end in time."""
        for ref in refs:
            self._ray.cancel(ref, force=False)
        _, still = self._ray.wait(refs, num_returns=len(refs), timeout=self.terminate_grace_s + 5.0)
        for ref in still:
            self._ray.cancel(ref, force=True)

    def _close_launches(self, handles: Sequence[RayReplicaHandle]) -> None:
        for launch in {id(h._launch): h._launch for h in handles if h._launch is not None}.values():
            launch.close()

    def _result(self, handle: RayReplicaHandle, *, timed_out_after: float | None) -> ReplicaResult:
        """The task's own `ReplicaResult`, or a failed one describing the Ray error that replaced it."""
        ray = self._ray
        try:
            result: ReplicaResult = ray.get(handle.ref)
        except ray.exceptions.TaskCancelledError:
            error = _CANCELLED
        except ray.exceptions.RayTaskError as exc:  # the task body raised (e.g. the command could not start)
            error = f"replica task raised {type(exc.cause).__name__}: {exc.cause}"
        except (
            ray.exceptions.WorkerCrashedError,
            ray.exceptions.OutOfMemoryError,
            ray.exceptions.NodeDiedError,
        ) as exc:
            first_line = next(iter(str(exc).strip().splitlines()), "")
            error = f"Ray worker died ({type(exc).__name__}): {first_line}"
        except ray.exceptions.RayError as exc:
            error = f"Ray error ({type(exc).__name__}): {exc}"
        else:
            if timed_out_after is None:
                return result
            return replace(
                result,
                timed_out=True,
                error=f"timed out after {timed_out_after:g} s; terminated ({describe_returncode(result.returncode)})",
            )
        if timed_out_after is not None:
            error = f"timed out after {timed_out_after:g} s; {error}"
        return ReplicaResult(
            rank=handle.rank,
            returncode=None,
            duration_s=time.monotonic() - handle.started_at,
            timed_out=timed_out_after is not None,
            error=error,
        )


def _add_cli_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--ray-address", default=None, help="Ray cluster address (default: a local one)")
    at_least_0 = number(minimum=0.0, inclusive=True)
    group.add_argument("--ray-num-cpus", type=at_least_0, default=None, metavar="C", help="CPUs per replica (1)")
    group.add_argument("--ray-num-gpus", type=at_least_0, default=None, metavar="G", help="GPUs per replica (0)")


def _from_cli(args: argparse.Namespace, context: BuildContext) -> RayExecutor:
    del context
    resources = {"num_cpus": args.ray_num_cpus, "num_gpus": args.ray_num_gpus}
    return RayExecutor(address=args.ray_address, **{k: v for k, v in resources.items() if v is not None})


LAUNCHER = Launcher("ray", "--executor ray", _from_cli, add_options=_add_cli_options, order=10)
