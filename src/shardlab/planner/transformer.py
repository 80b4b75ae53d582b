"""What the planner trains: decoder-only transformers by name, by shape, or from a ``config.json``.

Round numbers from the models' papers, so that a learner can name "70b" and get a plan; none
of them is tuned to make a published run come out right (``tests/test_planner_published.py``
checks the planner against those runs with these presets as they are). GPT-3 sizes from Brown
et al. 2020, Table 2.1 (175B with Megatron-LM's 51,200-token vocabulary); Llama 3 from the
Llama 3 paper (Dubey et al. 2024, Table 3); 1T from Megatron-LM (Narayanan et al. 2021, Table 1).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Transformer:
    """A decoder-only transformer: enough to count its parameters, FLOPs and activations.

    ``ffn_matrices`` is 2 for a GELU MLP (GPT) and 3 for SwiGLU (Llama); ``kv_heads`` below
    ``heads`` is grouped-query attention; ``bias`` adds GPT's biases (13h a block with the two
    LayerNorms); ``learned_positions`` adds GPT's seq × h position table; ``tied`` shares the
    embedding with the output head.
    """

    name: str
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    ffn: int = 0  # 0: 4 × hidden
    kv_heads: int = 0  # 0: same as heads
    ffn_matrices: int = 2
    bias: bool = True
    learned_positions: bool = True
    tied: bool = True

    def __post_init__(self):
        for field in ("layers", "hidden", "heads", "vocab", "seq"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Transformer.{field} must be a positive integer, got {value!r}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} must split evenly over {self.heads} heads")
        if self.ffn_matrices not in (2, 3):
            raise ValueError("ffn_matrices is 2 (GELU MLP) or 3 (SwiGLU)")

    @property
    def ffn_size(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def kv_dim(self) -> int:
        return (self.kv_heads or self.heads) * (self.hidden // self.heads)

    @property
    def block_matmul_params(self) -> int:
        """Weights the matmuls of one block multiply by: q, k, v, output projection, the FFN."""
        h = self.hidden
        return h * (h + 2 * self.kv_dim) + h * h + self.ffn_matrices * h * self.ffn_size

    @property
    def block_params(self) -> int:
        """One block: its matmul weights, the two norms, and GPT's biases (12h² + 13h for GPT)."""
        h = self.hidden
        biases = (h + 2 * self.kv_dim) + h + self.ffn_size + h if self.bias else 0
        norms = (4 if self.bias else 2) * h  # LayerNorm has a weight and a bias; RMSNorm a weight
        return self.block_matmul_params + biases + norms

    @property
    def root_params(self) -> int:
        """Everything outside the blocks: embedding, positions, final norm, output head."""
        h = self.hidden
        return (self.vocab * h * (1 if self.tied else 2) + (self.seq * h if self.learned_positions else 0)
                + (2 if self.bias else 1) * h)

    @property
    def params(self) -> int:
        """Ψ, the parameter count."""
        return self.layers * self.block_params + self.root_params

    def with_(self, **changes) -> Transformer:
        """A copy with some dimensions changed, e.g. ``model.with_(seq=4096)``."""
        return replace(self, **changes)


def _gpt3(name, layers, hidden, heads, vocab=50257):
    return Transformer(name, layers, hidden, heads, vocab, seq=2048)


def _llama(name, layers, hidden, heads, ffn, tied=False, seq=8192):
    return Transformer(name, layers, hidden, heads, vocab=128256, seq=seq, ffn=ffn, kv_heads=8,
                       ffn_matrices=3, bias=False, learned_positions=False, tied=tied)


MODELS = {m.name: m for m in (
    _gpt3("gpt3-125m", 12, 768, 12),
    _gpt3("gpt3-350m", 24, 1024, 16),
    _gpt3("gpt3-1.3b", 24, 2048, 16),
    _gpt3("gpt3-2.7b", 32, 2560, 32),
    _gpt3("gpt3-6.7b", 32, 4096, 32),
    _gpt3("gpt3-13b", 40, 5120, 40),
    _gpt3("gpt3-175b", 96, 12288, 96, vocab=51200),
    _llama("llama3-1b", 16, 2048, 32, 8192, tied=True),
    _llama("llama3-8b", 32, 4096, 32, 14336),
    _llama("llama3-70b", 80, 8192, 64, 28672),
    _llama("llama3-405b", 126, 16384, 128, 53248),
    Transformer("megatron-1t", 128, 25600, 160, 51200, seq=2048),
)}
ALIASES = {"125m": "gpt3-125m", "350m": "gpt3-350m", "1b": "llama3-1b", "1.3b": "gpt3-1.3b",
           "2.7b": "gpt3-2.7b", "6.7b": "gpt3-6.7b", "8b": "llama3-8b", "13b": "gpt3-13b",
           "70b": "llama3-70b", "175b": "gpt3-175b", "405b": "llama3-405b", "1t": "megatron-1t"}


def model(name_or_model) -> Transformer:
    """A :class:`Transformer` by name ('70b', 'gpt3-175b', ...); a Transformer passes through."""
    if isinstance(name_or_model, Transformer):
        return name_or_model
    key = str(name_or_model).lower()
    key = ALIASES.get(key, key)
    if key not in MODELS:
        raise ValueError(f"unknown model {name_or_model!r}; choose one of {sorted(ALIASES)} or {sorted(MODELS)}")
    return MODELS[key]




def need_transformer(model) -> Transformer:
    """``model`` itself: the planner's functions take a resolved :class:`Transformer`, never a name.

    Names are turned into models once, where they come in (:func:`model`, the CLI, the widget),
    so that no function deeper down looks a name up again.
    """
    if not isinstance(model, Transformer):
        raise TypeError(f"expected a planner Transformer, got {model!r}; resolve a name first: planner.model({model!r})")
    return model
