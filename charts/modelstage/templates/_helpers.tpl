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

{{/* Node caching: where every pod mounts the node root (core.node_cache.POD_MOUNT). */}}
{{- define "modelstage.nodeCacheMount" -}}
/modelstage/node-cache
{{- end -}}

{{/* The node agent's user: the stager image's non-root user, the same the copy Jobs run as
(modelstage.operator.kube.NONROOT_UID), so that both may write under the root. */}}
{{- define "modelstage.nodeAgentUID" -}}
65532
{{- end -}}

{{- define "modelstage.nodeAgentName" -}}
{{- printf "%s-node-agent" (include "modelstage.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "modelstage.nodeAgentSelectorLabels" -}}
app.kubernetes.io/name: {{ include "modelstage.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: node-agent
{{- end -}}

{{- define "modelstage.nodeAgentLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "modelstage.nodeAgentSelectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* The agent's image (Dockerfile.agent): nodeCache.agent.image, the tag defaulting to the
appVersion. */}}
{{- define "modelstage.nodeAgentImage" -}}
{{- $image := .Values.nodeCache.agent.image | default dict -}}
{{- $repository := $image.repository | default "ghcr.io/modelstage/agent" -}}
{{- $tag := $image.tag | default .Chart.AppVersion -}}
{{- printf "%s:%s" $repository $tag -}}
{{- end -}}

{{/* The budget as the agent's --budget takes it: a quantity as given, bytes without the
float formatting Helm gives large numbers (5e+11). */}}
{{- define "modelstage.nodeAgentBudget" -}}
{{- $budget := .Values.nodeCache.agent.budget -}}
{{- if kindIs "string" $budget -}}{{ $budget }}{{- else -}}{{ int64 $budget }}{{- end -}}
{{- end -}}

{{/* A byte quantity (nodeCache.namespaceQuota, nodeCache.agent.verifyRate) as the agent's flags
take it: a string as given, a number without Helm's float formatting. */}}
{{- define "modelstage.byteQuantity" -}}
{{- if kindIs "string" . -}}{{ . }}{{- else -}}{{ int64 . }}{{- end -}}
{{- end -}}

{{/* The node root must be a directory of its own: the agent's initContainer hands it to the
agent's user, and copies are written and evicted under it. A system directory, or anything
under one the kubelet, the container runtime or the OS owns, is refused. */}}
{{- define "modelstage.checkNodeCacheRoot" -}}
{{- $root := .Values.nodeCache.root -}}
{{- $system := list "/bin" "/boot" "/dev" "/etc" "/lib" "/lib32" "/lib64" "/proc" "/root" "/run" "/sbin" "/sys" "/usr" "/var/lib/kubelet" "/var/lib/containerd" "/var/lib/docker" "/var/lib/cri-o" "/var/lib/etcd" "/var/log" "/var/run" -}}
{{- range $system -}}
{{- if or (eq $root .) (hasPrefix (printf "%s/" .) $root) -}}
{{- fail (printf "nodeCache.root %s is (under) the system directory %s: choose a directory of its own, e.g. /var/lib/modelstage/node-cache or a local disk's mount point" $root .) -}}
{{- end -}}
{{- end -}}
{{- $shared := list "/home" "/mnt" "/opt" "/srv" "/tmp" "/var" "/var/lib" "/var/tmp" "/data" -}}
{{- if has $root $shared -}}
{{- fail (printf "nodeCache.root %s is a shared directory: use a directory of its own under it" $root) -}}
{{- end -}}
{{- end -}}
