"""What the main job leaves in ``runs/<timestamp>/``: the terminal table, ``summary.md`` and ``composer_main.png``.

The plot has six panels: the rollout reward per replica, the held-out pass rate before/after RL with its
95% intervals (all held-out tasks, the easy and the hard subset), each channel's loss, and DiLoCo's
rounds and megabytes through the store.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from main_job.evaluate import Change, PassRate
from main_job.records import CHANNELS, ReplicaReport, SyncStat

if TYPE_CHECKING:
    from crf_diloco.link import Link

__all__ = ["JobOutcome", "plot", "summary_markdown", "summary_table", "window"]


@dataclass(frozen=True)
class JobOutcome:
    """Everything the report shows about one run."""

    command: str
    model: str
    executor: str
    channels: tuple[str, ...]
    seed: int
    steps: int
    sync_every: int
    heldout_tasks: int
    train_tasks: int
    before: PassRate
    after: PassRate
    replicas: tuple[ReplicaReport, ...]
    identical_weights: bool
    seconds: float
    phases: dict[str, float]
    load_average: str
    sandbox: str
    numerics: str = ""
    """The CPU code paths the run computed with (``main_job.numerics.cpu_numerics``)."""
    hard: tuple[str, ...] = ()
    """Names of the held-out tasks in the hard subset."""
    title: str = "crf main job"
    """The heading of ``summary.md`` (the job's kind: ``main_job.job.Kind.heading``)."""
    link: Link | None = None
    """The network to the store (``--link``): each sync's time is then set against its floor on it."""

    @property
    def change(self) -> Change:
        return Change.between(self.before, self.after)

    def subsets(self) -> dict[str, tuple[PassRate, PassRate]]:
        """``{"all" | "easy" | "hard": (before, after)}``, the subsets only when both are non-empty."""
        out = {"all": (self.before, self.after)}
        easy = [t for t in self.before.tasks if t not in set(self.hard)]
        if self.hard and easy:
            out["easy"] = (self.before.subset(easy), self.after.subset(easy))
            out["hard"] = (self.before.subset(self.hard), self.after.subset(self.hard))
        return out


def window(steps: int) -> int:
    """Steps averaged at each end of a curve: a fifth of the run (one step's rollouts are noisy)."""
    return max(1, steps // 5)


def _span(values: Sequence[float], digits: int = 4) -> str:
    """``"first -> last"`` over the `ends` of ``values``, or ``"n/a"`` when there are none."""
    if not values:
        return "n/a"
    a, b = ends(values)
    return f"{a:+.{digits}f} -> {b:+.{digits}f}"


def ends(values: Sequence[float]) -> tuple[float, float]:
    """Mean over the first and the last `window` values (NaN for none)."""
    if not values:
        return float("nan"), float("nan")
    n = window(len(values))
    return sum(values[:n]) / n, sum(values[-n:]) / n


def _losses(report: ReplicaReport, channel: str) -> list[float]:
    return [row.losses[channel] for row in report.history if channel in row.losses]


@dataclass(frozen=True)
class SyncSummary:
    """One replica's DiLoCo syncs in medians: MB and sequential round trips per sync, seconds per sync, and with a
    link its floor (``Link.floor_s``) and the sync's time over it (the median of the per-sync ratios)."""

    megabytes: float
    round_trips: float
    seconds: float
    floor: float | None
    ratio: float | None

    @classmethod
    def of(cls, syncs: Sequence[SyncStat], link: Link | None) -> SyncSummary | None:
        if not syncs:
            return None
        floors = [link.floor_s(s.megabytes * 1e6, s.round_trips) for s in syncs] if link is not None else None
        return cls(
            statistics.median(s.megabytes for s in syncs),
            statistics.median(s.round_trips for s in syncs),
            statistics.median(s.seconds for s in syncs),
            None if floors is None else statistics.median(floors),
            None if floors is None else statistics.median(s.seconds / f for s, f in zip(syncs, floors, strict=True)),
        )

    def cells(self) -> list[str]:
        """Sync s, floor s and sync/floor as table cells ("n/a" without a link)."""
        floor = "n/a" if self.floor is None else f"{self.floor:.3f}"
        ratio = "n/a" if self.ratio is None else f"{self.ratio:.2f}"
        return [f"{self.seconds:.3f}", floor, ratio]


def summary_table(outcome: JobOutcome) -> str:
    """One row per replica: reward and each channel's loss over the first → last fifth, rounds, MB, time."""
    n = window(outcome.steps)
    header = ["replica", f"reward (first {n} -> last {n} steps)"]
    header += [f"{c} loss" for c in outcome.channels] + ["rounds", "MB synced", "checkpoints", "time s"]
    header += ["sync s", "floor s", "sync/floor"]
    rows = []
    for r in outcome.replicas:
        first, last = ends([row.reward for row in r.history])
        cells = [str(r.rank), f"{first:.3f} -> {last:.3f}"]
        cells += [_span(_losses(r, c)) for c in outcome.channels]
        cells += [str(r.rounds_committed), f"{(r.bytes_written + r.bytes_read) / 1e6:.2f}"]
        cells += [f"{r.checkpoint_bytes / 1e6:.2f}", f"{r.seconds:.0f}"]
        summary = SyncSummary.of(r.syncs, outcome.link)
        cells += summary.cells() if summary is not None else ["n/a"] * 3
        rows.append(cells)
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    line = "+".join("-" * (w + 2) for w in widths)

    def fmt(cells: Sequence[str]) -> str:
        return "|".join(f" {c:<{w}} " for c, w in zip(cells, widths, strict=True))

    held = [
        f"held-out pass rate ({outcome.heldout_tasks} tasks never trained on, {outcome.before.samples} samples each, "
        "95% intervals):"
    ]
    for name, (before, after) in outcome.subsets().items():
        change = Change.between(before, after)
        held.append(
            f"  {name:<4} ({len(before.tasks):>2} tasks): before RL {before.text()} -> after RL {after.text()}; "
            f"change {change.text()} ({_verdict(change)})"
        )
    return "\n".join([line, fmt(header), line, *(fmt(row) for row in rows), line, *held])


def _verdict(change: Change) -> str:
    lo, hi = change.interval
    if lo > 0:
        return "a rise above noise"
    if hi < 0:
        return "a DROP beyond noise"
    return "within noise"


def _syncs_section(outcome: JobOutcome) -> list[str]:
    """``summary.md``'s DiLoCo syncs: per replica, medians of MB, round trips and seconds per sync, and with
    ``--link`` each sync's time against its floor on that link."""
    link = outcome.link
    if link is None:
        where = (
            "Run with `--link RTT,BANDWIDTH` (the network to the store, e.g. `40ms,50MB/s`) to set each sync's time "
            "against its floor there."
        )
    else:
        where = (
            f"Link to the store: {link}; a sync's floor is its MB / bandwidth + its round trips × RTT, the least time "
            "that network allows it."
        )
    lines = [
        "",
        "## DiLoCo syncs",
        "",
        "Medians per sync (rounds and vote; round trips: sequential request waves that found something). " + where,
        "",
        "| replica | syncs (committed) | MB per sync | round trips per sync | sync s | floor s | sync / floor |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in outcome.replicas:
        summary = SyncSummary.of(r.syncs, link)
        committed = sum(s.committed for s in r.syncs)
        if summary is None:
            lines.append(f"| {r.rank} | 0 | n/a | n/a | n/a | n/a | n/a |")
            continue
        lines.append(
            f"| {r.rank} | {len(r.syncs)} ({committed}) | {summary.megabytes:.3f} | {summary.round_trips:g} | "
            + " | ".join(summary.cells())
            + " |"
        )
    return lines


def summary_markdown(outcome: JobOutcome, plot_name: str) -> str:
    """The short report beside the plot."""
    change = outcome.change
    lo, hi = change.interval
    r0 = outcome.replicas[0]
    first, last = ends([row.reward for row in r0.history])
    lines = [
        f"# {outcome.title}",
        "",
        f"`{outcome.command}`",
        "",
        f"Model `{outcome.model}`, channels {' + '.join(outcome.channels)}, seed {outcome.seed}; "
        f"{len(outcome.replicas)} replicas as separate processes ({outcome.executor} executor), "
        f"{outcome.steps} steps each, DiLoCo round every {outcome.sync_every} steps.",
        "",
        f"## Held-out pass rate: {outcome.before.mean:.3f} → {outcome.after.mean:.3f} ({change.mean:+.3f})",
        "",
        f"{outcome.heldout_tasks} held-out tasks (never in the train tasks, the warm-start demonstrations, the traces "
        f"or the DPO pairs), {outcome.before.samples} sampled completions each; a completion passes when it passes "
        "every unit test. 95% intervals with the task as the unit.",
        "",
        "| tasks | before RL (warm start only) [95%] | after RL [95%] | change (paired by task) [95%] |",
        "|---|---|---|---|",
        *(
            f"| {name} ({len(b.tasks)}) | {b.text()} | {a.text()} | {Change.between(b, a).text()} |"
            for name, (b, a) in outcome.subsets().items()
        ),
        "",
        f"The change is {_verdict(change)} (its 95% interval {'excludes' if lo > 0 or hi < 0 else 'includes'} 0). "
        "Hard tasks name their argument otherwise than `x`; the warm start never shows them in plain form.",
        "",
        "## Training",
        "",
        f"Rollout reward on the {outcome.train_tasks} train tasks (replica 0, mean over the first → last fifth of the "
        f"steps): {first:.3f} → {last:.3f}.",
        "",
        "| replica | "
        + " | ".join(f"{c} loss (first → last fifth)" for c in outcome.channels)
        + " | rounds | MB synced | MB per round | of which checkpoints |",
        "|---" * (len(outcome.channels) + 5) + "|",
    ]
    for r in outcome.replicas:
        cells = [_span(_losses(r, c)).replace("->", "→") for c in outcome.channels]
        mb = (r.bytes_written + r.bytes_read) / 1e6
        rounds = max(1, r.rounds_committed)
        lines.append(f"| {r.rank} | " + " | ".join(cells) + f" | {r.rounds_committed} | {mb:.2f} | {mb / rounds:.3f} | "
                     f"{r.checkpoint_bytes / 1e6 / rounds:.3f} |")  # fmt: skip
    lines += _syncs_section(outcome)
    same = "bit-identical" if outcome.identical_weights else "**different** (a round did not commit everywhere)"
    phases = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in outcome.phases.items())
    lines += [
        "",
        f"Replicas' final weights: {same}.",
        "",
        f"Wall time {outcome.seconds:.0f} s ({phases}); load average at the end: {outcome.load_average}.",
        "",
        outcome.sandbox,
        "",
        f"CPU numerics: {outcome.numerics or 'not recorded'} (`main_job.numerics`).",
        "",
        f"![curves]({plot_name})",
        "",
    ]
    return "\n".join(lines)


def _running_mean(values: Sequence[float], width: int) -> list[float]:
    """Trailing mean over the last ``width`` values (fewer at the start)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - width] if i >= width else 0.0)
        out.append(total / min(i + 1, width))
    return out


def plot(outcome: JobOutcome, path: Path) -> None:
    """The six-panel figure (see the module docstring)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    rounds = range(outcome.sync_every, outcome.steps + 1, outcome.sync_every)

    ax = axes[0, 0]
    for r in outcome.replicas:
        xs = [row.step for row in r.history]
        ys = [row.reward for row in r.history]
        ax.plot(xs, ys, color=f"C{r.rank}", alpha=0.25, linewidth=0.8)
        width = window(len(ys))
        ax.plot(xs, _running_mean(ys, width), color=f"C{r.rank}", linewidth=2, label=f"replica {r.rank}")
    ax.set(title="rollout reward on train tasks (thick: running mean)", xlabel="step", ylim=(-0.02, 1.02))
    ax.legend(fontsize=8)

    ax = axes[0, 1]
    groups = outcome.subsets()
    for offset, (label, color, which) in enumerate((("before RL", "#999999", 0), ("after RL", "#2a7ab9", 1))):
        rates = [pair[which] for pair in groups.values()]
        xs = [i + (offset - 0.5) * 0.38 for i in range(len(rates))]
        errors = [[r.mean - r.interval[0] for r in rates], [r.interval[1] - r.mean for r in rates]]
        ax.bar(xs, [r.mean for r in rates], width=0.38, yerr=errors, capsize=5, color=color, label=label)
        for x, r in zip(xs, rates, strict=True):
            ax.text(x, r.mean + 0.02, f"{r.mean:.2f}", ha="center", fontsize=8)
    ax.set_xticks(range(len(groups)), [f"{n} ({len(b.tasks)})" for n, (b, _) in groups.items()])
    changes = ", ".join(f"{n} {Change.between(b, a).mean:+.3f}" for n, (b, a) in groups.items())
    ax.set(title=f"held-out pass rate ({outcome.heldout_tasks} unseen tasks), 95% CI", ylim=(0, 1.2),
           xlabel=f"change: {changes}")  # fmt: skip
    ax.legend(fontsize=8, loc="upper center", ncol=2)

    for ax, channel in zip((axes[0, 2], axes[1, 0], axes[1, 1]), CHANNELS, strict=True):
        if channel not in outcome.channels:
            ax.text(0.5, 0.5, f"{channel}: off in this run", ha="center", va="center", transform=ax.transAxes)
            ax.set(title=f"{channel} loss", xticks=[], yticks=[])
            continue
        for r in outcome.replicas:
            points = [(row.step, row.losses[channel]) for row in r.history if channel in row.losses]
            xs, ys = [p[0] for p in points], [p[1] for p in points]
            ax.plot(xs, ys, color=f"C{r.rank}", alpha=0.25, linewidth=0.8)
            ax.plot(xs, _running_mean(ys, window(len(ys))), color=f"C{r.rank}", linewidth=2, label=f"replica {r.rank}")
        ax.set(title=f"{channel} loss (thick: running mean)", xlabel="step")
        ax.legend(fontsize=8)

    ax = axes[1, 2]
    for s in rounds:
        ax.axvline(s, color="grey", linestyle="--", linewidth=0.4)
    for r in outcome.replicas:
        ax.plot([row.step for row in r.history], [row.megabytes for row in r.history], color=f"C{r.rank}")
        ax.plot([], [], color=f"C{r.rank}", label=f"replica {r.rank}: {r.rounds_committed} rounds committed")
    ax.set(title="DiLoCo: MB through the object store (dashed: rounds)", xlabel="step", ylabel="MB written + read")
    ax.legend(fontsize=8)

    fig.suptitle(
        f"crf main job: {' + '.join(outcome.channels)}, {len(outcome.replicas)} DiLoCo replicas, seed {outcome.seed}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
