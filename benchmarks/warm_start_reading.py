"""What the main job's warm start teaches: the policy's held-out pass rate from the plain prompt, and from SDPO's
reprompt holding the sandbox's feedback on a wrong attempt or holding a correct answer.

What is measured
    The main job's warm start (``examples/main_job/policy.py``, its default 400 steps, or ``--steps``) on seed
    ``--seed``, then 8 sampled completions per held-out task (temperature 1, like the evaluation) in three
    contexts: the plain prompt (what the held-out pass rate measures), the reprompt with the feedback
    `UnitTestReward` gives on a weak student's wrong attempt at that task, and the reprompt with the task's
    correct answer. The reprompts are SDPO's self-teacher's view, so the gap between them and the plain prompt is
    the signal SDPO can distil. Held-out tasks are used here only to *measure*; nothing is trained on them.

    Then what SDPO's divergence does with that signal, at the first token where a wrong attempt leaves the right
    answer (the operator of ``x | 17`` after a wrong ``x + 57``): the student's probability of the right token
    (plain prompt), the teacher's (reprompt with the feedback), and the gradient each divergence puts on that
    token's student logit: the generalised JSD of SDPO's default (alpha 0.5) and forward KL (alpha 0), both on
    the full vocabulary. The JSD's gradient on a logit is proportional to the student's own probability of it,
    so a token the student never writes gets almost none, however sure the teacher is.

Printed
    One row per subset (easy, hard): the pass rate in each context; one row per subset: the medians over its
    tasks of those probabilities and gradients.

Run: ``PYTHONPATH=examples python benchmarks/warm_start_reading.py`` from the repository root, or ``nox -s bench --
warm_start_reading`` (about 3 minutes on 2 cores); it imports the main job's modules (``main_job``) from ``examples/``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--samples", type=int, default=8)
    args = parser.parse_args()

    try:
        from main_job.numerics import pin_cpu_numerics
    except ModuleNotFoundError as exc:
        if exc.name != "main_job":
            raise
        sys.exit("warm_start_reading.py imports the main job's modules: run it as `PYTHONPATH=examples python "
                 "benchmarks/warm_start_reading.py` from the repository root")  # fmt: skip

    pin_cpu_numerics()  # before torch: the main job's numerics, so this is the job's warm start bit for bit

    import torch
    from main_job import templates
    from main_job.feedback import feedback_examples
    from main_job.policy import build_policy, warm_start
    from main_job.tasks import DATA, build_drills, load_demonstrations, load_tasks

    from crf_core.rewards import UnitTestReward, bubblewrap_usable
    from crf_core.trainer.reprompt import build_reprompts
    from crf_distill import generalized_jsd_per_token

    torch.set_num_threads(1)
    isolation = "bwrap" if bubblewrap_usable() else "rlimits"
    train, heldout = load_tasks(DATA / "tasks_train.jsonl"), load_tasks(DATA / "tasks_heldout.jsonl")
    readable = [t for t in train if not t.hard] + build_drills()
    feedback = feedback_examples(readable, isolation=isolation, timeout_s=3.0, seed=args.seed)
    model, tokenizer = build_policy("tiny", seed=args.seed)
    start = time.monotonic()
    warm_start(model, tokenizer, load_demonstrations(DATA / "demonstrations.jsonl"), feedback=feedback,
               steps=args.steps, lr=3e-3, seed=args.seed)  # fmt: skip
    print(f"warm start: {args.steps} steps, seed {args.seed}, {time.monotonic() - start:.0f} s", flush=True)
    config = templates.reprompt_config()
    attempts = {e.task: e for e in feedback_examples(heldout, isolation=isolation, timeout_s=3.0, seed=args.seed)}
    reward = UnitTestReward(isolation=isolation, max_workers=2)  # type: ignore[arg-type]
    model.eval()

    def rate(tasks: list, contexts: list[str]) -> float:
        torch.manual_seed(args.seed + 12345)
        encoded = tokenizer(contexts, return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(**encoded, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=12,
                                 num_return_sequences=args.samples, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        completions = tokenizer.batch_decode(out[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True)
        rows = [t for t in tasks for _ in range(args.samples)]
        scores = reward([t.prompt for t in rows], completions, tests=[list(t.tests) for t in rows])
        return sum(s == 1.0 for s in scores) / len(scores)

    print("| subset | tasks | plain prompt | reprompt with feedback | reprompt with a correct answer |")
    print("|---|---|---|---|---|")
    for name, hard in (("easy", False), ("hard", True)):
        tasks = [t for t in heldout if t.hard == hard and t.name in attempts]
        fed = [
            build_reprompts([t.prompt] * 2, [attempts[t.name].attempt, ""], [0.0, 0.0],
                            [attempts[t.name].feedback, None], 2, config).reprompts[0].prompt
            for t in tasks
        ]  # fmt: skip
        shown = [build_reprompts([t.prompt] * 2, [t.solution, ""], [1.0, 0.0], None, 2, config).reprompts[1].prompt
                 for t in tasks]  # fmt: skip
        plain, with_feedback, with_answer = (rate(tasks, c) for c in ([t.prompt for t in tasks], fed, shown))
        print(f"| {name} | {len(tasks)} | {plain:.3f} | {with_feedback:.3f} | {with_answer:.3f} |", flush=True)

    def logits(context: str, prefix: str) -> torch.Tensor:
        ids = tokenizer(context)["input_ids"] + tokenizer(prefix, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            return model(input_ids=torch.tensor([ids])).logits[0, -1].double()

    def gradient(student: torch.Tensor, teacher: torch.Tensor, alpha: float, token: int) -> float:
        z = student.clone().requires_grad_(True)
        generalized_jsd_per_token(z[None], teacher[None], alpha=alpha).sum().backward()
        assert z.grad is not None
        return float(z.grad[token])

    print()
    print("| subset | tasks | student p(right token) | teacher p(right token) | JSD (alpha 0.5) gradient on it "
          "| forward KL gradient on it |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for name, hard in (("easy", False), ("hard", True)):
        rows = []
        for t in (t for t in heldout if t.hard == hard and t.name in attempts):
            attempt = attempts[t.name].attempt
            cut = next(i for i, (a, b) in enumerate(zip(t.solution + "\0", attempt + "\0", strict=False)) if a != b)
            if cut >= len(t.solution):
                continue
            token = tokenizer(t.solution[cut], add_special_tokens=False)["input_ids"][-1]
            fed = build_reprompts([t.prompt] * 2, [attempt, ""], [0.0, 0.0], [attempts[t.name].feedback, None], 2,
                                  config).reprompts[0].prompt  # fmt: skip
            student, teacher = logits(t.prompt, t.solution[:cut]), logits(str(fed), t.solution[:cut])
            rows.append((
                float(torch.softmax(student, -1)[token]), float(torch.softmax(teacher, -1)[token]),
                gradient(student, teacher, 0.5, token), gradient(student, teacher, 0.0, token),
            ))  # fmt: skip
        medians = [sorted(column)[len(column) // 2] for column in zip(*rows, strict=True)]
        print(f"| {name} | {len(rows)} | " + " | ".join(f"{m:.2e}" for m in medians) + " |", flush=True)
    load = Path("/proc/loadavg")
    print(f"load average {' '.join(load.read_text().split()[:3]) if load.exists() else 'n/a'}")


if __name__ == "__main__":
    main()
