"""Native ops versus data-juicer 1.6.1 on the same input (skipped where data-juicer is not importable).

Op level: every statistic, rewrite and digest must be identical (``==``, not approximately) on a corpus with
duplicates, junk, unicode and edge lengths. Executor level: the data-juicer backend (the real
``DefaultExecutor``) keeps exactly the records the native backend keeps, for single-field recipes and for
two-field recipes, where plain data-juicer 1.6.1 reuses the first field's statistic.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crf_replaysim._synthetic import synthetic_dj_records
from crf_replaysim.normalize import DJNormalizer
from crf_replaysim.ops import NATIVE_OPS
from crf_replaysim.ops._text import SPECIAL_CHARACTERS

OPS: dict[str, Any] = dict(NATIVE_OPS)  # name -> op class, typed loosely for per-op keyword arguments
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        importlib.util.find_spec("data_juicer") is None,
        reason="data-juicer is not importable (run the nox `dj` session)",
    ),
]

EDGE_TEXTS = [
    "",
    " ",
    "\t\n\r\x0b\x0c",
    "a",
    "x" * 9,
    "x" * 10,
    "x" * 11,
    "ab!!",
    "a\x1cb\x1dc\x1e\x1fd",  # str.isspace() but not data-juicer whitespace
    "K\u212a \u017ftra\u00df",  # Kelvin sign, long s, sharp s
    "e\u0301\u0308 n\u0303",  # combining marks
    "\u00a0\u2000\u200a\u200b\u2060\u3000\ufffc\u0084 mixed",
    "ΑΣ ΣΑΣ σς",
    "İI ıi",
    "😀😀😀 🇫🇷 👩‍💻 #️⃣ ©®",
    "word " * 40,
    "the cat sat on the mat " * 12,
    "abcabcabcabcabcabcabcabcabcabc",
    "Contact: a.b+c@ex-ample.org or A@B.CO or x@y.z1",
    "(https://en.wikipedia.org/wiki/Foo_(bar)) www2.site.com/a?b=c ftp://h/x mailto:joe@x.org example.com/path.",
    "def f(x):\n\treturn x  # tab\n",
    "1234567890 0987654321",
    "日本語のテキスト、句読点。",
]


@pytest.fixture(scope="module")
def texts() -> list[str]:
    records = list(synthetic_dj_records(300, seed=7))
    return EDGE_TEXTS + [r[key] for r in records for key in ("prompt", "chosen", "rejected")]


def _dj_op(name: str, **args: Any) -> Any:
    from data_juicer.ops import load_ops

    (op,) = load_ops([{name: {"text_key": "text", "skip_op_error": False, **args}}])
    return op


FILTER_CONFIGS = [
    ("text_length_filter", {}),
    ("words_num_filter", {}),
    ("special_characters_filter", {}),
    ("alphanumeric_filter", {}),
    ("character_repetition_filter", {}),
    ("character_repetition_filter", {"rep_len": 3}),
    ("word_repetition_filter", {}),
    ("word_repetition_filter", {"rep_len": 2}),
]


def test_special_characters_match_data_juicer() -> None:
    from data_juicer.ops.common.special_characters import SPECIAL_CHARACTERS as DJ_SPECIAL
    from data_juicer.ops.common.special_characters import VARIOUS_WHITESPACES

    assert {c for c in DJ_SPECIAL if len(c) == 1} == SPECIAL_CHARACTERS
    ws = OPS["whitespace_normalization_mapper"](text_key="text")
    assert {c for c in map(chr, range(0x10000)) if ws.apply("a" + c + "a") == "a a"} == VARIOUS_WHITESPACES


@pytest.mark.parametrize(("name", "args"), FILTER_CONFIGS, ids=[f"{n}-{a}" for n, a in FILTER_CONFIGS])
def test_filter_statistics_equal_data_juicer(name: str, args: dict[str, Any], texts: list[str]) -> None:
    dj = _dj_op(name, **args)
    native = OPS[name](text_key="text", **args)
    samples = dj.compute_stats_batched({"text": list(texts), "__dj__stats__": [{} for _ in texts]})
    theirs = [stat[native.stat_name] for stat in samples["__dj__stats__"]]
    ours = [native.stat(t) for t in texts]
    mismatches = [(t, a, b) for t, a, b in zip(texts, ours, theirs, strict=True) if a != b]
    assert not mismatches, mismatches[:3]
    keep_theirs = list(dj.process_batched(samples))
    assert [native.keep_value(v) for v in ours] == keep_theirs


@pytest.mark.parametrize(
    ("name", "args"),
    [
        ("whitespace_normalization_mapper", {}),
        ("clean_email_mapper", {}),
        ("clean_email_mapper", {"pattern": r"r'[a-z]+@'", "repl": "<at>"}),
        ("clean_links_mapper", {}),
        ("clean_links_mapper", {"repl": "<url>"}),
    ],
)
def test_mapper_output_equals_data_juicer(name: str, args: dict[str, Any], texts: list[str]) -> None:
    theirs = _dj_op(name, **args).process_batched({"text": list(texts)})["text"]
    native = OPS[name](text_key="text", **args)
    assert [native.apply(t) for t in texts] == list(theirs)


@pytest.mark.parametrize(
    "args", [{}, {"lowercase": True}, {"ignore_non_character": True}, {"lowercase": True, "ignore_non_character": True}]
)
def test_dedup_digest_equals_data_juicer(args: dict[str, Any], texts: list[str]) -> None:
    dj = _dj_op("document_deduplicator", **args)
    native = OPS["document_deduplicator"](text_key="text", **args)
    theirs = [dj.compute_hash({"text": t})["__dj__hash"] for t in texts]
    assert [native.digest(t).hex() for t in texts] == theirs


_PIECES = st.sampled_from(
    [
        *" \t\n\r\x0b\x0c\x1c\x85\xa0\u2003\u200b\u3000\ufffc.,;:!?'\"()[]{}<>@/\\-_#%&*+=|~`^$",
        *("😀", "👩\u200d💻", "©", "…", "—", "«", "»", "é", "e\u0301", "ß", "İ", "Σ", "ς", "日本", "ﬁ", "K", "Ⅻ", "٣"),
        *("www.", "http://", "https://a.b/", ".com/", "@", "x@y.org", "a.b@c.de", "(", ")"),
    ]
)
_TEXT = st.lists(
    st.one_of(_PIECES, st.text(max_size=6), st.sampled_from(["the", "cat", "THE", "Cat", "sat"])), max_size=40
).map("".join)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(texts=st.lists(_TEXT, min_size=1, max_size=8))
def test_random_text_ops_equal_data_juicer(texts: list[str]) -> None:
    """Property: on arbitrary text, every native statistic, rewrite and digest equals data-juicer's."""
    for name, args in [
        *FILTER_CONFIGS,
        ("word_repetition_filter", {"rep_len": 1}),
        ("character_repetition_filter", {"rep_len": 1}),
    ]:
        samples = _cached_dj_op(name, args).compute_stats_batched(
            {"text": list(texts), "__dj__stats__": [{} for _ in texts]}
        )
        native = OPS[name](text_key="text", **args)
        assert [native.stat(t) for t in texts] == [s[native.stat_name] for s in samples["__dj__stats__"]], name
    for name in ("whitespace_normalization_mapper", "clean_email_mapper", "clean_links_mapper"):
        theirs = _cached_dj_op(name, {}).process_batched({"text": list(texts)})["text"]
        assert [OPS[name](text_key="text").apply(t) for t in texts] == list(theirs), name
    dedup = OPS["document_deduplicator"](text_key="text", lowercase=True, ignore_non_character=True)
    theirs_hash = [
        _cached_dj_op("document_deduplicator", {"lowercase": True, "ignore_non_character": True}).compute_hash(
            {"text": t}
        )["__dj__hash"]
        for t in texts
    ]
    assert [dedup.digest(t).hex() for t in texts] == theirs_hash


