"""Drive a real `elasticep serve` deployment from outside: shared by `bench/` and
`elasticep_testkit.chaos`.

- `serve_process` — start/stop the `serve` subprocess, `join`, signal rank pids, HTTP
  status/scale, orphan checks (only pids this process started or read from the status);
- `status_watch` — background poller of the coordinator membership (epoch transitions);
- `load` — concurrent greedy streaming requests through the `openai` client, every token
  timestamped;
- `timeline` — pure statistics over those timestamps (gaps, tokens/s) and the PNG plot.
"""
