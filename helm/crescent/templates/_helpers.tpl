{{/* Shared names, labels and snippets. Components: gateway, scheduler, prefill, decode, aggregated, kvstore. */}}

{{- define "crescent.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* "<release>-<chart>", or the release name alone when it already contains the chart name. */}}
{{- define "crescent.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "crescent.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every resource. */}}
{{- define "crescent.labels" -}}
helm.sh/chart: {{ include "crescent.chart" . }}
app.kubernetes.io/name: {{ include "crescent.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: crescent
{{- end }}

{{/* Selector labels of the whole release; the NetworkPolicy admits pods that carry them. */}}
{{- define "crescent.releaseSelectorLabels" -}}
app.kubernetes.io/name: {{ include "crescent.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Selector labels of one component. Call with (dict "root" $ "component" "gateway"). */}}
{{- define "crescent.selectorLabels" -}}
{{ include "crescent.releaseSelectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* All labels of one component's resources. Call with (dict "root" $ "component" "gateway"). */}}
{{- define "crescent.componentLabels" -}}
{{ include "crescent.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "crescent.componentName" -}}
{{- printf "%s-%s" (include "crescent.fullname" .root) .component | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "crescent.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "crescent.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* A component's image: repository@digest when a digest is set (immutable), else repository:tag. Call with the component's values. */}}
{{- define "crescent.image" -}}
{{- if .image.digest }}{{ printf "%s@%s" .image.repository .image.digest }}{{ else }}{{ printf "%s:%s" .image.repository .image.tag }}{{ end }}
{{- end }}

{{- define "crescent.schedulerAddress" -}}
{{- printf "%s:%d" (include "crescent.componentName" (dict "root" . "component" "scheduler")) (int .Values.scheduler.grpcPort) }}
{{- end }}

{{/* Address of the kvstore on the caller's own node (a Service with internalTrafficPolicy Local). */}}
{{- define "crescent.localKvstoreAddress" -}}
{{- printf "%s:%d" (include "crescent.componentName" (dict "root" . "component" "kvstore-local")) (int .Values.kvstore.grpcPort) }}
{{- end }}

{{/* A number as prometheus_client writes it in an `le` label: 2 -> "2.0", 0.1 -> "0.1". */}}
{{- define "crescent.leLabel" -}}
{{- $s := toString . }}
{{- if contains "." $s }}{{ $s }}{{ else }}{{ printf "%s.0" $s }}{{ end }}
{{- end }}

{{/* Settings common to every pod of the release. */}}
{{- define "crescent.podSpecCommon" -}}
serviceAccountName: {{ include "crescent.serviceAccountName" . }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
{{- range . }}
  - name: {{ . }}
{{- end }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end }}

{{/* nodeSelector, tolerations and affinity of a component. Call with its values. */}}
{{- define "crescent.placement" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Probes on the admin (or gateway) HTTP port named "admin" / "http"; the startup probe allows
startupFailures misses (default 150), or startupSeconds when given. */}}
{{- define "crescent.probes" -}}
startupProbe:
  httpGet: {path: /health, port: {{ .port }}}
  periodSeconds: 2
  failureThreshold: {{ if .startupSeconds }}{{ div (int .startupSeconds) 2 }}{{ else }}{{ .startupFailures | default 150 }}{{ end }}
readinessProbe:
  httpGet: {path: /health, port: {{ .port }}}
  periodSeconds: 2
  failureThreshold: 2
# Liveness only checks that the process answers: /health turns 503 while a dependency is away,
# and restarting a pod for that would not help.
livenessProbe:
  tcpSocket: {port: {{ .port }}}
  periodSeconds: 10
  failureThreshold: 6
{{- end }}

{{/* Environment every Crescent container gets: writable HOME (the root filesystem is read-only) and pod identity. */}}
{{- define "crescent.baseEnv" -}}
- name: HOME
  value: /tmp
- name: POD_NAME
  valueFrom: {fieldRef: {fieldPath: metadata.name}}
- name: POD_IP
  valueFrom: {fieldRef: {fieldPath: status.podIP}}
- name: NODE_NAME
  valueFrom: {fieldRef: {fieldPath: spec.nodeName}}
{{- end }}

{{/* A ServiceMonitor scraping a component's Service on the named port. Call with (dict "root" $ "component" "gateway" "port" "http"). */}}
{{- define "crescent.serviceMonitor" -}}
{{- $m := .root.Values.monitoring.serviceMonitor }}
apiVersion: monitoring.coreos.com/v1
kind: ServiceMonitor
metadata:
  name: {{ include "crescent.componentName" . }}
  labels:
    {{- include "crescent.componentLabels" . | nindent 4 }}
    {{- with $m.labels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  # The job label is the Service name ("<release>-<component>"), which the alert rules select on.
  selector:
    matchLabels:
      {{- include "crescent.selectorLabels" . | nindent 6 }}
    # Not the kvstore's node-local Service: it routes to the same pods and would scrape them twice.
    matchExpressions:
      - {key: crescent.io/node-local, operator: DoesNotExist}
  namespaceSelector:
    matchNames: [{{ .root.Release.Namespace }}]
  endpoints:
    - port: {{ .port }}
      path: /metrics
      interval: {{ $m.interval }}
      {{- with .bearerSecret }}
      # The admin key: with auth on, the gateway's per-tenant spend is served to it alone.
      authorization:
        type: Bearer
        credentials: {name: {{ . | quote }}, key: admin-key}
      {{- end }}
{{- end }}

{{/* Distinct admin ports of the enabled gRPC components, as a JSON list. */}}
{{/* The kvstore's TCP side-channel port as its config ends up (kvstore.settings may override
sideChannel); empty when the kvstore or its side channel is off. */}}
{{- define "crescent.kvstoreSideChannelPort" -}}
{{- $v := .Values.kvstore }}
{{- $over := get $v.settings "side_channel" | default dict }}
{{- if and $v.enabled (ternary $over.enabled $v.sideChannel.enabled (hasKey $over "enabled")) }}
{{- ternary $over.port $v.sideChannel.port (hasKey $over "port") | int }}
{{- end }}
{{- end }}

{{/* Decode's handoff side-channel port as its config ends up (decode.settings may override
handoffSideChannel); empty when decode or its side channel is off. */}}
{{- define "crescent.decodeHandoffSideChannelPort" -}}
{{- $v := .Values.decode }}
{{- if and $v.enabled (ternary (get $v.settings "tcp_handoff") $v.handoffSideChannel.enabled (hasKey $v.settings "tcp_handoff")) }}
{{- ternary (get $v.settings "handoff_side_channel_port") $v.handoffSideChannel.port (hasKey $v.settings "handoff_side_channel_port") | int }}
{{- end }}
{{- end }}

{{- define "crescent.adminPorts" -}}
{{- $ports := list }}
{{- range $c := list "scheduler" "prefill" "decode" "aggregated" "kvstore" }}
{{- $v := index $.Values $c }}
{{- if $v.enabled }}{{ $ports = append $ports (int $v.adminPort) }}{{ end }}
{{- end }}
{{- $ports | uniq | toJson }}
{{- end }}

{{/*
Shutdown of a pod that drains (gateway, prefill, decode, aggregated). On deletion Kubernetes runs preStop (a
sleep: the endpoint leaves its Service and the scheduler's discovery before the service hears
of it), then sends SIGTERM; the service drains for drain_grace_s, ends what is left, and exits
before terminationGracePeriodSeconds runs out (a margin of crescent.drainMarginSeconds).
Call with a component's values.
*/}}
{{- define "crescent.drainMarginSeconds" -}}5{{- end }}

{{- define "crescent.drainGraceSeconds" -}}
{{- $grace := sub (sub (int .terminationGracePeriodSeconds) (int .preStopSleepSeconds)) (int (include "crescent.drainMarginSeconds" .)) }}
{{- if lt $grace 1 }}
{{- fail (printf "terminationGracePeriodSeconds (%d) must exceed preStopSleepSeconds (%d) plus %s s for the service to drain in" (int .terminationGracePeriodSeconds) (int .preStopSleepSeconds) (include "crescent.drainMarginSeconds" .)) }}
{{- end }}
{{- $grace }}
{{- end }}

{{- define "crescent.preStop" -}}
{{- if gt (int .preStopSleepSeconds) 0 }}
lifecycle:
  preStop:
    exec:
      command: [sleep, {{ .preStopSleepSeconds | quote }}]
{{- end }}
{{- end }}

{{/*
GiB of huge pages the kvstore pod reserves: kvstore.hugepages.sizeGiB, or hostMemoryGiB when 0.
*/}}
{{- define "crescent.kvstoreHugePagesGiB" -}}
{{- $v := .Values.kvstore -}}
{{- int (ternary $v.hostMemoryGiB $v.hugepages.sizeGiB (eq (int $v.hugepages.sizeGiB) 0)) -}}
{{- end -}}

{{/* NetworkPolicy peers: this release's pods of the given components. Call with
(dict "root" $ "components" (list "gateway" ...)). */}}
{{- define "crescent.networkPeers" -}}
- podSelector:
    matchLabels:
      {{- include "crescent.releaseSelectorLabels" .root | nindent 6 }}
    matchExpressions:
      - {key: app.kubernetes.io/component, operator: In, values: {{ toJson .components }}}
{{- end }}

{{/* A component's podLabels (none of the chart's own: those select the pods). Call with
(dict "component" "gateway" "values" <its values>). */}}
{{- define "crescent.extraPodLabels" -}}
{{- range $key, $value := .values.podLabels }}
{{- if or (hasPrefix "app.kubernetes.io/" $key) (hasPrefix "crescent.io/" $key) (hasPrefix "helm.sh/" $key) }}
{{- fail (printf "%s.podLabels: %s is one of the chart's own labels (app.kubernetes.io/*, crescent.io/*, helm.sh/*), which select the pods; choose another key" $.component $key) }}
{{- end }}
{{- end }}
{{- with .values.podLabels }}{{ toYaml . }}{{ end }}
{{- end }}

{{/* Who schedules a component's pods and how: priorityClassName, runtimeClassName, schedulerName,
topologySpreadConstraints (each only when set). Call with the component's values. */}}
{{- define "crescent.podScheduling" -}}
{{- with .priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with .schedulerName }}
schedulerName: {{ . }}
{{- end }}
{{- with .topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* metadata.annotations of a Service from its component's service.annotations (nothing when none). Call with the component's values. */}}
{{- define "crescent.serviceAnnotations" -}}
{{- with .service.annotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
