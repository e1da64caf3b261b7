"""The HTTP front-end: the OpenAI API, request routing over data-parallel ranks, resuming
a dead rank's requests on survivors, and the membership view it routes by.

- ``core``: :class:`Frontend`, the asyncio core (link pump, streams), with
  ``membership_watch`` (the membership watcher);
- ``request_tracker``: pure routing and resume decisions (no I/O, injected clock);
- ``http_server`` / ``openai_serving`` / ``openai_protocol`` (requests) /
  ``openai_responses`` / ``api_errors`` (the error shape and shared checks): FastAPI app
  and schemas;
- ``incremental_text``: streamed detokenization; ``metrics``: Prometheus metrics;
- ``membership_source``: the ``MembershipSource`` protocol it polls (the deployment supplies one);
- ``api_server_pool`` / ``api_server_proc``: a node's extra front-end processes on one
  listening socket (``serve --api-server-count``), with ``loop_beats`` (the liveness
  of each one's event loop).

It knows nothing of how ranks are started (``elasticep.deploy``) or of the CLI.
"""
