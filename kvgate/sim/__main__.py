"""`python -m kvgate.sim ...` until `kvgate sim` is wired into kvgate/cli.py."""

import argparse
import sys

from kvgate.logs import quiet_transformers_advice
from kvgate.sim.cli import add_arguments, run

quiet_transformers_advice()  # this is an entry point, as kvgate.cli.main is

parser = argparse.ArgumentParser(prog="kvgate sim", description=__doc__)
add_arguments(parser)
sys.exit(run(parser.parse_args()))
