"""The run machinery the Prefect tasks (one level up) call: Ray connection,
prompts, shards and their records, the generation plans and iteration
reports, the shard writers, dispatch over the engine pool, metrics and
curves, progress, metric loggers and artifacts. Nothing here is a Prefect
task, nor imports one."""
