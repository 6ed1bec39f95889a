"""The command groups of the `cachefs` CLI, one module each; cachefs/cli.py builds the parser
from them (each module's ``add_*`` functions) and turns every failure into one line."""
