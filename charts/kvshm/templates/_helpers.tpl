{{/* Names: <fullname> is the release name, unless it already contains the chart name. */}}
{{- define "kvshm.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvshm.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* <fullname>-<component>, kept within 63 characters. Call with (list . "agent"). */}}
{{- define "kvshm.componentName" -}}
{{- $root := index . 0 -}}
{{- printf "%s-%s" (include "kvshm.fullname" $root | trunc 50 | trimSuffix "-") (index . 1) -}}
{{- end -}}

{{- define "kvshm.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "kvshm.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvshm
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels of one component. Call with (list . "agent"). */}}
{{- define "kvshm.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "kvshm.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/* All labels of one component's objects. Call with (list . "agent"). */}}
{{- define "kvshm.componentLabels" -}}
{{ include "kvshm.labels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "kvshm.image" -}}
{{- $image := .Values.image -}}
{{- if $image.digest -}}
{{- printf "%s@%s" $image.repository $image.digest -}}
{{- else -}}
{{- printf "%s:%s" $image.repository (default .Chart.AppVersion $image.tag) -}}
{{- end -}}
{{- end -}}

{{/* ServiceAccount name of a component. Call with (list . "agent"). */}}
{{- define "kvshm.serviceAccountName" -}}
{{- $root := index . 0 -}}
{{- $component := index . 1 -}}
{{- $sa := get (get $root.Values $component) "serviceAccount" -}}
{{- if $sa.create -}}
{{- default (include "kvshm.componentName" (list $root $component)) $sa.name -}}
{{- else -}}
{{- /* never the namespace's "default" account: its ClusterRole would go to every pod there */ -}}
{{- required (printf "%s.serviceAccount.name is required when %s.serviceAccount.create is false: name the existing ServiceAccount the %s runs as (the chart binds its ClusterRole to it, so not the namespace's shared \"default\")" $component $component $component) $sa.name -}}
{{- end -}}
{{- end -}}

{{- define "kvshm.agent.priorityClassName" -}}
{{- $pc := .Values.agent.priorityClass -}}
{{- if $pc.create -}}
{{- default (include "kvshm.componentName" (list . "agent")) $pc.name -}}
{{- else -}}
{{- $pc.name -}}
{{- end -}}
{{- end -}}

{{/* The Prometheus Operator's API is served and the feature flag is on. Call with (list . flag). */}}
{{- define "kvshm.monitoringEnabled" -}}
{{- if and (index . 1) ((index . 0).Capabilities.APIVersions.Has "monitoring.coreos.com/v1") -}}
true
{{- end -}}
{{- end -}}

{{/*
The version of admissionregistration.k8s.io that serves ValidatingAdmissionPolicy here: v1
(Kubernetes 1.30+), v1beta1 (1.28 and 1.29 where the API server enables it), or "" (none).
*/}}
{{- define "kvshm.admissionPolicyVersion" -}}
{{- if .Capabilities.APIVersions.Has "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy" -}}
v1
{{- else if .Capabilities.APIVersions.Has "admissionregistration.k8s.io/v1beta1/ValidatingAdmissionPolicy" -}}
v1beta1
{{- end -}}
{{- end -}}

{{/*
The container securityContext shared by every kvshm container: no privilege escalation, read-only
root filesystem, RuntimeDefault seccomp, every capability dropped except those listed.
Call with (dict "add" (list ...) "root" bool).
*/}}
{{- define "kvshm.containerSecurityContext" -}}
allowPrivilegeEscalation: false
privileged: false
readOnlyRootFilesystem: true
{{- if .root }}
runAsNonRoot: false
runAsUser: 0
{{- else }}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
{{- end }}
seccompProfile:
  type: RuntimeDefault
capabilities:
  drop: [ALL]
  {{- with .add }}
  add:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}

{{/*
A ClusterRole with the given rules, bound to one ServiceAccount of the release's namespace.
Call with (dict "root" . "component" "agent" "rules" $rulesYaml), optionally with
"serviceAccount" (default: the component's) and "annotations".
*/}}
{{- define "kvshm.clusterRoleBound" -}}
{{- $root := .root -}}
{{- $name := include "kvshm.componentName" (list $root .component) -}}
{{- $meta := dict "name" $name "labels" (include "kvshm.componentLabels" (list $root .component) | fromYaml) -}}
{{- with .annotations }}{{ $_ := set $meta "annotations" . }}{{ end -}}
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  {{- toYaml $meta | nindent 2 }}
rules:
  {{- .rules | trim | nindent 2 }}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  {{- toYaml $meta | nindent 2 }}
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: {{ $name }}
subjects:
  - kind: ServiceAccount
    {{- if .serviceAccount }}
    name: {{ .serviceAccount }}
    {{- else }}
    name: {{ include "kvshm.serviceAccountName" (list $root .component) }}
    {{- end }}
    namespace: {{ $root.Release.Namespace }}
{{- end -}}
