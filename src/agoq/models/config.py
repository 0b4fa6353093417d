"""LLaMA architecture configurations: a tiny CPU model and the paper's real models (no weights)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True)
class LlamaConfig:
    """Architecture numbers of a LLaMA-family decoder."""

    vocab_size: int = 4096
    hidden: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    intermediate: int = 688
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden", "n_layers", "n_heads", "n_kv_heads", "intermediate", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model.{name} must be a positive integer, got {value!r}")
        if self.hidden % self.n_heads:
            raise ValueError(
                f"model.hidden={self.hidden} is not divisible by model.n_heads={self.n_heads}; pick a head count that divides the hidden size"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={self.n_kv_heads} "
                "(grouped-query attention shares each kv head across a whole number of query heads)"
            )
        if self.head_dim % 2:
            raise ValueError(f"head dimension {self.head_dim} must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        return self.hidden // self.n_heads

    def num_parameters(self) -> int:
        """Parameter count (the tied head counted once)."""
        h, kv = self.hidden, self.n_kv_heads * self.head_dim
        per_layer = h * h * 2 + 2 * h * kv + 3 * h * self.intermediate + 2 * h
        head = 0 if self.tie_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.n_layers * per_layer + h + head

    def to_dict(self) -> dict:
        """Plain-dict form (for checkpoints and JSON)."""
        return asdict(self)


# Architecture numbers from the models' published configurations. Rope scaling of LLaMA 3.1+/3.2 is
# not modelled (it changes long-context frequencies, not memory or speed).
PRESETS: dict[str, LlamaConfig] = {
    # Trains in minutes on 2 CPU cores; the default of `agoq train`.
    "tiny": LlamaConfig(),
    # 15.8 M parameters with vocab 4096: layers twice tiny's width, for what depends on width, and
    # still minutes on two cores.
    "small": LlamaConfig(hidden=512, n_layers=4, n_heads=8, n_kv_heads=4, intermediate=1376),
    "llama3.2-1b": LlamaConfig(
        vocab_size=128256,
        hidden=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        intermediate=8192,
        max_seq_len=131072,
        rope_theta=500000.0,
        tie_embeddings=True,
    ),
    "llama2-7b": LlamaConfig(
        vocab_size=32000,
        hidden=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=32,
        intermediate=11008,
        max_seq_len=4096,
    ),
    "llama3-8b": LlamaConfig(
        vocab_size=128256,
        hidden=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        intermediate=14336,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
    "llama2-13b": LlamaConfig(
        vocab_size=32000,
        hidden=5120,
        n_layers=40,
        n_heads=40,
        n_kv_heads=40,
        intermediate=13824,
        max_seq_len=4096,
    ),
    "codellama-34b": LlamaConfig(
        vocab_size=32000,
        hidden=8192,
        n_layers=48,
        n_heads=64,
        n_kv_heads=8,
        intermediate=22016,
        max_seq_len=16384,
        rope_theta=1000000.0,
    ),
    "llama3-70b": LlamaConfig(
        vocab_size=128256,
        hidden=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        intermediate=28672,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
}


def parameter_count_text(n: int) -> str:
    """A parameter count for people: '5.0 M parameters', '13.02 B parameters'."""
    if n >= 10**9:
        return f"{n / 1e9:.2f} B parameters"
    if n >= 10**5:
        return f"{n / 1e6:.1f} M parameters"
    return f"{n:,} parameters"


def get_config(name: str, **overrides: object) -> LlamaConfig:
    """A preset by name, with field overrides (e.g. n_layers=36)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; use one of {', '.join(PRESETS)}")
    fields = set(LlamaConfig.__dataclass_fields__)
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown model field(s) {unknown}; valid fields: {', '.join(sorted(fields))}")
    return replace(PRESETS[name], **overrides)  # type: ignore[arg-type]
