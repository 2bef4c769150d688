"""The eval step (``rtrl-job eval``): may a candidate checkpoint be shown to users?

``cli`` parses the flags, ``config`` builds the step's settings, ``step`` runs the suites
and judges the gates (``gates``). The suites: ``replay`` and ``behaviour`` on the held-out
set, and the code suites (``suite``: tasks and humaneval) graded by ``grader`` inside
``sandbox`` (whose server, ``sandbox_server``, is a standalone script run beside
``sandbox_shared``, ``sandbox_seccomp`` and ``plain_values``, which is why they sit in this
directory).
"""
