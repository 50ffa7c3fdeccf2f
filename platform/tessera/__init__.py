"""Tessera's control plane: settings, CLI, gateway, tenants, quotas, deployments."""

from pathlib import Path

# The trained default model ships in the repository (models/pycode-tiny, see its TRAINING.md). An install
# without it (a wheel) falls back to a random-weight demo model written by `tessera init-model`.
SHIPPED_MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "pycode-tiny"
