{{/*
Prefill, decode and aggregated are roles of one engine; these helpers render any of them. Each topology group
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
  # No surge by default: a replacement pod needs the GPUs its predecessor frees, so an upgrade
  # (any settings change, through the config checksum) rolls on nodes with no GPU to spare.
  strategy:
    type: RollingUpdate
    rollingUpdate:
      {{- include "crescent.engineRollingUpdate" . | nindent 6 }}
  selector:
    matchLabels:
      {{- include "crescent.engineGroupSelector" . | nindent 6 }}
  template:
    {{- include "crescent.enginePodTemplate" . | nindent 4 }}
{{- end }}

{{/* maxSurge and maxUnavailable of a group's rollout (Deployment or LeaderWorkerSet), from the
role's rollingUpdate; refuses the pair that could never make progress. */}}
{{- define "crescent.engineRollingUpdate" -}}
{{- $r := (index .root.Values .role).rollingUpdate }}
{{- if and (eq (toString $r.maxSurge) "0") (or (eq (toString $r.maxUnavailable) "0") (eq (toString $r.maxUnavailable) "0%")) }}
{{- fail (printf "%s.rollingUpdate: maxSurge and maxUnavailable are both 0, so an upgrade could never replace a pod; keep maxUnavailable at least 1 (maxSurge 0 needs no spare GPU)" .role) }}
{{- end }}
maxSurge: {{ $r.maxSurge }}
maxUnavailable: {{ $r.maxUnavailable }}
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

{{/* The per-pod metrics and targets each role's HPA scales on, as a JSON list of {metric,
target}; the first is the one it is known by. prefill: waiting prompts; decode: the running batch;
aggregated: waiting work and KV use (crescent_engine_kv_used_ratio is the adapter rule's name for
kv_used_tokens / kv_capacity_tokens, prometheus-adapter-configmap.yaml). Call with (dict "root" $
"role" <role>); "root" may be left out for the names alone. */}}
{{- define "crescent.engineScaleMetrics" -}}
{{- $a := dict }}
{{- with .root }}{{ $a = (index .Values $.role).autoscaling }}{{ end }}
{{- if eq .role "prefill" }}
{{- list (dict "metric" "crescent_engine_queue_depth" "target" (toString $a.queueDepthTarget)) | toJson }}
{{- else if eq .role "decode" }}
{{- list (dict "metric" "crescent_engine_running_requests" "target" (toString $a.runningRequestsTarget)) | toJson }}
{{- else }}
{{- list (dict "metric" "crescent_engine_queue_depth" "target" (toString $a.queueDepthTarget))
         (dict "metric" "crescent_engine_kv_used_ratio" "target" (toString $a.kvUsedRatioTarget)) | toJson }}
{{- end }}
{{- end }}

{{- define "crescent.engineScaleMetric" -}}
{{- (first (include "crescent.engineScaleMetrics" . | fromJsonArray)).metric }}
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
  # With several metrics the HPA takes the largest replica count any of them asks for.
  metrics:
    {{- range include "crescent.engineScaleMetrics" . | fromJsonArray }}
    - type: Pods
      pods:
        metric:
          name: {{ .metric }}
        target:
          type: AverageValue
          averageValue: {{ .target | quote }}
    {{- end }}
  behavior:
    {{- include "crescent.engineScaleBehavior" $a | nindent 4 }}
{{- end }}

{{/* GPU pods take minutes to load weights: scale up at once, scale down only after load has
stayed low for autoscaling.scaleDownStabilizationSeconds. Call with the role's autoscaling values. */}}
{{- define "crescent.engineScaleBehavior" -}}
scaleUp:
  stabilizationWindowSeconds: 0
scaleDown:
  stabilizationWindowSeconds: {{ .scaleDownStabilizationSeconds }}
{{- end }}

