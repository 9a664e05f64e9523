{{/* The chart's name, shortened to a DNS label. */}}
{{- define "modelstage.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The release's full name: the prefix of every object the chart creates. */}}
{{- define "modelstage.fullname" -}}
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

{{- define "modelstage.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "modelstage.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "modelstage.selectorLabels" -}}
app.kubernetes.io/name: {{ include "modelstage.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "modelstage.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "modelstage.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "modelstage.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "modelstage.stagerImage" -}}
{{- printf "%s:%s" .Values.stagerImage.repository (default .Chart.AppVersion .Values.stagerImage.tag) -}}
{{- end -}}

{{/* The namespaces served in namespaced mode, as a list (the release namespace by default). */}}
{{- define "modelstage.watchedNamespaces" -}}
{{- $namespaces := .Values.watch.namespaces | default (list .Release.Namespace) | uniq -}}
{{- toJson $namespaces -}}
{{- end -}}

{{/* kopf's peering object: the name modelstage.operator.settings gives kopf (PEERING_NAME). */}}
{{- define "modelstage.peeringName" -}}
modelstage
{{- end -}}

{{/* The operator's bind address as a URL host: the pod's IP by default, brackets for IPv6. */}}
{{- define "modelstage.bindHostForURL" -}}
{{- $host := .Values.operator.bindAddress | default "$(POD_IP)" -}}
{{- if contains ":" $host -}}[{{ $host }}]{{- else -}}{{ $host }}{{- end -}}
{{- end -}}
