"""DJNormalizer: passthrough, the two record shapes, native ops, recipe checks, streaming, JSONL summary.

The seed-named tests (failure modes 1 and 6) are the first five. Everything here runs without data-juicer
except ``test_dj_normalizer_e2e_default_recipe``; native-versus-data-juicer parity is in ``test_dj_parity.py``.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import subprocess
import sys
import textwrap
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from crf_replaysim._synthetic import synthetic_dj_records
from crf_replaysim.normalize import DJNormalizer, NormalizeSummary, normalize_jsonl, pair_text
from crf_replaysim.ops import NATIVE_OPS, RecipeError
from crf_replaysim.ops._recipe import DEFAULT_RECIPE_PATH, load_recipe
from crf_replaysim.records import DPOPair, NormalizedDPOPair, RecordError, _dpo_pair_to_dj_record

OPS: dict[str, Any] = dict(NATIVE_OPS)  # name -> op class, typed loosely for per-op keyword arguments
HAS_DJ = importlib.util.find_spec("data_juicer") is not None


def _pair(chosen: str, rejected: str, prompt: str = "Fix the failing test in utils.py", **meta: Any) -> dict[str, Any]:
    return _dpo_pair_to_dj_record(
        DPOPair(
            prompt_messages=[{"role": "user", "content": prompt}],
            chosen_messages=[{"role": "assistant", "content": chosen}],
            rejected_messages=[{"role": "assistant", "content": rejected}],
            trace_id=f"t-{abs(hash((prompt, chosen, rejected))) % 10**8}",
            turn=1,
            meta=dict(meta),
        )
    )


GOOD = "I will open utils.py, read the failing assertion and patch the off-by-one in the loop bound."
JUNK = "!!!! ???? #### $$$$ %%%% ^^^^"


# --------------------------------------------------------------------------- seed tests


def test_dj_normalizer_skip_dj_passthrough(tmp_path: Path) -> None:
    """skip_dj=True passes every record through unchanged and imports neither data-juicer nor Ray."""
    script = textwrap.dedent(
        """
        import json, sys
        from crf_replaysim import DJNormalizer
        from crf_replaysim._synthetic import synthetic_dj_records
        records = list(synthetic_dj_records(300, seed=3))
        normalizer = DJNormalizer(skip_dj=True, backend="data-juicer")
        out = list(normalizer.normalize(records))
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("data_juicer", "ray", "torch"))
        print(json.dumps({"same": out == records, "n": len(out), "kept": normalizer.stats.kept, "loaded": loaded}))
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"same": True, "n": 300, "kept": 300, "loaded": []}


def test_dj_normalizer_skip_dj_preserves_count(tmp_path: Path) -> None:
    """Every valid line comes out (junk included); malformed lines are reported with line numbers, not dropped silently."""
    records = [_pair(GOOD, JUNK), _pair(JUNK, GOOD), _pair("x", "y"), _pair(GOOD, GOOD)]
    lines = [json.dumps(r) for r in records[:2]] + ["{not json", ""] + [json.dumps(r) for r in records[2:]] + ["[1, 2]"]
    src = tmp_path / "pairs.jsonl"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "out.jsonl"
    summary = normalize_jsonl(src, out, skip_dj=True)
    written = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert written == records
    assert (summary.read, summary.kept, summary.dropped_per_op) == (7, 4, {})
    assert [number for number, _ in summary.malformed] == [3, 4, 7]
    assert "invalid JSON" in summary.malformed[0][1]
    assert summary.malformed[1][1] == "blank line"
    assert "line 7" in summary.format()


def test_record_chosen_rejected_are_flat_strings_for_dj_text_ops() -> None:
    """``chosen``/``rejected`` are plain strings every native text op reads; list-valued ones are refused."""
    call = {"id": "c1", "type": "function", "function": {"name": "run", "arguments": '{"cmd": "pytest -q"}'}}
    pair = DPOPair(
        prompt_messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "run the tests"}],
        chosen_messages=[
            {"role": "assistant", "content": [{"type": "text", "text": "Running them."}], "tool_calls": [call]}
        ],
        rejected_messages=[{"role": "assistant", "content": "No."}],
        trace_id="t-flat",
        turn=2,
    )
    record = _dpo_pair_to_dj_record(pair)
    for key in ("prompt", "chosen", "rejected"):
        assert type(record[key]) is str
    assert record["chosen"] == 'Running them.\nrun({"cmd": "pytest -q"})'
    recipe = load_recipe(DEFAULT_RECIPE_PATH)
    normalizer = DJNormalizer(recipe={"text_keys": "chosen", "process": [{"words_num_filter": {"min_num": 1}}]})
    assert len(list(normalizer.normalize([record]))) == 1
    assert all(step.text_key in ("chosen", "rejected", "prompt", "pair") for step in recipe.steps)
    broken = {**record, "chosen": record["chosen_messages"]}
    with pytest.raises(RecordError, match="chosen is list"):
        list(normalizer.normalize([broken]))