_DJ_OPS: dict[str, Any] = {}


def _cached_dj_op(name: str, args: dict[str, Any]) -> Any:
    key = json.dumps([name, args], sort_keys=True)
    if key not in _DJ_OPS:
        _DJ_OPS[key] = _dj_op(name, **args)
    return _DJ_OPS[key]


# --------------------------------------------------------------------------- executor level


def test_data_juicer_runtime_installs_are_refused() -> None:
    """Inside the backend, data-juicer's LazyLoader raises (naming the package) instead of pip-installing it."""
    from data_juicer.utils import lazy_loader

    from crf_replaysim._dj_executor import _no_runtime_installs

    original = lazy_loader.LazyLoader.__dict__["_install_package"]
    missing = lazy_loader.LazyLoader("crf_replaysim_no_such_module", package_name="crf-replaysim-no-such-package")
    with _no_runtime_installs(lazy_loader), pytest.raises(ImportError, match="Pre-install it"):
        missing.anything  # noqa: B018
    assert lazy_loader.LazyLoader.__dict__["_install_package"] is original


def test_data_juicer_backend_rejects_unknown_and_non_text_ops() -> None:
    from crf_replaysim.ops import RecipeError

    record = next(synthetic_dj_records(1))
    typo = DJNormalizer(recipe={"process": [{"text_lenght_filter": {"text_key": "chosen"}}]}, backend="data-juicer")
    with pytest.raises(RecipeError, match="no op of that name"):
        list(typo.normalize([record]))
    with pytest.raises(RecipeError, match="mapper 'whitespace_normalization_mapper' cannot rewrite"):
        DJNormalizer(
            recipe={"process": [{"whitespace_normalization_mapper": {"text_key": "pair"}}]}, backend="data-juicer"
        )


