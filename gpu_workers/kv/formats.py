"""KV-cache element formats: values as they are (model dtype, bf16) or FP8-e4m3 with scales, and scale files.

FP8 pages hold ``x / scale`` saturated to ±448 (the largest finite e4m3 value, so nothing overflows to
NaN/inf) as float8_e4m3fn bits in uint8 tensors: CPU torch lacks several fp8 ops (ENVIRONMENT.md), and
a uint8 view supports every gather and slot assignment the cache needs. Reading views the bits as fp8
again and multiplies by the scale.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_DTYPE = torch.float32
# A page of exact zeros still needs a usable scale; below this amax, precision no longer matters.
MIN_AMAX = 1e-6
SCALES_FORMAT = "tessera-kv-scales/1"


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def storage_dtype(dtype: torch.dtype) -> torch.dtype:
    """What a cache of ``dtype`` elements is allocated as: FP8 lives in uint8 tensors."""
    return torch.uint8 if is_fp8(dtype) else dtype


def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """The scale that maps ``amax`` onto the largest finite e4m3 value."""
    return amax.float().clamp_min(MIN_AMAX) / FP8_MAX


def fp8_scale_pow2(amax: torch.Tensor) -> torch.Tensor:
    """The smallest power of two at least ``fp8_scale(amax)``.

    Dividing by a power of two only shifts exponents, so a value in e4m3's normal range rounds to the
    same 3-bit mantissa whatever the scale: two scales computed from different chunks of the same
    sequence store the same dequantised values, except at the range ends (saturation, subnormals).
    """
    return torch.exp2(torch.ceil(torch.log2(fp8_scale(amax))))


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """uint8 bits of ``x / scale`` in e4m3; values beyond ±448·scale saturate instead of becoming inf/NaN."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(torch.uint8)


def dequantize_fp8(bits: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    return (bits.view(FP8_DTYPE).float() * scale).to(dtype)


@dataclass(frozen=True)
class KVScales:
    """Static per-layer FP8 scales for K and V (``scale = amax / 448``), as ``tessera calibrate`` writes them.

    ``k_amax``/``v_amax`` are the absolute maxima observed over ``tokens`` calibration tokens; they are
    kept so a reader can see how much headroom the scales have.
    """

    k_scale: tuple[float, ...]
    v_scale: tuple[float, ...]
    k_amax: tuple[float, ...]
    v_amax: tuple[float, ...]
    tokens: int = 0
    model: str = ""

    @classmethod
    def from_amax(cls, k_amax: list[float], v_amax: list[float], tokens: int, model: str = "") -> KVScales:
        k = fp8_scale(torch.tensor(k_amax, dtype=torch.float64)).tolist()
        v = fp8_scale(torch.tensor(v_amax, dtype=torch.float64)).tolist()
        return cls(tuple(k), tuple(v), tuple(k_amax), tuple(v_amax), tokens, model)

    @property
    def num_layers(self) -> int:
        return len(self.k_scale)

    def save(self, path: str | Path) -> None:
        body = {"format": SCALES_FORMAT, "fp8_max": FP8_MAX, "num_layers": self.num_layers, **asdict(self)}
        Path(path).write_text(json.dumps(body, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> KVScales:
        """Read a scales file; raises ValueError naming what is wrong with it."""
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(
                f"KV scales file {path} does not exist; write one with `tessera calibrate MODEL --out {path}`"
            ) from None
        except json.JSONDecodeError as e:
            raise ValueError(f"KV scales file {path} is not valid JSON: {e}") from None
        if not isinstance(raw, dict) or raw.get("format") != SCALES_FORMAT:
            raise ValueError(f'{path} is not a KV scales file (expected "format": "{SCALES_FORMAT}")')
        fields = ("k_scale", "v_scale", "k_amax", "v_amax")
        lists = {name: raw.get(name) for name in fields}
        lengths = {len(v) for v in lists.values() if isinstance(v, list)}
        if len(lengths) != 1 or any(not isinstance(v, list) for v in lists.values()):
            raise ValueError(f"{path}: {', '.join(fields)} must be lists with one entry per layer")
        values = [x for v in lists.values() for x in v]
        if any(not isinstance(x, int | float) or not math.isfinite(x) or x < 0 for x in values):
            raise ValueError(f"{path}: scales and amax values must be finite, non-negative numbers")
        if any(x <= 0 for x in lists["k_scale"] + lists["v_scale"]):
            raise ValueError(f"{path}: every scale must be positive")
        return cls(
            **{name: tuple(float(x) for x in v) for name, v in lists.items()},
            tokens=int(raw.get("tokens", 0)),
            model=str(raw.get("model", "")),
        )
