"""Running the operator's decisions on one machine: an in-memory cluster that applies plan
actions like the API server, a local kubelet for Jobs, and ``rtrl demo`` on top."""
