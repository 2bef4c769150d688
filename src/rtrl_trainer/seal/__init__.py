"""``rtrl-job seal``: from the events the serving side wrote to the interaction shards the
stage reads, once each hour's feedback is final.

The capture proxy writes generation events, the feedback service feedback events, both
into hourly partitions of the hour the interaction was served
(:mod:`rtrl.core.events`). An hour can be *sealed* once every signal's maturity has
passed for its last interaction (plus a delay for the last files to ship): its
generations are joined with its feedback, deduplicated, judged (late, orphan,
conflicting feedback; unverified checkpoints, engine errors), and written as ordinary
shards with a marker listing them, written last. The stage run with ``--sealed`` reads
exactly the files the markers list.

- :mod:`~rtrl_trainer.seal.config`: flags to a :class:`~rtrl_trainer.seal.config.SealConfig`.
- :mod:`~rtrl_trainer.seal.join`: the join of one hour in DuckDB, out of core.
- :mod:`~rtrl_trainer.seal.rows`: the decided rows met with the generation files.
- :mod:`~rtrl_trainer.seal.step`: top to bottom, hour by hour.
"""