def test_record_chosen_rejected_messages_carry_chat_shape() -> None:
    """``*_messages`` are chat lists; a mapper keeps them in step with the flat string and the round trip holds."""
    record = _pair("Mail bob@example.com or see https://example.org/x now", GOOD, prompt="ask alice@example.com")
    for key in ("prompt_messages", "chosen_messages", "rejected_messages"):
        assert isinstance(record[key], list)
        assert record[key]
        assert all(isinstance(m, dict) and isinstance(m["role"], str) for m in record[key])
    recipe = {
        "text_keys": "chosen",
        "process": [
            {"clean_email_mapper": {"text_key": "chosen"}},
            {"clean_links_mapper": {"text_key": "chosen", "repl": "<url>"}},
            {"clean_email_mapper": {"text_key": "prompt", "repl": "<email>"}},
        ],
    }
    (out,) = DJNormalizer(recipe=recipe).normalize([record])
    assert out["chosen"] == "Mail  or see <url> now"
    assert out["chosen_messages"] == [{"role": "assistant", "content": "Mail  or see <url> now"}]
    assert out["prompt_messages"] == [{"role": "user", "content": "ask <email>"}]
    assert out["prompt"] == "user: ask <email>"
    assert out["rejected_messages"] == record["rejected_messages"]
    assert record["chosen"].startswith("Mail bob@")  # the input is not mutated
    normalized = NormalizedDPOPair.from_dj_record(out)
    assert normalized.chosen_messages == out["chosen_messages"]
    assert normalized.chosen == out["chosen"]


@pytest.mark.integration
@pytest.mark.skipif(not HAS_DJ, reason="data-juicer is not importable (run the nox `dj` session)")
def test_dj_normalizer_e2e_default_recipe(tmp_path: Path) -> None:
    """The default recipe through the real data-juicer executor keeps exactly what the native backend keeps."""
    records = list(synthetic_dj_records(400, seed=11))
    src = tmp_path / "pairs.jsonl"
    src.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records) + "not json\n", encoding="utf-8")
    native = normalize_jsonl(src, tmp_path / "native.jsonl")
    dj = normalize_jsonl(src, tmp_path / "dj.jsonl", backend="data-juicer")
    native_rows = (tmp_path / "native.jsonl").read_text(encoding="utf-8")
    assert (tmp_path / "dj.jsonl").read_text(encoding="utf-8") == native_rows
    assert dj.read == native.read == 401
    assert dj.malformed == native.malformed == [(401, dj.malformed[0][1])]
    assert 0 < dj.kept == native.kept < 400
    assert sum(dj.dropped_per_op.values()) == sum(native.dropped_per_op.values()) == 400 - dj.kept
    kept = [json.loads(line) for line in native_rows.splitlines()]
    assert [NormalizedDPOPair.from_dj_record(r).to_dj_record() for r in kept] == kept
    assert len({pair_text(r) for r in kept}) == len(kept)  # pair-level dedup


# --------------------------------------------------------------------------- native ops, by hand


def _stat(name: str, text: str, **args: Any) -> float:
    op = OPS[name](text_key="chosen", **args)
    return op.stat(text)


