"""``rtrl-job stage``: from logged interactions to a clean, rewarded, on-policy training set.

The first half of every cycle. It reads the interaction shards the serving checkpoint
produced, keeps the rows that are good and ready, rewards them, measures how the checkpoint
behaved, and writes the training set split for the trainer's data-parallel ranks, plus
``stage.json``, the summary the operator reads. One pass over the shards:

1. **Select** (pass 1). Stream the shards through the validating reader (bad files and rows
   are quarantined and counted by reason; duplicate ``interaction_id``s are dropped there,
   first good one kept), listing only the Hive partitions of the serving checkpoint and,
   when admitted, the previous one. Keep a row when

   - its ``checkpoint_id`` is the serving checkpoint (on-policy), or the previous one when
     ``data.maxOffPolicyFraction`` > 0 (off-policy, admitted below). Rows of checkpoints
     given with ``--exclude-checkpoint`` (rolled back) are never kept, even if named as
     previous; a row whose ``checkpoint_id`` disagrees with its file's ``checkpoint=`` path
     is quarantined as ``checkpoint_mismatch`` (which one served it is unknown, so its
     log-probs cannot be trusted as on- or off-policy);
   - its org passes ``data.population`` (``orgs`` / ``excludeOrgs``; a null org is in no
     listed org);
   - it was created at or after ``now - data.window`` (when a window is set);
   - it is *ready*: created at least ``data.maturity`` before ``now`` (else ``too_recent``)
     and its feedback is final, ``feedback_at`` set and not after ``now`` (else
     ``immature``);
   - it became ready after ``--since``: ``max(created_at + maturity, feedback_at) > since``
     (else ``already_staged``).

   ``since`` is a readiness watermark: the operator passes the previous stage's ``now``
   (reported as ``next_since``), so the intervals ``(since, now]`` of consecutive cycles
   partition time and every interaction is staged exactly once, in the cycle in which it
   became ready, however late its feedback arrived. Immature and too-recent rows are
   therefore not lost: a later cycle picks them up.

   The reader runs a batch ahead on a thread of its own (:mod:`rtrl_trainer.read_ahead`).
   Token ids are stored in two bytes when every file's footer declares them within
   0-65535 (:func:`token_id_type`, decided before the first row; each id is checked as it
   is packed, and a row that contradicts its footer is quarantined as
   ``statistics_mismatch``), else in four.

   Rewards (:mod:`rtrl_trainer.reward`) and behaviour monitors
   (:mod:`rtrl_trainer.monitors`) are computed per batch, and the selected rows, with
   their rewards, are dealt round-robin to ``train/rank-RRRRR-of-NNNNN.parquet`` as they
   come, each rank file encoded by a worker thread (:mod:`rtrl_trainer.stage.ranks`;
   hashed and flushed to disk as it grows, since its bytes are final once written; the
   advantages, in a file of their own per rank, come in step 3). Only when
   previous-checkpoint rows are admissible do the selected rows wait in a local scratch
   file instead (Arrow IPC with zstd-compressed buffers, not re-encoded on the way in or
   out): which of those rows enter the set is known only once all are read.

2. **Decide.** If more than ``data.maxBadFraction`` of the rows read were bad, fail (exit
   1) and commit only ``stage.json`` with ``ok: false``. Admit previous-checkpoint rows up
   to ``maxOffPolicyFraction`` of the final set, choosing them by a hash of their
   ``interaction_id`` (the same rows on every rerun). Below ``minInteractions`` or
   ``minTokens`` the set is insufficient: ``stage.json`` says so, no training set is
   written, and that is not an error (exit 0).

3. **Advantages.** (With a scratch file, first stream it and deal its on-policy and
   admitted rows to the rank files, in the order they were read.) Compute the advantages
   with the whole set's baselines and standard deviation and write each rank's advantage
   file (``train/rank-RRRRR-of-NNNNN.advantage.parquet``: one ``advantage`` column, the
   rank file's rows in its order).

4. **Commit** everything through the object store's commit protocol (manifest last), so a
   reader never sees a half-written training set. A ``file://`` output store had the files
   written in place under hidden temp names: they are renamed, not copied (the rank files
   were hashed and made durable while written). Files depend
   only on the inputs; timing sits under ``timing`` in ``stage.json``, so a rerun gives
   identical files otherwise.

Memory is bounded by a few batches whatever the number of rows, plus 8 bytes per row in the
reader's duplicate set and 20 bytes per eligible previous-checkpoint row (their hashes,
rewards, strata and lengths, needed to choose them after pass 1). Each row's reward and
stratum wait for step 3 in a side file on local disk (8 bytes a row), not in memory.

Modules: :mod:`~rtrl_trainer.stage.config` (the typed config), :mod:`~.select` (pass 1),
:mod:`~.admit` (off-policy admission, pass 2), :mod:`~.ranks` (the rank and advantage
files), :mod:`~.workers` (background writers and digests), :mod:`~.commit` (staging and
the commit), :mod:`~.step` (the step, top to bottom), :mod:`~.cli` (``rtrl-job stage``).
The staged set's format itself is :mod:`rtrl_trainer.stagedset`'s.
"""
