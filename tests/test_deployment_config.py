"""DeploymentConfig: one owner of the deployment's flags, their checks and their JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from elasticep.config import (
    Backend,
    DeploymentConfig,
    DispatchAlgorithm,
    JoinMode,
    LoadFormat,
    WorkerConfig,
)
from elasticep.elastic.exit_code import ExitCode
from elasticep.entrypoints.cli import build_parser
from elasticep.entrypoints.serve_args import validate as serve_validate
from elasticep.frontend.incremental_text import IncrementalText, cut_at_stop
from elasticep.frontend_link import WorkerHello, is_routable
from elasticep.membership.transitions import SlotState


def test_json_round_trip_keeps_modes_as_enums_and_strings():
    d = DeploymentConfig(model="/m", ep_size=2, max_ep_size=4, ep_dispatch_algorithm="dynamic",
                         load_format="dummy", heartbeat_timeout_s=3.5)
    assert d.ep_dispatch_algorithm is DispatchAlgorithm.DYNAMIC
    assert d.load_format is LoadFormat.DUMMY and d.elastic_ep_backend is Backend.ELASTIC
    text = d.to_json()
    raw = json.loads(text)  # what a joiner reads from the coordinator's store
    assert (raw["ep_dispatch_algorithm"], raw["load_format"], raw["elastic_ep_backend"]) == (
        "dynamic", "dummy", "elastic")
    back = DeploymentConfig.from_json(text)
    assert back == d and back.load_format is LoadFormat.DUMMY
    # a mode prints as its string (messages, logs), and compares equal to it
    assert f"{back.load_format} {back.elastic_ep_backend}" == "dummy elastic"
    assert str(Backend.NONE) == "none" and Backend.NONE == "none"
    w = WorkerConfig(d, 3, "127.0.0.1:1", join_mode="scale")
    assert w.join_mode is JoinMode.SCALE
    assert WorkerConfig.from_json(w.to_json()) == w


@pytest.mark.parametrize("kwargs, message", [
    ({"ep_size": 0}, "--ep-size must be >= 1, got 0"),
    ({"ep_size": 4, "max_ep_size": 3}, r"--max-ep-size \(3\) must be >= --ep-size \(4\)"),
    ({"ep_size": 2, "max_ep_size": 2, "min_ep_size": 3},
     r"--min-ep-size must be in \[1, --ep-size \(2\)\], got 3"),
    ({"min_ep_size": 0}, r"--min-ep-size must be in \[1, --ep-size \(1\)\], got 0"),
    ({"elastic_ep_backend": "none", "ep_size": 2, "max_ep_size": 2, "min_ep_size": 1},
     "--elastic-ep-backend none cannot survive a failure, so it reserves no expert slots: "
     "drop --min-ep-size"),
    ({"max_total_tokens": 8}, "--max-total-tokens must be >= 16"),
    ({"heartbeat_timeout_s": float("inf")}, "--heartbeat-timeout must be a finite"),
    ({"log_stats_interval_s": -1.0}, "--log-stats-interval must be a finite"),
    ({"gc_warning_threshold_s": -1.0}, "--gc-warning-threshold-secs must be a finite"),
    ({"elastic_ep_backend": "none", "ep_size": 2, "max_ep_size": 3},
     "--elastic-ep-backend none cannot scale"),
    ({"elastic_ep_backend": "nccl"}, "--elastic-ep-backend must be one of elastic, none, got "
                                     "'nccl'"),
    ({"ep_dispatch_algorithm": "random"}, "--ep-dispatch-algorithm must be one of static, "
                                          "dynamic"),
    ({"load_format": "pt"}, "--load-format must be one of auto, safetensors, dummy"),
    ({"dtype": "float16"}, "--dtype must be one of float32, bfloat16, got 'float16'"),
])
def test_bad_values_raise_naming_the_flag(kwargs, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        DeploymentConfig(model="/m", **kwargs)


def test_from_json_refuses_unknown_fields_and_bad_values():
    with pytest.raises(ValueError, match="bad DeploymentConfig"):
        DeploymentConfig.from_json('{"model": "/m", "bogus": 1}')
    with pytest.raises(ValueError, match="--ep-size must be >= 1"):
        DeploymentConfig.from_json('{"model": "/m", "ep_size": 0}')
    with pytest.raises(ValueError, match='bad WorkerConfig: worker_config.join_mode: expected '
                       '.*JoinMode.*got "later"'):
        WorkerConfig.from_json(json.dumps({"deployment": {"model": "/m"}, "rank": 0,
                                           "coordinator": "h:1", "join_mode": "later"}))


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_both_commands_share_the_flags_and_defaults(command):
    extra = ["--prompt", "x"] if command == "generate" else []
    args = build_parser().parse_args([command, *extra, "--ep-size", "3",
                                      "--heartbeat-timeout", "4", "--load-format", "dummy"])
    d = DeploymentConfig.from_args(args)
    assert (d.ep_size, d.max_ep_size, d.heartbeat_timeout_s, d.load_format) == (3, 3, 4.0,
                                                                                "dummy")
    default = DeploymentConfig(model=d.model, ep_size=3, max_ep_size=3,
                               heartbeat_timeout_s=4.0, load_format="dummy")
    assert d == default  # every other flag's default is the dataclass's


def test_from_args_takes_overrides_and_leaves_absent_flags_at_their_defaults():
    args = argparse.Namespace(model="/m", ep_size=2, max_ep_size=None)
    d = DeploymentConfig.from_args(args, model="/resolved")
    assert (d.model, d.max_ep_size, d.max_running_requests) == ("/resolved", 2, None)


def test_is_routable_needs_healthy_and_the_hello_of_the_same_pid():
    hello = WorkerHello(rank=1, epoch=0, pid=42)
    assert is_routable(SlotState.HEALTHY, 42, hello)
    assert is_routable(SlotState.HEALTHY, None, hello)  # membership knows no pid
    assert not is_routable(SlotState.HEALTHY, 43, hello)  # a predecessor's hello
    assert not is_routable(SlotState.HEALTHY, 42, None)
    assert not is_routable(SlotState.DRAINING, 42, hello)


def test_one_stop_trimmer_for_generate_and_the_stream():
    assert cut_at_stop("abc STOP def END", ["END", "STOP", ""]) == "abc "
    assert cut_at_stop("abc", ["x"]) == "abc"
    text = IncrementalText(lambda ids: "".join(chr(i) for i in ids), ["ST"])
    streamed = "".join(text.push(ord(c)) for c in "abc ST def") + text.finish()
    assert streamed == cut_at_stop("abc ST def", ["ST"]) == "abc "


def test_exit_codes_are_the_statuses_the_supervisor_reads():
    assert (ExitCode.REMOVED, ExitCode.ERROR, ExitCode.LOST) == (0, 1, 3)


def test_the_config_module_sits_below_every_layer():
    """elastic/ and deploy/ read elasticep.config: it may import nothing of elasticep but
    the wire convention and the mode base (which import only the standard library), and
    nothing heavy, or a layer below would import upward through it."""
    import ast
    import sys
    from pathlib import Path

    import elasticep.config as config
    import elasticep.enums as enums
    import elasticep.wire as wire
    import elasticep.wire.values as wire_values

    def imports(module) -> set[str]:
        tree = ast.parse(Path(module.__file__).read_text())
        names = {alias.name for node in ast.walk(tree)
                 if isinstance(node, ast.Import) for alias in node.names}
        return names | {node.module for node in ast.walk(tree)
                        if isinstance(node, ast.ImportFrom) and node.module}

    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    assert {n.split(".")[0] for n in imports(config) - {"elasticep.wire", "elasticep.enums"}
            } <= stdlib
    for part in (wire, wire_values):  # the wire package imports only itself and the stdlib
        assert {n.split(".")[0] for n in imports(part) - {"elasticep.wire", "elasticep.wire.values"}
                } <= stdlib
    assert {n.split(".")[0] for n in imports(enums)} <= stdlib


def test_stall_grace_follows_the_coordinator_timeout():
    from elasticep.distributed.control import stall_grace_s
    assert stall_grace_s(15.0, 2.0) == 15.0
    assert stall_grace_s(1.0, 3.0) == 3.0  # never shorter than the heartbeat timeout
    import argparse
    args = argparse.Namespace(model="/m", coordinator_timeout=15.0, heartbeat_timeout=2.0)
    d = DeploymentConfig.from_args(args)
    assert d.coordinator_timeout_s == 15.0
    assert DeploymentConfig.from_json(d.to_json()).coordinator_timeout_s == 15.0
    with pytest.raises(ValueError, match="--coordinator-timeout"):
        DeploymentConfig(model="/m", coordinator_timeout_s=0)


def test_slot_reserve_defaults_to_surviving_one_death():
    """The elastic backend reserves slots for one failure unless told otherwise; the
    baseline, which cannot survive one, reserves nothing."""
    def cfg(**kw):
        return DeploymentConfig(model="/m", **kw)
    assert cfg(ep_size=4, max_ep_size=4).slot_reserve_ranks == 3
    assert cfg(ep_size=1, max_ep_size=2).slot_reserve_ranks == 1
    assert cfg(ep_size=4, max_ep_size=4, min_ep_size=4).slot_reserve_ranks == 4
    assert cfg(ep_size=4, max_ep_size=4, elastic_ep_backend="none").slot_reserve_ranks == 4
    args = build_parser().parse_args(["serve", "--model", "/m", "--ep-size", "4",
                                      "--min-ep-size", "2"])
    assert DeploymentConfig.from_args(args).slot_reserve_ranks == 2


def test_the_served_name_is_model_as_given(monkeypatch):
    """Clients send ``--model`` as they typed it (the resolved path was served: a 404),
    or ``--served-model-name``."""
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    s = serve_validate(build_parser().parse_args(["serve", "--model", "models/tiny-qwen3-moe/"]))
    assert s.served_model_name == "models/tiny-qwen3-moe/"
    assert Path(s.deployment.model).is_absolute()  # the ranks get the resolved directory
    s = serve_validate(build_parser().parse_args(
        ["serve", "--model", "models/tiny-qwen3-moe", "--served-model-name", "tiny"]))
    assert s.served_model_name == "tiny"