@pytest.mark.parametrize(
    ("name", "text", "args", "expected"),
    [
        ("text_length_filter", "héllo 😀", {}, 7),
        ("special_characters_filter", "ab!!", {}, 0.5),
        ("special_characters_filter", "", {}, 0.0),
        ("special_characters_filter", "a😀b…", {}, 0.5),  # emoji and the ellipsis are special
        ("special_characters_filter", "ab\u00e9\u4e2d", {}, 0.0),
        # crf-replaysim's extension: whitespace (indentation, line breaks, U+3000) is not counted at all
        ("special_characters_filter", "if x:\n        return 1\n", {"count_whitespace": False}, 2 / 11),
        ("special_characters_filter", "if x:\n        return 1\n", {}, 14 / 23),  # data-juicer: 0.61, dropped
        ("special_characters_filter", "a\u3000\t!", {"count_whitespace": False}, 0.5),
        ("special_characters_filter", " \n\t", {"count_whitespace": False}, 0.0),
        ("alphanumeric_filter", "ab1_ !", {}, 0.5),  # underscore is not alphanumeric
        ("alphanumeric_filter", "日本x", {}, 1.0),
        ("words_num_filter", "a ,, b\tc\n!!!\r", {}, 3),  # ",," and "!!!\r" strip to nothing
        ("words_num_filter", "well-known (words), 'quoted'", {}, 3),
        ("words_num_filter", "a\u3000b", {}, 1),  # only space, tab and newline split words
        ("word_repetition_filter", "A b a B a b", {"rep_len": 2}, 1.0),  # ab, ba, ab, ba, ab: all repeat
        ("word_repetition_filter", "one two three one two", {"rep_len": 2}, 0.5),  # 2 of 4 bigrams repeat
        ("word_repetition_filter", "too short", {"rep_len": 3}, 0.0),
        # 2-grams of "aaaab": aa x3, ab x1 -> d=2, singles=1, k=min(1, 1)=1 -> 3/4
        ("character_repetition_filter", "aaaab", {"rep_len": 2}, 0.75),
        ("character_repetition_filter", "abcdef", {"rep_len": 2}, 0.0),
        ("character_repetition_filter", "abc", {"rep_len": 5}, 0.0),
    ],
)
def test_native_filter_statistics_by_hand(name: str, text: str, args: dict[str, Any], expected: float) -> None:
    assert _stat(name, text, **args) == pytest.approx(expected, abs=0, rel=1e-12)


def test_special_characters_without_whitespace_equals_its_definition() -> None:
    """The fast ASCII path and the general path both equal the definition: specials among non-space characters."""
    import random

    from crf_replaysim.ops._text import SPECIAL_CHARACTERS

    op = OPS["special_characters_filter"](text_key="x", count_whitespace=False)
    rng = random.Random(1)
    alphabet = [chr(c) for c in range(128)] + ["\u3000", "\u00e9", "\U0001f389", "\u00a0", "\u2028", "\x85"]
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        shown = [c for c in text if not c.isspace()]
        expected = sum(c in SPECIAL_CHARACTERS for c in shown) / len(shown) if shown else 0.0
        assert op.stat(text) == expected, repr(text)


def test_extension_arguments_are_checked() -> None:
    with pytest.raises(RecipeError, match="count_whitespace must be true or false"):
        OPS["special_characters_filter"](text_key="chosen", count_whitespace="no")


def test_native_filter_interval_closure_and_reversed_range() -> None:
    op = OPS["text_length_filter"]
    assert [op(text_key="chosen", min_len=2, max_len=4).keep(t) for t in ("a", "ab", "abcd", "abcde")] == [
        False,
        True,
        True,
        False,
    ]
    opened = op(text_key="chosen", min_len=2, max_len=4, min_closed_interval=False, max_closed_interval=False)
    assert [opened.keep(t) for t in ("ab", "abc", "abcd")] == [False, True, False]
    # data-juicer 1.6.1 flips both closures before negating, so the bounds themselves are kept (its
    # docstring says "(-inf, min) or (max, +inf)"; the code keeps min and max, and so do we, for parity).
    outside = op(text_key="chosen", min_len=2, max_len=4, reversed_range=True)
    assert [outside.keep(t) for t in ("a", "ab", "abc", "abcd", "abcde")] == [True, True, False, True, True]


def test_native_mappers_and_deduplicator_by_hand() -> None:
    ws = OPS["whitespace_normalization_mapper"](text_key="chosen")
    assert ws.apply("  a\tb\u2003c\u200bd\ne  ") == "a b c d\ne"
    email = OPS["clean_email_mapper"](text_key="chosen", repl="<e>")
    assert email.apply("to a.b+c@ex-ample.org, B@X.COM") == "to <e>, B@X.COM"
    custom = OPS["clean_email_mapper"](text_key="chosen", pattern=r"r'\d+'", repl="#")
    assert custom.apply("a1b22") == "a#b#"
    links = OPS["clean_links_mapper"](text_key="chosen")
    assert links.apply("see https://x.org/a_(b) and www.y.com, ok") == "see  and , ok"
    dedup = OPS["document_deduplicator"](text_key="chosen", lowercase=True, ignore_non_character=True)
    assert dedup.digest("Hello, World 42!") == dedup.digest("hello world")
    exact = OPS["document_deduplicator"](text_key="chosen")
    assert exact.digest(" same ") == exact.digest("same") != exact.digest("Same")