{{/* KEDA: the per-pod metric summed over the group's pods, plus a latency p99 the group's own
pods measure against its SLO: prefill, crescent_engine_step_seconds of its prompts (admission to
first token) against the TTFT SLO; decode and aggregated, crescent_engine_step_seconds of their
decode steps (each running stream gets one token per step: the group's time between tokens)
against the TBT SLO; aggregated also on the group's KV use. Every query selects the group's own
pods, so one group's load never scales another. KEDA's cooldownPeriod only governs scaling to
zero; the HPA KEDA makes scales down after autoscaling.scaleDownStabilizationSeconds. */}}
{{- define "crescent.engineScaledObject" -}}
{{- $root := .root }}
{{- $a := (index $root.Values .role).autoscaling }}
{{- $first := first (include "crescent.engineScaleMetrics" . | fromJsonArray) }}
{{- $ofPods := include "crescent.engineGroupPodMatchers" . }}
{{- $stepRole := ternary "prefill" "decode" (eq .role "prefill") }}
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
  cooldownPeriod: {{ $a.scaleDownStabilizationSeconds }}
  advanced:
    horizontalPodAutoscalerConfig:
      behavior:
        {{- include "crescent.engineScaleBehavior" $a | nindent 8 }}
  triggers:
    - type: prometheus
      metricType: AverageValue
      metadata:
        serverAddress: {{ $a.keda.prometheusAddress }}
        query: sum({{ $first.metric }}{ {{- $ofPods -}} })
        threshold: {{ $first.target | quote }}
    - type: prometheus
      # Value: replicas grow in proportion to how far the p99 is above 80% of the SLO.
      metricType: Value
      metadata:
        serverAddress: {{ $a.keda.prometheusAddress }}
        query: histogram_quantile(0.99, sum by (le) (rate(crescent_engine_step_seconds_bucket{ {{- $ofPods -}} ,role="{{ $stepRole }}"}[2m])))
        threshold: {{ mulf $slo 0.8 | toString | quote }}
    {{- if eq .role "aggregated" }}
    - type: prometheus
      # Value: the group's share of KV held by running requests; replicas grow in proportion
      # to how far it is above the target.
      metricType: Value
      metadata:
        serverAddress: {{ $a.keda.prometheusAddress }}
        query: sum(crescent_engine_kv_used_tokens{ {{- $ofPods -}} }) / clamp_min(sum(crescent_engine_kv_capacity_tokens{ {{- $ofPods -}} }), 1)
        threshold: {{ toString $a.kvUsedRatioTarget | quote }}
    {{- end }}
{{- end }}

{{/* PromQL label matchers of one group's instance pods, by their exact name shape (every scrape
of the chart's ServiceMonitors, or your own, carries namespace and pod): a Deployment's pods are
"<workload>-<pod-template-hash>-<5 characters>", a LeaderWorkerSet's "<workload>-<instance>" and
"<workload>-<instance>-<worker>". A prefix alone would also take in group "g0-a"'s pods as "g0"'s;
validateTopology refuses the one pair of names these shapes could still confuse. */}}
{{- define "crescent.engineGroupPodMatchers" -}}
{{- $name := include "crescent.engineGroupName" . }}
{{- $multiNode := (index .root.Values .role).multiNode.enabled }}
{{- /* Kubernetes cuts a generated pod name's base to 58 characters: past that the shape breaks. */}}
{{- if and (not $multiNode) (gt (len $name) 46) }}
{{- fail (printf "%s.autoscaling.keda: the group's Deployment %s has %d characters; its pods' names would be cut short and the per-group queries could not find them: keep it to 46 (shorter fullnameOverride, release or group name)" .role $name (len $name)) }}
{{- end }}
{{- $shape := ternary "[0-9]+(-[0-9]+)?" "[a-z0-9]{1,10}-[a-z0-9]{5}" $multiNode }}
{{- printf "namespace=%q,pod=~%q" .root.Release.Namespace (printf "%s-%s" $name $shape) }}
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
  # A pod that is not Ready (crash-looping, still loading) may always be evicted, so it can never
  # hold a node drain hostage to the budget.
  unhealthyPodEvictionPolicy: AlwaysAllow
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
  {{- include "crescent.serviceAnnotations" $v | nindent 2 }}
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

{{/* YAML settings of a role (services/prefill/config.py, services/decode/config.py,
services/aggregated/config.py). The
instance id and advertised address are per pod, so they come from env vars in the Deployment. */}}
{{- define "crescent.engineConfigMap" -}}
{{- $root := .root }}
{{- $v := index $root.Values .role }}
{{- $cfg := dict
  "listen" (dict "host" "0.0.0.0" "port" (int $v.grpcPort) "admin_port" (int $v.adminPort))
  "scheduler_address" (include "crescent.schedulerAddress" $root)
  "engine" (dict "model" (include "crescent.modelSpec" $root) "drain_grace_s" (include "crescent.drainGraceSeconds" $v | int)) }}
{{- /* The roles that prefill read and write the node's kvstore; a vLLM decode loads its handoffs from it. */}}
{{- if and (or (has .role (list "prefill" "aggregated")) (include "crescent.isVllm" .)) $root.Values.kvstore.enabled }}
{{- $_ := set $cfg "kvstore_address" (include "crescent.localKvstoreAddress" $root) }}
{{- end }}
{{- /* The engine backend (_vllm.tpl): native, or vLLM with its arguments. */}}
{{- $_ := set $cfg.engine "backend" $v.backend }}
{{- /* The native engine computes on the pod's GPU when it requests one (a multiNode group runs its
tensor-parallel ranks on the CPU); settings.engine.device/dtype override. */}}
{{- if eq $v.backend "native" }}
{{- $_ := set $cfg.engine "device" (ternary "cuda" "cpu" (and (gt (int $v.gpus) 0) (not $v.multiNode.enabled))) }}
{{- end }}
{{- if include "crescent.isVllm" . }}
{{- $_ := set $cfg.engine "vllm" (include "crescent.vllmSettings" . | fromJson) }}
{{- end }}
{{- if eq .role "decode" }}
{{- $_ := set $cfg "tcp_handoff" $v.handoffSideChannel.enabled }}
{{- $_ := set $cfg "handoff_side_channel_port" (int $v.handoffSideChannel.port) }}
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
