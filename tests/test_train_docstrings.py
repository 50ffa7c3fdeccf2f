"""The trainer's --short-docstrings: every docstring of more than one paragraph is cut to its first, the code
around it is untouched, and a corpus cache records which text it was tokenised from."""

from __future__ import annotations

import ast
import textwrap

import pytest
import torch

from gpu_workers.tools.train import data, pycode
from gpu_workers.tools.train.docstrings import short_docstrings
from tests.test_train_device import small_stdlib  # noqa: F401  (the fixture)

SOURCE = textwrap.dedent(
    '''\
    """Module summary.

    More about the module.
    """
    import os


    def area(width, height):
        """Return the area of a rectangle.

        Parameters
        ----------
        width : float
        """
        return width * height


    class Box:
        r"""A box with \\escapes kept.
        Still the summary.

        Details.
        """

        def size(self):
            """
            The size, after a line holding only quotes.

            Details.
            """
            return 1

        def name(self):
            """One paragraph
            over two lines, kept whole."""
            return "box"
    \x0c
    def after_form_feed():
        \'\'\'Single quotes.

        Details.
        \'\'\'
    '''
)


def docstrings(tree: ast.AST) -> dict[str, str]:
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
            found[getattr(node, "name", "<module>")] = ast.get_docstring(node, clean=False)
    return found


def without_docstrings(tree: ast.AST) -> str:
    for node in ast.walk(tree):
        if (
            isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef))
            and ast.get_docstring(node) is not None
        ):
            node.body[0].value.value = ""
    return ast.dump(tree)


def test_each_docstring_is_cut_to_its_summary_and_the_code_is_untouched():
    cut = short_docstrings(SOURCE)

    got = docstrings(ast.parse(cut))
    assert got["<module>"] == "Module summary.\n"
    assert got["area"] == "Return the area of a rectangle.\n    "
    assert got["Box"] == "A box with \\escapes kept.\n    Still the summary.\n    "  # raw: kept as written
    assert got["size"] == "\n        The size, after a line holding only quotes.\n        "
    assert got["name"] == "One paragraph\n        over two lines, kept whole."
    assert got["after_form_feed"] == "Single quotes.\n    "
    assert without_docstrings(ast.parse(cut)) == without_docstrings(ast.parse(SOURCE))
    assert "Parameters" not in cut and "Details" not in cut and "\x0c" in cut
    assert short_docstrings(cut) == cut  # nothing left to cut


def test_text_that_does_not_parse_or_has_nothing_to_cut_is_returned_as_is():
    broken = 'def f(:\n    """Summary.\n\n    More.\n    """\n'
    assert short_docstrings(broken) == broken
    one_paragraph = 'def f():\n    """Summary\n    continued.\n    """\n    return 1\n'
    assert short_docstrings(one_paragraph) == one_paragraph
    concatenated = 'def f():\n    """Summary.\n\n    More.\n    """ "tail"\n'
    assert short_docstrings(concatenated) == concatenated


TINY = ["--vocab-size", "300", "--heldout-percent", "50"]


def test_the_corpus_is_tokenised_from_the_cut_text_and_its_cache_says_so(small_stdlib, tmp_path):  # noqa: F811
    full, _ = pycode.prepare_corpus(pycode.parse_args(TINY))
    cache = tmp_path / "short.pt"
    short, _ = pycode.prepare_corpus(
        pycode.parse_args([*TINY, "--short-docstrings", "--corpus-cache", str(cache)])
    )

    assert short.short_docstrings and not full.short_docstrings
    assert short.train_files == full.train_files
    assert len(short.train_stream) < 0.95 * len(full.train_stream)  # heapq's and queue's docstrings are long
    assert len(short.heldout_stream) < len(full.heldout_stream)
    texts = [short_docstrings((small_stdlib / name).read_text()) for name in short.train_files]
    assert torch.equal(data.token_stream(short.tokenizer, texts), short.train_stream)

    with pytest.raises(SystemExit, match="was made with --short-docstrings"):
        pycode.prepare_corpus(pycode.parse_args([*TINY, "--corpus-cache", str(cache)]))
    loaded, record = pycode.prepare_corpus(
        pycode.parse_args([*TINY, "--short-docstrings", "--corpus-cache", str(cache)])
    )
    assert record["loaded"] and loaded.short_docstrings
