"""The held-out H1-H6 (scenarios.py) replayed with every request non-streaming: `H1n` plays H1's
very calls without `stream` (non_streaming.py says why).

    python -m bench.repeat_arm H1n --scenarios-from tests/heldout/non_streaming_heldout.py --arm kvgate
"""

from __future__ import annotations

from pathlib import Path

from bench.__main__ import module_from, scenarios_from

_HERE = Path(__file__).parent
SCENARIOS = module_from(_HERE / "non_streaming.py").plain_variants(scenarios_from(_HERE / "scenarios.py"))
