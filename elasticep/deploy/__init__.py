"""Assembling a deployment: start, relaunch, scale and stop ranks (serve, join and
generate alike), the coordinator of node 0, and the restart policy.

Imports downward only (distributed, elastic's configs and worker entry point, engine's
link types); the entrypoints build on it.
"""

from elasticep.deploy.deployment import Deployment
from elasticep.deploy.launcher import RankExit, RankLauncher, fetch_config, publish_config

__all__ = ["Deployment", "RankExit", "RankLauncher", "fetch_config", "publish_config"]
