"""What the planner trains: decoder-only transformers by name, by shape, or from a ``config.json``.

Three ways in, each turned into a :class:`Transformer` once, where it comes in:

* **a name** (:func:`model`): the presets below, from the models' papers, none tuned to make a
  published run come out right. GPT-3 sizes from Brown et al. 2020, Table 2.1 (175B with
  Megatron-LM's 51,200-token vocabulary); Llama 2 from Touvron et al. 2023, Table 1 and the
  model cards; Llama 3 from Dubey et al. 2024, Table 3; 1T from Megatron-LM (Narayanan et al.
  2021, Table 1). ``"7b"`` is Llama 2 7B, the course's running example;
* **a shape** (:func:`from_shape`): layers, hidden, heads, kv-heads, ffn, vocab, seq, built
  like Llama (SwiGLU, RMSNorm, no biases, untied head);
* **a Hugging Face ``config.json`` on disk** (:func:`from_config`): nothing is downloaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path


@dataclass(frozen=True)
class Transformer:
    """A decoder-only transformer: enough to count its parameters, FLOPs and activations.

    ``ffn_matrices`` is 2 for a GELU MLP (GPT) and 3 for SwiGLU (Llama); ``kv_heads`` below
    ``heads`` is grouped-query attention; ``bias`` adds GPT's biases (13h a block with the two
    LayerNorms); ``qkv_bias`` adds only the q/k/v projections' biases (Qwen2);
    ``learned_positions`` adds GPT's seq × h position table; ``tied`` shares the embedding with
    the output head; ``head_dim`` is one head's size when it is not hidden / heads (Gemma 7B:
    16 heads of 256 on a hidden of 3072), so q, k, v and the output projection are sized by it.
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
    head_dim: int = 0  # 0: hidden // heads
    qkv_bias: bool = False

    def __post_init__(self):
        for field in ("layers", "hidden", "heads", "vocab", "seq", "ffn", "kv_heads", "head_dim"):
            value = getattr(self, field)
            least = 0 if field in ("ffn", "kv_heads", "head_dim") else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{self.name}: {field} must be a positive integer, got {value!r}")
        if not self.head_dim and self.hidden % self.heads:
            raise ValueError(f"{self.name}: hidden {self.hidden} must split evenly over {self.heads} heads "
                             f"(hidden = heads × head size), or give head_dim")
        if self.kv_heads and self.heads % self.kv_heads:
            raise ValueError(f"{self.name}: kv_heads {self.kv_heads} must divide heads {self.heads} "
                             "(each key/value head serves a whole group of query heads)")
        if self.ffn_matrices not in (2, 3):
            raise ValueError("ffn_matrices is 2 (GELU MLP) or 3 (SwiGLU)")

    @property
    def ffn_size(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        """Width of the queries (and of the attention output): heads × head size."""
        return self.heads * self.head_size

    @property
    def kv_dim(self) -> int:
        return (self.kv_heads or self.heads) * self.head_size

    @property
    def block_matmul_params(self) -> int:
        """Weights the matmuls of one block multiply by: q, k, v, output projection, the FFN."""
        h = self.hidden
        return h * (self.q_dim + 2 * self.kv_dim) + self.q_dim * h + self.ffn_matrices * h * self.ffn_size

    @property
    def block_params(self) -> int:
        """One block: its matmul weights, the two norms, and GPT's biases (12h² + 13h for GPT)."""
        h = self.hidden
        qkv = self.q_dim + 2 * self.kv_dim
        biases = qkv + h + self.ffn_size + h if self.bias else qkv if self.qkv_bias else 0
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

    def shape(self) -> dict:
        """The dimensions, as ``--json`` prints them."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _gpt3(name, layers, hidden, heads, vocab=50257):
    return Transformer(name, layers, hidden, heads, vocab, seq=2048)


def _llama(name, layers, hidden, heads, ffn, kv_heads=8, vocab=128256, tied=False, seq=8192):
    return Transformer(name, layers, hidden, heads, vocab=vocab, seq=seq, ffn=ffn, kv_heads=kv_heads,
                       ffn_matrices=3, bias=False, learned_positions=False, tied=tied)


MODELS = {m.name: m for m in (
    _gpt3("gpt3-125m", 12, 768, 12),
    _gpt3("gpt3-350m", 24, 1024, 16),
    _gpt3("gpt3-760m", 24, 1536, 16),
    _gpt3("gpt3-1.3b", 24, 2048, 16),
    _gpt3("gpt3-2.7b", 32, 2560, 32),
    _gpt3("gpt3-6.7b", 32, 4096, 32),
    _gpt3("gpt3-13b", 40, 5120, 40),
    _gpt3("gpt3-175b", 96, 12288, 96, vocab=51200),
    _llama("llama2-7b", 32, 4096, 32, 11008, kv_heads=32, vocab=32000, seq=4096),
    _llama("llama2-13b", 40, 5120, 40, 13824, kv_heads=40, vocab=32000, seq=4096),
    _llama("llama2-70b", 80, 8192, 64, 28672, kv_heads=8, vocab=32000, seq=4096),
    _llama("llama3-1b", 16, 2048, 32, 8192, tied=True),
    _llama("llama3-8b", 32, 4096, 32, 14336),
    _llama("llama3-70b", 80, 8192, 64, 28672),
    _llama("llama3-405b", 126, 16384, 128, 53248),
    Transformer("megatron-1t", 128, 25600, 160, 51200, seq=2048),
)}
ALIASES = {"125m": "gpt3-125m", "350m": "gpt3-350m", "760m": "gpt3-760m", "1b": "llama3-1b",
           "1.3b": "gpt3-1.3b", "2.7b": "gpt3-2.7b", "6.7b": "gpt3-6.7b", "7b": "llama2-7b", "8b": "llama3-8b",
           "13b": "gpt3-13b", "70b": "llama3-70b", "175b": "gpt3-175b", "405b": "llama3-405b", "1t": "megatron-1t"}
SHAPE = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq")  # what --layers ... --seq set


def model(name_or_model) -> Transformer:
    """A :class:`Transformer` by name ('70b', 'gpt3-175b', ...) or a ``config.json`` path; a Transformer passes through."""
    if isinstance(name_or_model, Transformer):
        return name_or_model
    text = str(name_or_model)
    if text.endswith(".json") or Path(text).is_file():
        return from_config(text)
    key = ALIASES.get(text.lower(), text.lower())
    if key not in MODELS:
        raise ValueError(f"unknown model {name_or_model!r}; choose one of {sorted(ALIASES)} or {sorted(MODELS)}, "
                         "give a config.json, or a shape (--layers --hidden --heads --vocab --seq)")
    return MODELS[key]


def from_shape(name: str = "custom", base: Transformer | None = None, **shape) -> Transformer:
    """A model from its dimensions (:data:`SHAPE`); unset ones come from ``base``, else are required.

    Without a ``base`` it is built like Llama: SwiGLU, RMSNorm, no biases, an untied head.
    """
    unknown = set(shape) - set(SHAPE)
    if unknown:
        raise ValueError(f"unknown shape fields {sorted(unknown)}; the shape is {SHAPE}")
    given = {k: v for k, v in shape.items() if v is not None}
    if base is not None:
        return base.with_(name=base.name if not given else f"{base.name} (changed)", **given)
    missing = [k for k in ("layers", "hidden", "heads", "vocab", "seq") if k not in given]
    if missing:
        raise ValueError(f"a custom shape needs {', '.join('--' + k.replace('_', '-') for k in missing)} "
                         "(--kv-heads and --ffn are optional)")
    return Transformer(name, **given, ffn_matrices=3, bias=False, learned_positions=False, tied=False)


#: Hugging Face config keys, Llama style first, then GPT-2 style.
_HF = {"layers": ("num_hidden_layers", "n_layer"), "hidden": ("hidden_size", "n_embd"),
       "heads": ("num_attention_heads", "n_head"), "vocab": ("vocab_size",),
       "kv_heads": ("num_key_value_heads",), "ffn": ("intermediate_size", "n_inner"),
       "seq": ("max_position_embeddings", "n_positions"), "head_dim": ("head_dim",)}
MAX_SEQ = 8192  # a config's max_position_embeddings (Llama 3.1: 131,072) is what it can read, not what it trains on
#: The ``model_type``s the planner can count, and how each is built. GPT-2 style: GELU MLP,
#: biases, learned positions. Llama style: a gated MLP (SwiGLU; Gemma's GeGLU has the same three
#: matrices), RMSNorm, rotary positions, no biases (Qwen2: q/k/v biases). Any other type raises:
#: GPT-NeoX, OPT, Falcon, BLOOM, Phi... differ in ways these two shapes would silently miscount.
GPT2_TYPES = ("gpt2", "gpt_neo", "gptj")
LLAMA_TYPES = ("llama", "mistral", "qwen2", "gemma")


def from_config(path, seq: int | None = None) -> Transformer:
    """A model from a Hugging Face ``config.json`` read from disk (no download).

    ``model_type`` must be one of :data:`GPT2_TYPES` or :data:`LLAMA_TYPES`. The head is tied
    unless ``tie_word_embeddings`` is false: that is ``PretrainedConfig``'s default, and
    ``save_pretrained`` leaves default keys out (Gemma's config has none). ``head_dim`` is read
    when the config gives it. The sequence is ``seq`` if given, else ``max_position_embeddings``
    up to :data:`MAX_SEQ`.
    """
    p = Path(path)
    try:
        cfg = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"no config.json at {p}; give the path of a Hugging Face config.json on disk") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{p} is not a JSON file ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{p} holds no JSON object of config fields")
    kind = cfg.get("model_type")
    if kind not in GPT2_TYPES + LLAMA_TYPES:
        raise ValueError(f"{p}: model_type {kind!r} is not one the planner knows how to count "
                         f"({', '.join(GPT2_TYPES + LLAMA_TYPES)}); give its shape with "
                         "--layers --hidden --heads --vocab --seq")
    dims = {}
    for field, keys in _HF.items():
        found = next((cfg[k] for k in keys if cfg.get(k) is not None), None)
        if found is None and field in ("layers", "hidden", "heads", "vocab"):
            raise ValueError(f"{p} has no {' or '.join(repr(k) for k in keys)}: a config.json needs "
                             "num_hidden_layers, hidden_size, num_attention_heads and vocab_size")
        if found is not None:
            dims[field] = found
    dims["seq"] = seq if seq is not None else min(dims.get("seq", MAX_SEQ), MAX_SEQ)
    name = cfg.get("_name_or_path") or p.parent.name or p.stem
    tied = bool(cfg.get("tie_word_embeddings", True))
    if kind in GPT2_TYPES:
        return Transformer(name, **dims, ffn_matrices=2, bias=True, learned_positions=True, tied=tied)
    return Transformer(name, **dims, ffn_matrices=3, bias=False, learned_positions=False, tied=tied,
                       qkv_bias=kind == "qwen2")


def need_transformer(model) -> Transformer:
    """``model`` itself: the planner's functions take a resolved :class:`Transformer`, never a name.

    Names are turned into models once, where they come in (:func:`model`, the CLI, the widget),
    so that no function deeper down looks a name up again.
    """
    if not isinstance(model, Transformer):
        raise TypeError(f"expected a planner Transformer, got {model!r}; resolve a name first: planner.model({model!r})")
    return model
