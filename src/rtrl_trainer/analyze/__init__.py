"""The analyze step (``rtrl-job analyze``): judge a canary against the stable checkpoint.

``cli`` parses the flags, ``config`` builds the step's settings, ``scan`` makes the one
streaming pass over the two arms' shards into ``accumulate``'s per-unit sums, ``estimate``
turns them into differences; the sequential statistics judge them: ``confidence`` (the
always-valid intervals), ``srm`` (the sample-ratio test), ``rule`` (verdicts and the
decision) and ``decide`` (its reasons and rows); ``step`` runs it all and commits
analysis.json.
"""
