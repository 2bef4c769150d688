"""Kubernetes on one machine, for the demo, the tests and the benchmarks (like ``kopf.testing``).

Three ways to stand in for a cluster, each as real as its users need:

- :class:`~rtrl_localkube.cluster.LocalCluster`: an in-memory store that applies the
  planner's actions the way the API server would, with Job pods run as local processes
  (:mod:`~rtrl_localkube.podprocess`). ``rtrl demo`` drives it with simulated time.
- :class:`~rtrl_localkube.emulator.KubeEmulator`: an emulated API server (kmock) served over
  HTTP, whose Jobs :class:`~rtrl_localkube.job_runner.JobRunner` plays and whose Deployments
  :class:`~rtrl_localkube.deployment_controller.DeploymentController` rolls out, so the real
  operator process runs against it (tests/integration, bench/).
- :class:`~rtrl_localkube.controlplane.ControlPlane`: the real kube-apiserver, etcd and
  controllers, with a kubelet stand-in (:mod:`~rtrl_localkube.kubelet`) that runs pods as
  processes and a Gateway API stand-in (:mod:`~rtrl_localkube.gateway`) (tests/e2e;
  ``python -m rtrl_localkube [DIR]`` keeps one running).

Neither image ships this package.
"""
