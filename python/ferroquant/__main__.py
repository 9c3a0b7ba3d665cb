"""``python -m ferroquant`` runs the command line."""

from .cli import run

run()
