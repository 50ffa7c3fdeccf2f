"""Benchmark drivers behind ``tessera bench``: they measure, and print a table or a JSON report.

The CLI (``tessera.cli.bench``) parses and checks the flags, then calls one ``run_*`` function here.
"""


class BenchError(Exception):
    """A bench could not measure what it set out to (a request failed, a server did not start); the CLI
    prints it without a traceback and exits 1."""
