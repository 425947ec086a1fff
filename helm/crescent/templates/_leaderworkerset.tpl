{{/*
An engine group whose instances span nodes: a LeaderWorkerSet (leaderworkerset.x-k8s.io/v1,
Kubernetes SIG Apps; its controller must be installed) instead of a Deployment. Each replica is
one instance of multiNode.nodesPerInstance pods (a leader and workers), created, restarted
(RecreateGroupOnPodRestart) and rolled out together; replicas and the autoscalers count
instances. Call with (dict "root" $ "role" "prefill" "group" <group values>).
*/}}
{{- define "crescent.engineLeaderWorkerSet" -}}
{{- $root := .root }}
{{- $v := index $root.Values .role }}
{{- $m := $v.multiNode }}
apiVersion: leaderworkerset.x-k8s.io/v1
kind: LeaderWorkerSet
metadata:
  name: {{ include "crescent.engineGroupName" . }}
  labels:
    {{- include "crescent.componentLabels" (dict "root" $root "component" .role) | nindent 4 }}
    crescent.io/group: {{ .group.name }}
  annotations:
    crescent.io/pod-security-level: {{ include "crescent.enginePodSecurityLevel" $root }}
    {{- with $m.exclusiveTopology }}
    # Every domain of this label holds at most one instance, all of whose pods are in it.
    leaderworkerset.sigs.k8s.io/exclusive-topology: {{ . }}
    {{- end }}
spec:
  {{- if not (or $v.autoscaling.enabled $v.autoscaling.keda.enabled) }}
  replicas: {{ $v.replicas }}
  {{- end }}
  startupPolicy: {{ $m.startupPolicy }}
  rolloutStrategy:
    type: RollingUpdate
    rollingUpdateConfiguration:
      {{- include "crescent.engineRollingUpdate" . | nindent 6 }}
  leaderWorkerTemplate:
    size: {{ $m.nodesPerInstance }}
    restartPolicy: RecreateGroupOnPodRestart
    leaderTemplate:
      {{- include "crescent.enginePodTemplate" (merge (dict "worker" false) .) | nindent 6 }}
    workerTemplate:
      {{- include "crescent.enginePodTemplate" (merge (dict "worker" true) .) | nindent 6 }}
{{- end }}

{{/* Refuses multi-node settings that cannot run. Renders nothing. */}}
{{- define "crescent.validateMultiNode" -}}
{{- range $role := list "prefill" "decode" "aggregated" }}
{{- $v := index $.Values $role }}
{{- $m := $v.multiNode }}
{{- if and $v.enabled $m.enabled }}
{{- if and (eq $.Values.topology.mode "nvlinkDomain") (eq $m.exclusiveTopology $.Values.topology.supernodeLabel) }}
{{- fail (printf "%s.multiNode.exclusiveTopology: %s is the group's own domain label, so each instance would need a domain to itself and the group's other instances (and prefill or decode) could never join it; leave it empty, topology.mode nvlinkDomain already keeps the instance's pods in the group's domain" $role $m.exclusiveTopology) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