def _both_backends(recipe: dict[str, Any], records: list[dict[str, Any]]) -> tuple[list[Any], list[Any]]:
    native = list(DJNormalizer(recipe=recipe).normalize(records))
    dj = list(DJNormalizer(recipe=recipe, backend="data-juicer").normalize(records))
    return native, dj


@pytest.mark.slow
def test_single_field_recipe_same_kept_records(tmp_path: Path) -> None:
    """Every native op on `chosen` in one data-juicer pass: identical output records, in order."""
    records = list(synthetic_dj_records(300, seed=21))
    recipe = {
        "text_keys": "chosen",
        "process": [
            {"clean_email_mapper": {}},
            {"clean_links_mapper": {"repl": "<url>"}},
            {"whitespace_normalization_mapper": {}},
            {"text_length_filter": {"min_len": 10, "max_len": 400}},
            {"words_num_filter": {"min_num": 3}},
            {"special_characters_filter": {"max_ratio": 0.4}},
            {"alphanumeric_filter": {"min_ratio": 0.3}},
            {"character_repetition_filter": {"max_ratio": 0.3}},
            {"word_repetition_filter": {"rep_len": 3, "max_ratio": 0.4}},
            {"document_deduplicator": {"lowercase": True}},
        ],
    }
    native, dj = _both_backends(recipe, records)
    assert 0 < len(native) < len(records)
    assert dj == native


@pytest.mark.slow
def test_two_field_recipe_with_mappers_same_kept_records() -> None:
    """Mappers on all three fields, filters on both sides, pair dedup: several passes, identical output."""
    records = list(synthetic_dj_records(300, seed=22))
    recipe = {
        "text_keys": "chosen",
        "process": [
            {"special_characters_filter": {"text_key": "chosen", "max_ratio": 0.45}},
            {"clean_email_mapper": {"text_key": "prompt", "repl": "<email>"}},
            {"clean_email_mapper": {"text_key": "chosen", "repl": "<email>"}},
            {"clean_links_mapper": {"text_key": "rejected"}},
            {"special_characters_filter": {"text_key": "chosen", "max_ratio": 0.45}},  # stale after the mapper
            {"special_characters_filter": {"text_key": "rejected", "max_ratio": 0.45}},
            {"words_num_filter": {"text_key": "rejected", "min_num": 2}},
            {"document_deduplicator": {"text_key": "pair"}},
            {"document_deduplicator": {"text_key": "chosen"}},
        ],
    }
    native, dj = _both_backends(recipe, records)
    assert 0 < len(native) < len(records)
    assert any("<email>" in json.dumps(r["prompt_messages"]) for r in native)
    assert dj == native


@pytest.mark.slow
def test_same_filter_on_two_fields_plain_data_juicer_misses_rejected_both_backends_drop() -> None:
    """data-juicer 1.6.1 reuses `special_char_ratio` of `chosen` for the `rejected` copy; our backends do not."""
    from data_juicer.config import get_init_configs
    from data_juicer.core import DefaultExecutor

    special = OPS["special_characters_filter"](text_key="x")
    records = list(synthetic_dj_records(400, seed=23))
    recipe = {
        "text_keys": "chosen",
        "process": [
            {"special_characters_filter": {"text_key": "chosen", "max_ratio": 0.4}},
            {"special_characters_filter": {"text_key": "rejected", "max_ratio": 0.4}},
        ],
    }
    over = {r["trace_id"] for r in records if special.stat(r["rejected"]) > 0.4}
    native, dj = _both_backends(recipe, records)
    assert dj == native
    assert over
    assert not over & {r["trace_id"] for r in native}

    # Plain data-juicer, one executor pass over the same recipe: the rejected-side filter does nothing.
    import tempfile

    with tempfile.TemporaryDirectory() as work:
        data = Path(work) / "in.jsonl"
        data.write_text(
            "".join(json.dumps({k: r[k] for k in ("trace_id", "chosen", "rejected")}) + "\n" for r in records)
        )
        cfg = get_init_configs(
            {
                **recipe,
                "project_name": "plain",
                "dataset_path": str(data),
                "export_path": str(Path(work) / "out" / "o.jsonl"),
                "work_dir": str(Path(work) / "out"),
                "np": 1,
                "use_cache": False,
                "open_monitor": False,
                "skip_op_error": False,
            }
        )
        plain = DefaultExecutor(cfg).run(skip_export=True).to_list()
    leaked = {r["trace_id"] for r in plain} & over
    assert leaked, "data-juicer no longer reuses the first field's stats: the pass split may be unnecessary"
    assert {r["trace_id"] for r in plain} - leaked == {r["trace_id"] for r in native}
