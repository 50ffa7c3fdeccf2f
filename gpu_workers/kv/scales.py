"""Static per-layer FP8 KV scales: what ``tessera calibrate`` writes and an FP8 deployment loads."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from gpu_workers.formats.fp8 import FP8_MAX, fp8_scale

SCALES_FORMAT = "tessera-kv-scales/1"


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
