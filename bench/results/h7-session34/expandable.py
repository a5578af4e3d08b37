"""H7 with expandable segments on both sides (vLLM PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, kvgate --expandable-segments), the pool re-advised: session 34.

PYTHONPATH=. python -m bench.repeat_arm H7e --scenarios-from bench/results/h7-session34/expandable.py --arm kvgate
"""

import dataclasses

from demo.replay import fully_utilized
from tests.heldout.scenarios import SCENARIOS as H

h7 = next(s for s in H if s.key == "H7")
sim = fully_utilized(dataclasses.replace(h7.sim, expandable_segments=True, kv_cache_memory_bytes=None))
SCENARIOS = [dataclasses.replace(h7, key="H7e", sim=sim, kvgate_flags=[*h7.kvgate_flags, "--expandable-segments"])]
