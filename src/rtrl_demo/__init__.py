"""``rtrl demo``: the real-time RL loop on this machine with simulated users (docs/demo.md).

The operator's planning core decides every step, :mod:`rtrl_localkube` applies the actions
and runs the Job pods, a serving fleet (:mod:`~rtrl_demo.fleet`, :mod:`~rtrl_demo.serve`)
answers simulated users (:mod:`~rtrl_demo.sim`), and :mod:`~rtrl_demo.report` writes the
report. Neither image ships this package.
"""
