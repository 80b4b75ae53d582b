"""``planner.model("config.json")`` against published parameter counts, one family a fixture.

The fixtures in ``tests/configs/`` are the keys of the models' own configs (see its README). Each
count below is the one its paper or model card publishes; nothing here was tuned to the formula.
"""

from pathlib import Path

import pytest

from shardlab import planner

CONFIGS = Path(__file__).resolve().parent / "configs"


@pytest.mark.parametrize("config, low, high", [
    # GPT-2 small: "124M parameters" (Hugging Face model card, openai-community/gpt2). No
    # tie_word_embeddings key: tied by default, or it would count 38.6M more.
    ("gpt2.json", 123.5e6, 124.5e6),
    # Llama 2 7B has LLaMA 7B's shape: "6.7B" (Touvron et al. 2023a, LLaMA, Table 2); untied head.
    ("llama-2-7b.json", 6.65e9, 6.75e9),
    # Qwen2-0.5B: "0.49B" parameters (Yang et al. 2024, Qwen2 Technical Report, Table 1); q/k/v biases, tied.
    ("qwen2-0.5b.json", 0.485e9, 0.495e9),
])
def test_a_config_counts_to_its_published_size(config, low, high):
    assert low <= planner.model(str(CONFIGS / config)).params < high


@pytest.mark.parametrize("config, non_embedding", [
    ("gemma-2b.json", 1_981_884_416),  # Gemma Team 2024, "Gemma: Open Models...", Table 2
    ("gemma-7b.json", 7_751_248_896),
])
def test_gemma_counts_its_published_non_embedding_parameters_exactly(config, non_embedding):
    """Gemma's head_dim (256) is not hidden / heads (3072 / 16 = 192 for 7B), and its config has no
    tie_word_embeddings key (tied). Table 2 counts the blocks and final norm exactly; its embedding
    (524,550,144 and 786,825,216) is a 256,128-row table where the released config says 256,000."""
    m = planner.model(str(CONFIGS / config))
    assert m.params - m.vocab * m.hidden == non_embedding
    assert m.tied and m.head_size == 256


def test_a_model_type_the_planner_cannot_count_is_refused():
    with pytest.raises(ValueError, match=r"model_type 'gpt_neox' is not one the planner knows how to count.*--layers"):
        planner.model(str(CONFIGS / "gpt-neox-pythia-160m.json"))


def test_head_dim_sizes_the_attention_flops():
    from shardlab.planner.compute import unit_flops

    gemma = planner.model(str(CONFIGS / "gemma-7b.json"))
    narrow = gemma.with_(head_dim=0)  # hidden / heads = 192: what ignoring head_dim would count
    assert unit_flops(gemma, 1)["attention"] == unit_flops(narrow, 1)["attention"] * 256 / 192