# --------------------------------------------------------------------------- recipe checks


@pytest.mark.parametrize(
    ("recipe", "fragment"),
    [
        ({"text_key": "chosen", "process": [{"text_length_filter": {}}]}, "top-level `text_key`"),
        ({"process": [{"text_length_filter": {"text_keys": "chosen"}}]}, "takes `text_key` (singular)"),
        ({"process": [{"text_length_filter": {"text_key": "chosen_messages"}}]}, "list of chat messages"),
        ({"text_keys": ["rejected_messages"], "process": [{"text_length_filter": {}}]}, "Use 'rejected'"),
        ({"process": [{"text_length_filter": {"text_key": ["chosen", "rejected"]}}]}, "Repeat the op"),
        ({"process": [{"text_length_filter": {"text_key": "text"}}]}, "records do not have"),
        ({"process": [{"text_length_filter": {}}]}, "no `text_key`"),
        ({"process": [{"text_lenght_filter": {"text_key": "chosen"}}]}, "unknown op 'text_lenght_filter'"),
        ({"process": [{"text_length_filter": {"text_key": "chosen", "min_length": 3}}]}, "unknown argument"),
        ({"process": [{"words_num_filter": {"text_key": "chosen", "tokenization": True}}]}, "tokenization: false"),
        (
            {"process": [{"special_characters_filter": {"text_key": "chosen", "min_ratio": 0.6, "max_ratio": 0.4}}]},
            "every record would be dropped",
        ),
        ({"process": [{"special_characters_filter": {"text_key": "chosen", "max_ratio": "0.4"}}]}, "must be a number"),
        (
            {"skip_op_error": True, "process": [{"text_length_filter": {"text_key": "chosen"}}]},
            "skip_op_error must be false",
        ),
        ({"process": [{"clean_links_mapper": {"text_key": "pair"}}]}, "cannot rewrite the derived 'pair'"),
        (
            {"process": [{"clean_email_mapper": {"text_key": "chosen", "pattern": "("}}]},
            "not a valid regular expression",
        ),
        ({"process": []}, "non-empty list"),
        ({"process": [{"a": {}, "b": {}}]}, "one-key mapping"),
    ],
)
def test_recipe_mistakes_fail_with_the_fix(recipe: dict[str, Any], fragment: str) -> None:
    with pytest.raises(RecipeError, match=_escape(fragment)):
        DJNormalizer(recipe=recipe)


def _escape(fragment: str) -> str:
    import re

    return re.escape(fragment)


def test_recipe_from_yaml_file_and_constructor_arguments(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text("text_keys: rejected\nprocess:\n  - text_length_filter:\n      min_len: 3\n", encoding="utf-8")
    (step,) = load_recipe(path).steps
    assert (step.text_key, step.label) == ("rejected", "text_length_filter(rejected)")
    (tmp_path / "bad.yaml").write_text("- just a list\n", encoding="utf-8")
    with pytest.raises(RecipeError, match="YAML mapping"):
        DJNormalizer(recipe=tmp_path / "bad.yaml")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        DJNormalizer(recipe=tmp_path / "missing.yaml")
    with pytest.raises(ValueError, match="backend must be one of"):
        DJNormalizer(backend="ray")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="skip_dj must be a bool"):
        DJNormalizer(skip_dj="yes")  # type: ignore[arg-type]


def test_default_recipe_follows_both_rules() -> None:
    header = DEFAULT_RECIPE_PATH.read_text(encoding="utf-8")
    assert "text_keys" in header
    assert "text_key" in header
    assert "_messages" in header
    recipe = load_recipe(None)
    assert recipe.settings["skip_op_error"] is False
    assert recipe.settings["text_keys"] == "chosen"
    for name in ("text_length_filter", "words_num_filter", "special_characters_filter"):
        assert {s.text_key for s in recipe.steps if s.name == name} == {"chosen", "rejected"}


# --------------------------------------------------------------------------- behaviour


def test_native_filters_each_field_on_its_own_statistic() -> None:
    """The data-juicer 1.6.1 stale-stats case: the rejected-side copy of a filter must still filter."""
    recipe = {
        "text_keys": "chosen",
        "process": [
            {"special_characters_filter": {"text_key": "chosen", "max_ratio": 0.4}},
            {"special_characters_filter": {"text_key": "rejected", "max_ratio": 0.4}},
        ],
    }
    records = [_pair(GOOD, GOOD), _pair(GOOD, JUNK), _pair(JUNK, GOOD)]
    normalizer = DJNormalizer(recipe=recipe)
    assert list(normalizer.normalize(records)) == records[:1]
    assert normalizer.stats.dropped_per_op == {
        "special_characters_filter(chosen)": 1,
        "special_characters_filter(rejected)": 1,
    }


