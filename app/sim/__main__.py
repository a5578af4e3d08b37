"""`python -m app.sim ...` until `kvgate sim` is wired into app/cli.py."""

import argparse
import sys

from app.sim.cli import add_arguments, run

parser = argparse.ArgumentParser(prog="kvgate sim", description=__doc__)
add_arguments(parser)
sys.exit(run(parser.parse_args()))
