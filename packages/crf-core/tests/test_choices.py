"""One ``Literal`` per concept: every choice tuple is derived from its ``Literal`` with ``typing.get_args``, and
``ComposerConfig``'s choice fields are typed with them (so mypy and ``HfArgumentParser`` see the choices)."""

from __future__ import annotations

import typing
from typing import Any

import pytest

from crf_core.channels import CHUNK_MODES, DPO_VARIANTS, SDPO_WRAPPERS, ChunkMode, DPOVariant, SDPOWrapper
from crf_core.rewards.asserts import UNSPLITTABLE, Unsplittable
from crf_distill import DPO_LOSS_TYPES
from crf_distill.dpo import DPOLossType
from crf_distill.entropy_opd import ENTROPY_GATES, EntropyGate


@pytest.mark.parametrize(
    ("choices", "literal"),
    [
        (DPO_LOSS_TYPES, DPOLossType),
        (DPO_VARIANTS, DPOVariant),
        (CHUNK_MODES, ChunkMode),
        (ENTROPY_GATES, EntropyGate),
        (UNSPLITTABLE, Unsplittable),
    ],
)
def test_choice_tuples_are_their_literals(choices: tuple[str, ...], literal: Any) -> None:
    assert choices == typing.get_args(literal)


def test_dpo_variants_are_the_loss_types_plus_simpo() -> None:
    assert (*DPO_LOSS_TYPES, "simpo") == DPO_VARIANTS
    assert (None, *typing.get_args(SDPOWrapper)) == SDPO_WRAPPERS


def test_composer_config_choice_fields_are_typed_with_the_literals() -> None:
    pytest.importorskip("trl")
    from transformers import HfArgumentParser

    from crf_core.trainer import ComposerConfig
    from crf_core.trainer.config import TRACE_REPLAY_REFERENCES, TraceReplayReference
    from crf_core.trainer.reprompt import REPROMPT_TRUNCATIONS, RepromptTruncation
    from crf_core.trainer.teacher import SDPO_TEACHERS, SDPOTeacher

    hints = typing.get_type_hints(ComposerConfig)
    assert hints["sdpo_wrapper"] == SDPOWrapper | None
    assert hints["entropy_opd_gate"] == EntropyGate
    assert hints["lm_head_chunking"] == ChunkMode
    assert hints["sdpo_teacher"] == SDPOTeacher
    assert hints["sdpo_reprompt_truncation"] == RepromptTruncation
    assert hints["trace_replay_reference"] == TraceReplayReference
    assert typing.get_args(TraceReplayReference) == TRACE_REPLAY_REFERENCES
    assert typing.get_args(RepromptTruncation) == REPROMPT_TRUNCATIONS
    assert typing.get_args(SDPOTeacher) == SDPO_TEACHERS
    actions = {a.dest: a for a in HfArgumentParser(ComposerConfig)._actions}
    assert tuple(actions["entropy_opd_gate"].choices) == ENTROPY_GATES
    assert tuple(actions["sdpo_teacher"].choices) == SDPO_TEACHERS
    with pytest.raises(SystemExit):
        HfArgumentParser(ComposerConfig).parse_args_into_dataclasses(["--output_dir", "x", "--sdpo_teacher", "old"])
