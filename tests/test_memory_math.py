"""The memory and communication formulas against the numbers printed in the sources.

Oracles: ZeRO paper (arXiv 1910.02054) Figure 1 and Table 1, the seed's 7B example, the
Ultra-Scale Playbook's 16 and 20 bytes/param, DeepSpeed's estimator. See
/work/shared/notes/reference-facts.md.
"""

import json
import math
from decimal import Decimal
from fractions import Fraction

import pytest

from shardlab.instruments import memory_cli
from shardlab.instruments import memory_math as mm
from shardlab.models import GPT, GPTConfig

# ZeRO paper, Table 1: GB per device for Pos / Pos+g / Pos+g+p, exactly as printed.
TABLE1 = {  # Nd: {column: "Pos / Pos+g / Pos+g+p"}
    1: {"7.5B": "120 / 120 / 120", "128B": "2048 / 2048 / 2048", "1T": "16000 / 16000 / 16000"},
    4: {"7.5B": "52.5 / 41.3 / 30", "128B": "896 / 704 / 512", "1T": "7000 / 5500 / 4000"},
    16: {"7.5B": "35.6 / 21.6 / 7.5", "128B": "608 / 368 / 128", "1T": "4750 / 2875 / 1000"},
    64: {"7.5B": "31.4 / 16.6 / 1.88", "128B": "536 / 284 / 32", "1T": "4187 / 2218 / 250"},
    256: {"7.5B": "30.4 / 15.4 / 0.47", "128B": "518 / 263 / 8", "1T": "4046 / 2054 / 62.5"},
    1024: {"7.5B": "30.1 / 15.1 / 0.12", "128B": "513 / 257 / 2", "1T": "4011 / 2013 / 15.6"},
}
COLUMNS = {"7.5B": (7_500_000_000, "half-up"), "128B": (128 * 10**9, "truncate"), "1T": (10**12, "truncate")}


def printed_as(exact: Fraction, printed: str, rule: str) -> bool:
    """Would the paper print ``exact`` as ``printed``, rounding to as many decimals by ``rule``?"""
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    scale = 10**decimals
    scaled = exact * scale
    digits = math.floor(scaled + Fraction(1, 2)) if rule == "half-up" else math.floor(scaled)
    return digits == int(Decimal(printed) * scale)


@pytest.mark.parametrize("nd", sorted(TABLE1))
@pytest.mark.parametrize("column", sorted(COLUMNS))
def test_every_cell_of_zero_table_1(nd, column):
    psi, rule = COLUMNS[column]
    exact = mm.model_state_bytes(Fraction(psi), nd)  # Fractions in, Fractions out: no float error
    printed = [p.strip() for p in TABLE1[nd][column].split("/")]
    for stage, cell in zip(("zero1", "zero2", "zero3"), printed):
        value = exact[stage] / mm.GB
        assert printed_as(value, cell, rule), f"{column} Nd={nd} {stage}: exact {float(value)} vs printed {cell}"


def test_the_rounding_check_has_teeth():
    # 41.25 rounds half-up to 41.3 but truncates to 41.2; 4187.5 truncates to 4187, not 4188.
    assert printed_as(Fraction(4125, 100), "41.3", "half-up") and not printed_as(Fraction(4125, 100), "41.3", "truncate")
    assert printed_as(Fraction(41875, 10), "4187", "truncate") and not printed_as(Fraction(41875, 10), "4187", "half-up")


def test_figure_1_example():
    gb = {s: v / mm.GB for s, v in mm.model_state_bytes(7.5e9, 64).items()}
    assert gb == pytest.approx({"ddp": 120, "zero1": 31.40625, "zero2": 16.640625, "zero3": 1.875}, abs=1e-9)
    assert [round(gb[s], 1) for s in mm.STAGES] == [120, 31.4, 16.6, 1.9]  # as Figure 1 prints them


def test_breakdown_shards_the_right_state():
    b = mm.model_state_breakdown(1000, 10)
    assert b["ddp"] == {"params": 2000, "grads": 2000, "optimizer": 12000}
    assert b["zero1"] == {"params": 2000, "grads": 2000, "optimizer": 1200}
    assert b["zero2"] == {"params": 2000, "grads": 200, "optimizer": 1200}
    assert b["zero3"] == {"params": 200, "grads": 200, "optimizer": 1200}
    assert mm.formula_text("zero1") == "4Ψ + 12Ψ/Nd" and mm.formula_text(2) == "2Ψ + 14Ψ/Nd"


def test_seed_7b_on_8_gpus():
    m = mm.model_state_bytes(7e9, 8)
    assert m["ddp"] == 112 * mm.GB and m["zero3"] == 14 * mm.GB


@pytest.mark.parametrize("psi, gb", [(1e9, 16), (7e9, 112), (70e9, 1120)])
def test_playbook_16_bytes_per_param(psi, gb):
    assert mm.model_state_bytes(psi, 1)["ddp"] == gb * mm.GB


def test_playbook_fp32_grad_accumulation_is_20_bytes():
    r = mm.RECIPES["bf16-fp32-grads"]
    assert r.bytes_per_param == 20  # about 25% over 16
    assert mm.model_state_bytes(7e9, 1, r)["ddp"] == 140 * mm.GB
    assert mm.model_state_bytes(7e9, 1, "bf16-fp32-grads")["ddp"] / mm.model_state_bytes(7e9, 1)["ddp"] == 1.25


def test_other_recipes():
    assert mm.RECIPES["fp32-adam"].bytes_per_param == 16
    assert mm.RECIPES["sgd-momentum"].bytes_per_param == 12
    assert mm.model_state_bytes(1e9, 4, "sgd-momentum")["zero1"] == (8 + 4 / 4) * 1e9


