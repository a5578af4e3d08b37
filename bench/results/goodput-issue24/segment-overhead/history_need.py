"""What S13's 4,096-token step needs after histories of other step sizes, by kvgate's replay.

    PYTHONPATH=. python bench/results/goodput-issue24/segment-overhead/history_need.py

kvgate charges one earlier step (kvgate/memory/activation.py profile_segment_overhead_bytes);
this shows what longer histories need under the same rules (kvgate/memory/allocator.py).
"""

import itertools

from kvgate.memory.activation import EngineShape, profile_forward_tape
from kvgate.memory.allocator import footprint, worst_need
from kvgate.memory.geometry import ModelGeometry
from kvgate.sim.presets import model_config
from kvgate.units import MiB

geometry = ModelGeometry.from_config(model_config("llama-3.1-8b"))
engine = EngineShape(max_model_len=16384, max_num_batched_tokens=4096, max_num_seqs=256, runner="v2")
step = profile_forward_tape(geometry, engine)
alone = footprint(step)
print(
    f"alone: allocated {alone.allocated_peak / MiB:.0f} MiB, cached {alone.reserved_peak / MiB:.0f}, needed {alone.need / MiB:.0f}"
)
sizes = [4096 * k // 16 for k in range(1, 17)]
tapes = {t: profile_forward_tape(geometry, engine, t) for t in sizes}
for depth in (1, 2):
    histories = ([tapes[t] for t in h] for h in itertools.product(sizes, repeat=depth))
    print(f"after {depth} earlier step(s) of 256-4,096 tokens: needed {worst_need(step, histories) / MiB:.0f} MiB")
