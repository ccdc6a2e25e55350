{{/* Names and labels shared by the chart's templates. */}}

{{- define "dynamograph.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "dynamograph.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "dynamograph.labels" -}}
{{ include "dynamograph.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: dynamograph
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "dynamograph.serviceAccountName" -}}
{{- default (include "dynamograph.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "dynamograph.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/*
The operator's permissions on the namespaced objects a graph owns. Least privilege: it never
updates (PUT) or lists across kinds it does not manage. It holds pods get/list/watch because
Kubernetes only lets it grant (in each graph's discovery Role) what it holds itself.
*/}}
{{- define "dynamograph.namespacedRules" -}}
- apiGroups: [dynamograph.io]
  resources: [dynamographs]
  verbs: [get, list, watch, patch]
- apiGroups: [dynamograph.io]
  resources: [dynamographs/status]
  verbs: [get, patch]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [services, configmaps, serviceaccounts]
  verbs: [get, list, create, patch, delete]
# Only create: the operator makes each graph's admin-token Secret and never reads a Secret.
- apiGroups: [""]
  resources: [secrets]
  verbs: [create]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, create, patch, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, create, patch, delete]
# Listed on every pass, which is how the operator learns whether the CRD is served.
- apiGroups: [monitoring.coreos.com]
  resources: [podmonitors]
  verbs: [get, list, create, patch, delete]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [get, list, create, patch, delete]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [get, list, watch, create, patch, delete]
# Granted to each graph's EPP (its discovery Role): RBAC lets the operator grant only what it
# holds. The EPP reads its pool's InferenceObjectives' priorities.
- apiGroups: [inference.networking.x-k8s.io]
  resources: [inferenceobjectives]
  verbs: [get, list, watch]
- apiGroups: [gateway.networking.k8s.io]
  resources: [httproutes]
  verbs: [get, list, watch, create, patch, delete]
# Read only: a graph's status.endpoint is the address of the Gateway its HTTPRoute attaches to.
- apiGroups: [gateway.networking.k8s.io]
  resources: [gateways]
  verbs: [get, list, watch]
- apiGroups: ["", events.k8s.io]
  resources: [events]
  verbs: [create]
{{- end -}}

{{/*
The peering rules for the operator's replicas: watch the peering objects (kopf lists and
watches them all), read and patch only its own (keep-alives go into its status).
*/}}
{{- define "dynamograph.peeringRules" -}}
{{- $resource := ternary "clusterkopfpeerings" "kopfpeerings" (empty .Values.watchNamespaces) -}}
- apiGroups: [kopf.dev]
  resources: [{{ $resource }}]
  verbs: [list, watch]
- apiGroups: [kopf.dev]
  resources: [{{ $resource }}]
  resourceNames: [{{ .Values.operator.peering | quote }}]
  verbs: [get, patch]
{{- end -}}
