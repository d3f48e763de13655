"""`python -m meshtrain.cli COMMAND [--flags]`, as the `meshtrain` script."""

from meshtrain.cli import run

run()
