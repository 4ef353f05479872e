"""Partial rollouts: the generation of the `partial` schedule (slime's
--partial-rollout, AReaL's interruptible generation), in one place.

- task.py: the Prefect task, one iteration: its plan, the groups it keeps
  generating, the batch it takes, the carry to the next iteration;
- runner.py: `SegmentRunner`, which sends the groups' samples to the engines
  as segments and aborts what still runs once the batch is complete;
- left.py: `LeftRunning`, what an iteration leaves generating while the
  policy trains (and the next iteration's groups it starts then), until
  the flow stops it before the sync;
- segments.py: a sample and its group as plain data, resumed segment by
  segment and carried on disk between iterations (`CarryStore`).
"""