def test_communication_volume():
    assert [mm.comm_elements(s, 100) for s in mm.STAGES] == [200, 200, 200, 300]
    assert mm.ring_bytes_per_rank("zero3", 100, 4, dtype_bytes=2) == 300 * 3 / 4 * 2
    assert mm.ring_bytes_per_rank("ddp", 100, 1) == 0  # one rank sends nothing


def test_gathered_units_at_stage_3():
    assert mm.gathered_unit_bytes(1000) == 2 * 1000 * 2
    assert mm.gathered_unit_bytes(1000, prefetch=False) == 2000
    assert mm.gathered_unit_bytes(1000, "fp32-adam", prefetch=False, include_grad=True) == 8000


def test_deepspeed_estimator_differs_from_the_ideal():
    ideal = mm.model_state_bytes(7e9, 8)["zero3"]
    ds = mm.deepspeed_estimate(7e9, 8, stage=3, largest_layer_params=200e6)
    assert ideal / mm.GB == 14
    assert round(ds / mm.GIB, 2) == 15.41  # what DeepSpeed prints, labelled "GB"
    assert mm.deepspeed_estimate(7e9, 8, stage=2) == 2 * 7e9 + 18 * 7e9 / 8
    with pytest.raises(ValueError):
        mm.deepspeed_estimate(7e9, 8, stage=1)


def test_gpt_param_count_matches_the_model():
    for cfg in (GPTConfig(vocab=128, d=32, n_layer=2, n_head=2, seq=16), GPTConfig(tie_weights=True)):
        model = GPT(cfg)
        n = sum(dict((p.data_ptr(), p.numel()) for p in model.parameters()).values())
        assert mm.gpt_param_count(cfg) == n


def test_activation_estimate_and_checkpointing():
    cfg = GPTConfig(vocab=4096, d=384, n_layer=6, n_head=6, seq=64)
    full = mm.activation_bytes(cfg, 8)
    ckpt = mm.activation_bytes(cfg, 8, checkpoint=True)
    btd = 8 * 64 * 384
    assert full["per_block"] == 16 * btd * 4 and full["blocks"] == 6 * 16 * btd * 4
    assert ckpt["blocks"] == (6 + 16) * btd * 4 and ckpt["total"] < full["total"]
    assert mm.activation_bytes(cfg, 8, dtype_bytes=2)["blocks"] == full["blocks"] // 2


@pytest.mark.parametrize("text, value", [("7.5e9", 7_500_000_000), ("7.5B", 7_500_000_000), ("13M", 13_000_000),
                                         ("1T", 10**12), ("350k", 350_000), ("1_000", 1000)])
def test_parse_count(text, value):
    assert mm.parse_count(text) == value


@pytest.mark.parametrize("bad", ["-1", "0", "abc", "7.5X", "", "inf"])
def test_parse_count_rejects(bad):
    with pytest.raises(ValueError):
        mm.parse_count(bad)


def test_bad_input_is_refused_clearly():
    with pytest.raises(ValueError, match="world_size"):
        mm.model_state_bytes(1e9, 0)
    with pytest.raises(ValueError, match="params"):
        mm.model_state_bytes(-1, 4)
    with pytest.raises(ValueError, match="unknown recipe"):
        mm.model_state_bytes(1e9, 4, "lion")
    with pytest.raises(ValueError, match="unknown stage"):
        mm.comm_elements("zero4", 10)


def test_cli_prints_the_papers_numbers(capsys):
    assert memory_cli.main(["--params", "7.5e9", "--gpus", "64"]) == 0
    out = capsys.readouterr().out
    for number in ("120.000", "31.406", "16.641", "1.875"):
        assert number in out


def test_cli_shows_the_papers_volume_and_the_rings_bytes_apart(capsys):
    """2Ψ x 2 bytes = 28 GB is the paper's volume; a ring sends (N-1)/N of it: 24.5 GB at N=8."""
    assert memory_cli.main(["--params", "7e9", "--gpus", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("stage"))
    assert header.split() == ["stage", "formula", "GB", "GiB", "volume", "(paper)", "ring", "GB", "per", "rank"]
    ddp = next(line for line in lines if line.startswith("DDP"))
    assert "2Ψ = 28.000 GB" in ddp and ddp.split()[-1] == "24.500"
    zero3 = next(line for line in lines if line.startswith("ZeRO-3"))
    assert "3Ψ = 42.000 GB" in zero3 and zero3.split()[-1] == "36.750"
    assert any("7/8 x volume" in line for line in lines)


def test_cli_json(capsys):
    assert memory_cli.main(["--params", "7.5B", "--gpus", "64", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ddp"] == 120 * 10**9 and data["zero3"] == 1_875_000_000
    assert data["zero1"] == 31_406_250_000 and data["zero2"] == 16_640_625_000
    assert data["recipe"] == "mixed-adam" and data["gpus"] == 64


@pytest.mark.parametrize("argv, message", [(["--gpus", "0"], "positive integer"), (["--params", "-5"], "positive"),
                                           (["--recipe", "lion"], "unknown recipe"), (["--gpus", "two"], "--gpus")])
def test_cli_errors(capsys, argv, message):
    assert memory_cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_activation_estimate_is_close_to_what_autograd_saves():
    import torch

    from shardlab.models import batch, lm_loss

    cfg = GPTConfig(vocab=1024, d=128, n_layer=4, n_head=4, seq=32)
    torch.manual_seed(0)
    model = GPT(cfg)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    x, y = batch(cfg, 4, seed=0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lm_loss(model(x), y)
    estimate = mm.activation_bytes(cfg, 4)["total"]
    assert abs(sum(saved.values()) - estimate) / estimate < 0.03
