"""Wire format (safetensors + per-shard CRC, codecs) and the safetensors state checkpoints."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from crf_diloco.checkpoint import dumps_state, loads_state
from crf_diloco.errors import CorruptObjectError
from crf_diloco.layout import RoundKeys, parse_round_dir, parse_state_key, state_key, validate_name
from crf_diloco.store import ObjectStore
from crf_diloco.wire import (
    INT8_BLOCK,
    ShardPlan,
    decode_reduced,
    encode_payload,
    encode_reduced,
    read_header,
    read_payload_shard,
)


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("n_shards", [1, 3, 7])
def test_payload_shards_roundtrip_with_ranged_reads(codec: str, n_shards: int, memory_uri: str) -> None:
    n = 3 * INT8_BLOCK + 77
    x = torch.randn(n, generator=torch.Generator().manual_seed(n_shards))
    plan = ShardPlan.build(n, codec, n_shards)
    assert plan.bounds[0] == 0
    assert plan.bounds[-1] == plan.units
    store = ObjectStore(memory_uri)
    store.put_create("obj", encode_payload(x, plan, {"token": "t"}))
    header = read_header(store, "obj")
    parts = [read_payload_shard(store, "obj", header, plan, k) for k in range(n_shards)]
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


def test_crc_detects_a_flipped_byte(memory_uri: str) -> None:
    x = torch.randn(1000)
    plan = ShardPlan.build(1000, "fp32", 2)
    blob = bytearray(b"".join(encode_payload(x, plan, {"token": "t"})))
    blob[-10] ^= 0x01  # inside shard 1's bytes
    store = ObjectStore(memory_uri)
    store.put_create("obj", bytes(blob))
    header = read_header(store, "obj")
    assert torch.equal(read_payload_shard(store, "obj", header, plan, 0), x[:500])
    with pytest.raises(CorruptObjectError, match="CRC-32 mismatch on shard 1"):
        read_payload_shard(store, "obj", header, plan, 1)


def test_objects_load_with_the_safetensors_library() -> None:
    from safetensors.torch import load

    x = torch.randn(2 * INT8_BLOCK + 5)
    for codec in ("fp32", "bf16", "int8"):
        plan = ShardPlan.build(x.numel(), codec, 3)
        loaded = load(b"".join(encode_payload(x, plan, {"token": "t"})))
        assert set(loaded) == ({"q", "s"} if codec == "int8" else {"x"})
        if codec == "fp32":
            assert torch.equal(loaded["x"], x)


def test_reduced_shard_checks_token_layout_and_crc() -> None:
    plan = ShardPlan.build(100, "int8", 1)
    values = torch.randn(100)
    parts, decoded = encode_reduced(values, plan, 0, {"token": "abc"})
    blob = b"".join(parts)
    got, _ = decode_reduced(blob, plan, 0, "k", "abc")
    assert torch.equal(got, decoded)
    with pytest.raises(CorruptObjectError, match="another round"):
        decode_reduced(blob, plan, 0, "k", "other-token")
    with pytest.raises(CorruptObjectError, match="does not match"):
        decode_reduced(blob, ShardPlan.build(100, "fp32", 1), 0, "k", "abc")
    with pytest.raises(CorruptObjectError, match="truncated"):
        decode_reduced(blob[: len(blob) - 50], plan, 0, "k", "abc")
    with pytest.raises(CorruptObjectError):
        decode_reduced(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops", plan, 0, "k", "abc")


def test_shard_plan_validation() -> None:
    with pytest.raises(ValueError, match="codec"):
        ShardPlan.build(10, "fp8", 2)
    with pytest.raises(ValueError, match="at least one element"):
        ShardPlan.build(0, "fp32", 2)
    plan = ShardPlan.build(10, "fp32", 4)
    assert plan.bounds == (0, 2, 5, 7, 10)
    assert ShardPlan.from_json(json.loads(json.dumps(plan.to_json()))) == plan
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
        "misc": {"betas": (0.9, 0.95), "none": None, "flag": True, "bf16": torch.ones(2, dtype=torch.bfloat16)},
    }
    back = loads_state(dumps_state(state))
    sd = back["frag"]["outer_optimizer"]
    assert list(sd["state"]) == [0], "int keys survive"
    assert torch.equal(sd["state"][0]["momentum_buffer"], opt.state_dict()["state"][0]["momentum_buffer"])
    assert sd["param_groups"][0]["nesterov"] is True
    assert back["misc"]["betas"] == (0.9, 0.95)
    assert back["misc"]["none"] is None
    assert back["misc"]["bf16"].dtype == torch.bfloat16
    assert torch.equal(back["frag"]["original_parameters"]["w2"], shared)
    fresh = torch.optim.SGD([torch.nn.Parameter(torch.randn(2))], lr=0.1, momentum=0.9, nesterov=True)
    fresh.load_state_dict(sd)  # loadable by torch as is


def test_checkpoint_rejects_bad_values_and_corruption() -> None:
    with pytest.raises(TypeError, match="cannot checkpoint set at /x"):
        dumps_state({"x": {1, 2}})
    blob = bytearray(dumps_state({"t": torch.arange(10.0)}))
    blob[-3] ^= 0xFF
    with pytest.raises(ValueError, match="CRC-32"):
        loads_state(bytes(blob))
