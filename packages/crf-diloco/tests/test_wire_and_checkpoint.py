"""Wire format (authenticated safetensors, per-shard content tags, codecs) and the state checkpoints."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from crf_diloco.auth import Authenticator
from crf_diloco.checkpoint import dumps_state, loads_state
from crf_diloco.errors import CorruptObjectError
from crf_diloco.layout import RoundKeys, parse_round_dir, parse_state_key, state_key, validate_name
from crf_diloco.store import ObjectStore
from crf_diloco.wire import (
    INT8_BLOCK,
    Scratch,
    ShardPlan,
    check_payload_header,
    encode_payload,
    encode_reduced,
    read_header,
    read_payload_shard,
    read_reduced,
)

AUTH = Authenticator("wire-secret-0123456789abcdefghij", "run")


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("n_shards", [1, 3, 7])
def test_payload_shards_roundtrip_with_ranged_reads(codec: str, n_shards: int, memory_uri: str) -> None:
    n = 3 * INT8_BLOCK + 77
    x = torch.randn(n, generator=torch.Generator().manual_seed(n_shards))
    plan = ShardPlan.build(n, codec, n_shards)
    assert plan.bounds[0] == 0
    assert plan.bounds[-1] == plan.units
    store = ObjectStore(memory_uri)
    store.put_create("obj", encode_payload("obj", AUTH, x, plan, {"token": "t"}))
    header = read_header(store, "obj", AUTH)
    check_payload_header(header, plan, token="t")
    parts = [read_payload_shard(store, header, AUTH, plan, k, Scratch()).float() for k in range(n_shards)]
    got = torch.cat(parts)
    assert got.shape == (n,)
    if codec == "fp32":
        assert torch.equal(got, x)
    elif codec == "bf16":
        assert torch.equal(got, x.to(torch.bfloat16).float())
    else:
        pad = torch.cat([x, x.new_zeros((-n) % INT8_BLOCK)]).view(-1, INT8_BLOCK)
        scale = (pad.abs().amax(dim=1) / 127).repeat_interleave(INT8_BLOCK)[:n]
        assert bool(((got - x).abs() <= scale / 2 + 1e-7).all())


def test_content_tag_detects_a_flipped_byte_per_shard(memory_uri: str) -> None:
    x = torch.randn(1000)
    plan = ShardPlan.build(1000, "fp32", 2)
    blob = bytearray(b"".join(encode_payload("obj", AUTH, x, plan, {"token": "t"})))
    blob[-10] ^= 0x01  # inside shard 1's bytes
    store = ObjectStore(memory_uri)
    store.put_create("obj", bytes(blob))
    header = read_header(store, "obj", AUTH)
    assert torch.equal(read_payload_shard(store, header, AUTH, plan, 0, Scratch()), x[:500])
    with pytest.raises(CorruptObjectError, match=r"^obj: item 1 failed authentication"):
        read_payload_shard(store, header, AUTH, plan, 1, Scratch())


def test_objects_are_bound_to_their_key_run_and_secret(memory_uri: str) -> None:
    x = torch.randn(100)
    plan = ShardPlan.build(100, "fp32", 1)
    store = ObjectStore(memory_uri)
    blob = encode_payload("a", AUTH, x, plan, {"token": "t"})
    store.put_create("a", blob)
    store.put_create("b", blob)  # the same bytes under another key (a replay)
    read_header(store, "a", AUTH)
    for key, auth in [
        ("b", AUTH),
        ("a", Authenticator("wire-secret-0123456789abcdefghij", "other-run")),
        ("a", Authenticator("other-secret-0123456789abcdefghi", "run")),
    ]:
        with pytest.raises(CorruptObjectError, match="failed authentication"):
            read_header(store, key, auth)
    with pytest.raises(CorruptObjectError, match="failed its checksum"):
        read_header(store, "a", Authenticator(None, "run"))


def test_objects_load_with_the_safetensors_library() -> None:
    from safetensors.torch import load

    x = torch.randn(2 * INT8_BLOCK + 5)
    for codec in ("fp32", "bf16", "int8"):
        plan = ShardPlan.build(x.numel(), codec, 3)
        loaded = load(b"".join(encode_payload("k", AUTH, x, plan, {"token": "t"})))
        assert set(loaded) == ({"q", "s"} if codec == "int8" else {"x"})
        if codec == "fp32":
            assert torch.equal(loaded["x"], x)


def test_reduced_shard_checks_token_layout_and_tag(memory_uri: str) -> None:
    plan = ShardPlan.build(100, "int8", 1)
    values = torch.randn(100)
    store = ObjectStore(memory_uri)
    parts, decoded = encode_reduced("k", AUTH, values, plan, 0, {"token": "abc"})
    blob = b"".join(parts)
    store.put_create("k", blob)
    out = torch.empty(100)
    read_reduced(store, "k", AUTH, plan, 0, out, Scratch(), token="abc")
    assert torch.equal(out, decoded)
    with pytest.raises(CorruptObjectError, match="does not match"):
        read_reduced(store, "k", AUTH, plan, 0, out, Scratch(), token="other-token")
    with pytest.raises(CorruptObjectError, match="does not match"):
        read_reduced(store, "k", AUTH, ShardPlan.build(100, "fp32", 1), 0, out, Scratch(), token="abc")
    short = ObjectStore(f"{memory_uri}/short")
    short.put_create("k", blob[: len(blob) - 50])
    with pytest.raises(CorruptObjectError, match=r"^k: truncated"):
        read_reduced(short, "k", AUTH, plan, 0, out, Scratch(), token="abc")
    store.put_create("junk", b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    with pytest.raises(CorruptObjectError, match=r"^junk: "):
        read_reduced(store, "junk", AUTH, plan, 0, out, Scratch(), token="abc")


def test_shard_plan_validation() -> None:
    with pytest.raises(ValueError, match="codec"):
        ShardPlan.build(10, "fp8", 2)
    with pytest.raises(ValueError, match="at least one element"):
        ShardPlan.build(0, "fp32", 2)
    plan = ShardPlan.build(10, "fp32", 4)
    assert plan.bounds == (0, 2, 5, 7, 10)
    int8 = ShardPlan.build(INT8_BLOCK * 2 + 1, "int8", 2)
    assert int8.units == 3
    assert int8.elem_range(1) == (INT8_BLOCK, INT8_BLOCK * 2 + 1)


def test_layout_names() -> None:
    keys = RoundKeys(12)
    assert keys.data(3) == "r00000012/data/3.safetensors"
    assert keys.reduced(0) == "r00000012/reduced/0.safetensors"
    assert parse_round_dir("bucket/run/r00000012/") == 12
    assert parse_round_dir("state") is None
    assert parse_state_key(state_key(5)) == 5
    assert validate_name("run-1.a_b", "run_id") == "run-1.a_b"
    for bad in ["..", "a/../b", "/abs", "a/b", "~x", "", ".hidden", "x" * 200]:
        with pytest.raises(ValueError, match="could escape"):
            validate_name(bad, "run_id")


def test_checkpoint_roundtrip_keeps_types_and_shared_tensors() -> None:
    shared = torch.randn(3)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.randn(2))], lr=0.7, momentum=0.9, nesterov=True)
    opt.param_groups[0]["params"][0].grad = torch.ones(2)
    opt.step()
    state: dict[str, Any] = {
        "frag": {"outer_optimizer": opt.state_dict(), "original_parameters": {"w": shared, "w2": shared}},
        "misc": {
            "betas": (0.9, 0.95),
            "none": None,
            "flag": True,
            "bf16": torch.ones(2, dtype=torch.bfloat16),
            "step": torch.tensor(3),
            "mask": torch.tensor([True, False]),
        },
    }
    back = loads_state(b"".join(dumps_state(state, "state/r1", AUTH)), "state/r1", AUTH)
    sd = back["frag"]["outer_optimizer"]
    assert list(sd["state"]) == [0], "int keys survive"
    assert torch.equal(sd["state"][0]["momentum_buffer"], opt.state_dict()["state"][0]["momentum_buffer"])
    assert sd["param_groups"][0]["nesterov"] is True
    assert back["misc"]["betas"] == (0.9, 0.95)
    assert back["misc"]["none"] is None
    assert back["misc"]["bf16"].dtype == torch.bfloat16
    assert back["misc"]["step"].dtype == torch.int64
    assert back["misc"]["step"].dim() == 0
    assert torch.equal(back["misc"]["mask"], torch.tensor([True, False]))
    assert torch.equal(back["frag"]["original_parameters"]["w2"], shared)
    fresh = torch.optim.SGD([torch.nn.Parameter(torch.randn(2))], lr=0.1, momentum=0.9, nesterov=True)
    fresh.load_state_dict(sd)  # loadable by torch as is


def test_checkpoint_rejects_bad_values_corruption_and_forgery() -> None:
    with pytest.raises(TypeError, match="cannot checkpoint set at /x"):
        dumps_state({"x": {1, 2}}, "k", AUTH)
    blob = bytearray(b"".join(dumps_state({"t": torch.arange(10.0)}, "state/r1", AUTH)))
    loads_state(bytes(blob), "state/r1", AUTH)
    with pytest.raises(CorruptObjectError, match="failed authentication"):
        loads_state(bytes(blob), "state/r2", AUTH)  # another round's key
    blob[-3] ^= 0xFF
    with pytest.raises(CorruptObjectError, match="content failed authentication"):
        loads_state(bytes(blob), "state/r1", AUTH)
    with pytest.raises(CorruptObjectError, match="truncated or has trailing"):
        loads_state(bytes(blob) + b"x", "state/r1", AUTH)
