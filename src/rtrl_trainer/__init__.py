"""rtrl_trainer: the Job side of rtrl, run as ``rtrl-job <step>`` inside Job pods and locally.

Each step reads and writes the object store only and writes its result as a small JSON
document, committed last, so the operator reads summaries and never bulk data.
"""
