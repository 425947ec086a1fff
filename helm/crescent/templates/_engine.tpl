{{/*
Prefill and decode are two roles of one engine; these helpers render either. Each topology group
gets its own Deployment (and HPA, PDB) per role; where its pods may land is _topology.tpl's.
Call with (dict "root" $ "role" "prefill"), plus "group" (the group's values) for per-group objects.
*/}}

{{- define "crescent.engineGroupName" -}}
{{- printf "%s-%s-%s" (include "crescent.fullname" .root) .role .group.name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "crescent.engineGroupSelector" -}}
{{ include "crescent.selectorLabels" (dict "root" .root "component" .role) }}
crescent.io/group: {{ .group.name }}
{{- end }}

{{- define "crescent.engineDeployment" -}}
{{- $root := .root }}
{{- $v := index $root.Values .role }}
{{- $component := dict "root" $root "component" .role }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "crescent.engineGroupName" . }}
  labels:
    {{- include "crescent.componentLabels" $component | nindent 4 }}
    crescent.io/group: {{ .group.name }}
  annotations:
    crescent.io/pod-security-level: {{ include "crescent.enginePodSecurityLevel" $root }}
spec:
  {{- if not (or $v.autoscaling.enabled $v.autoscaling.keda.enabled) }}
  replicas: {{ $v.replicas }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "crescent.engineGroupSelector" . | nindent 6 }}
  template:
    {{- include "crescent.enginePodTemplate" . | nindent 4 }}
{{- end }}

{{/* What an autoscaler scales: the group's Deployment, or its LeaderWorkerSet (scale subresource: instances). */}}
{{- define "crescent.engineScaleTargetRef" -}}
{{- if (index .root.Values .role).multiNode.enabled }}
apiVersion: leaderworkerset.x-k8s.io/v1
kind: LeaderWorkerSet
{{- else }}
apiVersion: apps/v1
kind: Deployment
{{- end }}
name: {{ include "crescent.engineGroupName" . }}
{{- end }}

{{/* The per-pod metric and target each role scales on. */}}
{{- define "crescent.engineScaleMetric" -}}
{{- if eq .role "prefill" }}crescent_engine_queue_depth{{ else }}crescent_engine_running_requests{{ end }}
{{- end }}

{{- define "crescent.engineScaleTarget" -}}
{{- $a := (index .root.Values .role).autoscaling }}
{{- if eq .role "prefill" }}{{ $a.queueDepthTarget }}{{ else }}{{ $a.runningRequestsTarget }}{{ end }}
{{- end }}

{{- define "crescent.engineHpa" -}}
{{- $a := (index .root.Values .role).autoscaling }}
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ include "crescent.engineGroupName" . }}
  labels:
    {{- include "crescent.componentLabels" (dict "root" .root "component" .role) | nindent 4 }}
    crescent.io/group: {{ .group.name }}
spec:
  scaleTargetRef:
    {{- include "crescent.engineScaleTargetRef" . | trim | nindent 4 }}
  minReplicas: {{ $a.minReplicas }}
  maxReplicas: {{ $a.maxReplicas }}
  metrics:
    - type: Pods
      pods:
        metric:
          name: {{ include "crescent.engineScaleMetric" . }}
        target:
          type: AverageValue
          averageValue: {{ include "crescent.engineScaleTarget" . | quote }}
  behavior:
    # GPU pods take minutes to load weights: scale up at once, scale down slowly.
    scaleUp:
      stabilizationWindowSeconds: 0
    scaleDown:
      stabilizationWindowSeconds: 600
{{- end }}

{{/* KEDA: the same per-pod metric, plus the role's latency p99 against its SLO. */}}
{{- define "crescent.engineScaledObject" -}}
{{- $root := .root }}
{{- $a := (index $root.Values .role).autoscaling }}
{{- $ns := $root.Release.Namespace }}
{{- $pods := printf "%s-.*" (include "crescent.engineGroupName" .) }}
{{- $latency := ternary "ttft" "tbt" (eq .role "prefill") }}
{{- $slo := ternary (float64 $root.Values.slo.ttftSeconds) (float64 $root.Values.slo.tbtSeconds) (eq .role "prefill") }}
apiVersion: keda.sh/v1alpha1
kind: ScaledObject
metadata:
  name: {{ include "crescent.engineGroupName" . }}
  labels:
    {{- include "crescent.componentLabels" (dict "root" $root "component" .role) | nindent 4 }}
    crescent.io/group: {{ .group.name }}
