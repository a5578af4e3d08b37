"""`python -m kvgate.sim ...` until `kvgate sim` is wired into kvgate/cli.py."""

import argparse
import sys

from kvgate.sim.cli import add_arguments, run

parser = argparse.ArgumentParser(prog="kvgate sim", description=__doc__)
add_arguments(parser)
sys.exit(run(parser.parse_args()))
