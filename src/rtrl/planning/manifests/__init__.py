"""What the objects a cycle creates look like, apart from the decisions to create them:
``names`` (object names, labels, owners, store locations), ``jobs`` (the Checkpoint, its
ConfigMap, Service and step Jobs) and ``canary`` (the canary workload and HTTPRoute rules).
Pure functions of the RLCycle, the Checkpoint and what was observed."""