spec:
  scaleTargetRef:
    {{- include "crescent.engineScaleTargetRef" . | trim | nindent 4 }}
  minReplicaCount: {{ $a.minReplicas }}
  maxReplicaCount: {{ $a.maxReplicas }}
  cooldownPeriod: 600
  triggers:
    - type: prometheus
      metricType: AverageValue
      metadata:
        serverAddress: {{ $a.keda.prometheusAddress }}
        query: sum({{ include "crescent.engineScaleMetric" . }}{namespace="{{ $ns }}",pod=~"{{ $pods }}"})
        threshold: {{ include "crescent.engineScaleTarget" . | quote }}
    - type: prometheus
      # Value: replicas grow in proportion to how far the p99 is above 80% of the SLO.
      metricType: Value
      metadata:
        serverAddress: {{ $a.keda.prometheusAddress }}
        query: histogram_quantile(0.99, sum by (le) (rate(crescent_gateway_{{ $latency }}_seconds_bucket{namespace="{{ $ns }}"}[2m])))
        threshold: {{ mulf $slo 0.8 | toString | quote }}
{{- end }}

{{- define "crescent.enginePdb" -}}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "crescent.engineGroupName" . }}
  labels:
    {{- include "crescent.componentLabels" (dict "root" .root "component" .role) | nindent 4 }}
    crescent.io/group: {{ .group.name }}
spec:
  maxUnavailable: {{ (index .root.Values .role).podDisruptionBudget.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "crescent.engineGroupSelector" . | nindent 6 }}
{{- end }}

{{/* Headless: its EndpointSlices list every pod of the role (discovery, ServiceMonitor). */}}
{{- define "crescent.headlessService" -}}
{{- $v := index .root.Values .role }}
{{- $component := dict "root" .root "component" .role }}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "crescent.componentName" $component }}
  labels:
    {{- include "crescent.componentLabels" $component | nindent 4 }}
spec:
  clusterIP: None
  publishNotReadyAddresses: false
  selector:
    {{- include "crescent.selectorLabels" $component | nindent 4 }}
  ports:
    - name: grpc
      port: {{ $v.grpcPort }}
      targetPort: grpc
      appProtocol: grpc
    - name: admin
      port: {{ $v.adminPort }}
      targetPort: admin
{{- end }}

{{/* YAML settings of a role (services/prefill/config.py, services/decode/config.py). The
instance id and advertised address are per pod, so they come from env vars in the Deployment. */}}
{{- define "crescent.engineConfigMap" -}}
{{- $root := .root }}
{{- $v := index $root.Values .role }}
{{- $cfg := dict
  "listen" (dict "host" "0.0.0.0" "port" (int $v.grpcPort) "admin_port" (int $v.adminPort))
  "scheduler_address" (include "crescent.schedulerAddress" $root)
  "engine" (dict "model" (include "crescent.modelSpec" $root) "drain_grace_s" (include "crescent.drainGraceSeconds" $v | int)) }}
{{- if and (eq .role "prefill") $root.Values.kvstore.enabled }}
{{- $_ := set $cfg "kvstore_address" (include "crescent.localKvstoreAddress" $root) }}
{{- end }}
{{- include "crescent.internalTlsSettings" (dict "root" $root "cfg" $cfg) }}
{{- $cfg = mustMergeOverwrite $cfg (deepCopy $v.settings) }}
apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ include "crescent.componentName" (dict "root" $root "component" .role) }}
  labels:
    {{- include "crescent.componentLabels" (dict "root" $root "component" .role) | nindent 4 }}
data:
  config.yaml: |
    {{- toYaml $cfg | nindent 4 }}
{{- end }}
