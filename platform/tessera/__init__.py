"""Tessera's control plane: settings, CLI, gateway, tenants, quotas, deployments."""

from importlib.resources import files
from pathlib import Path

# Package data, found through importlib.resources so that a checkout (editable install) and a wheel
# agree: tessera/_models and tessera/_migrations are symlinks to the checkout's models/ and migrations/
# (the single source), and the wheel carries copies of them. See README "Installing from a wheel".
PACKAGE_DATA = Path(str(files(__name__)))

# The trained default model (models/pycode-tiny, see its TRAINING.md). An install without it falls back
# to a random-weight demo model written by `tessera init-model`.
SHIPPED_MODEL_DIR = (PACKAGE_DATA / "_models" / "pycode-tiny").resolve()
