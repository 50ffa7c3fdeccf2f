"""Docstrings cut to their summary paragraph: the text of ``--short-docstrings`` training.

A small model trained on library sources learns their long numpydoc / Sphinx docstrings, and greedy decoding
then loops inside one and never reaches code. Trained on the same files with every multi-paragraph docstring
cut to its first paragraph (the summary, as PEP 257 asks), it learns to close a docstring and write the body.

Only triple-quoted docstrings whose opening quotes start their line and whose closing quotes end theirs are
cut; the cut keeps the source's own text (prefixes, escapes, indentation) and closes it with the same quotes
on a line of their own. A file that no longer parses as the same module after the cut is left as it was.
"""

from __future__ import annotations

import ast
import re

_OPENING = re.compile(r"[rRuU]?(\"\"\"|''')")
_LINES = re.compile(r"[^\n]*\n|[^\n]+$")
_HAS_DOCSTRING = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def short_docstrings(text: str) -> str:
    """``text`` with each docstring of more than one paragraph cut to its first one (see the module)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return text
    lines = _LINES.findall(text)  # as the parser counts them: a form feed does not end a line
    cuts = (_cut(node, lines) for node in ast.walk(tree) if isinstance(node, _HAS_DOCSTRING))
    spans = sorted((span for span in cuts if span is not None), reverse=True)  # bottom up: indices hold
    if not spans:
        return text
    for start, end, replacement in spans:
        lines[start : end + 1] = replacement
    cut = "".join(lines)
    try:
        ast.parse(cut)
    except (SyntaxError, ValueError):
        return text
    return cut


def _cut(node: ast.AST, lines: list[str]) -> tuple[int, int, list[str]] | None:
    """(first line, last line, the lines that replace them) for ``node``'s docstring, or None to keep it."""
    body = getattr(node, "body", None)
    if not body or not isinstance(body[0], ast.Expr):
        return None
    expr = body[0].value
    if not (isinstance(expr, ast.Constant) and isinstance(expr.value, str)):
        return None
    start, end = expr.lineno - 1, expr.end_lineno - 1
    if end - start < 2:  # one or two lines: nothing to cut
        return None
    first = lines[start]
    indent = first[: len(first) - len(first.lstrip())]
    opening = _OPENING.match(first.lstrip())
    if opening is None or expr.col_offset != len(indent.encode()):
        return None
    quotes = opening.group(1)
    if not lines[end].rstrip().endswith(quotes) or lines[end].rstrip()[:-3].rstrip().endswith(quotes):
        return None  # something after the closing quotes, or an implicit concatenation
    # The summary: from the first line with text (the opening line, or the next when it holds only quotes)
    # to the line before the first blank one.
    text_from = start if first.strip() != opening.group(0) else start + 1
    para_end = next((i for i in range(text_from + 1, end) if not lines[i].strip()), None)
    if para_end is None or text_from >= end:  # one paragraph, or no text: kept whole
        return None
    summary = lines[start:para_end]
    if summary[-1].rstrip("\r\n").endswith("\\"):  # a continued line would swallow the closing quotes
        return None
    newline = "\r\n" if first.endswith("\r\n") else "\n"
    return start, end, [*summary, f"{indent}{quotes}{newline}"]
