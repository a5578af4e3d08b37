"""What the ledger charges S1-shaped sets of open prefills (DeepSeek-V2-Lite, MLA, V2, 2,048-token
steps), before (the sum, capped at the profile's forward pass by the budget) and after the step
bound. `PYTHONPATH=.:tests .venv/bin/python bench/results/goodput-session27/ledger/charges.py`"""

from unit.test_step_bound import _demand, _predictor

from kvgate.gate.ledger import Ledger
from kvgate.memory.activation import profile_forward_bytes
from kvgate.units import MiB

p = _predictor("deepseek-v2-lite", "mla", "v2")
pf = profile_forward_bytes(p.layout.geometry, p.engine)
print(f"profile forward pass {pf / MiB:.1f} MiB")
SETS = [
    ("32,000 doc", [32000]),
    ("32,000 doc + 700 chat", [32000, 700]),
    ("32,000 doc + 2 x 700", [32000, 700, 700]),
    ("16,000 doc + 700 chat", [16000, 700]),
    ("4 x 700 chats", [700] * 4),
    ("10 x 700 chats", [700] * 10),
    ("16,000 + 32,000 docs", [16000, 32000]),
]
for name, prompts in SETS:
    demands = [_demand(p, n) for n in prompts]
    old = min(sum(d.profiled_prefill_bytes for d in demands), pf)
    ledger = Ledger()
    for d in demands:
        ledger.reserve(d)
    s = ledger.step()
    print(
        f"{name:24s} old {old / MiB:7.1f}  new profiled {s.forward_profiled / MiB:7.1f} + unprofiled "
        f"{s.unprofiled / MiB:6.1f} = {(s.forward_profiled + s.unprofiled) / MiB:7.1f} MiB"
    )
