"""Seeded chaos suite against a real `elasticep serve` deployment (a top-level tool: it
drives the deployment from outside, through `elasticep_testkit.harness`).

- `schedule` — random fault schedules from a seed (pure), one-line text form;
- `actions` — carry out each fault kind, restore the healthy baseline;
- `invariants` — request outcomes and membership agreement checks (pure);
- `runner` — trials against one reused deployment; `__main__` — the command line.
"""