def test_pair_dedup_drops_exact_pairs_only_and_follows_mappers() -> None:
    a, b = _pair(GOOD, "No, I refuse to look."), _pair(GOOD, "No, I refuse to look.", prompt="another prompt")
    spaced = _pair(GOOD + "\t", "No, I refuse to look.")
    recipe = {
        "process": [
            {"whitespace_normalization_mapper": {"text_key": "chosen"}},
            {"document_deduplicator": {"text_key": "pair"}},
        ]
    }
    normalizer = DJNormalizer(recipe=recipe)
    out = list(normalizer.normalize([a, b, a, spaced]))
    assert [r["prompt"] for r in out] == [a["prompt"], b["prompt"]]  # the copy of a and its tab variant go
    assert normalizer.stats.dropped_per_op == {
        "whitespace_normalization_mapper(chosen)": 0,
        "document_deduplicator(pair)": 2,
    }


def test_normalize_streams_lazily() -> None:
    """Records are pulled one at a time: the first outputs arrive from an endless input."""
    endless = (r for r in itertools.chain.from_iterable(synthetic_dj_records(50, seed=s) for s in itertools.count()))
    first = list(itertools.islice(DJNormalizer().normalize(endless), 5))
    assert len(first) == 5


def test_normalize_memory_is_flat_in_input_size() -> None:
    """Peak traced memory while streaming 8x more records stays the same (no deduplicator: no digest set)."""
    recipe = dict(load_recipe(None).settings)
    recipe["process"] = [{s.name: dict(s.args)} for s in load_recipe(None).steps if s.name != "document_deduplicator"]
    base = list(synthetic_dj_records(200, seed=5))

    def peak(n: int) -> int:
        normalizer = DJNormalizer(recipe=recipe)
        tracemalloc.start()
        for _ in normalizer.normalize(base[i % len(base)] for i in range(n)):
            pass
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return top

    small, large = peak(1000), peak(8000)
    assert large < small * 1.2 + 16_384, (small, large)


def test_normalize_jsonl_summary_counts_each_op(tmp_path: Path) -> None:
    records = [_pair(GOOD, GOOD), _pair(GOOD, JUNK), _pair("short", GOOD), _pair(GOOD, GOOD)]
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"chosen": "x"}\n', encoding="utf-8")
    ticks: list[int] = []
    summary = normalize_jsonl(src, tmp_path / "o.jsonl", progress=ticks.append)
    assert isinstance(summary, NormalizeSummary)
    assert (summary.read, summary.kept, len(ticks)) == (5, 1, 5)
    dropped = {k: v for k, v in summary.dropped_per_op.items() if v}
    assert dropped == {
        "text_length_filter(chosen)": 1,
        "words_num_filter(rejected)": 1,  # JUNK has no word left once special characters are stripped
        "document_deduplicator(pair)": 1,
    }
    assert summary.malformed[0][0] == 5
    assert "lacks" in summary.malformed[0][1]
    text = summary.format()
    assert text.startswith("read 5, kept 1, dropped 3")
    assert "document_deduplicator(pair): 1" in text


def test_normalize_rejects_non_records_with_their_index() -> None:
    with pytest.raises(RecordError, match=r"record 1: .*lacks"):
        list(DJNormalizer().normalize([_pair(GOOD, GOOD), {"chosen": GOOD}]))


def _records_stream(n: int) -> Iterator[dict[str, Any]]:
    yield from synthetic_dj_records(n, seed=1)


def test_default_recipe_on_synthetic_corpus_keeps_good_and_drops_junk() -> None:
    normalizer = DJNormalizer()
    kept = list(normalizer.normalize(_records_stream(2000)))
    stats = normalizer.stats
    assert stats.read == 2000
    assert stats.kept == len(kept)
    assert 0 < len(kept) < 2000
    assert sum(stats.dropped_per_op.values()) == 2000 - len(kept)
    special = OPS["special_characters_filter"](text_key="chosen", count_whitespace=False)  # the recipe's statistic
    assert all(special.stat(r[side]) <= 0.5 for r in kept for side in ("chosen", "rejected"))
    assert all(len(r["chosen"]) >= 10 and len(r["rejected"]) >= 10 for r in kept)
    assert stats.dropped_per_op["document_deduplicator(pair)"] > 0
