"""Which weight format a checkpoint holds and which layers stay unquantised: ``quantization_config``.

Torch-free, so the control plane can read it. The key ``format`` is what deployments check
(``tessera.tenancy.check_checkpoint``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

WEIGHT_FORMATS = ("bf16", "fp8", "int4")
QUANTIZED_FORMATS = ("fp8", "int4")
DEFAULT_GROUP_SIZE = 128
QUANT_METHOD = "tessera"
# Kept in bf16 in every format. Each entry matches whole dotted components of a module name, so
# "mlp.gate" (a MoE router) does not match "mlp.gate_proj". Norms are listed for readers: only linear
# layers are ever converted.
DEFAULT_NOT_CONVERTED = (
    "embed_tokens",
    "lm_head",
    "input_layernorm",
    "post_attention_layernorm",
    "q_norm",
    "k_norm",
    "norm",
    "block_sparse_moe.gate",
    "mlp.gate",
)
# MoE routers stay unquantised whatever a quantization_config lists (their top-k decides which experts run).
ALWAYS_KEPT = ("block_sparse_moe.gate", "mlp.gate")
# Which linear layers a quantisation converts (``--only``): all of them, or the routed experts alone (the
# published INT4 Kimi K2 convention: attention, shared experts, dense MLPs, router and embeddings stay
# bf16). Patterns match whole dotted components, so "experts" is not "shared_experts".
SELECTIONS: dict[str, tuple[str, ...] | None] = {"all": None, "routed-experts": ("experts",)}


@dataclass(frozen=True)
class QuantConfig:
    """A quantised checkpoint's weight format, as written to ``config.json["quantization_config"]``."""

    format: str
    group_size: int | None = None  # int4 only: input channels per scale/zero group
    symmetric: bool = False  # int4 only: no zero points, codes centred on 8
    modules_not_converted: tuple[str, ...] = field(default=DEFAULT_NOT_CONVERTED)
    # Only layers matching one of these are converted (None: every linear layer not excluded above).
    modules_to_convert: tuple[str, ...] | None = None

    @classmethod
    def selecting(cls, format: str, only: str = "all", **kwargs: Any) -> QuantConfig:
        """``format`` for the layers ``only`` names (a key of ``SELECTIONS``)."""
        if only not in SELECTIONS:
            raise ValueError(f"--only must be one of {', '.join(SELECTIONS)}, got {only!r}")
        return cls(format, modules_to_convert=SELECTIONS[only], **kwargs)

    @property
    def selection(self) -> str:
        """The ``SELECTIONS`` name of ``modules_to_convert`` ("custom" for a hand-written list)."""
        return next((k for k, v in SELECTIONS.items() if v == self.modules_to_convert), "custom")

    def __post_init__(self) -> None:
        if self.format not in QUANTIZED_FORMATS:
            raise ValueError(f"quantised weight format must be fp8 or int4, got {self.format!r}")
        if self.format == "int4":
            validate_group_size(self.group_size)
        elif self.group_size is not None or self.symmetric:
            raise ValueError("group_size and symmetric apply to int4 only; fp8 scales are per output channel")

    def converts(self, module_name: str) -> bool:
        """Whether the linear layer ``module_name`` (e.g. ``model.layers.0.mlp.up_proj``) is quantised."""
        if not converts(module_name, self.modules_not_converted + ALWAYS_KEPT):
            return False
        return self.modules_to_convert is None or not converts(module_name, self.modules_to_convert)

    def to_json(self) -> dict[str, Any]:
        body = {"quant_method": QUANT_METHOD, **asdict(self)}
        body["modules_not_converted"] = list(self.modules_not_converted)
        if self.modules_to_convert is None:
            del body["modules_to_convert"]
        else:
            body["modules_to_convert"] = list(self.modules_to_convert)
        if self.format == "fp8":
            del body["group_size"], body["symmetric"]
        return body

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> QuantConfig:
        if raw.get("quant_method", QUANT_METHOD) != QUANT_METHOD:
            raise ValueError(
                f"quantization_config quant_method {raw.get('quant_method')!r} is not supported; this loader "
                f"reads checkpoints written by `tessera quantize` ({QUANT_METHOD!r})"
            )
        return cls(
            format=raw.get("format"),
            group_size=raw.get("group_size"),
            symmetric=bool(raw.get("symmetric", False)),
            modules_not_converted=tuple(raw.get("modules_not_converted", DEFAULT_NOT_CONVERTED)),
            modules_to_convert=None
            if raw.get("modules_to_convert") is None
            else tuple(raw["modules_to_convert"]),
        )


def converts(module_name: str, not_converted: tuple[str, ...]) -> bool:
    """False when a pattern of ``not_converted`` matches whole dotted components of ``module_name``."""
    parts = module_name.split(".")
    for pattern in not_converted:
        want = pattern.split(".")
        if any(parts[i : i + len(want)] == want for i in range(len(parts) - len(want) + 1)):
            return False
    return True


def validate_group_size(group_size: int | None) -> None:
    # Kernels tile the input dimension in power-of-two blocks of at least 16 that must not straddle groups.
    if not isinstance(group_size, int) or group_size < 16 or group_size % 16:
        raise ValueError(f"int4 group_size must be a positive multiple of 16 (e.g. 128), got {group_size!r}")
