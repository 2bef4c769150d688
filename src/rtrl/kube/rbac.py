"""The RBAC the operator needs, in code: the Helm chart's Roles and ClusterRoles grant exactly
this, no more (``tests/contract/test_chart.py`` renders the chart and compares).

- :data:`rtrl.kube.client.PERMISSIONS`: what rtrl's own code does (one path per call).
- :data:`KOPF_PERMISSIONS`: what kopf itself does in the watched namespaces.
- :data:`KOPF_CLUSTER_PERMISSIONS`: kopf's cluster-scoped reads: it watches CRDs to notice
  resources appearing or going away.
- :data:`KOPF_NAMESPACE_PERMISSIONS`: when watching a list of namespaces, kopf lists and
  watches Namespaces to notice one being created or deleted (clusterwide it does not). The
  cluster-wide grants include them too, so that ``rtrl operator --namespace NS`` runs under
  them (without, kopf retries the list for a minute at start, then goes on blind to
  namespace changes).
- :data:`KOPF_PEERING_PERMISSIONS` / :data:`KOPF_CLUSTER_PEERING_PERMISSIONS`: only with
  more than one replica (``--peering``): the KopfPeering in each watched namespace, or the
  ClusterKopfPeering when watching all namespaces. One replica runs ``--standalone``.
"""

from __future__ import annotations

from .client import PERMISSIONS

Permissions = dict[tuple[str, str], tuple[str, ...]]

KOPF_PERMISSIONS: Permissions = {
    # kopf's own Events (handler errors); rtrl's reconciler posts its Events itself.
    ("", "events"): ("create",),
}
KOPF_CLUSTER_PERMISSIONS: Permissions = {
    ("apiextensions.k8s.io", "customresourcedefinitions"): ("list", "watch"),
}
KOPF_NAMESPACE_PERMISSIONS: Permissions = {
    ("", "namespaces"): ("list", "watch"),
}
KOPF_PEERING_PERMISSIONS: Permissions = {
    ("kopf.dev", "kopfpeerings"): ("get", "list", "watch", "patch"),
}
KOPF_CLUSTER_PEERING_PERMISSIONS: Permissions = {
    ("kopf.dev", "clusterkopfpeerings"): ("get", "list", "watch", "patch"),
}


def merge(*tables: Permissions) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for table in tables:
        for key, verbs in table.items():
            out.setdefault(key, set()).update(verbs)
    return out


def required(
    *, clusterwide: bool, peering: bool
) -> tuple[dict[tuple[str, str], set[str]], dict[tuple[str, str], set[str]]]:
    """(namespaced, cluster) grants: what a Role in each watched namespace must allow (or,
    clusterwide, what the ClusterRole allows on namespaced resources), and what a
    ClusterRole must allow on cluster-scoped resources."""
    namespaced: list[Permissions] = [PERMISSIONS, KOPF_PERMISSIONS]
    cluster: list[Permissions] = [KOPF_CLUSTER_PERMISSIONS, KOPF_NAMESPACE_PERMISSIONS]
    if clusterwide:
        if peering:
            cluster.append(KOPF_CLUSTER_PEERING_PERMISSIONS)
    elif peering:
        namespaced.append(KOPF_PEERING_PERMISSIONS)
    return merge(*namespaced), merge(*cluster)


__all__ = [
    "KOPF_CLUSTER_PEERING_PERMISSIONS",
    "KOPF_CLUSTER_PERMISSIONS",
    "KOPF_NAMESPACE_PERMISSIONS",
    "KOPF_PEERING_PERMISSIONS",
    "KOPF_PERMISSIONS",
    "PERMISSIONS",
    "required",
]
