"""The policy's LM head, scored token by token: decoder states once, then the head chunked or materialised.

``LMHead`` splits a Hugging Face causal LM into its decoder (``get_decoder()``) and its linear ``lm_head``
(``get_output_embeddings()``), so a training step can run the decoder once and push the hidden states through
the head in chunks of rows (``crf_distill.head_scores``): no ``(B, T, V)`` logits tensor ever exists. Models
whose head cannot be separated (no linear ``lm_head``, logit soft-capping or scaling, a PEFT adapter on the
head) are scored from their full logits instead, and ``LMHead.reason`` says why.

When to chunk is a :class:`ChunkPlan`: ``auto`` (the default) chunks whenever the logits of the scored rows
would take more than ``auto_threshold_mb`` (64 MiB) in float32, e.g. 512 tokens at a 32k vocabulary or 110
tokens at Qwen's 151,936; below that the materialised path is faster (no recompute in the backward) and its
memory is small beside the optimizer state. Chunks hold ``chunk_budget_mb`` (8 MiB) of logits each (13 rows
at 151,936) unless ``chunk_size`` fixes the rows.

Mixed precision is a :class:`HeadPrecision`: every pass (decoder, head, teacher projections) runs inside its
``autocast`` (the accelerator's, as TRL 1.16's ``_get_per_token_logps_and_entropies`` does), so under bf16 the
decoder runs in autocast and the head product in bf16 with a float32 log-softmax; ``head_dtype=torch.float32`` is
TRL's ``cast_lm_head_to_fp32`` (the product in float32, autocast off). The numerics are those of
``crf_distill.precision``; without autocast (``bf16=False``) nothing changes.

Sharded models (FSDP2, ``torch.distributed.fsdp.fully_shard`` as accelerate applies it): the head reads
``lm_head.weight`` directly, which FSDP2 holds as a sharded ``DTensor`` outside the model's forward. So
:meth:`LMHead.run` runs the decoder *and* the scoring inside the root module's forward (its hooks gather every
unit's parameters, the head's included, as TRL 1.16's fused head does): the scores are the forward's outputs, so
FSDP2's pre-backward hooks re-gather the head before the chunked backward recomputes with it, and its gradient
lands on the gathered parameter that FSDP2 reduce-scatters. Outside a forward, a still-sharded head is gathered
once per :class:`LMHead` (``full_tensor``) for no-grad use (a sharded teacher's projections); with grad that is an
error, since the gradient would bypass FSDP2's reduction.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, get_args

import torch

from crf_core._checks import is_int, is_number
from crf_distill import (
    HeadScores,
    RowSource,
    RowTerm,
    chunked_weighted_sums,
    head_logits,
    head_logits_at,
    head_scores,
    logit_scores,
)

__all__ = [
    "CHUNK_MODES",
    "ChunkMode",
    "ChunkPlan",
    "HeadPrecision",
    "HeadStates",
    "LMHead",
    "RowLogits",
    "RowSource",
    "hidden_source",
    "logits_source",
    "mean_weights",
    "token_mean",
]

MIB = 1 << 20
ChunkMode = Literal["auto", "on", "off"]
CHUNK_MODES: tuple[ChunkMode, ...] = get_args(ChunkMode)
T = TypeVar("T")


@dataclass(frozen=True)
class ChunkPlan:
    """When and how finely the LM head runs in chunks (see the module docstring).

    Attributes:
        mode: ``"auto"``, ``"on"`` (always chunk) or ``"off"`` (always materialise the logits).
        chunk_size: rows per chunk; ``None`` sizes chunks to ``chunk_budget_mb`` of float32 logits.
        chunk_budget_mb: logits per chunk, in MiB, when ``chunk_size`` is None.
        auto_threshold_mb: in ``auto`` mode, chunk when the full logits would exceed this many MiB.
    """

    mode: ChunkMode = "auto"
    chunk_size: int | None = None
    chunk_budget_mb: float = 8.0
    auto_threshold_mb: float = 64.0

    def __post_init__(self) -> None:
        if self.mode not in CHUNK_MODES:
            raise ValueError(f"chunking mode must be 'auto', 'on' or 'off', got {self.mode!r}")
        size = self.chunk_size
        if size is not None and (not is_int(size) or size <= 0):
            raise ValueError(f"chunk_size must be a positive int (rows per chunk) or None, got {size!r}")
        for name in ("chunk_budget_mb", "auto_threshold_mb"):
            value = getattr(self, name)
            if not is_number(value) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")

    def rows(self, n_rows: int, vocab: int) -> int | None:
        """Rows per chunk for scoring ``n_rows`` rows over ``vocab`` tokens; ``None`` materialises."""
        if self.mode == "off" or (self.mode == "auto" and n_rows * vocab * 4 <= self.auto_threshold_mb * MIB):
            return None
        if self.chunk_size is not None:
            return self.chunk_size
        return max(1, int(self.chunk_budget_mb * MIB) // (vocab * 4))


@dataclass(frozen=True)
class HeadPrecision:
    """The precision regime of a head's passes (see the module docstring).

    Attributes:
        autocast: a factory of the context entered around every pass, e.g. ``accelerator.autocast`` (TRL's);
            ``nullcontext`` (the default) runs in the model's own dtype.
        head_dtype: the dtype of the LM-head product; ``None`` follows autocast and the weight, ``torch.float32``
            is TRL's ``cast_lm_head_to_fp32``.
    """

    autocast: Callable[[], AbstractContextManager[Any]] = nullcontext
    head_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if not callable(self.autocast):
            raise TypeError(
                f"autocast must be a callable returning a context manager (e.g. accelerator.autocast), "
                f"got {type(self.autocast).__name__}"
            )
        if self.head_dtype is not None and self.head_dtype != torch.float32:
            raise ValueError(
                f"head_dtype must be None (follow autocast) or torch.float32 (cast_lm_head_to_fp32), got "
                f"{self.head_dtype!r}"
            )


@dataclass(frozen=True)
class HeadStates:
    """What the model produced for ``(B, T)`` tokens: decoder hidden states, or full logits (``is_logits``)."""

    tensor: torch.Tensor
    is_logits: bool


def is_sharded(module: Any) -> bool:
    """Whether ``module`` is an FSDP2 unit (``fully_shard`` applied to it)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(module, FSDPModule)


def _is_dtensor(tensor: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(tensor, DTensor)


def _module_type(module: Any) -> type:
    """The module's own class: FSDP2 swaps in a subclass ``FSDP<Name>(FSDPModule, <Name>)``; this is ``<Name>``."""
    cls = type(module)
    if not is_sharded(module):
        return cls
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in cls.__mro__[1:] if not issubclass(c, FSDPModule))


def _separation(causal_lm: Any) -> tuple[Any, torch.nn.Linear | None, str | None]:
    """``(decoder, head, None)`` or ``(None, None, reason)`` for a causal LM."""
    get_head = getattr(causal_lm, "get_output_embeddings", None)
    get_decoder = getattr(causal_lm, "get_decoder", None)
    head = get_head() if callable(get_head) else None
    if not callable(get_decoder) or head is None:
        return None, None, "the model has no get_decoder()/get_output_embeddings() (not a Hugging Face causal LM)"
    if _module_type(head) is not torch.nn.Linear:
        kind = _module_type(head).__name__
        return None, None, f"its lm_head is a {kind}, not a plain nn.Linear (e.g. a PEFT adapter on it)"
    config: Any = getattr(causal_lm, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "final_logit_softcapping", None) is not None:
        return None, None, "it soft-caps its logits (final_logit_softcapping)"
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling"):
        if getattr(text, name, None) not in (None, 1, 1.0):
            return None, None, f"it scales its logits ({name}={getattr(text, name)})"
    return get_decoder(), head, None


class LMHead:
    """A causal LM seen as decoder + linear head, scored per token (see the module docstring).

    Args:
        model: what the training step calls: the model itself or a distributed wrapper of it (DDP), whose
            forward is then entered so its gradient hooks run.
        plan: the :class:`ChunkPlan`.
        unwrap: returns the model inside a wrapper (``accelerator.unwrap_model``); identity by default.
        temperature: logits are divided by it (TRL's sampling temperature).
        precision: the :class:`HeadPrecision` of every pass; none (the model's own dtype) by default.
    """

    def __init__(
        self,
        model: Any,
        plan: ChunkPlan | None = None,
        *,
        unwrap: Callable[[Any], Any] | None = None,
        temperature: float = 1.0,
        precision: HeadPrecision | None = None,
    ) -> None:
        if precision is not None and not isinstance(precision, HeadPrecision):
            raise TypeError(f"precision must be a HeadPrecision or None, got {type(precision).__name__}")
        if not is_number(temperature) or not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature!r}")
        self.model = model
        self.plan = plan or ChunkPlan()
        self.precision = precision or HeadPrecision()
        self.temperature = float(temperature)
        self.inner = unwrap(model) if unwrap is not None else model
        get_base = getattr(self.inner, "get_base_model", None)  # PEFT
        self.causal_lm = get_base() if callable(get_base) else self.inner
        self.decoder, self._head, self.reason = _separation(self.causal_lm)
        self.sharded = is_sharded(self.inner) or is_sharded(self.causal_lm)
        self._gathered: dict[str, torch.Tensor] = {}

    @property
    def separable(self) -> bool:
        """Whether the decoder and a plain linear head can be run apart (else full logits are used)."""
        return self._head is not None

    @property
    def weight(self) -> torch.Tensor:
        """The head's ``(V, H)`` weight: the parameter itself, or (sharded, outside a forward) its gathered copy."""
        assert self._head is not None, self.reason
        return self._unsharded("weight", self._head.weight)

    @property
    def bias(self) -> torch.Tensor | None:
        assert self._head is not None, self.reason
        bias = self._head.bias
        return None if bias is None else self._unsharded("bias", bias)

    def _unsharded(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``, or for a sharded ``DTensor`` its full value, gathered once (no grad; see the module docstring)."""
        if not _is_dtensor(tensor):
            return tensor
        if torch.is_grad_enabled() and tensor.requires_grad:
            raise RuntimeError(
                f"the LM head's {name} is still sharded (an FSDP2 DTensor) where the chunked head reads it with grad: "
                "score through LMHead.run, which runs inside the model's forward where FSDP2 gathers it; if the "
                "lm_head is an FSDP unit of its own, shard it together with the final norm "
                "(fully_shard([norm, lm_head]), as accelerate's FSDP2 preparation does) or with the root"
            )
        if name not in self._gathered:
            with torch.no_grad():
                self._gathered[name] = tensor.full_tensor()  # type: ignore[attr-defined]
        return self._gathered[name]

    def gather(self) -> None:
        """Gather a sharded head's weight and bias now (a collective: every rank must call it at the same point)."""
        if self.separable:
            _ = self.weight, self.bias

    def run(self, fn: Callable[[HeadStates], T], input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> T:
        """``fn(self.states(input_ids, attention_mask))``: score what the model produced for ``(B, T)`` tokens.

        For a sharded model ``fn`` runs inside the model's forward, after the decoder (see the module docstring);
        its result (tensors, or tuples/dicts/dataclasses of them) is the forward's output.
        """
        if not self.sharded:
            return fn(self.states(input_ids, attention_mask))

        def forward(ids: torch.Tensor, mask: torch.Tensor | None) -> T:
            with self.precision.autocast():
                if self.separable:
                    states = HeadStates(self._decoder_states(ids, mask), is_logits=False)
                else:
                    states = HeadStates(self._full_logits(ids, mask), is_logits=True)
            return fn(states)

        with _forward_replaced(self.inner, forward):
            out: T = self.model(input_ids, attention_mask)
        return out

    def states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> HeadStates:
        """Run the model on ``(B, T)`` tokens: decoder states if the head is separable, else full logits."""
        with self.precision.autocast():
            if self.separable:
                return HeadStates(self._call(self._decoder_states, input_ids, attention_mask), is_logits=False)
            return HeadStates(self._call(self._full_logits, input_ids, attention_mask), is_logits=True)

    def _decoder_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        out = self.decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        hidden = getattr(out, "last_hidden_state", None)
        return out[0] if hidden is None else hidden

    def _full_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        out = self.causal_lm(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        logits = getattr(out, "logits", None)
        if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
            raise TypeError(f"the model must return (B, T, V) logits, got {type(out).__name__}")
        return logits

    def _call(self, fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
        """``fn(*args)``, entered through the wrapper's forward when the model is wrapped (DDP) or sharded (FSDP2:
        the root's hooks gather the parameters)."""
        if self.model is self.inner and not self.sharded:
            return fn(*args)
        with _forward_replaced(self.inner, fn):
            out: torch.Tensor = self.model(*args)
        return out

    def score(
        self,
        rows: torch.Tensor,
        labels: torch.Tensor,
        *,
        is_logits: bool,
        terms: Sequence[RowTerm] = (),
        entropy: bool = False,
    ) -> HeadScores:
        """Label log-probs (and entropies, term values) of ``(N, X)`` row states predicting ``labels`` ``(N,)``."""
        if is_logits:
            z = rows if self.temperature == 1.0 else rows / self.temperature
            return logit_scores(z, labels, terms=terms, entropy=entropy)
        chunk = self.plan.rows(rows.shape[0], self.weight.shape[0])
        with self.precision.autocast():
            return head_scores(
                rows,
                self.weight,
                labels,
                bias=self.bias,
                terms=terms,
                entropy=entropy,
                temperature=self.temperature,
                chunk_size=chunk,
                precision=self.precision.head_dtype,
            )

    def weighted_sums(
        self,
        rows: torch.Tensor,
        *,
        is_logits: bool,
        terms: Sequence[RowTerm],
        weights: Sequence[torch.Tensor],
        scales: Sequence[float],
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``values[k] = Σ_r weights[k][r]·terms[k](row r)`` and ``total = Σ_k scales[k]·values[k]``.

        For losses that are a fixed weighted sum of per-row terms (``compose_loss``): chunked, the total's
        gradient is taken inside the forward (as many matmuls as unchunked autograd); every value keeps its own
        gradient either way.
        """
        chunk = None if is_logits else self.plan.rows(rows.shape[0], self.weight.shape[0])
        if chunk is not None:
            with self.precision.autocast():
                return chunked_weighted_sums(
                    rows,
                    self.weight,
                    terms,
                    weights,
                    scales,
                    bias=self.bias,
                    temperature=self.temperature,
                    chunk_size=chunk,
                    precision=self.precision.head_dtype,
                )
        labels = torch.zeros(rows.shape[0], dtype=torch.long, device=rows.device)
        scores = self.score(rows, labels, is_logits=is_logits, terms=terms)
        values = [(v * w.to(v.dtype)).sum() for v, w in zip(scores.values, weights, strict=True)]
        total = torch.stack([s * v for s, v in zip(scales, values, strict=True)]).sum()
        return total, values

    def project(self, rows: torch.Tensor) -> torch.Tensor:
        """No-grad ``(n, V)`` logits of ``(n, H)`` states (temperature applied), for teacher-like sources."""
        with torch.no_grad(), self.precision.autocast():
            return head_logits(rows, self.weight, self.bias, self.temperature, precision=self.precision.head_dtype)

    def project_at(self, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """:meth:`project` at ``ids`` ``(n, k)`` only: no-grad ``(n, k)`` logits, without the ``(n, V)`` product."""
        with torch.no_grad(), self.precision.autocast():
            return head_logits_at(
                rows, self.weight, ids, self.bias, self.temperature, precision=self.precision.head_dtype
            )


def mean_weights(mask: torch.Tensor) -> torch.Tensor:
    """``m / Σ m`` as float32 (float64 stays), 0 everywhere when ``Σ m = 0``: the weights of a token mean."""
    w = mask.to(torch.float64 if mask.dtype == torch.float64 else torch.float32)
    total = w.sum()
    return w / torch.where(total > 0, total, torch.ones_like(total))


def token_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``Σ_r m_r·v_r / Σ_r m_r`` (0 when the mask is empty)."""
    return (values * mean_weights(mask).to(values.dtype)).sum()


@contextmanager
def _forward_replaced(module: torch.nn.Module, fn: Callable[..., Any]) -> Iterator[None]:
    """Make ``module(...)`` run ``fn`` for the duration (an instance-level forward, restored afterwards)."""
    instance = module.__dict__
    had, previous = "forward" in instance, instance.get("forward")
    instance["forward"] = fn
    try:
        yield
    finally:
        if had:
            instance["forward"] = previous
        else:
            del instance["forward"]


class RowLogits:
    """A :data:`RowSource` over ``M`` fixed rows (no grad) that also gives full-vocabulary log-probs at a few ids.

    ``source(rows)`` is ``(n, V)`` logits ``z`` of the rows ``index(rows)``; ``source.logprobs_at(rows, ids)`` is
    ``z[ids] − logsumexp(z)`` ``(n, k)``, read without the ``(n, V)`` logits: ``logsumexp`` of every row is computed
    once (:meth:`log_normaliser`, chunked like the head) and the logits at ``ids`` directly. What a top-k divergence
    needs of its teacher.
    """

    def __init__(
        self, count: int, index: Callable[[torch.Tensor], torch.Tensor], chunk: int | None, device: torch.device
    ) -> None:
        self.count = count
        self.index = index
        self.device = device
        self._chunk = chunk or max(count, 1)
        self._lse: torch.Tensor | None = None

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        return self._logits(self.index(rows))

    def logprobs_at(self, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``(n, k)`` log-probs of the vocabulary ids ``ids`` ``(n, k)`` in the rows ``index(rows)``."""
        own = self.index(rows)
        return self._logits_at(own, ids) - self.log_normaliser()[own].unsqueeze(-1)

    def log_normaliser(self) -> torch.Tensor:
        """``logsumexp`` of the logits of each of the ``M`` rows ``(M,)``, computed on first use."""
        if self._lse is None:
            parts = [
                torch.logsumexp(
                    self._logits(torch.arange(i, min(i + self._chunk, self.count), device=self.device)), dim=-1
                )
                for i in range(0, self.count, self._chunk)
            ]
            self._lse = torch.cat(parts) if parts else torch.zeros(0, device=self.device)
        return self._lse

    def rows(self, index: torch.Tensor) -> RowLogits:
        """These logits seen from other rows: row ``i`` of the result is row ``index[i]`` ``(N',)`` of this source
        (the same ``M`` rows and log-normaliser, so :meth:`log_normaliser` is computed once for both)."""
        return _Reindexed(self, index)

    def _logits(self, own: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _logits_at(self, own: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class _Reindexed(RowLogits):
    """:meth:`RowLogits.rows`: ``base`` with its row index composed with ``index``."""

    def __init__(self, base: RowLogits, index: torch.Tensor) -> None:
        super().__init__(base.count, lambda rows: base.index(index[rows]), None, base.device)
        self.base = base

    def log_normaliser(self) -> torch.Tensor:
        return self.base.log_normaliser()

    def _logits(self, own: torch.Tensor) -> torch.Tensor:
        return self.base._logits(own)

    def _logits_at(self, own: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.base._logits_at(own, ids)


class _FixedLogits(RowLogits):
    """Rows of precomputed ``(M, V)`` logits, divided by ``scale``."""

    def __init__(self, logits: torch.Tensor, index: Callable[[torch.Tensor], torch.Tensor], scale: float) -> None:
        super().__init__(logits.shape[0], index, ChunkPlan().rows(logits.shape[0], logits.shape[-1]), logits.device)
        self.logits = logits.detach()
        self.scale = scale

    def _logits(self, own: torch.Tensor) -> torch.Tensor:
        rows = self.logits[own.to(self.logits.device)]
        return rows if self.scale == 1.0 else rows / self.scale

    def _logits_at(self, own: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        at = self.logits[own.to(self.logits.device).unsqueeze(-1), ids]
        return at if self.scale == 1.0 else at / self.scale


class _ProjectedRows(RowLogits):
    """Rows of ``(M, H)`` decoder states, projected through a head on demand."""

    def __init__(self, head: LMHead, hidden: torch.Tensor, index: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__(hidden.shape[0], index, head.plan.rows(hidden.shape[0], head.weight.shape[0]), hidden.device)
        self.head = head
        self.hidden = hidden.detach()

    def _logits(self, own: torch.Tensor) -> torch.Tensor:
        return self.head.project(self.hidden[own])

    def _logits_at(self, own: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.head.project_at(self.hidden[own], ids)


def logits_source(logits: torch.Tensor, index: Callable[[torch.Tensor], torch.Tensor]) -> RowLogits:
    """A :class:`RowLogits` over precomputed ``(M, V)`` logits; ``index`` maps scored rows to their rows."""
    return _FixedLogits(logits, index, 1.0)


def hidden_source(head: LMHead, hidden: torch.Tensor, index: Callable[[torch.Tensor], torch.Tensor]) -> RowLogits:
    """A :class:`RowLogits` projecting ``(M, H)`` states (or ``(M, V)`` logits of a non-separable model) on demand."""
    if not head.separable:
        return _FixedLogits(hidden, index, head.temperature)
    return _ProjectedRows(head, hidden, index)
