"""The `moemerge` command: thin Typer commands over the Python API, one module per command group.

Exit codes scripts can rely on: 0 success, 1 runtime error (bad or missing checkpoint, mismatch
between models, failed output check), 2 recipe or usage error, 130 interrupted.
"""

# registration order is the order of `moemerge --help`
# isort: off
from moemerge.cli import (  # noqa: F401
    build,
    demo,
    bake,
    extend,
    extract,
    finetune,
    import_mergekit,
    inspect,
    methods,
    route,
    shrink,
)
# isort: on
from moemerge.cli.app import app

__all__ = ["app"]
