"""Measured memory against the formulas: model states at rest, the stage-3 peak, activations.

One launch per world size measures every stage (see ``instrument_workers.measured``); the model
is the course's GPT at an odd width, so padding is exercised at N = 3 and 4.
"""

from __future__ import annotations

import pytest
import torch
from instrument_workers import (
    MODEL,
    MODEL_KW,
    PER_RANK,
    measured,
    saved_bytes_single_process,
    uncounted_at_collectives,
)

import shardlab
from shardlab.engine.base import Engine
from shardlab.instruments import memory_math as mm
from shardlab.launch import run_ranks
from shardlab.models import batch, gpt, lm_loss

WORLD_SIZES = (2, 3, 4)
STEP_COUNTER = 4  # AdamW keeps one fp32 scalar ``step`` per tensor it steps: one per parameter here


def _padding_here(m, stage: int) -> int:
    """Padding elements in what this rank's optimizer steps: all of it at stage 0, else its shard's."""
    if stage == 0:
        return sum(m["padded"]) - sum(m["numel"])
    n, r = m["world_size"], m["rank"]
    return sum(max(0, (r + 1) * (p // n) - max(real, r * (p // n))) for real, p in zip(m["numel"], m["padded"]))


def _units(m):
    """(numel, padded) of the root unit and of the largest other unit, in elements."""
    root = m["unit_names"].index("root")
    blocks = [p for i, p in enumerate(m["padded"]) if i != root]
    return m["padded"][root], max(blocks)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("stage", range(4))
def test_model_states_at_rest_equal_the_formula(world_size, stage):
    """After ``optimizer.step()``: params, grads, optimizer are the paper's, on padded Ψ, exactly.

    ZeRO-1's full gradient (the paper's 4Ψ) lives only until its reduce-scatter at the end of
    backward, so it is checked at the peak; what stays for the step is this rank's shard. The
    optimizer keeps its state per parameter (one piece each), so it holds no padding, and one
    4-byte ``step`` per parameter with elements on this rank.
    """
    for rank_results in measured(world_size):
        m = rank_results[stage]
        psi_padded = sum(m["padded"])
        formula = mm.model_state_breakdown(psi_padded, world_size, "fp32-adam")[mm.stage_name(stage)]
        rest = m["rest"]
        assert rest["params"] == formula["params"]
        if stage == 1:  # full gradients exist at the end of backward; a shard is kept for the step
            assert rest["grads"] == formula["grads"] / world_size
        else:
            assert rest["grads"] == formula["grads"]
        state_on_padding = 8 * _padding_here(m, stage)  # AdamW's two fp32 moments
        assert rest["optimizer"] == formula["optimizer"] - state_on_padding + STEP_COUNTER * m["pieces_here"]
        assert rest["gathered"] == 0  # stage 3 frees every unit at the end of backward
        assert rest["total"] == sum(v for k, v in rest.items() if k not in ("total", "padding"))
        assert m["after_zero_grad"]["grads"] == 0


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_padding_is_reported_and_lives_on_the_last_ranks(world_size):
    """Padding is inside the counted bytes; at stage 3 the ranks' padding adds up to the whole.
    Weights and gradients are flat buffers, so they pad; the optimizer state is per parameter."""
    results = measured(world_size)
    m0 = results[0][0]
    pad_elements = sum(m0["padded"]) - sum(m0["numel"])
    assert (pad_elements > 0) == (world_size > 2)
    assert all(r[0]["rest"]["padding"] == 8 * pad_elements for r in results)  # 4 + 4 bytes, whole
    assert sum(r[3]["rest"]["padding"] for r in results) == 8 * pad_elements  # sharded across ranks
    if pad_elements:
        assert results[0][3]["rest"]["padding"] == 0  # the padding sits at the end of the flat


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_stage3_gathers_at_most_the_root_and_two_units(world_size):
    """With prefetch, the root (kept for backward) plus the running and the next unit."""
    for rank_results in measured(world_size):
        m = rank_results[3]
        root, block = _units(m)
        assert m["peak_gathered"] == 4 * (root + 2 * block)
        peak = m["peak"]["bytes"]
        rest = m["rest"]
        assert peak["params"] == rest["params"] and peak["optimizer"] == rest["optimizer"]
        # everything but gradients in flight fits: rest + gathered units + activations
        no_grads = peak["params"] + peak["optimizer"] + peak["gathered"] + peak["activations"]
        assert no_grads <= rest["params"] + rest["optimizer"] + 4 * (root + 2 * block) + m["peak_activations"]


def test_stage3_without_prefetch_gathers_one_unit_beside_the_root():
    for rank_results in measured(2):
        m = rank_results[4]  # stage 3, prefetch=False
        root, block = _units(m)
        assert m["peak_gathered"] == 4 * (root + block)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_zero1_gradient_peak_is_every_full_gradient_and_every_shard(world_size):
    """ZeRO-1 issues every reduction when backward ends before it waits for any (``keep`` =
    every unit): at the last issue every unit's packed full gradient and every output shard
    exist, 4Ψ + 4Ψ/N on padded Ψ, to the byte. The sample at that reduce-scatter's own issue
    must see the buffers just packed for it."""
    for rank_results in measured(world_size):
        m = rank_results[1]
        psi_padded = sum(m["padded"])
        assert m["peak_grads"] == 4 * psi_padded + 4 * psi_padded // world_size


@pytest.mark.parametrize("stage", (2, 3))
def test_gradients_in_flight_at_their_peak(stage):
    """ZeRO-2/3 issue a reduction, then wait for the oldest until ``max_reductions_in_flight``
    (2) remain: at each issue three units' full gradients are in flight. The peak is the issue
    of the last block's: three blocks' packed gradients, every block's shard (landed or in
    flight) and the root's head and final-norm gradients (the root's backward ends last)."""
    tiny = gpt(MODEL, **MODEL_KW)
    head_and_norm = sum(p.numel() for part in (tiny.ln_f, tiny.head) for p in part.parameters())
    in_flight = Engine.max_reductions_in_flight + 1
    for world_size in (2, 4):
        for rank_results in measured(world_size):
            m = rank_results[stage]
            block = max(p for name, p in zip(m["unit_names"], m["padded"]) if name != "root")
            blocks = len(m["padded"]) - 1
            shards = blocks * 4 * block // world_size
            assert m["peak_grads"] == 4 * in_flight * block + shards + 4 * head_and_norm, (world_size, m["rank"])


@pytest.mark.slow
def test_every_buffer_of_a_collective_is_counted_at_its_own_events():
    """Ground truth from the garbage collector: at every collective of a unit, issued or landed,
    no live flat buffer or shard of a unit escapes the tally (``instrument_workers``). The tally
    once missed the reduction being issued: its packed gradient and shard were still the
    engine's local variables, not yet queued, at that collective's ``COMM`` event."""
    from support import slowdown

    results = run_ranks(uncounted_at_collectives, 2, (0, 1, 2, 3), timeout=slowdown(120))
    for rank, per_stage in enumerate(results):
        for stage, seen in per_stage.items():
            assert {kind for _, kind, _, _ in seen} >= ({"all_reduce"} if stage == 0 else {"reduce_scatter"})
            missed = [s for s in seen if s[3]]
            assert not missed, (rank, stage, missed[:3])


def test_activations_do_not_shrink_with_stage_but_do_with_checkpointing():
    """'ZeRO does not shrink activations': the same bytes at every stage; checkpointing does."""
    rank0 = measured(2)[0]
    plain = [rank0[s]["peak_activations"] for s in range(4)]
    ckpt = [rank0[5 + s]["peak_activations"] for s in range(4)]
    assert max(plain) == min(plain)
    assert max(ckpt) == min(ckpt)
    assert ckpt[0] < plain[0] / 2


def test_saved_activations_match_the_estimate():
    """Within 5% of ``memory_math.activation_bytes`` (checkpointing: minus the recompute)."""
    cfg = gpt(MODEL, **MODEL_KW).cfg
    plain, ckpt = saved_bytes_single_process(False), saved_bytes_single_process(True)
    estimate = mm.activation_bytes(cfg, PER_RANK)
    estimate_ckpt = mm.activation_bytes(cfg, PER_RANK, checkpoint=True)
    assert plain["forward"] == plain["peak"] and plain["after_backward"] == 0
    assert abs(plain["forward"] / estimate["total"] - 1) < 0.05
    # one block's recompute happens in backward, out of the hooks' sight
    assert abs(ckpt["forward"] / (estimate_ckpt["total"] - estimate_ckpt["per_block"]) - 1) < 0.05


def test_memory_report_on_a_plain_model():
    torch.manual_seed(0)
    model = gpt(MODEL, **MODEL_KW)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    psi = sum(p.numel() for p in model.parameters())
    before = shardlab.memory_report(model, opt)
    assert before["params"] == 4 * psi and before["grads"] == 0 and before["optimizer"] == 0
    x, y = batch(model.cfg, PER_RANK, seed=0)
    lm_loss(model(x), y).backward()
    opt.step()
    report = shardlab.memory_report(model, opt)
    n_tensors = len(list(model.parameters()))
    assert report["grads"] == 4 * psi
    assert report["optimizer"] == 8 * psi + STEP_COUNTER * n_tensors
    assert report["total"] == 16 * psi + STEP_COUNTER * n_tensors and report["padding"] == 0
    assert "optimizer" in report.table()


def test_views_of_one_storage_count_once_and_frozen_params_apart():
    model = torch.nn.Linear(4, 4)
    model.bias.requires_grad_(False)
    flat = torch.zeros(20)
    model.weight.data = flat[:16].view(4, 4)
    report = shardlab.memory_report(model)
    assert report["params"] == 80 and report["frozen"] == 16 and report["total"] == 96


def test_bad_input_is_refused():
    with pytest.raises(TypeError, match="nn.Module"):
        shardlab.memory_report("model")
    with pytest.raises(TypeError, match="optimizer"):
        shardlab.memory_report(torch.nn.Linear(2, 2), optimizer=object())
    with pytest.raises(ValueError, match="parallelized models"):
        with shardlab.track_memory():
            pass


class _Pair(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)])

    def forward(self, x):
        return self.blocks[1](self.blocks[0](x))


def _in_flight_across_models():
    """Two models of one architecture (units ``blocks.0``, ``blocks.1`` in both): a gather of the
    first's unit in flight, each model's gathered bytes; then a collective whose call raised."""
    from shardlab.engine import comm
    from shardlab.engine.api import engine_of
    from shardlab.instruments.memory import memory_report

    a, _ = shardlab.parallelize(_Pair(), stage=3)
    b, _ = shardlab.parallelize(_Pair(), stage=3)
    before = memory_report(a)["gathered"], memory_report(b)["gathered"]
    unit = engine_of(a).units[0]
    unit.gather(async_op=True)
    during = memory_report(a)["gathered"], memory_report(b)["gathered"]
    unit.wait_gather()
    unit.free()
    try:  # 3 is not 2 x 2 elements: the call raises on every rank, before anything is sent
        comm.all_gather(torch.empty(3), torch.zeros(2))
    except (RuntimeError, ValueError) as exc:
        held = exc  # its traceback keeps _issue's frame, and so the Pending, alive
    return before, during, unit.full.element_size() * unit.padded_numel, len(comm.in_flight()), held is not None


def test_a_collective_in_flight_counts_for_its_own_model_only():
    """The tally matches a collective to a unit by the unit object: a gather of model A's
    ``blocks.0`` in flight is A's gathered weights, not B's (B has a ``blocks.0`` too). A call
    that raised is not in flight, though its traceback still holds it."""
    from support import slowdown

    for before, during, full_bytes, listed, raised in run_ranks(_in_flight_across_models, 2, timeout=slowdown(120)):
        assert during[0] == before[0] + full_bytes  # A: the unit being gathered
        assert during[1] == before[1]                # B: nothing of A's
        assert raised and listed == 0
