"""The run machinery the Prefect tasks (one level up) call: Ray connection,
prompts, shards and their records, dispatch over the engine pool, reports,
progress, metric loggers and artifacts. Nothing here is a Prefect task."""
