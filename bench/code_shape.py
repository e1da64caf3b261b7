"""The shape of the runtime package: the figures of issue 45's review, for any tree.

    python -m bench.code_shape                      # this checkout, the walks as of now
    python -m bench.code_shape --root /tmp/fc68fa1 --walks review

Prints one JSON line per figure: ``lines`` (files and lines per package below
``elasticep/``, every line of every ``.py`` file), ``long_functions`` (every ``def``,
methods and nested ones too, whose span from ``def`` to its last line is over 60 lines),
``big_modules`` (modules over 400 lines) and one ``walk`` line per walk.

A walk is written down below as data: the functions a path enters, in call order, one
entry per call into another module (a return is no entry; a call back into a module
already left is a new one). Left out: logging, metrics, timers and first-token tracing,
fault hooks, constructors of plain data classes, and what torch does between our calls.
Each walk is checked against the tree (every entry must name a function or class there),
so a walk that code has moved away from fails (exit 1, one line per missing entry)
instead of printing a stale figure. Its figures: ``entries``, distinct ``modules`` and
``packages`` (the package below ``elasticep/``), and ``package_changes``, how often two
consecutive entries lie in different packages (the review's "bounces").

The walks (``docs/design/code_shape.md`` reads them):
- ``request``: one streamed chat completion without tools on an EP group over the CPU
  ``elastic`` backend, from the HTTP handler to the client's first chunk: the front-end
  in, the rank's step (the attention layers left out: only the MoE path), the front-end
  out;
- ``rank_death``: a survivor's view of a killed rank, without a membership store: the
  coordinator sees the EOF and announces, each survivor reports, the coordinator
  commits, the survivor applies the commit, its collective in flight raises, and it
  repairs the placement and the exchange before the next step; then the front-end
  learns the slot failed and moves the dead rank's requests;
- ``placement_repair``: the part of ``rank_death`` from ``placement_sync.reconcile`` to the
  swapped executor, the walk the review counted as its package sequence.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LONG_FUNCTION = 60  # lines: a function over this is counted
BIG_MODULE = 400  # lines: a module over this is counted

# ---- the walks, as the code stood at the review (fc68fa1) and as it stands now ---------
# A list per walk and tree; a comment starts each leg (a process or thread that picks the
# walk up: its first entry is where it does, and is counted as an entry).
_REPAIR_REVIEW = [
    "elastic/placement_sync.py:reconcile",
    "eplb/elastic.py:reconcile_placement",
    "elastic/placement_sync.py:commit_placement",  # (from reconcile, after the return)
    "moe/ep_executor.py:EPMoEExecutor.apply_placement",
    "eplb/weight_transfer.py:move_expert_weights",
    "eplb/elastic.py:plan_expert_loads",
    "elastic/placement_sync.py:commit_placement.commit",  # the commit all_reduce
    "eplb/metadata.py:ExpertLocationMetadata.from_placement",
    "moe/ep_executor.py:EPMoEExecutor.set_placement",
]
_REPAIR_NOW = [
    "elastic/placement_sync.py:reconcile",
    "eplb/elastic.py:reconcile_placement",
    "elastic/placement_sync.py:commit_placement",
    "eplb/elastic.py:plan_expert_loads",  # plan
    "moe/weight_transfer.py:move_expert_weights",  # move
    "elastic/placement_sync.py:_commit",  # commit: the all_reduce (back from the move)
    "eplb/metadata.py:ExpertLocationMetadata.from_placement",  # swap: from _swap
    "moe/ep_executor.py:EPMoEExecutor.set_placement",
]

WALKS: dict[str, dict[str, list[str]]] = {
    "request": {
        "review": [
            # front-end, the HTTP handler: to the rank's socket
            "frontend/http_server.py:build_app.chat_completions",
            "frontend/openai_serving.py:OpenAIServing.chat",
            "frontend/tokenizer.py:TokenizerPool.run",
            "frontend/openai_protocol.py:_SamplingFields.to_sampling_params",  # + resolve_max_tokens
            "engine/request.py:SamplingParams.validate",
            "frontend/core.py:Frontend.submit",
            "frontend/request_tracker.py:RequestTracker.add",
            "frontend_link/channels.py:FrontendChannel.send",
            # the rank's step loop: the socket to the committed token sent back
            "elastic/step_loop.py:LockstepLoop._iteration",
            "frontend_link/channels.py:WorkerChannel.poll",
            "elastic/serve_loop.py:apply_messages",
            "engine/llm_engine.py:LLMEngine.add_request",  # + abort
            "engine/request.py:SamplingParams.validate",
            "engine/sequence.py:Sequence.from_request",
            "engine/scheduler.py:Scheduler.add",
            "engine/llm_engine.py:LLMEngine.schedule",
            "engine/scheduler.py:Scheduler.schedule",
            "engine/kv_cache.py:BlockManager.grow",  # + can_grow
            "engine/llm_engine.py:LLMEngine.execute",
            "engine/model_runner.py:ModelRunner.forward",
            "models/model.py:MoECausalLM.forward",
            "models/moe_block.py:moe_block",
            "moe/ep_executor.py:EPMoEExecutor.__call__",
            "moe/dispatch.py:dispatch_pairs",  # + choose_physical_slots
            "moe/expert_compute.py:run_expert_rows",
            "moe/dispatch.py:combine_pairs",
            "engine/sampler.py:sample_batch",
            "engine/llm_engine.py:LLMEngine.commit",
            "frontend_link/channels.py:WorkerChannel.send_outputs",
            # front-end, the output pump: the socket to the request's stream
            "frontend/core.py:Frontend._pump_outputs",
            "frontend_link/channels.py:FrontendChannel.poll",
            "frontend/request_tracker.py:RequestTracker.on_outputs",
            "frontend/incremental_text.py:IncrementalText.push",
            "frontend/core.py:RequestStream.put",
            # front-end, the response's writer: the stream to the client's chunk
            "frontend/openai_serving.py:OpenAIServing.sse.body",
            "frontend/core.py:RequestStream.__anext__",
            "frontend/openai_serving.py:OpenAIServing.chat.chunk",
        ],
        "now": [
            "frontend/http_server.py:build_app.chat_completions",
            "frontend/openai_serving.py:OpenAIServing.chat",
            "frontend/chat_tools.py:tool_parser",
            "frontend/tokenizer.py:TokenizerPool.run",
            "frontend/api_errors.py:resolve_max_tokens",
            "frontend/openai_protocol.py:_SamplingFields.to_sampling_params",
            "frontend/sampling_fields.py:SharedSamplingFields.shared_params",  # + model_default
            "frontend/sampling_fields.py:validated",
            "engine/request.py:SamplingParams.validate",
            "frontend/chat_tools.py:with_forced_call",
            "frontend/core.py:Frontend.submit",
            "frontend/request_tracker.py:RequestTracker.add",
            "frontend_link/channels.py:FrontendChannel.send",
            "frontend/response_streams.py:sse_response",
            "elastic/step_loop.py:LockstepLoop._take_messages",
            "frontend_link/fanout.py:FrontendLinks.poll",
            "frontend_link/channels.py:WorkerChannel.poll",
            "elastic/serve_loop.py:apply_messages",
            "engine/llm_engine.py:LLMEngine.abort",
            "engine/grammar.py:Grammars.drop",
            "engine/llm_engine.py:LLMEngine.add_request",
            "engine/request.py:SamplingParams.validate",
            "engine/sequence.py:Sequence.from_request",
            "engine/scheduler.py:Scheduler.add",
            "engine/llm_engine.py:LLMEngine.schedule",
            "engine/scheduler.py:Scheduler.schedule",
            "engine/admission.py:take_chunks",  # + StepBudget.prefill_tokens
            "engine/kv_cache.py:BlockManager.grow",
            "elastic/step_header.py:step_header",  # + parse_header, agreed_max_tokens
            "engine/llm_engine.py:LLMEngine.execute",
            "engine/prompt_scoring.py:PromptScoring.of",
            "engine/model_runner.py:ModelRunner.forward",
            "models/model.py:MoECausalLM.forward",
            "models/moe_block.py:moe_block",
            "moe/ep_executor.py:EPMoEExecutor.__call__",
            "moe/exchange/uneven_exchange.py:uneven_dispatch",  # + choose_physical_slots
            "moe/experts/expert_compute.py:run_expert_rows",
            "moe/exchange/uneven_exchange.py:uneven_combine",
            "engine/grammar.py:Grammars.mask",
            "engine/sampler.py:sample_batch",
            "engine/llm_engine.py:LLMEngine.commit",
            "engine/grammar.py:Grammars.accept",
            "frontend_link/fanout.py:FrontendLinks.send_outputs",
            "frontend_link/channels.py:WorkerChannel.send_outputs",
            "frontend/core.py:Frontend._pump_outputs",
            "frontend_link/channels.py:FrontendChannel.poll",
            "frontend/request_tracker.py:RequestTracker.on_outputs",
            "frontend/incremental_text.py:IncrementalText.push",
            "frontend/request_stream.py:RequestStream.put",
            "frontend/response_streams.py:sse_response.body",
            "frontend/request_stream.py:RequestStream.__anext__",
            "frontend/openai_serving.py:OpenAIServing.chat.render",
        ],
    },
    "rank_death": {
        "review": [
            # the coordinator, the dead rank's connection: the EOF to the Announce
            "membership/server.py:Coordinator._serve",
            "membership/service.py:MembershipService.closed",
            "membership/transitions.py:state_after_death",
            "membership/registry.py:Group.set_state",
            "membership/registry.py:Transition.begin",
            "membership/protocol.py:Connection.send",
            # each survivor's control thread: the Announce to its report
            "distributed/control.py:RankControl._read_loop",
            "distributed/state.py:GroupState.on_push",
            "distributed/control.py:RankControl.send",
            "membership/protocol.py:Connection.send",
            # the coordinator, the last report's connection: the report to the Commit
            "membership/server.py:Coordinator._serve",
            "membership/service.py:MembershipService.handle",
            "membership/transitions.py:decide",
            "membership/registry.py:Group.commit",
            "membership/protocol.py:Connection.send",
            # each survivor's control thread: the Commit applied
            "distributed/control.py:RankControl._read_loop",
            "distributed/state.py:GroupState.on_push",
            "distributed/epoch_groups.py:EpochComms.abort_below",
            "distributed/epoch_log.py:EpochLog.add",
            "distributed/epoch_groups.py:EpochComms.for_epoch",
            # the survivor's step thread: its collective raises
            "distributed/state.py:GroupState._wait_work",
            # the raise lands in the step loop: recovery
            "elastic/step_loop.py:LockstepLoop.run",
            "distributed/api.py:get_current_epoch",
            "elastic/placement_sync.py:share_placement",
            "eplb/metadata.py:broadcast_global_expert_location_metadata",
            "distributed/api.py:get_active_ranks",
            *_REPAIR_REVIEW,
            "elastic/exchange_setup.py:sync_exchange",
            # the front-end's membership watch: the failed slot to the requests moved
            "frontend/core.py:Frontend._watch_membership",
            "deploy/membership.py:CoordinatorMembership.status",
            "membership/client.py:ReconnectingClient.call",
            "frontend_link/messages.py:is_routable",
            "frontend/request_tracker.py:RequestTracker.update_ranks",
            "frontend_link/channels.py:FrontendChannel.send",
        ],
        "now": [
            "membership/server.py:Coordinator._serve",
            "membership/service.py:MembershipService.closed",
            "membership/epoch_transitions.py:EpochTransitions._proc_dead",
            "membership/transitions.py:state_after_death",
            "membership/registry.py:Group.set_state",
            "membership/registry.py:Transition.begin",
            "membership/service.py:MembershipService._send",
            "membership/protocol.py:Connection.send",
            "distributed/control.py:RankControl._read_until_closed",
            "distributed/state.py:GroupState.on_push",
            "distributed/control.py:RankControl.send",
            "membership/protocol.py:Connection.send",
            "membership/server.py:Coordinator._serve",
            "membership/service.py:MembershipService.handle",
            "membership/epoch_transitions.py:EpochTransitions._maybe_commit",
            "membership/transitions.py:decide",
            "membership/registry.py:Group.commit",
            "membership/service.py:MembershipService._send",
            "membership/protocol.py:Connection.send",
            "distributed/control.py:RankControl._read_until_closed",
            "distributed/state.py:GroupState.on_push",
            "distributed/epoch_groups.py:EpochComms.abort_below",
            "distributed/epoch_log.py:EpochLog.add",
            "distributed/epoch_groups.py:EpochComms.for_epoch",
            "distributed/op_run.py:OpRun._wait_work",
            "distributed/state.py:GroupState.check_gen",
            "elastic/step_loop.py:LockstepLoop.run",
            "elastic/group_view.py:GroupView.epoch",
            "distributed/api.py:get_current_epoch",
            "elastic/placement_sync.py:share_placement",
            "eplb/metadata.py:broadcast_global_expert_location_metadata",
            "elastic/group_view.py:GroupView.active_mask",
            "distributed/api.py:get_active_ranks",
            *_REPAIR_NOW,
            "elastic/exchange_setup.py:sync_exchange",
            "frontend/membership_watch.py:MembershipWatch._watch_membership",
            "deploy/membership_backends.py:CoordinatorMembership.status",
            "membership/client.py:ReconnectingClient.call",
            "frontend_link/messages.py:is_routable",
            "frontend/request_tracker.py:RequestTracker.update_ranks",
            "frontend/core.py:Frontend._dispatch",
            "frontend_link/channels.py:FrontendChannel.send",
        ],
    },
    "placement_repair": {"review": _REPAIR_REVIEW, "now": _REPAIR_NOW},
}


def package_of(rel: str) -> str:
    """``frontend/core.py`` -> ``frontend``; a module directly in ``elasticep/`` ->
    ``(top level)``."""
    parts = Path(rel).parts
    return parts[0] if len(parts) > 1 else "(top level)"


def size_figures(pkg: Path) -> list[dict]:
    """The ``lines``, ``long_functions`` and ``big_modules`` records of package ``pkg``."""
    lines: Counter[str] = Counter()
    files: Counter[str] = Counter()
    long_fns, big = [], []
    for f in sorted(pkg.rglob("*.py")):
        rel = f.relative_to(pkg).as_posix()
        text = f.read_text()
        n = len(text.splitlines())
        lines[package_of(rel)] += n
        files[package_of(rel)] += 1
        if n > BIG_MODULE:
            big.append({"module": rel, "lines": n})
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                span = node.end_lineno - node.lineno + 1
                if span > LONG_FUNCTION:
                    long_fns.append({"function": f"{rel}:{node.lineno} {node.name}",
                                     "lines": span})
    per = {p: {"files": files[p], "lines": n} for p, n in lines.most_common()}
    return [
        {"figure": "lines", "packages": per, "files": sum(files.values()),
         "lines": sum(lines.values())},
        {"figure": "long_functions", "over": LONG_FUNCTION, "count": len(long_fns),
         "functions": sorted(long_fns, key=lambda r: -r["lines"])},
        {"figure": "big_modules", "over": BIG_MODULE, "count": len(big),
         "modules": sorted(big, key=lambda r: -r["lines"])},
    ]


def resolves(pkg: Path, entry: str) -> bool:
    """Whether ``module.py:Outer.inner`` names a def or class of that module of ``pkg``
    (each name looked for anywhere inside the one before it)."""
    rel, _, qualname = entry.partition(":")
    path = pkg / rel
    if not path.is_file():
        return False
    node: ast.AST = ast.parse(path.read_text())
    for name in qualname.split("."):
        found = next((n for n in ast.walk(node) if n is not node
                      and isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                      and n.name == name), None)
        if found is None:
            return False
        node = found
    return True


def walk_figures(name: str, entries: list[str]) -> dict:
    """The ``walk`` record of one walk (see the module docstring)."""
    modules = [e.partition(":")[0] for e in entries]
    packages = [package_of(m) for m in modules]
    changes = sum(a != b for a, b in zip(packages, packages[1:], strict=False))
    sequence = [p for i, p in enumerate(packages) if i == 0 or p != packages[i - 1]]
    return {"figure": "walk", "walk": name, "entries": len(entries),
            "modules": len(set(modules)), "packages": len(set(packages)),
            "package_changes": changes, "package_sequence": sequence}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.code_shape",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=REPO,
                    help="a tree's root (an export of a past commit, say); default: this one")
    ap.add_argument("--walks", choices=("now", "review"), default="now",
                    help="which written-down walks to check and count against the tree")
    args = ap.parse_args(argv)
    pkg = args.root / "elasticep"
    if not pkg.is_dir():
        print(f"code_shape: no elasticep/ under {args.root}", file=sys.stderr)
        return 2
    missing = [f"{name}: {e}" for name, by_tree in WALKS.items()
               for e in by_tree[args.walks] if not resolves(pkg, e)]
    if missing:
        for m in missing:
            print(f"code_shape: walk entry not in the tree: {m}", file=sys.stderr)
        return 1
    for record in size_figures(pkg):
        print(json.dumps(record))
    for name, by_tree in WALKS.items():
        print(json.dumps(walk_figures(name, by_tree[args.walks])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
