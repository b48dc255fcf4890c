"""The sub-int8 wire codecs (``int4``, ``topk``) and their error feedback: round trips against float64 references,
bit stability, residual conservation, allreduce over a local folder, adversarial payloads, checkpoints, bytes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import crf_diloco.allreduce as allreduce_module
from crf_diloco import ObjectStoreAllReduce
from crf_diloco.auth import Authenticator
from crf_diloco.checkpoint import dumps_state, loads_state
from crf_diloco.errors import CorruptObjectError, RoundAbortedError
from crf_diloco.payload import codec_of
from crf_diloco.store import ObjectStore
from crf_diloco.wire import (
    TOPK_BLOCK,
    TOPK_K,
    Scratch,
    ShardPlan,
    _encode_units,
    encode_object,
    encode_payload,
    feedback_roundtrip,
    parse_codec,
    read_header,
    read_payload_shard,
    wire_roundtrip,
)

RunReplicas = Callable[..., list[Any]]
AUTH = Authenticator("codec-secret-0123456789abcdefghij", "run")
SECRET = "0123456789abcdef" * 4
SMALL_TOPK = "topk:8/256"
WORLD = 3
N = 1000  # three whole blocks of 256 and a partial one: padding is exercised


def _nonzero(n: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    """Random fp32 values, none of them zero (so top-k never chooses between zeros)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * scale
    return torch.where(x == 0, torch.full_like(x, 1e-3), x)


