"""The crf-replaysim CLI end to end against the scripted teacher on 127.0.0.1."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from crf_replaysim.cli import main
from crf_replaysim.pairs import example_pairs_path
from crf_replaysim.progress import StderrProgress
from crf_replaysim.traces import example_traces_path, load_traces

KEY_ENV = "CRF_REPLAYSIM_TEST_KEY"
N_POINTS = sum(len(t.decision_points()) for t in load_traces(example_traces_path())[0])


def replay_args(server, traces, out, *extra):
    return ["replay", str(traces), "-o", str(out), "--model", "org/teacher", "--base-url", server.base_url,
            "--api-key-env", KEY_ENV, "--backoff-base", "0.01", "--backoff-max", "0.05", *extra]  # fmt: skip


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_cli_replay_then_validate_then_normalize(teacher_server, api_key, tmp_path, capsys):
    pairs = tmp_path / "pairs.jsonl"
    teacher_server.script.append({"status": 429, "headers": {"Retry-After": "0.01"}})
    assert main(replay_args(teacher_server, example_traces_path(), pairs, "--cache-dir", str(tmp_path / "c"))) == 0
    err = capsys.readouterr().err
    assert f"pairs written:    {N_POINTS}" in err
    assert "retries 1" in err
    assert f"replay: {N_POINTS} decision points" in err  # the progress line's final draw
    assert len(lines(pairs)) == N_POINTS

    assert main(["validate", str(pairs)]) == 0
    assert f"valid records:   {N_POINTS}" in capsys.readouterr().err

    out = tmp_path / "out.jsonl"
    assert main(["normalize", str(pairs), "-o", str(out), "--skip-dj", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert lines(out) == lines(pairs)
    assert "normalize:" not in err  # --quiet: no progress line
    assert f"read {N_POINTS}, kept {N_POINTS}, dropped 0" in err


def test_cli_normalize_default_recipe_reports_drops_and_malformed_lines(teacher_server, api_key, tmp_path, capsys):
    pairs = tmp_path / "pairs.jsonl"
    assert main(replay_args(teacher_server, example_traces_path(), pairs, "--quiet")) == 0
    with open(pairs, "a", encoding="utf-8") as fh:
        fh.write("{truncated\n")
    out = tmp_path / "out.jsonl"
    assert main(["normalize", str(pairs), "-o", str(out)]) == 0
    err = capsys.readouterr().err
    kept = lines(out)
    assert f"read {N_POINTS + 1}, kept {len(kept)}" in err
    assert "dropped by special_characters_filter(rejected)" in err
    assert f"line {N_POINTS + 1}: invalid JSON" in err
    assert main(["validate", str(out), "--strict", "--quiet"]) == 0
    assert main(["normalize", str(pairs), "-o", str(out), "--strict", "--quiet"]) == 3


def test_cli_reports_malformed_lines_and_strict_fails(
    teacher_server, api_key, tmp_path, capsys, trace_factory, jsonl_writer
):
    traces = jsonl_writer(tmp_path / "t.jsonl", [trace_factory("a"), "not json", trace_factory("b")])
    pairs = tmp_path / "pairs.jsonl"
    assert main(replay_args(teacher_server, traces, pairs, "--quiet")) == 0
    assert "line 2: invalid JSON" in capsys.readouterr().err
    assert main(replay_args(teacher_server, traces, pairs, "--quiet", "--strict")) == 3

    with open(pairs, "a", encoding="utf-8") as fh:
        fh.write('{"chosen": ["a list"]}\n')
    assert main(["validate", str(pairs), "--quiet", "--strict"]) == 3
    err = capsys.readouterr().err
    assert "malformed lines: 1" in err
    assert "line 5: record lacks" in err


def test_cli_errors_exit_1_with_a_message(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("OPENROUTER_API_KEY", raising=False)
    assert main(["replay", str(example_traces_path()), "-o", str(tmp_path / "p.jsonl"), "--model", "m"]) == 1
    assert "OPENROUTER_API_KEY is not set" in capsys.readouterr().err
    monkeypatch.setenv("OPENROUTER_API_KEY", "sk-x")
    assert main(["replay", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "p.jsonl"), "--model", "m"]) == 1
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["replay", str(example_traces_path()), "-o", "x", "--model", "m", "--chosen", "student"])
    assert info.value.code == 2


def test_cli_subprocess_never_prints_the_key(teacher_server, api_key, tmp_path):
    """``python -m crf_replaysim`` in a child process; the server echoes the Authorization header back."""
    teacher_server.responder = lambda body: {"status": 403, "echo_auth": True}
    env = {**os.environ, KEY_ENV: api_key}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "crf_replaysim",
            *replay_args(teacher_server, example_traces_path(), tmp_path / "p.jsonl"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "HTTP 403" in proc.stderr
    assert "Fix: check the key in $CRF_REPLAYSIM_TEST_KEY" in proc.stderr
    assert api_key not in proc.stdout + proc.stderr
    assert not (tmp_path / "p.jsonl").exists()


def test_stderr_progress_line():
    stream = io.StringIO()
    progress = StderrProgress("replay", "decision points", stream=stream, log_every=2)
    for done in range(1, 6):
        progress(done)
    progress.close()
    shown = stream.getvalue().splitlines()
    assert [line.split(" (")[0] for line in shown] == [
        "replay: 2 decision points",
        "replay: 4 decision points",
        "replay: 5 decision points",
    ]


def test_import_pulls_in_neither_data_juicer_nor_ray_nor_torch():
    """Failure mode 1: replaysim must not import data-juicer or Ray (or torch) unless asked."""
    code = (
        "import sys, crf_replaysim, crf_replaysim.records, crf_replaysim.traces, crf_replaysim.teacher, "
        "crf_replaysim.replay, crf_replaysim.cli, crf_replaysim.normalize\n"
        "from crf_replaysim import DJNormalizer, TeacherClient, replay_jsonl, normalize_jsonl, DPOPair, NormalizedDPOPair\n"
        "from crf_replaysim.records import _dpo_pair_to_dj_record\n"
        "m = [{'role': 'user', 'content': 'Please fix the failing test in the parser module.'}]\n"
        "a = [{'role': 'assistant', 'content': 'I will read the parser module and the failing test first.'}]\n"
        "rec = _dpo_pair_to_dj_record(DPOPair(m, a, a, 't', 1))\n"
        "assert list(DJNormalizer(skip_dj=True).normalize([rec])) == [rec]\n"
        "assert len(list(DJNormalizer().normalize([rec]))) == 1  # native backend, default recipe\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in {'data_juicer', 'ray', 'torch'})\n"
        "print(heavy)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_the_guides_commands_run_as_written(teacher_server, api_key, tmp_path, capsys, monkeypatch):
    """docs/guide.md: `crf-replaysim replay traces.jsonl pairs.raw.jsonl` and `normalize pairs.raw.jsonl pairs.jsonl`."""
    monkeypatch.chdir(tmp_path)
    Path("traces.jsonl").write_bytes(example_traces_path().read_bytes())
    common = ["--model", "org/teacher", "--base-url", teacher_server.base_url, "--api-key-env", KEY_ENV, "--quiet"]
    assert main(["replay", "traces.jsonl", "pairs.raw.jsonl", *common]) == 0
    assert main(["normalize", "pairs.raw.jsonl", "pairs.jsonl", "--quiet"]) == 0
    assert Path("pairs.jsonl").is_file()
    assert main(["normalize", "pairs.raw.jsonl", "same.jsonl", "-o", "same.jsonl", "--quiet"]) == 0  # agreeing
    capsys.readouterr()
    for args in (["normalize", "pairs.raw.jsonl", "a.jsonl", "-o", "b.jsonl"], ["normalize", "pairs.raw.jsonl"]):
        with pytest.raises(SystemExit) as info:
            main(args)
        assert info.value.code == 2
    err = capsys.readouterr().err
    assert "two outputs given" in err
    assert "an output is required" in err


def test_validate_exits_3_on_malformed_lines_and_says_so_in_its_help(tmp_path, capsys):
    pairs = tmp_path / "p.jsonl"
    pairs.write_text(Path(example_pairs_path()).read_text(encoding="utf-8") + "{broken\n", encoding="utf-8")
    assert main(["validate", str(pairs), "--quiet"]) == 3
    assert "line 5: invalid JSON" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["validate", "--help"])
    assert "3 when any line is malformed" in " ".join(capsys.readouterr().out.split())
