{{/* Chart name, truncated to the 63 characters of a label value. */}}
{{- define "rtrl-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: the release name, with the chart name unless the release already contains it;
     a release named after the project (`rtrl`, the README's) gives `rtrl-operator`, not
     `rtrl-rtrl-operator`. */}}
{{- define "rtrl-operator.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else if hasPrefix (printf "%s-" .Release.Name) $name }}
{{- $name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "rtrl-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every resource. */}}
{{- define "rtrl-operator.labels" -}}
helm.sh/chart: {{ include "rtrl-operator.chart" . }}
{{ include "rtrl-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: rtrl
{{- end }}

{{/* Labels selecting the operator pods. */}}
{{- define "rtrl-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rtrl-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "rtrl-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "rtrl-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "rtrl-operator.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{- define "rtrl-operator.clusterwide" -}}
{{- if empty .Values.watchNamespaces }}true{{ end }}
{{- end }}

{{- define "rtrl-operator.peered" -}}
{{- if gt (int .Values.replicas) 1 }}true{{ end }}
{{- end }}

{{- define "rtrl-operator.peeringName" -}}
{{- default (include "rtrl-operator.fullname" .) .Values.peering.name }}
{{- end }}

{{/*
RBAC rules, kept in step with the code: rtrl.kube.client.PERMISSIONS (rtrl's own calls) and
rtrl.kube.rbac.KOPF_* (kopf's). tests/contract/test_chart.py renders the chart and fails when
the grants differ in either direction. No wildcards.
*/}}
{{- define "rtrl-operator.namespacedRules" -}}
- apiGroups: [rtrl.io]
  resources: [rlcycles]
  verbs: [get, list, watch, patch]
- apiGroups: [rtrl.io]
  resources: [rlcycles/status]
  verbs: [get, patch]
- apiGroups: [rtrl.io]
  resources: [checkpoints]
  verbs: [get, list, watch, create, delete, patch]
- apiGroups: [rtrl.io]
  resources: [checkpoints/status]
  verbs: [get, patch]
# Children's ownerReferences set blockOwnerDeletion: OwnerReferencesPermissionEnforcement
# admission (OpenShift's default) requires update on the owner's finalizers for that.
- apiGroups: [rtrl.io]
  resources: [rlcycles/finalizers, checkpoints/finalizers]
  verbs: [update]
- apiGroups: [batch]
  resources: [jobs]
  verbs: [get, list, watch, create, delete]
# The seal CronJob of an RLCycle with spec.capture.
- apiGroups: [batch]
  resources: [cronjobs]
  verbs: [get, list, watch, create, delete, patch]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list]
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, watch, create, delete]
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, list, watch, create, delete, patch]
- apiGroups: [""]
  resources: [secrets]
  verbs: [get]
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, delete, patch]
- apiGroups: [gateway.networking.k8s.io]
  resources: [httproutes]
  verbs: [get, patch]
{{- end }}

{{/* kopf: CRD and Namespace observation (always cluster-scoped). Namespaces matter only
when the operator watches a list of them, which `rtrl operator --namespace` also does under
the cluster-wide ClusterRole. */}}
{{- define "rtrl-operator.scanningRules" -}}
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [list, watch]
- apiGroups: [""]
  resources: [namespaces]
  verbs: [list, watch]
{{- end }}

{{/* Labels selecting the feedback service's pods: a name of their own, so the operator's
     selectors (name and instance) never match them. */}}
{{- define "rtrl-operator.feedbackSelectorLabels" -}}
app.kubernetes.io/name: {{ include "rtrl-operator.name" . }}-feedback
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "rtrl-operator.feedbackImage" -}}
{{- $image := .Values.feedback.image }}
{{- if $image.digest }}
{{- printf "%s@%s" $image.repository $image.digest }}
{{- else }}
{{- printf "%s:%s" $image.repository (default .Chart.AppVersion $image.tag) }}
{{- end }}
{{- end }}

{{/*
The tenancy policy as the operator reads it (RTRL_POLICY, JSON): the values' policy, with
an empty jobServiceAccount or secretLabel left out (null: the namespace's default account;
any Secret), and maxResources set to null (helm drops a key set to null: no limit).
*/}}
{{- define "rtrl-operator.policy" -}}
{{- $policy := deepCopy .Values.policy -}}
{{- if not (hasKey $policy "maxResources") }}{{- $_ := set $policy "maxResources" nil }}{{- end -}}
{{- if not $policy.jobServiceAccount }}{{- $_ := unset $policy "jobServiceAccount" }}{{- end -}}
{{- if not $policy.secretLabel }}{{- $_ := set $policy "secretLabel" nil }}{{- end -}}
{{- toJson $policy -}}
{{- end -}}
