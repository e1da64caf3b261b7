"""Test and benchmark tooling for ElasticEP, kept out of the runtime package.

- ``paths``: ``REPO`` and ``DEMO_MODEL``, the bundled demo model's directory;
- ``prompts``: the one loader of the bundled GSM8K sample (``data/gsm8k/test_head64.jsonl``);
- ``harness``: drives a real ``elasticep serve`` from outside (CLI and HTTP only);
- ``chaos``: ``python -m elasticep_testkit.chaos``, seeded fault schedules and invariants.

It lives in the repository, not in the ``elasticep`` wheel, and needs the ``test`` extra
(``pip install -e '.[test]'``: ``openai``, ``httpx``, ``matplotlib``, pytest). It finds
the repository's data next to itself.
"""
