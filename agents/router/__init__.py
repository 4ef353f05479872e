"""The router: one URL per run in front of the engines' OpenAI endpoints,
keeping each agent session on one engine and recording its exact tokens.

- `agents.router.actor`: the Ray actor that serves it, one URL per run
  (`start_router`, `Router`).
- `agents.router.proxy`: the HTTP side: the routes, forwarding a request to
  an engine, failover, each session's record (`SessionProxy`, `build_app`).
- `agents.router.placement`: which engine serves a session (sticky, least
  loaded by requests in flight and KV-cache use, round robin), pure
  (`SessionPlacement`, `RouterStats`).
- `agents.router.loads`: the engines' own load reports that placement weighs
  (`LoadReports`).
- `agents.router.transport`: the HTTP connections to the engines (an aiohttp
  transport under httpx).
- `agents.router.turns`: a session's turns assembled into exact-token
  trajectories (`TrajectoryBuilder`), split where a prompt leaves the stream.

The engines' side of HTTP (the server, the trajectory type) is in
`engines.serving` and `engines.trajectory`.
"""
