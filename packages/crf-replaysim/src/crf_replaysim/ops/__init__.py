"""Native (pure-Python, no data-juicer, no Ray) implementations of data-juicer 1.6.1 text ops.

Each op lives in its own module under the data-juicer name; :data:`NATIVE_OPS` maps that name to the class.
"""

from __future__ import annotations

from crf_replaysim.ops._base import NativeDeduplicator, NativeFilter, NativeMapper, NativeOp, RecipeError
from crf_replaysim.ops.alphanumeric_filter import AlphanumericFilter
from crf_replaysim.ops.character_repetition_filter import CharacterRepetitionFilter
from crf_replaysim.ops.clean_email_mapper import CleanEmailMapper
from crf_replaysim.ops.clean_links_mapper import CleanLinksMapper
from crf_replaysim.ops.document_deduplicator import DocumentDeduplicator
from crf_replaysim.ops.special_characters_filter import SpecialCharactersFilter
from crf_replaysim.ops.text_length_filter import TextLengthFilter
from crf_replaysim.ops.whitespace_normalization_mapper import WhitespaceNormalizationMapper
from crf_replaysim.ops.word_repetition_filter import WordRepetitionFilter
from crf_replaysim.ops.words_num_filter import WordsNumFilter

NATIVE_OPS: dict[str, type[NativeOp]] = {
    cls.name: cls
    for cls in (
        TextLengthFilter,
        WordsNumFilter,
        SpecialCharactersFilter,
        AlphanumericFilter,
        CharacterRepetitionFilter,
        WordRepetitionFilter,
        DocumentDeduplicator,
        WhitespaceNormalizationMapper,
        CleanEmailMapper,
        CleanLinksMapper,
    )
}

__all__ = [
    "NATIVE_OPS",
    "AlphanumericFilter",
    "CharacterRepetitionFilter",
    "CleanEmailMapper",
    "CleanLinksMapper",
    "DocumentDeduplicator",
    "NativeDeduplicator",
    "NativeFilter",
    "NativeMapper",
    "NativeOp",
    "RecipeError",
    "SpecialCharactersFilter",
    "TextLengthFilter",
    "WhitespaceNormalizationMapper",
    "WordRepetitionFilter",
    "WordsNumFilter",
]
