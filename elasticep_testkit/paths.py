"""Where the repository and its bundled demo model are, for tests, benches and the
testkit: the one place that spells the demo model's path.

Both are found next to this package (it lives in the repository, not in the wheel).
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# the tiny Qwen3-MoE checkpoint of models/ (also serve's and generate's default --model)
DEMO_MODEL = REPO / "models" / "tiny-qwen3-moe"