# -- float64 references (numpy; independent of the codec implementation) --------------------------------------
def _ref_blocks(x: np.ndarray, block: int) -> np.ndarray:
    rows = -(-x.size // block)
    padded = np.zeros(rows * block, dtype=np.float64)
    padded[: x.size] = x
    return padded.reshape(rows, block)


def _int4_bound(x: np.ndarray, block: int) -> np.ndarray:
    """Per element: half a quantisation step, s/2 with s = block absmax / 7."""
    s = np.abs(_ref_blocks(x, block)).max(axis=1) / 7
    return np.repeat(s / 2, block)[: x.size]


def _topk_ref(x: np.ndarray, k: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """(kept mask, per-element bound on kept values: s/2 with s = absmax of the kept values / 127)."""
    blocks = _ref_blocks(x, block)
    valid = _ref_blocks(np.ones_like(x), block) > 0
    mag = np.where(valid, np.abs(blocks), -1.0)
    order = np.argsort(-mag, axis=1, kind="stable")[:, :k]
    kept = np.zeros_like(blocks, dtype=bool)
    np.put_along_axis(kept, order, True, axis=1)
    s = np.where(kept, np.abs(blocks), 0).max(axis=1) / 127
    return kept.reshape(-1)[: x.size], np.repeat(s / 2, block)[: x.size]


def _check_within_reference(x: torch.Tensor, got: torch.Tensor, codec: str) -> None:
    spec = parse_codec(codec)
    x64, got64 = x.double().numpy(), got.double().numpy()
    err = np.abs(got64 - x64)
    if spec.kind == "int4":
        bound = _int4_bound(x64, spec.block)
        assert np.all(err <= bound * (1 + 1e-6) + 1e-30), float((err - bound).max())
    else:
        kept, bound = _topk_ref(x64, spec.k, spec.block)
        assert np.all(got64[~kept] == 0), "only the k largest magnitudes of a block survive"
        assert np.all(got64[kept] != 0)
        assert np.all(err[kept] <= bound[kept] * (1 + 1e-6) + 1e-30), float((err[kept] - bound[kept]).max())
    assert float(err.max()) > 0  # it really compressed


@pytest.mark.parametrize("codec", ["int4:64", "int4:8", "int4:4096", "topk:41/4096", "topk:1/64", SMALL_TOPK])
@pytest.mark.parametrize("scale", [1.0, 1e-20, 1e20])
def test_roundtrip_error_within_the_float64_reference_bound(codec: str, scale: float) -> None:
    n = 3 * parse_codec(codec).block + 77
    x = _nonzero(n, 7, scale)
    _check_within_reference(x, wire_roundtrip(x, codec), codec)


@pytest.mark.parametrize("codec", ["int4:64", SMALL_TOPK])
@pytest.mark.parametrize("n_shards", [1, 3])
def test_payload_shards_decode_alone_through_the_store(codec: str, n_shards: int, memory_uri: str) -> None:
    x = _nonzero(N, 3)
    plan = ShardPlan.build(N, codec, n_shards)
    store = ObjectStore(memory_uri)
    store.put_create("obj", encode_payload("obj", AUTH, x, plan, {"token": "t"}))
    header = read_header(store, "obj", AUTH)
    got = torch.cat([read_payload_shard(store, header, AUTH, plan, k, Scratch()).clone() for k in range(n_shards)])
    assert torch.equal(got, wire_roundtrip(x, codec))
    _check_within_reference(x, got, codec)


@pytest.mark.parametrize("codec", ["int4:64", "int4:8", "topk:41/4096", SMALL_TOPK])
def test_encoding_is_bit_stable(codec: str) -> None:
    x = _nonzero(5 * parse_codec(codec).block + 3, 11)
    first = {k: v.clone() for k, v in _encode_units(x, codec).items()}
    again = _encode_units(x.clone(), codec)
    assert first.keys() == again.keys()
    for name in first:
        assert torch.equal(first[name].view(torch.uint8), again[name].view(torch.uint8)), name
    plan = ShardPlan.build(x.numel(), codec, 2)
    a = encode_payload("k", AUTH, x, plan, {"token": "t"})
    b = encode_payload("k", AUTH, x.clone(), plan, {"token": "t"})
    assert [bytes(v) for v in a[1:]] == [bytes(v) for v in b[1:]], "same input, same tensor bytes"


def test_topk_ties_keep_the_lowest_offsets() -> None:
    x = torch.ones(300)
    enc = _encode_units(x, SMALL_TOPK)
    assert enc["i"][0].tolist() == list(range(8))
    assert enc["i"][1].tolist() == list(range(8))  # the partial block: 44 real elements, padding never chosen


def test_topk_block_shorter_than_k_keeps_padding_at_zero() -> None:
    x = _nonzero(256 + 3, 5)  # the last block has 3 real elements, k = 8
    got = wire_roundtrip(x, SMALL_TOPK)
    assert torch.equal(got[256:] != 0, torch.ones(3, dtype=torch.bool))
    _check_within_reference(x, got, SMALL_TOPK)


@pytest.mark.parametrize("codec", ["int4:64", "topk:41/4096", SMALL_TOPK])
def test_error_feedback_carries_exactly_the_residual(codec: str) -> None:
    """Each step's residual is exactly what that step lost, and over 3 rounds the decoded outputs plus the last
    residual add up to the inputs (float64; only fp32 rounding of the additions remains)."""
    n = 2 * parse_codec(codec).block + 50
    residual: torch.Tensor | None = None
    inputs = torch.zeros(n, dtype=torch.float64)
    outputs = torch.zeros(n, dtype=torch.float64)
    for t in range(3):
        x = _nonzero(n, 100 + t)
        decoded, new = feedback_roundtrip(x, residual, codec)
        intended = x if residual is None else x + residual
        assert torch.equal(new, intended - decoded), "the residual is intended minus decoded, bit for bit"
        assert torch.equal(decoded, wire_roundtrip(intended, codec))
        inputs += x.double()
        outputs += decoded.double()
        residual = new
    assert residual is not None
    gap = (outputs + residual.double() - inputs).abs()
    assert float(gap.max()) <= 1e-5 * float(inputs.abs().max() + residual.abs().max()), float(gap.max())
    # without feedback, what was dropped would be lost for good
    assert float(residual.abs().max()) > 0


# -- validation ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("codec", "fix"),
    [
        ("int3", "one of"),
        ("int4:7", "must be even"),
        ("int4:4", r"in \[8, 4096\]"),
        ("int4:8192", r"in \[8, 4096\]"),
        ("int4:064", "plain positive integer"),
        ("topk:41", "topk:<k>/<block>"),
        ("topk:0/4096", r"k .* must be in \[1, 1024\]"),
        ("topk:2000/4096", r"denser than that, 'int4' or 'int8'"),
        ("topk:1/32", r"block size must be in \[64, 32768\]"),
        ("topk:1/65536", r"block size must be in \[64, 32768\]"),
        ("topk:x/4096", "plain positive integer"),
    ],
)
def test_bad_codec_names_k_or_block_sizes_name_the_fix(codec: str, fix: str, tmp_path: Any) -> None:
    with pytest.raises(ValueError, match=fix):
        parse_codec(codec)
    with pytest.raises(ValueError, match=fix):
        ObjectStoreAllReduce(str(tmp_path), 0, 2, compression=codec)
    with pytest.raises(ValueError, match="not canonical"):
        ShardPlan.build(10, "int4", 1)


def test_codec_defaults_and_canonical_names() -> None:
    assert codec_of("int4") == "int4:64"
    assert codec_of("topk") == f"topk:{TOPK_K}/{TOPK_BLOCK}" == "topk:41/4096"
    assert codec_of("topk:41/4096") == "topk:41/4096"
    # the default sparse codec: 41 int16 offsets + 41 int8 values + one fp32 scale per 4096 fp32 values
    assert parse_codec("topk").bytes_per_block() == 41 * 3 + 4
    assert parse_codec("topk").ratio() == pytest.approx(127 / 16384)
    assert parse_codec("topk").ratio() <= 0.02
    assert parse_codec("int4").ratio() == pytest.approx(36 / 256)
    with pytest.raises(ValueError, match="pass None"):
        codec_of("fp32")


# -- the protocol ---------------------------------------------------------------------------------------------
def _x(rank: int, round_id: int, n: int = N) -> torch.Tensor:
    return _nonzero(n, 1000 * rank + round_id, 1 + rank)


def _pipeline_ref(xs: list[np.ndarray], codec: str) -> tuple[np.ndarray, np.ndarray]:
    """float64 bound of one round (zero residuals): the mean of the inputs, and per element the bound on the result's
    error, the mean of each input's codec error plus the broadcast re-encoding's error."""
    spec = parse_codec(codec)
    exact = sum(xs) / len(xs)
    if spec.kind == "int4":
        up = sum(_int4_bound(x, spec.block) for x in xs) / len(xs)
        return exact, up + _int4_bound(np.abs(exact) + up, spec.block) * 1.0001
    up = sum(np.where(_topk_ref(x, spec.k, spec.block)[0], _topk_ref(x, spec.k, spec.block)[1], np.abs(x)) for x in xs)
    return exact, up / len(xs)  # the broadcast leg is checked separately (kept set of the reduced sum)


@pytest.mark.parametrize("codec", ["int4:64", SMALL_TOPK])
def test_allreduce_over_a_local_folder_gives_the_mean_within_the_bound_and_conserves_mass(
    codec: str, tmp_path: Any, run_replicas: RunReplicas
) -> None:
    rounds = 3

    def replica(rank: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        ar = ObjectStoreAllReduce(str(tmp_path), rank, WORLD, timeout=30, compression=codec, secret=SECRET)
        out = []
        for t in range(rounds):
            x = _x(rank, t)
            ar.allreduce(x)
            out.append(x.clone())
        (residual,) = ar.state_dict()["residuals"].values()
        return out, residual

    results = run_replicas(replica, WORLD, timeout=120)
    for t in range(rounds):
        assert all(torch.equal(r[0][t], results[0][0][t]) for r in results), "bit-identical on every replica"
    # round 0 (no residual yet): the mean within the codec's bound
    xs = [_x(r, 0).double().numpy() for r in range(WORLD)]
    exact, bound = _pipeline_ref(xs, codec)
    got = results[0][0][0].double().numpy()
    if parse_codec(codec).kind == "int4":
        assert np.all(np.abs(got - exact) <= bound + 1e-9), float((np.abs(got - exact) - bound).max())
    else:
        spec = parse_codec(codec)
        mean_of_decoded = sum(wire_roundtrip(_x(r, 0), codec).double() for r in range(WORLD)) / WORLD
        kept, half_step = _topk_ref(mean_of_decoded.numpy(), spec.k, spec.block)
        assert np.all(got[~kept] == 0)
        assert np.all(np.abs(got - mean_of_decoded.numpy())[kept] <= half_step[kept] * 1.0001 + 1e-9)
        assert np.all(np.abs(mean_of_decoded.numpy() - exact) <= bound + 1e-6)
    # error feedback over both legs: sum of m * results + residuals == sum of inputs (float64, fp32 rounding only)
    total_in = sum(_x(r, t).double() for r in range(WORLD) for t in range(rounds))
    delivered = sum(WORLD * results[0][0][t].double() for t in range(rounds))
    held = sum(r[1].double() for r in results)
    gap = (delivered + held - total_in).abs()
    assert float(gap.max()) <= 1e-4 * float(total_in.abs().max() + 1), float(gap.max())


def test_topk_bytes_per_round_are_under_0_02_of_fp32(memory_uri: str, run_replicas: RunReplicas) -> None:
    n, world = 1 << 20, 4

    def replica(rank: int, compression: str | None) -> int:
        ar = ObjectStoreAllReduce(memory_uri, rank, world, timeout=60, run_id=f"c{compression}".replace(":", "-")
                                  .replace("/", "-"), compression=compression)  # fmt: skip
        ar.allreduce(torch.randn(n))
        return ar.bytes_read + ar.bytes_written

    plain = run_replicas(lambda r: replica(r, None), world)
    for codec, limit in (("topk", 0.02), ("int4", 0.16)):
        ratio = max(a / b for a, b in zip(run_replicas(lambda r, c=codec: replica(r, c), world), plain, strict=True))
        assert ratio <= limit, (codec, ratio)


# -- adversarial -------------------------------------------------------------------------------------------------
def _tamper(codec: str, how: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def int4(t: dict[str, torch.Tensor]) -> None:
        if how == "nan scale":
            t["s"][1] = float("nan")
        elif how == "negative scale":
            t["s"][0] = -1.0
        elif how == "inf scale":
            t["s"][-1] = float("inf")
        elif how == "nibble -8":
            t["q"][0, 0] = 0x10  # low nibble 0
        else:
            raise AssertionError(how)

    def topk(t: dict[str, torch.Tensor]) -> None:
        if how == "nan scale":
            t["s"][1] = float("nan")
        elif how == "negative scale":
            t["s"][0] = -1.0
        elif how == "index out of range":
            t["i"][0, -1] = 256
        elif how == "negative index":
            t["i"][1, 0] = -1
        elif how == "duplicate index":
            t["i"][0, 1] = t["i"][0, 0]
        elif how == "value -128":
            t["q"][0, 0] = -128
        elif how == "value in the padding":
            t["i"][-1, -1] = 255  # block 3 holds 232 real elements: offset 255 is padding
            t["q"][-1, -1] = 5
        else:
            raise AssertionError(how)

    return int4 if codec.startswith("int4") else topk


ATTACKS = [("int4:64", h) for h in ("nan scale", "negative scale", "inf scale", "nibble -8")] + [
    (SMALL_TOPK, h)
    for h in (
        "nan scale",
        "negative scale",
        "index out of range",
        "negative index",
        "duplicate index",
        "value -128",
        "value in the padding",
    )
]


@pytest.mark.parametrize(("codec", "how"), ATTACKS, ids=[f"{c}-{h}" for c, h in ATTACKS])
def test_forged_content_is_refused_by_the_decoder(codec: str, how: str, memory_uri: str) -> None:
    x = _nonzero(N, 1)
    plan = ShardPlan.build(N, codec, 1)
    tensors = _encode_units(x, codec)
    _tamper(codec, how)(tensors)
    store = ObjectStore(memory_uri)
    meta = {"codec": codec, "numel": str(N), "token": "t"}
    store.put_create("obj", encode_object("obj", AUTH, "payload", tensors, meta, [(0, plan.units)]))
    header = read_header(store, "obj", AUTH)
    with pytest.raises(CorruptObjectError, match=r"^obj: "):
        read_payload_shard(store, header, AUTH, plan, 0, Scratch())


def _play_attacked(uri: str, run_replicas: RunReplicas, codec: str, attack: Callable[[int], None] | None = None,
                   poison: Callable[[ObjectStoreAllReduce], None] | None = None) -> list[tuple[str, str]]:  # fmt: skip
    """Round 0 clean (residuals appear), round 1 attacked on rank 1 (must abort everywhere with inputs and residuals
    unchanged), round 2 clean again (nothing was lost: it commits). Rounds 0 and 2 wait up to 30 s for every replica
    (a quorum forms as soon as all announced), so a replica slow to start under load is not left out of round 0;
    the attacked round waits 4 s."""

    def replica(rank: int) -> tuple[str, str]:
        ar = ObjectStoreAllReduce(uri, rank, WORLD, timeout=30, quorum_timeout=30, poll_interval=0.01,
                                  compression=codec, secret=SECRET)  # fmt: skip
        ar.allreduce(_x(rank, 0))
        ar.timeout = ar.quorum_timeout = 4.0
        before = ar.state_dict()["residuals"]
        if rank == 1 and poison is not None:
            poison(ar)
            before = {k: v.clone() for k, v in ar._residuals.items()}
        if rank == 1 and attack is not None:
            attack(rank)
        x = _x(rank, 1)
        try:
            ar.allreduce(x)
            outcome = ("commit", "")
        except RoundAbortedError as exc:  # any other AllReduceError fails the test
            outcome = ("abort", str(exc))
        assert torch.equal(x, _x(rank, 1)), "a failed round leaves the inputs unchanged"
        after = ar._residuals
        assert before.keys() == after.keys()
        kept = [k for k in before if not bool(before[k].isnan().any())]
        assert all(torch.equal(before[k], after[k]) for k in kept), "an aborted round leaves the residuals unchanged"
        if rank == 1 and poison is not None:
            ar._residuals = {}  # the replica drops its broken residual; the run goes on
        ar.timeout = ar.quorum_timeout = 30.0
        ar.allreduce(_x(rank, 2))
        assert ar.last_round is not None
        assert ar.last_round.outcome == "commit"
        return outcome

    return run_replicas(replica, WORLD, timeout=120)


@pytest.mark.parametrize(("codec", "how"), [("int4:64", "nan scale"), (SMALL_TOPK, "index out of range"),
                                            (SMALL_TOPK, "value in the padding"), (SMALL_TOPK, "negative scale")])  # fmt: skip
def test_a_replica_sending_forged_content_aborts_the_round_everywhere(
    codec: str, how: str, memory_uri: str, run_replicas: RunReplicas, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 holds the secret but sends forged scales or indices (a broken or malicious replica): every replica
    aborts the round with `RoundAbortedError`, inputs and residuals unchanged, and the next round commits."""
    real = allreduce_module.encode_payload
    armed = {"on": False}

    def forging(key: str, auth: Authenticator, flat: torch.Tensor, plan: ShardPlan, meta: dict[str, str]) -> Any:
        if not (armed["on"] and key.endswith("/data/1.safetensors") and meta.get("round") == "1"):
            return real(key, auth, flat, plan, meta)
        tensors = _encode_units(flat, plan.codec)
        _tamper(codec, how)(tensors)
        items = [(plan.bounds[k], plan.bounds[k + 1]) for k in range(plan.n_shards)]
        return encode_object(key, auth, "payload", tensors, {"codec": plan.codec, "numel": str(plan.numel), **meta},
                             items)  # fmt: skip

    monkeypatch.setattr(allreduce_module, "encode_payload", forging)

    def attack(rank: int) -> None:
        armed["on"] = True

    outcomes = _play_attacked(memory_uri, run_replicas, codec, attack)
    assert {o for o, _ in outcomes} == {"abort"}, outcomes
    assert any("data/1.safetensors" in why for _, why in outcomes), outcomes


@pytest.mark.parametrize("codec", ["int4:64", SMALL_TOPK])
def test_a_truncated_payload_aborts_cleanly(
    codec: str, faulty_store: Any, fault_rule: Any, run_replicas: RunReplicas
) -> None:
    rules: list[dict[str, Any]] = []

    def attack(rank: int) -> None:
        rules.append(fault_rule("read", lambda p: "r00000001/data/1" in p, "truncate", count=10_000))

    outcomes = _play_attacked("crffaulty://trunc", run_replicas, codec, attack)
    assert {o for o, _ in outcomes} == {"abort"}, outcomes
    assert any("truncated" in why for _, why in outcomes), outcomes
    assert rules[0]["fired"] > 0


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("codec", ["int4:64", SMALL_TOPK])
def test_a_non_finite_residual_vetoes_the_round(codec: str, value: float, memory_uri: str,
                                                run_replicas: RunReplicas) -> None:  # fmt: skip
    def poison(ar: ObjectStoreAllReduce) -> None:
        (key,) = ar._residuals
        ar._residuals[key][17] = value

    outcomes = _play_attacked(memory_uri, run_replicas, codec, poison=poison)
    assert {o for o, _ in outcomes} == {"abort"}, outcomes
    assert any("error-feedback residual" in why for _, why in outcomes), outcomes


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_values_veto_the_round(value: float, memory_uri: str, run_replicas: RunReplicas) -> None:
    def replica(rank: int) -> str:
        ar = ObjectStoreAllReduce(memory_uri, rank, WORLD, timeout=4, quorum_timeout=4, compression=SMALL_TOPK,
                                  secret=SECRET)  # fmt: skip
        x = _x(rank, 0)
        if rank == 2:
            x[3] = value
        before = x.clone()
        with pytest.raises(RoundAbortedError) as info:
            ar.allreduce(x)
        assert torch.equal(x.view(torch.int32), before.view(torch.int32))
        assert ar.state_dict() == {"residuals": {}}
        return str(info.value)

    assert any("rank 2's contribution has 1 NaN/inf" in why for why in run_replicas(replica, WORLD, timeout=60))


# -- checkpoints ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("codec", ["int4:64", SMALL_TOPK])
def test_residuals_checkpoint_round_trip_and_resume_bit_identical(
    codec: str, tmp_path: Any, run_replicas: RunReplicas
) -> None:
    """Run A: 3 rounds. Run B: 2 rounds, each replica saves its residuals (an authenticated state object), restarts
    as a new instance, loads them and runs round 3. The third results and the final residuals are bit-identical."""
    auth = Authenticator(SECRET, "ckpt")

    def run(folder: str, restart: bool) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        def replica(rank: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            make = lambda: ObjectStoreAllReduce(folder, rank, WORLD, timeout=30, compression=codec, secret=SECRET)  # noqa: E731
            ar = make()
            for t in range(2):
                ar.allreduce(_x(rank, t))
            if restart:
                key = f"replica-{rank}/residuals"
                blob = b"".join(dumps_state(ar.state_dict(), key, auth))
                ar.close()
                ar = make()
                state = loads_state(blob, key, auth)
                assert state.keys() == {"residuals"}
                ar.load_state_dict(state)
            x = _x(rank, 2)
            ar.allreduce(x)
            return x, ar.state_dict()["residuals"]

        return run_replicas(replica, WORLD, timeout=120)

    a = run(str(tmp_path / "a"), restart=False)
    b = run(str(tmp_path / "b"), restart=True)
    for (xa, ra), (xb, rb) in zip(a, b, strict=True):
        assert torch.equal(xa, xb)
        assert ra.keys() == rb.keys()
        assert len(ra) == 1
        assert all(torch.equal(ra[k], rb[k]) for k in ra)


def test_load_state_dict_refuses_what_is_not_a_residual_state(tmp_path: Any) -> None:
    ar = ObjectStoreAllReduce(str(tmp_path), 0, 2, compression="int4")
    good = {"residuals": {"int4:64|avg|10|": torch.zeros(10)}}
    ar.load_state_dict(good)
    assert torch.equal(ar.state_dict()["residuals"]["int4:64|avg|10|"], torch.zeros(10))
    for bad, why in [
        ({"residuals": {"int8|avg|10|": torch.zeros(10)}}, "int4/topk"),
        ({"residuals": {"int4:64|avg|10|": torch.zeros(11)}}, "10 elements"),
        ({"residuals": {"int4:64|avg|10|": torch.zeros(10, dtype=torch.float64)}}, "float32"),
        ({"residuals": {"int4:64|avg|10|": torch.full((10,), float("nan"))}}, "NaN/inf"),
        ({"residuals": {"int4:64|max|10|": torch.zeros(10)}}, "stream"),
        ({"other": {}}, "state_dict"),
    ]:
        with pytest.raises(ValueError, match=why):
            ar.load_state_dict(bad)
    assert torch.equal(ar.state_dict()["residuals"]["int4:64|avg|10|"], torch.zeros(10)), "unchanged on error"


@pytest.mark.parametrize("verdict", [True, False])
def test_deferred_rounds_take_the_residual_only_when_the_vote_commits(
    verdict: bool, memory_uri: str, run_replicas: RunReplicas
) -> None:
    """MockManager's path (``defer_decision=True`` then ``vote``): the staged residual becomes the replica's only if
    the round commits; a vote that aborts leaves the residuals of the last committed round."""

    def replica(rank: int) -> tuple[bool, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        ar = ObjectStoreAllReduce(memory_uri, rank, 2, timeout=20, compression="int4", secret=SECRET)
        ar.allreduce(_x(rank, 0))
        before = ar.state_dict()["residuals"]
        ar.allreduce(_x(rank, 1), defer_decision=True)
        assert ar.state_dict()["residuals"].keys() == before.keys()
        assert all(torch.equal(ar._residuals[k], before[k]) for k in before), "nothing taken before the vote"
        committed = ar.vote(verdict or rank == 0)
        return committed, before, ar.state_dict()["residuals"]

    for committed, before, after in run_replicas(replica, 2):
        assert committed is verdict
        (key,) = before
        if verdict:
            assert not torch.equal(after[key], before[key]), "the committed round's residual was taken"
        else:
            assert torch.equal(after[key], before[key]), "an aborted vote leaves the residual unchanged"


def test_topk_ties_match_a_stable_sort_reference() -> None:
    """Integer-valued inputs tie a lot: the kept offsets are the numpy stable-sort choice (larger magnitude first,
    then the lower offset), and the result is the same whatever the memory layout of the input."""
    g = torch.Generator().manual_seed(4)
    x = torch.randint(-3, 4, (5000,), generator=g).float()
    idx = _encode_units(x, SMALL_TOPK)["i"].long().numpy()
    blocks = _ref_blocks(x.double().numpy(), 256)
    mag = np.where(_ref_blocks(np.ones(5000), 256) > 0, np.abs(blocks), -1.0)
    ref = np.sort(np.argsort(-mag, axis=1, kind="stable")[:, :8], axis=1)
    assert np.array_equal(idx, ref)
    assert torch.equal(_encode_units(x[::1].clone(), SMALL_TOPK)["i"], _encode_units(x, SMALL_TOPK)["i"])


def test_mockmanager_syncs_take_the_residual_only_on_commit(memory_uri: str, run_replicas: RunReplicas) -> None:
    """Through MockManager (deferred rounds + store-wide vote): a committed sync takes the staged residual, a sync
    that votes false (rank 1 reports an error after the allreduce) leaves it unchanged on both replicas."""
    from crf_diloco import MockManager

    def replica(rank: int) -> tuple[bool, bool, bool, bool]:
        ar = ObjectStoreAllReduce(memory_uri, rank, 2, secret=SECRET, timeout=20, compression="topk:8/256")
        manager = MockManager(ar, checkpoint=False)
        manager.start_quorum()
        t = _x(rank, 0)
        manager.allreduce(t).wait()
        first = manager.should_commit()
        taken = bool(ar.state_dict()["residuals"])
        before = ar.state_dict()["residuals"]
        manager.start_quorum()
        manager.allreduce(_x(rank, 1)).wait()
        if rank == 1:
            manager.report_error(RuntimeError("the inner step diverged"))
        second = manager.should_commit()
        after = ar.state_dict()["residuals"]
        unchanged = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
        return first, taken, second, unchanged

    assert run_replicas(replica, 2) == [(True, True, False, True)] * 2


def test_two_deferred_rounds_of_one_stream_chain_their_residuals(memory_uri: str, run_replicas: RunReplicas) -> None:
    """Two open rounds of the same stream before one vote: the second starts from the first's staged residual (not
    the committed one, which would send the first round's residual twice); mass is conserved over both."""

    def replica(rank: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        ar = ObjectStoreAllReduce(memory_uri, rank, 2, timeout=20, compression="int4:8", secret=SECRET)
        outs = []
        for t in range(2):
            x = _x(rank, t, 64)
            ar.allreduce(x, defer_decision=True)
            outs.append(x)
        assert ar.vote(True)
        (residual,) = ar.state_dict()["residuals"].values()
        return outs, residual

    results = run_replicas(replica, 2)
    total_in = sum(_x(r, t, 64).double() for r in range(2) for t in range(2))
    delivered = sum(2 * results[0][0][t].double() for t in range(2))
    gap = (delivered + results[0][1].double() + results[1][1].double() - total_in).abs()
    assert float(gap.max()) <= 1e-5, float(gap.max())


@pytest.mark.parametrize(("codec", "how"), [("int4:64", "negative scale"), (SMALL_TOPK, "duplicate index")])
def test_forged_reduced_shard_content_is_refused(codec: str, how: str, memory_uri: str) -> None:
    """The broadcast leg is decoded by the same checks: a reduced shard with forged content is corrupt."""
    from crf_diloco.wire import read_reduced

    plan = ShardPlan.build(N, codec, 1)
    tensors = _encode_units(_nonzero(N, 2), codec)
    _tamper(codec, how)(tensors)
    meta = {"codec": codec, "numel": str(N), "shard": "0", "token": "t"}
    store = ObjectStore(memory_uri)
    store.put_create("red", encode_object("red", AUTH, "reduced", tensors, meta))
    with pytest.raises(CorruptObjectError, match=r"^red: "):
        read_reduced(store, "red", AUTH, plan, 0, torch.empty(N), Scratch(), token="t")
