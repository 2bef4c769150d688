"""The train step (``rtrl-job train``): one cycle of on-policy policy-gradient training
with DeepSpeed, from the parent checkpoint and the staged set to the next checkpoint.

loop.py is the training loop, read top to bottom; the other modules are its parts:
config.py and cli.py (what a run is asked to do), collectives.py (ranks agreeing),
state.py (inputs, rows, progress), examples.py and batches.py (rows to micro-batches),
engine.py and deepspeed_config.py (the policy and its DeepSpeed engine), forward.py and
loss.py (log-probs and the learning rule), resume.py (saved state) and publish.py.
Only cli.py and config.py may be imported without torch.
"""
