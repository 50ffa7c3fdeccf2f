"""The JSON Schemas of the bench reports (``serve.schema.json``, ``matrix.schema.json``) and their validator.

The matrix schema reuses the serve schema's definitions through its ``$id``, ``urn:tessera:bench:serve``.
"""

from __future__ import annotations

import json
from importlib import resources

from tessera.bench import BenchError

NAMES = ("serve", "matrix")


def load(name: str) -> dict:
    """The schema of ``tessera bench NAME --json``'s report."""
    if name not in NAMES:
        raise BenchError(f"no report schema named {name!r}: there are {', '.join(NAMES)}")
    return json.loads(resources.files(__name__).joinpath(f"{name}.schema.json").read_text())


def validate(report: dict, name: str) -> None:
    """Raise ``jsonschema.ValidationError`` (the most relevant error, with its path) unless ``report`` is a
    valid ``name`` report."""
    try:
        import jsonschema
        from referencing import Registry, Resource
    except ImportError:
        raise BenchError("validating a report needs jsonschema: pip install 'jsonschema>=4.18'") from None
    schemas = [load(n) for n in NAMES]
    registry = Registry().with_resources((s["$id"], Resource.from_contents(s)) for s in schemas)
    validator = jsonschema.Draft202012Validator(load(name), registry=registry)
    errors = list(validator.iter_errors(report))
    # A subschema that failed evaluates no properties, so every field it knows is "unevaluated" too: say
    # what failed in it, not that.
    errors = [e for e in errors if e.validator != "unevaluatedProperties"] or errors
    error = jsonschema.exceptions.best_match(errors)
    if error is not None:
        raise error
