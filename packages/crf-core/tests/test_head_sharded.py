"""The chunked LM head on an FSDP2-sharded model, in one process (a 1-rank gloo group), and the parallelism checks.

``fully_shard`` on one rank still turns every parameter into a ``DTensor`` and runs FSDP2's hooks, so this checks
the mechanics fast (the 2-rank parity run is ``test_trainer_fsdp.py``, marked slow): the FSDP-wrapped head stays
separable; ``LMHead.run`` scores inside the root forward and gives the unsharded model's log-probs and gradients;
outside a forward the sharded head is gathered for no-grad use and refused with grad; the EMA teacher shards and
takes its EMA step shard-locally. Plus ``check_sharding``: FSDP1, ZeRO-3 and an adapter EMA teacher under FSDP2
are refused with a message naming the alternative.
"""

from __future__ import annotations

import copy
import socket
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from crf_core.channels import ChunkPlan, LMHead, score_completions
from crf_core.trainer.sharding import check_sharding
from crf_core.trainer.teacher import EmaTeacher


@pytest.fixture
def one_rank() -> Iterator[None]:
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _shard(model: Any) -> Any:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard([model.model.norm, model.lm_head], reshard_after_forward=False)  # as accelerate's FSDP2 does
    fully_shard(model)
    return model


def test_sharded_head_scores_like_the_unsharded_one(one_rank: None, make_tiny_causal_lm: Any) -> None:
    from torch.distributed.tensor import DTensor

    plain = make_tiny_causal_lm(vocab_size=53, num_hidden_layers=2)
    sharded = _shard(copy.deepcopy(plain))
    assert isinstance(sharded.lm_head.weight, DTensor)
    ids = torch.randint(0, 53, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    results = []
    for model in (plain, sharded):
        head = LMHead(model, ChunkPlan("on", chunk_size=4))
        assert head.separable, head.reason
        assert head.sharded == (model is sharded)
        scores = score_completions(head, ids, mask, 5, entropy=True)
        (scores.logps.sum() + scores.entropies.sum()).backward()  # FSDP2 reduces into the sharded .grad
        params = dict(model.named_parameters())
        grads = [params[n].grad for n in ("lm_head.weight", "model.layers.0.mlp.up_proj.weight")]
        full = [g.full_tensor() if isinstance(g, DTensor) else g for g in grads]
        results.append((scores.logps.detach(), scores.entropies.detach(), full))
    (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = results
    torch.testing.assert_close(lp_b, lp_a, rtol=0, atol=1e-6)
    torch.testing.assert_close(ent_b, ent_a, rtol=0, atol=1e-5)
    for a, b in zip(g_a, g_b, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_sharded_head_outside_a_forward(one_rank: None, make_tiny_causal_lm: Any) -> None:
    model = _shard(make_tiny_causal_lm(vocab_size=53))
    head = LMHead(model)
    with torch.no_grad():
        weight = head.weight  # gathered once, for no-grad use
        assert head.weight is weight
    assert type(weight) is torch.Tensor
    assert weight.shape == (53, 32)
    with pytest.raises(RuntimeError, match=r"LMHead\.run"):
        _ = LMHead(model).weight


def test_ema_teacher_shards_and_moves_shard_by_shard(one_rank: None, make_tiny_causal_lm: Any) -> None:
    from torch.distributed.tensor import DTensor

    policy = make_tiny_causal_lm(vocab_size=53)
    teacher = EmaTeacher(policy, 0.25)
    state = SimpleNamespace(fsdp_plugin=SimpleNamespace(fsdp_version=2, reshard_after_forward=True))
    accelerator = SimpleNamespace(state=state, torch_device_mesh=None, device=torch.device("cpu"))
    state.fsdp_plugin.cpu_offload = None
    state.fsdp_plugin.mixed_precision_policy = None
    state.fsdp_plugin.ignored_modules = None
    teacher.shard(accelerator)
    assert teacher.sharded
    assert all(isinstance(p, DTensor) for p in teacher.module.parameters())
    before = teacher.state_dict()
    assert all(type(v) is torch.Tensor for v in before.values())  # gathered to full tensors
    sharded_policy = _shard(copy.deepcopy(policy))
    with torch.no_grad():
        for p in sharded_policy.parameters():
            p.add_(1.0)
    teacher.update(sharded_policy)
    after = teacher.state_dict()
    for name, value in before.items():
        if name.endswith("inv_freq"):
            continue
        torch.testing.assert_close(after[name], value + 0.25, rtol=0, atol=1e-6)
    teacher.load_state_dict(before)
    assert all(torch.equal(teacher.state_dict()[k], v) for k, v in before.items())
    with pytest.raises(ValueError, match="not sharded alike"):
        teacher.update(policy)


def test_unsupported_parallelisms_are_refused() -> None:
    none = SimpleNamespace()
    check_sharding(none, adapter_ema_teacher=True)  # no sharding: anything goes
    fsdp2 = SimpleNamespace(fsdp_plugin=SimpleNamespace(fsdp_version=2))
    check_sharding(fsdp2, adapter_ema_teacher=False)
    with pytest.raises(ValueError, match="sdpo_teacher='live'"):
        check_sharding(fsdp2, adapter_ema_teacher=True)
    with pytest.raises(ValueError, match="fsdp_version: 2"):
        check_sharding(SimpleNamespace(fsdp_plugin=SimpleNamespace(fsdp_version=1)), adapter_ema_teacher=False)
    with pytest.raises(ValueError, match="ZeRO-3"):
        check_sharding(SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=3)), adapter_ema_teacher=False)
    check_sharding(SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=2)), adapter_ema_teacher=False)
